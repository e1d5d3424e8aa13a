"""``ipu-emulator ray-node start`` on a shared machine: it writes its state and its
daemon's log through no link planted at their names, and when ``ray start`` fails it
stops its daemon (SIGTERM: the daemon removes its shared memory) and reaps it.
``ray start`` is ``/bin/false`` here: no Ray process is started."""

from __future__ import annotations

import os
import secrets

import pytest

from ipu_emulator import cluster
from ipu_emulator.errors import UnsafePathError
from tests.daemon_rig import shm_entries
from tools import ray_node


@pytest.fixture
def node_env(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    tag = "r" + secrets.token_hex(4)
    monkeypatch.setenv("IPU_EMULATOR_HOME", str(home))
    monkeypatch.setenv("IPU_EMULATOR_SHM_TAG", tag)
    monkeypatch.delenv("IPU_EMULATOR_DAEMON", raising=False)
    monkeypatch.setattr(cluster, "_ray_exe", lambda: ["/bin/false"])
    victim = tmp_path / "victim"
    victim.write_text("precious")
    return home, tag, victim


def test_a_failed_ray_start_stops_and_reaps_its_daemon_and_writes_through_no_link(
        node_env, tmp_path, capsys):
    home, tag, victim = node_env
    os.symlink(victim, home / "ray-node.json")          # planted by someone else
    sock = str(home / "node.sock")
    rc = ray_node.main(["start", "--head", "--ipus", "1", "--socket", sock])
    assert rc == 1
    assert "'ray start' failed (exit 1); the daemon stopped" in capsys.readouterr().err
    assert victim.read_text() == "precious"               # the link was replaced, not followed
    assert not os.path.lexists(home / "ray-node.json")    # and the state removed
    assert shm_entries(tag) == set()                      # SIGTERM: the daemon cleaned up
    assert os.path.isfile(sock + ".log")


def test_a_link_at_the_daemon_log_is_refused(node_env):
    home, _, victim = node_env
    sock = str(home / "node.sock")
    os.symlink(victim, sock + ".log")
    with pytest.raises(UnsafePathError, match="is a symlink; refusing to write through it"):
        ray_node.main(["start", "--head", "--ipus", "1", "--socket", sock])
    assert victim.read_text() == "precious"
