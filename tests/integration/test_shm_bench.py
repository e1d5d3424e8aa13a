"""The ring benchmark runs end to end (figures are printed, not asserted)."""

from __future__ import annotations

import re

from tools.bench.__main__ import main as bench_main


def test_bench_dispatcher_lists_and_refuses(capsys) -> None:
    assert bench_main([]) == 2
    assert re.search(r"^  ring\s+shm ring latency", capsys.readouterr().out, re.M)
    assert bench_main(["nope"]) == 2
    assert re.search(r"unknown benchmark 'nope'; expected one of .*\bring\b",
                     capsys.readouterr().err)


def test_ring_bench_runs_and_prints_every_row(capsys) -> None:
    assert bench_main(["ring", "--rounds", "200", "--blocks", "2", "--bw-rounds", "2"]) == 0
    out = capsys.readouterr().out
    for label in ("bare posix_ipc semaphore ping-pong", "shm.Ring pair (write + read)",
                  "multiprocessing.Pipe"):
        assert re.search(rf"^  {re.escape(label)}\s+\d+\.\d", out, re.M), out
    assert re.search(r"^\s+1 MiB\s+\d+\.\d\d", out, re.M), out
    assert re.search(r"^\s+16 MiB\s+\d+\.\d\d", out, re.M), out
    assert re.search(r"ring / sem = \d+\.\d\d .* ring / Pipe = \d+\.\d\d", out), out


def test_runner_bench_runs_and_checks_its_shared_memory_results(capsys, private_machine) -> None:
    assert bench_main(["runner", "--rounds", "40", "--blocks", "2", "--seconds", "0.05",
                       "--bw-rounds", "1"]) == 0
    out = capsys.readouterr().out
    for label in ("ModelRunner.execute (one in flight)", "onnxruntime in-process",
                  "ProcessPoolExecutor + onnxruntime", "same, tensors in empty_shared memory",
                  "ModelRunner.execute (Identity model)"):
        assert re.search(rf"^\s+{re.escape(label)}\s+\d+", out, re.M), out
