"""``python -m tools.bench pipeline``: the hop (IPU-Link vs host ring, timed directly between
two processes) and the latency parts run end to end (figures printed, not asserted)."""

from __future__ import annotations

import os
import re

import pytest

from host_runtime.devices._ipu_group import LINK_DEPTH
from tools.bench import pipeline
from tools.bench.__main__ import main as bench_main

pytestmark = pytest.mark.usefixtures("private_machine")


def test_pipeline_bench_hop_and_latency_print_every_row(capsys) -> None:
    machine = os.environ.get("IPU_EMULATOR_NUM_IPUS")
    assert bench_main(["pipeline", "--only", "hop", "latency", "--hop-rounds", "60",
                       "--blocks", "3"]) == 0
    assert os.environ.get("IPU_EMULATOR_NUM_IPUS") == machine   # this process's machine kept
    out = capsys.readouterr().out
    link = re.search(r"^  IPU-Link hop \(IPU process stream code\)\s+(\d+\.\d)", out, re.M)
    host = re.search(r"^  host ring transfer \(shm\.Ring\)\s+(\d+\.\d)", out, re.M)
    assert link and host, out
    assert float(link.group(1)) > 0 and float(host.group(1)) > 0, out
    assert re.search(r"^  hop / host = \d+\.\d\d \(target <= 1\.5\)", out, re.M), out
    for label in ("1 IPU", "2 IPUs sharded", "2 IPUs pipelined"):
        assert re.search(rf"^  {re.escape(label)}\s+\d+\.\d", out, re.M), out


def test_hop_rigs_have_the_geometry_of_a_sharded_sessions_links() -> None:
    assert pipeline.HOP_DEPTH == LINK_DEPTH
    assert pipeline.HOP_BYTES == 256 * 1024
