"""``ipu-emulator stress``: a short run of each scenario checks every result and leaks nothing;
a wrong result, a leaked object and a leaked process make it fail and say what."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import posix_ipc
import pytest

from tools import stress
from tools._stress_rig import Rig

# The scenarios whose faults are timed (kills, forks) run 3 s of load; the kill windows
# are counted from the hosts' readiness, so at least one fault lands even on a slow
# machine. The others run a request budget (the side threads of the interrupt scenario
# last as long as the requests do).
_SHAPE = ["--hosts", "2", "--threads", "2", "--replicas", "2"]
_TIMED = ("kill-ipu", "kill-pipeline", "kill-host", "fork")


def _short(scenario: str) -> list[str]:
    if scenario == "faults":   # its length is its schedule's requests: one host is enough
        return ["--requests", "12", "--hosts", "1", "--threads", "1", "--replicas", "1"]
    if scenario == "shared-machine":   # 3 s of changes under one host's runner
        return ["--duration", "3", "--hosts", "1", "--threads", "1", "--replicas", "1",
                "--private-shm-mib", "64", "--shm-fill-mib", "64"]
    if scenario not in _TIMED:
        return ["--requests", "30", *_SHAPE]
    # one host where the scenario is about what happens inside it (kill-host replaces hosts)
    hosts = "2" if scenario == "kill-host" else "1"
    return ["--duration", "3", "--hosts", hosts, "--threads", "2", "--replicas", "2"]


def _run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict]:
    code = stress.main([*args, "--json", "--seed", "11"])
    out = capsys.readouterr().out
    return code, json.loads(out)


def _own_shm(tag: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if f"ipuemu_{tag}_" in n]


@pytest.mark.parametrize("scenario", stress.SCENARIOS)
def test_each_scenario_checks_every_result_and_passes(capsys, scenario):
    code, report = _run(capsys, "--scenario", scenario, *_short(scenario))
    [sc] = report["scenarios"]
    assert (code, report["passed"], report["problems"], sc["problems"]) == (0, True, [], []), report
    assert sc["name"] == scenario and sc["passed"]
    assert (sc["wrong"], sc["hung"], sc["errors"], sc["leaks"]) == (0, 0, 0, 0)
    assert sc["ok"] > 0 and sc["p50_ms"] is not None and sc["p99_ms"] >= sc["p50_ms"]
    if scenario in ("kill-ipu", "kill-pipeline"):
        assert sc["ipus_killed"] >= 1
    elif scenario == "fork":
        # every forked child's execute and executeAsync on its host's runner raised the
        # named error (failed as expected); its own runner answered right (in ok)
        # (cycles in the 3 s: one on a loaded machine, where a fork and its child's
        # runner take seconds)
        assert sc["cycles"] >= 1 and sc["expected"] == 2 * sc["cycles"]
    elif scenario == "interrupt":
        # KeyboardInterrupts were delivered into the hosts' threads (cycles); the requests
        # they hit and the queue runs a raising callback failed are failed as expected
        assert sc["cycles"] >= 2 and sc["expected"] >= 1
    elif scenario == "faults":
        # every single-IPU kind twice (with and without auto_reset), link_down once: each
        # error fault failed its request as expected (and, unreset, the next one too)
        assert sc["faults"] >= 6 and sc["expected"] >= 5 and sc["resets"] >= 1
        assert sc["recovery_ms"] and sc["cycles"] == sc["faults"]
    elif scenario == "shared-machine":
        # the file was cut and rewritten, /dev/shm filled and the IPU killed under the
        # runner: every answer right or a named error (failed as expected), no crash
        assert sc["faults"] >= 3
    else:
        assert sc["expected"] == 0        # only killed IPUs may fail a request
    if scenario == "kill-host":
        # a killed host is replaced while more than 2 s of load remain
        assert sc["hosts_killed"] >= 1 and 2 <= sc["hosts"] <= 2 + sc["hosts_killed"]
        assert sc["orphans_checked"] >= 2 * sc["hosts_killed"]     # 2 replicas: 2 IPUs each
    if scenario == "daemon":
        assert sc["cycles"] >= 1
    assert report["verdict"].startswith("PASS: 1 scenarios")


def test_several_scenarios_through_a_daemon_with_a_request_budget(capsys, tmp_path):
    timeline = tmp_path / "stress.json"
    code, report = _run(capsys, "--daemon", "--scenario", "mixed", "--scenario", "batching",
                        "--requests", "20", "--hosts", "2", "--threads", "2",
                        "--trace", str(timeline))
    assert code == 0 and report["passed"], report
    assert [s["name"] for s in report["scenarios"]] == ["mixed", "batching"]
    assert [s["ok"] for s in report["scenarios"]] == [40, 40]
    # --trace: the hosts' and daemons' files as one, read by Perfetto's rules; the
    # daemon's IPU processes once each, named by the host they served; every request's
    # arrows kept
    from tools import trace_summary

    trace = trace_summary.load(str(timeline))
    assert trace_summary.validate(trace) == []
    requests = trace_summary.requests(trace)
    assert len(requests) == 80
    sources = {(a["pid"], a["id2"]["local"], a["ts"]) for a, _ in trace_summary.arrows(trace)
               if "id2" in a}
    assert all(any((r["pid"], r["id2"]["local"]) == s[:2]
                   and r["ts"] <= s[2] <= r["ts"] + r["dur"] for s in sources)
               for r, _ in requests)
    ipus = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
            if e["name"] == "process_name" and e["args"]["name"].startswith("ipu ")}
    served = {b["pid"] for _, b in trace_summary.arrows(trace)}
    # every IPU that served a request is named by its host (one a host never got is not)
    assert len(ipus) == 8 and served and served <= set(ipus)
    assert all(" · host " in ipus[pid] for pid in served), ipus


def test_a_wrong_result_fails_the_run_and_is_named(capsys):
    code = stress.main(["--scenario", "mixed", "--requests", "6", "--hosts", "1",
                        "--threads", "1", "--inject-wrong", "2", "--seed", "3"])
    out = capsys.readouterr().out
    assert code == 1, out
    lines = out.splitlines()
    assert lines[-1].startswith("FAIL: 1 scenarios, 4 requests checked, 2 wrong, 0 hung"), out
    row = next(line for line in lines if line.startswith("mixed "))
    assert row.split()[-1] == "FAIL"
    wrong = [line for line in lines if "wrong: mode" in line]
    assert len(wrong) == 2 and all("differ from numpy" in line for line in wrong), out


def test_a_wrong_result_in_json(capsys):
    code, report = _run(capsys, "--scenario", "fused", "--requests", "3", "--hosts", "1",
                        "--threads", "1", "--inject-wrong", "1")
    [sc] = report["scenarios"]
    assert code == 1 and not report["passed"] and not sc["passed"]
    assert (sc["ok"], sc["wrong"]) == (2, 1)
    assert "differ from numpy" in sc["problems"][0] and "graph" in sc["problems"][0]


def test_the_rig_reports_and_removes_a_leaked_object_and_a_leaked_process():
    rig = Rig(num_ipus=1, seed=0)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                            stdin=subprocess.DEVNULL)
    rig.adopt(proc)
    name = f"/ipuemu_{rig.tag}_{os.getpid()}_abcd_region"
    posix_ipc.SharedMemory(name, posix_ipc.O_CREX, size=16).close_fd()
    assert _own_shm(rig.tag) == [name[1:]]
    problems = rig.finish(grace=0.2)
    proc.wait(30)
    assert proc.returncode == -9
    assert any(f"process {proc.pid} started by the run is still alive; killed" in p
               for p in problems), problems
    assert f"leak: /dev/shm/{name[1:]} left behind; removed" in problems
    assert _own_shm(rig.tag) == []
    assert not rig.workdir.exists()


def test_bad_arguments_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        stress.main(["--hosts", "0"])
    assert exc.value.code == 2
    assert "--hosts must be in 1..64, got 0" in capsys.readouterr().err
    for flag, value, message in (("--threads", "100000", "--threads must be in 1..256"),
                                 ("--duration", "1e20", "--duration must be in (0, 86400]"),
                                 ("--duration", "nan", "--duration must be in (0, 86400]"),
                                 ("--hang-timeout", "-1", "--hang-timeout must be in (0, 86400]")):
        with pytest.raises(SystemExit) as exc:
            stress.main([flag, value])
        assert exc.value.code == 2
        assert f"{message}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        stress.main(["--scenario", "kill-host", "--hosts", "1"])
    assert "kill-host needs --hosts 2 or more (one host always runs), got 1" \
        in capsys.readouterr().err
    with pytest.raises(SystemExit):
        stress.main(["--scenario", "nope"])
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_a_request_past_the_hang_timeout_counts_as_hung(capsys):
    # No async result arrives within 1 us (a round trip takes hundreds): each thread reports
    # its first async request as hung and stops.
    code, report = _run(capsys, "--scenario", "mixed", "--requests", "200", "--hosts", "1",
                        "--threads", "2", "--hang-timeout", "0.000001")
    [sc] = report["scenarios"]
    assert code == 1 and not sc["passed"], report
    assert 1 <= sc["hung"] <= 2 and sc["wrong"] == 0
    assert any("no result within 1e-06 s" in p for p in sc["problems"]), sc["problems"]
    assert ", 0 wrong, " in report["verdict"] and report["verdict"].startswith("FAIL")
