"""The daemon's partitions kept in its home (ipu_emulator.daemon.partitions): what a new
daemon takes back from the file, and what it leaves out."""

from __future__ import annotations

import json
import logging
import os
from types import SimpleNamespace

import pytest

from ipu_emulator.daemon.partitions import PartitionTable


def _pool(n: int) -> list:
    return [SimpleNamespace(state="free", holder=None) for _ in range(n)]


def _names(table: PartitionTable) -> dict:
    return {p["name"]: p["ipus"] for p in table.handle("partition_list", {}, 1)["partitions"]}


def test_made_and_removed_partitions_are_kept_and_taken_back(tmp_path):
    path = str(tmp_path / "partitions.json")
    table = PartitionTable(_pool(8), path)
    assert table.handle("partition_create", {"name": "a", "size": 4}, 7)["ok"]
    assert table.handle("partition_create", {"name": "b", "size": 2}, 7)["ok"]
    assert table.handle("partition_remove", {"name": "a"}, 7)["ok"]
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert _names(PartitionTable(_pool(8), path)) == {"b": [4, 5]}


@pytest.mark.parametrize("text", ["{not json", json.dumps({"version": 2, "partitions": []}),
                                  json.dumps(["a"]), json.dumps({"version": 1})])
def test_an_unreadable_file_is_logged_and_no_partition_taken(tmp_path, caplog, text):
    path = tmp_path / "partitions.json"
    path.write_text(text)
    path.chmod(0o600)
    with caplog.at_level(logging.WARNING, "ipu_emulator.daemon.server"):
        assert _names(PartitionTable(_pool(4), str(path))) == {}
    assert f"the partitions file {path} is unreadable" in caplog.text


def test_entries_that_do_not_fit_are_left_out_by_name(tmp_path, caplog):
    path = tmp_path / "partitions.json"
    entries = [{"name": "ok", "ipus": [0, 1]},
               {"name": "overlap", "ipus": [1]},          # ipu 1 is ok's
               {"name": "unaligned", "ipus": [1, 2]},
               {"name": "three", "ipus": [4, 5, 6]},      # not a power of two
               {"name": "far", "ipus": [8]},              # past a pool of 8
               {"name": "bad name!", "ipus": [3]},
               {"name": "ok", "ipus": [2]},               # the name again
               {"name": "last", "ipus": [3], "reconfigurable": True}]
    path.write_text(json.dumps({"version": 1, "partitions": entries}))
    path.chmod(0o600)
    with caplog.at_level(logging.WARNING, "ipu_emulator.daemon.server"):
        table = PartitionTable(_pool(8), str(path))
    assert _names(table) == {"ok": [0, 1], "last": [3]}
    for name in ("overlap", "unaligned", "three", "far", "bad name!"):
        assert f"'{name}'" in caplog.text
    assert caplog.text.count("left out") == 6


def test_a_link_planted_at_the_file_is_not_followed(tmp_path, caplog):
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps({"version": 1, "partitions": [{"name": "x", "ipus": [0]}]}))
    (tmp_path / "partitions.json").symlink_to(target)
    with caplog.at_level(logging.WARNING, "ipu_emulator.daemon.server"):
        assert _names(PartitionTable(_pool(2), str(tmp_path / "partitions.json"))) == {}
    assert "cannot read the partitions kept in" in caplog.text


@pytest.mark.parametrize("port", ["²", "٤٤", "8_0", "0", "65536"])
def test_a_port_that_is_not_an_ascii_number_in_range_is_refused(port):
    from ipu_emulator.errors import VipuError
    from ipu_emulator.vipu import controller_socket

    with pytest.raises(VipuError, match=r"IPUOF_VIPU_API_PORT=.*: expected a TCP port number "
                       r"1\.\.65535"):
        controller_socket({"IPUOF_VIPU_API_PORT": port, "IPU_EMULATOR_DAEMON": "/tmp/d.sock"})
