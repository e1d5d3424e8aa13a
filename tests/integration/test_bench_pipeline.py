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
    rows = re.findall(r"^  (as scheduled|one vCPU|two vCPUs)\s+(\d+\.\d)\s+(\d+\.\d)\s+"
                      r"(\d+\.\d\d)   blocks", out, re.M)
    assert [r[0] for r in rows] == (["as scheduled", "one vCPU", "two vCPUs"]
                                    if len(os.sched_getaffinity(0)) > 1 else ["as scheduled"]), out
    for _, link, host, ratio in rows:
        assert float(link) > 0 and float(host) > 0, out
        assert abs(float(link) / float(host) - float(ratio)) <= 0.02 * float(ratio) + 0.01, out
    for label in ("1 IPU", "2 IPUs sharded", "2 IPUs pipelined"):
        assert re.search(rf"^  {re.escape(label)}\s+\d+\.\d", out, re.M), out


def test_hop_rigs_have_the_geometry_of_a_sharded_sessions_links() -> None:
    assert pipeline.HOP_DEPTH == LINK_DEPTH
    assert pipeline.HOP_BYTES == 256 * 1024
