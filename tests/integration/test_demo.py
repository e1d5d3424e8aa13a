"""``ipu-emulator demo`` on a fresh machine: every mode passes and the exit status says so."""

from __future__ import annotations

import os
import subprocess
import sys


def test_demo_runs_every_mode_and_passes(tmp_path):
    env = dict(os.environ)
    env["IPU_EMULATOR_HOME"] = str(tmp_path / "home")      # a fresh emulated machine
    timeline = tmp_path / "demo-trace.json"
    proc = subprocess.run([sys.executable, "-m", "tools.cli", "demo", "--dir", str(tmp_path),
                           "--trace", str(timeline)],
                          capture_output=True, text=True, env=env, timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    for mode in ("sync, InputMemoryView, output allocated by ModelRunner",
                 "async, numpy dict, output allocated by the user (shares memory)",
                 "frozen inputs", "dynamic batch sizes", "replication over 2 IPUs",
                 "multithreading: 4 threads x 5 async requests", "monitoring statistics",
                 "Save program run on close", "conditional execution",
                 "sharded over 2 IPUs", "pipelined over 2 IPUs"):
        assert f"PASS  {mode}" in out, out
    assert "FAIL" not in out
    assert "request_monitoring_statistics_mean_us" in out
    assert "18 of 18 modes passed" in out
    # --trace: the demo's timeline, every IPU process of it named, well formed
    from tools import trace_summary

    trace = trace_summary.load(str(timeline))
    assert trace_summary.validate(trace) == []
    names = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"]
    assert len([n for n in names if n.startswith("ipu ")]) >= 4
    assert len(trace_summary.summarise(trace)["models"]) >= 3
    # each process and request track says which runner, model, replica (and IPU) it is
    assert len(set(names)) == len(names)
    # (a request's name titles its track: Perfetto shows one track per title)
    tracks = {(r["name"], r["args"]["runner"], r["args"]["model"], r["args"]["replica"])
              for r, _ in trace_summary.requests(trace)}
    assert len({t[0] for t in tracks}) == len(tracks) >= 9
    assert all(t[0] == f"{t[1]} · {t[2]} · replica {t[3]}" for t in tracks), tracks
    assert len(trace_summary.arrows(trace)) >= len(trace_summary.requests(trace))


def test_demo_exits_non_zero_when_a_mode_fails(tmp_path, monkeypatch):
    from tools import demo

    monkeypatch.setenv("IPU_EMULATOR_HOME", str(tmp_path / "home"))

    def broken_check(got, want, what):
        raise AssertionError(f"{what}: forced mismatch")
    monkeypatch.setattr(demo, "_check", broken_check)
    assert demo.main(["--dir", str(tmp_path)]) == 1
