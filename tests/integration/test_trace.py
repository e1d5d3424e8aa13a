"""Timeline traces (ipu_emulator.trace) over real IPU processes: the file's structure.

- an unchanged program (tests/integration/trace_program.py) run in a fresh process with
  IPU_EMULATOR_TRACE set, over a model pipelined on 2 IPUs and a model on 2 replicas,
  ending by an exception: the file is written, its processes are named, each request
  has its slices, each IPU its Load and Main runs, flows go from requests to IPU
  iterations and between pipeline stages, IPU iterations lie inside the requests they
  served (one clock), and ``ipu-emulator trace`` summarises it;
- in this process: ``trace.tracing()``, getTimeTrace agreeing with the timeline, an IPU
  process killed mid-run (its events are kept, the file is written);
- the pytest plugin's ``--ipu-trace-dir``: the timeline of a failing test is kept.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from collections import Counter
from importlib import metadata

import numpy as np
import onnx
import pytest

import host_runtime as model_runtime
from ipu_emulator import trace
from tests.daemon_rig import REPO
from tests._paths import child_pythonpath
from tools import poprt, trace_summary
from tools._chain_model import chain_model, write_shard_yaml
from tools.generate_simple_popef import write_simple_popef

pytestmark = pytest.mark.usefixtures("private_machine")
pytest_plugins = ["pytester"]


def _names(timeline: dict) -> dict[int, str]:
    return {e["pid"]: e["args"]["name"] for e in timeline["traceEvents"]
            if e["ph"] == "M" and e["name"] == "process_name"}


def _slices(timeline: dict, pid: int | None = None, name: str | None = None) -> list[dict]:
    return [e for e in timeline["traceEvents"] if e["ph"] == "X"
            and (pid is None or e["pid"] == pid) and (name is None or e["name"] == name)]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[str, str, str]:
    tmp = tmp_path_factory.mktemp("trace_models")
    chain = os.path.join(tmp, "chain.onnx")
    onnx.save(chain_model(4, width=8, batch=2, seed=3), chain)
    shard = write_shard_yaml(os.path.join(tmp, "shard.yaml"), 4, 2, pipelined=True)
    out = os.path.join(tmp, "out")
    assert poprt.main(["--input_model", chain, "--num_ipus", "2", "--manual_sharding_config",
                       shard, "--enable_pipelining", "--batches_per_step", "2",
                       "--export_popef", "--output_dir", out]) == 0
    simple = os.fspath(write_simple_popef(os.path.join(tmp, "simple.popef")))
    return os.path.join(out, "executable.popef"), simple, chain


def test_an_unchanged_program_traced_through_the_environment(tmp_path, models):
    path = tmp_path / "timeline.json"
    tag = "t" + secrets.token_hex(4)
    env = dict(os.environ, IPU_EMULATOR_TRACE=str(path), IPU_EMULATOR_SHM_TAG=tag,
               IPU_EMULATOR_NUM_IPUS="4",
               PYTHONPATH=child_pythonpath())
    proc = subprocess.run([sys.executable, str(REPO / "tests/integration/trace_program.py"),
                           *models], env=env, capture_output=True, text=True, timeout=120)
    assert "RESULTS OK" in proc.stdout, proc.stderr
    assert proc.returncode == 1 and "the trace is written anyway" in proc.stderr
    assert not [n for n in os.listdir("/dev/shm") if f"_{tag}_" in n]

    timeline = trace_summary.load(str(path))
    assert trace_summary.validate(timeline) == []
    names = _names(timeline)
    hosts = [p for p, n in names.items() if n.startswith("host ")]
    ipus = [p for p, n in names.items() if n.startswith("ipu ")]
    assert len(hosts) == 1 and names[hosts[0]] == f"host {hosts[0]}"
    assert len(ipus) == 4     # 2 IPUs of the pipelined model, then 1 per replica
    for pid in ipus:          # each IPU loaded and ran Main, in iterations
        assert _slices(timeline, pid, "Load") and _slices(timeline, pid, "Main")
        assert _slices(timeline, pid, "iteration")
    requests = [r for r, _ in trace_summary.requests(timeline) if r["pid"] == hosts[0]]
    by_model = Counter((r["args"]["model"], r["args"]["replica"]) for r in requests)
    assert by_model == {("executable", 0): 4, ("simple_model", 0): 3, ("simple_model", 1): 3}
    assert all(r["args"]["batch_size"] >= 1 and r["args"]["seqs"] for r in requests)
    for what in ("attach and load", "close"):
        assert len([s for s in _slices(timeline, hosts[0]) if s["name"].startswith(what)]) == 3
    # one clock: a Main run of one iteration (batches_per_step 1) lies inside its request
    spans = [(r["ts"], r["ts"] + r["dur"]) for r in requests]
    singles = 0
    for pid in ipus:
        iterations = _slices(timeline, pid, "iteration")
        for main in _slices(timeline, pid, "Main"):
            end = main["ts"] + main["dur"]
            if len([i for i in iterations if main["ts"] <= i["ts"] <= end]) == 1:
                singles += 1
                assert any(a <= main["ts"] and end <= b for a, b in spans), main
    assert singles >= 6
    # arrows, bound to their slices: each request's transfer in to an IPU iteration, and
    # a pipeline stage's last transfer out to the next stage's iteration
    arrows = trace_summary.arrows(timeline)
    kinds = Counter((names[a["pid"]].split(" ")[0], a["name"].split(" (")[0], b["name"])
                    for a, b in arrows)
    assert set(kinds) <= {("host", "transfer in", "iteration"), ("ipu", "link out", "iteration"),
                          ("ipu", "copies out", "iteration")}, kinds
    from_requests = {(a["pid"], a["id2"]["local"], a["ts"]) for a, b in arrows
                     if a["pid"] == hosts[0]}
    assert len(from_requests) >= len(requests)
    assert sum(n for k, n in kinds.items() if k[0] == "ipu") >= 4
    # the IPUs' tracks hold work only: no control message spans the idle time
    assert not _slices(timeline, name="main loop") and not _slices(timeline, name="run")
    for pid in ipus:
        assert names[pid].startswith("ipu ") and f"· pid {pid} · host {hosts[0]} runner " \
            in names[pid]

    result = subprocess.run([sys.executable, "-m", "tools.cli", "trace", str(path), "--json",
                             "--check"], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(result.stdout)
    assert summary["problems"] == []
    rows = {(m["model"], m["replica"]): m for m in summary["models"]}
    assert set(rows) == set(by_model)
    assert set(rows[("executable", 0)]["latency_us"]) == {"request", *trace_summary.PHASES}
    assert len(summary["ipus"]) == 4
    assert all(0 < i["busy_fraction"] < 1 for i in summary["ipus"])
    # the runners apart (the pipelined one, then simple_model's of 2 replicas) and each
    # IPU's program runs counted
    assert {m["runner"] for m in summary["models"]} == {"runner 1", "runner 2"}
    for i in summary["ipus"]:
        assert i["program_runs"]["Load"] >= 1 and i["program_runs"]["Main"] >= 1


def test_time_trace_agrees_with_the_timeline(tmp_path, models):
    _, simple, _ = models
    a = np.ones((1, 4), np.float32)
    with trace.tracing(str(tmp_path / "t.json")):
        with model_runtime.ModelRunner(simple) as runner:
            # more than a ring's slots: each slot is bound once before the C step serves it
            for _ in range(10):
                runner.execute({"tensor_A": a, "tensor_B": a})
            futures = [runner.executeAsync({"tensor_A": a, "tensor_B": a}) for _ in range(4)]
            for f in futures:
                f.wait()
            last = runner.getTimeTrace()
            mean = runner.getMonitoringStatisticsMean()
            trace.instant("marked", note="by the test")
    timeline = trace_summary.load(str(tmp_path / "t.json"))
    assert trace_summary.validate(timeline) == []
    assert any(e["ph"] == "i" and e["name"] == "marked" and e["args"] == {"note": "by the test"}
               for e in timeline["traceEvents"])
    # the C step's iterations (copies in, compute, copies out) are recorded by the C code
    assert _slices(timeline, name="copies in") and _slices(timeline, name="copies out")
    requests, phases = zip(*trace_summary.requests(timeline))
    assert len(requests) == 14
    final = max(range(14), key=lambda k: requests[k]["ts"] + requests[k]["dur"])
    p = phases[final]
    # getTimeTrace's phases are the timeline's instants (to the ns of rounding)
    assert last["request_duration_us"] == pytest.approx(requests[final]["dur"], abs=0.01)
    assert last["read_preparation_duration_us"] == pytest.approx(p["preparation"], abs=0.01)
    assert last["read_queue_duration_us"] == pytest.approx(p["queue"], abs=0.01)
    assert last["computation_duration_us"] == pytest.approx(
        p["waiting for device"] + p["transfer out"] + p["callbacks"], abs=0.02)
    # read_queue is measured: it holds at least the laying of the inputs
    assert last["read_queue_duration_us"] >= p["transfer in"] - 0.002 and p["transfer in"] > 0
    assert mean["read_queue_monitoring_statistics_mean_us"] > 0


def test_a_killed_ipu_keeps_its_events_and_the_file(tmp_path, models):
    _, simple, _ = models
    a = np.ones((1, 4), np.float32)
    with trace.tracing(str(tmp_path / "t.json")):
        runner = model_runtime.ModelRunner(simple)
        try:
            for _ in range(3):   # the IPU records a run before it takes the next request
                runner.execute({"tensor_A": a, "tensor_B": a})
            (pid,) = runner.device_pids()
            os.kill(pid, 9)
            with pytest.raises(model_runtime.DeviceLostError):
                for _ in range(50):
                    runner.execute({"tensor_A": a, "tensor_B": a})
        finally:
            runner.close()
    timeline = trace_summary.load(str(tmp_path / "t.json"))
    assert trace_summary.validate(timeline) == []
    assert _names(timeline)[pid].startswith("ipu ")
    assert len(_slices(timeline, pid, "Main")) >= 2 and _slices(timeline, pid, "load")


def test_trace_dir_keeps_the_timeline_of_a_failing_test(pytester, tmp_path, monkeypatch, models):
    _, simple, _ = models
    monkeypatch.setenv("SIMPLE_POPEF", simple)
    pytester.makepyfile(test_traced='''
        import os
        import numpy as np

        def run(model_runner):
            a = np.ones((1, 4), np.float32)
            return model_runner(os.environ["SIMPLE_POPEF"]).execute({"tensor_A": a, "tensor_B": a})

        def test_passes(model_runner):
            assert run(model_runner)["tensor_C"].shape == (1, 4)

        def test_fails(model_runner):
            run(model_runner)
            assert False, "this test fails"
    ''')
    folder = tmp_path / "traces"
    installed = any(ep.value == "tools.pytest_plugin"
                    for ep in metadata.entry_points(group="pytest11"))
    load = [] if installed else ["-p", "tools.pytest_plugin"]
    result = pytester.runpytest(*load, "-p", "no:cacheprovider", "-q", f"--ipu-trace-dir={folder}")
    result.assert_outcomes(passed=1, failed=1)
    (name,) = os.listdir(folder)
    assert "test_fails" in name
    timeline = trace_summary.load(str(folder / name))
    assert trace_summary.validate(timeline) == []
    names = _names(timeline).values()
    assert any(n.startswith("ipu ") for n in names) and any(n.startswith("host ") for n in names)
    assert len(trace_summary.requests(timeline)) == 1


def test_a_daemon_and_a_host_it_serves_both_traced(tmp_path, models, monkeypatch):
    from tests.daemon_rig import DaemonRig

    _, simple, _ = models
    rig = DaemonRig(tmp_path, num_ipus=1, args=("--trace", str(tmp_path / "daemon.json")))
    try:
        monkeypatch.setenv("IPU_EMULATOR_DAEMON", rig.socket)
        a = np.ones((1, 4), np.float32)
        with trace.tracing(str(tmp_path / "host.json")):
            with model_runtime.ModelRunner(simple) as runner:
                for _ in range(3):
                    runner.execute({"tensor_A": a, "tensor_B": a})
    finally:
        rig.stop()     # the daemon writes its file; nothing is left in /dev/shm
    (ipu_pid,) = rig.pool_pids
    host = trace_summary.load(str(tmp_path / "host.json"))
    assert trace_summary.validate(host) == []
    # the host's timeline holds the daemon's IPU process it was lent, with arrows to it
    assert _names(host)[ipu_pid].startswith(f"ipu 0 · pid {ipu_pid} · host {os.getpid()} runner 1")
    assert len(_slices(host, ipu_pid, "iteration")) >= 3
    assert [b["pid"] for a, b in trace_summary.arrows(host)] == [ipu_pid] * 3
    daemon = trace_summary.load(str(tmp_path / "daemon.json"))
    assert trace_summary.validate(daemon) == []
    names = _names(daemon)
    assert names[rig.proc.pid] == f"daemon {rig.proc.pid}"
    assert names[ipu_pid] == f"ipu 0 · pid {ipu_pid}"
    marks = [e["name"] for e in daemon["traceEvents"] if e["ph"] == "i"]
    assert any("attached ipus [0]" in m for m in marks) and any("released" in m for m in marks)
    assert _slices(daemon, ipu_pid, "handover")
    # both files as one: the IPU process once, with the host's arrows to it
    both = trace.combine([daemon, host])
    assert trace_summary.validate(both) == []
    assert [b["pid"] for a, b in trace_summary.arrows(both)] == [ipu_pid] * 3
    assert len(_slices(both, ipu_pid, "iteration")) == len(_slices(daemon, ipu_pid, "iteration"))
    assert _names(both)[ipu_pid] == _names(host)[ipu_pid]


def test_an_idle_ipu_has_no_slice(tmp_path, models):
    """A Main run begins when its first transfer comes: waiting for a request is the gap
    between slices, also after the last request (it lasted until close())."""
    _, simple, _ = models
    out = str(tmp_path / "idle.json")
    a, b = np.ones((1, 4), np.float32), np.zeros((1, 4), np.float32)
    with trace.tracing(out):
        with model_runtime.ModelRunner(simple) as runner:
            for _ in range(2):
                runner.execute({"tensor_A": a, "tensor_B": b})
                time.sleep(0.2)   # the IPU idles (what is measured, not a synchronisation)
    timeline = json.load(open(out))
    ipu = [pid for pid, name in _names(timeline).items() if name.startswith("ipu ")]
    mains = [e for e in _slices(timeline, ipu[0]) if e["name"] == "Main"]
    assert len(mains) == 2, [(e["name"], e["dur"]) for e in mains]
    assert all(e["dur"] < 50_000 for e in mains), [e["dur"] for e in mains]   # us
    waits = [e for e in _slices(timeline, ipu[0]) if e["name"] == "wait for input"]
    assert all(e["dur"] < 50_000 for e in waits), [e["dur"] for e in waits]
    assert trace_summary.summarise(timeline)["ipus"][0]["busy_fraction"] < 0.1


def test_an_injected_fault_is_marked_on_its_ipu(tmp_path, models):
    from ipu_emulator import faults
    from host_runtime.errors import ApplicationRuntimeError

    _, simple, _ = models
    out = str(tmp_path / "fault.json")
    a, b = np.ones((1, 4), np.float32), np.zeros((1, 4), np.float32)
    with trace.tracing(out), faults.inject(kind="application_error", after=1):
        with model_runtime.ModelRunner(simple) as runner:
            runner.execute({"tensor_A": a, "tensor_B": b})
            with pytest.raises(ApplicationRuntimeError):
                runner.execute({"tensor_A": a, "tensor_B": b})
    timeline = json.load(open(out))
    ipu = [pid for pid, name in _names(timeline).items() if name.startswith("ipu ")]
    marks = [e["name"] for e in timeline["traceEvents"]
             if e["ph"] == "i" and e["pid"] == ipu[0] and e["name"].startswith("fault ")]
    assert marks == ["fault 0: application_err"], marks   # (24 bytes on an IPU)
    # the failed request is drawn too (from its arrival to its failure), counted apart
    failed = [e for e in timeline["traceEvents"] if e["ph"] == "b"
              and e.get("args", {}).get("error") == "ApplicationRuntimeError"]
    assert len(failed) == 1 and failed[0]["name"].endswith("replica 0"), failed
    assert [e["name"] for e in timeline["traceEvents"] if e["ph"] == "b"
            and e["id2"] == failed[0]["id2"]][1:] == ["failed: ApplicationRuntimeError"]
    summary = trace_summary.summarise(timeline)["models"]
    assert [(m["requests"], m["failed"]) for m in summary] == [(1, 1)], summary
    assert trace_summary.validate(timeline) == []


def test_runners_made_before_tracing_are_named_apart(tmp_path, models):
    _, simple, _ = models
    out = str(tmp_path / "late.json")
    a, b = np.ones((1, 4), np.float32), np.zeros((1, 4), np.float32)
    with model_runtime.ModelRunner(simple) as first, model_runtime.ModelRunner(simple) as second:
        with trace.tracing(out):
            for r in (first, second):
                r.execute({"tensor_A": a, "tensor_B": b})
    timeline = json.load(open(out))
    titles = sorted({e["name"] for e in timeline["traceEvents"] if e["ph"] == "b"
                     and e.get("cat") == "request" and "replica" in e["name"]})
    assert titles == ["runner 1 · simple_model · replica 0",
                      "runner 2 · simple_model · replica 0"], titles
    assert not [e for e in timeline["traceEvents"] if e["ph"] == "X"
                and e["name"].startswith("running")]   # a name only, no slice
