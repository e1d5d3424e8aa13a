"""Every host call is bounded, checked from the outside: an unchanged user program
(tests/faults/stopped_peer_program.py, a fresh process with only public calls) stops its
IPU process (or the daemon) with SIGSTOP and makes one kind of call. Each call must end
within the host sync timeout with a named error (DeviceTimeoutError naming the host sync
timeout and the stopped pid), never hang; once the peer is continued the runner answers
right; nothing is left in /dev/shm.

A call that runs past the program's hang bound (12 s, for a 1 s host sync timeout) is
counted as hung and the peer is continued, so the program still closes and reports.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from ipu_emulator.daemon import socket_protocol as wire

from tests._paths import child_pythonpath

pytestmark = pytest.mark.usefixtures("private_machine")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SYNC = "1"

def run_program(case: str, model_path: str, *args: str, **env: str) -> dict[str, Any]:
    environ = dict(os.environ, IPU_EMULATOR_HOST_SYNC_TIMEOUT=SYNC,
                   PYTHONPATH=child_pythonpath(), **env)
    proc = subprocess.run([sys.executable, "-m", "tests.faults.stopped_peer_program", case,
                           model_path, *args], capture_output=True, text=True, timeout=180,
                          env=environ, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def assert_bounded(report: dict[str, Any], names: list[str]) -> None:
    """Every call ended without hanging, with the host sync timeout's named error."""
    calls = {c["call"]: c for c in report["calls"]}
    assert [c["call"] for c in report["calls"] if c["hung"]] == [], report
    for name in names:
        call = calls[name]
        assert call["error"] == "DeviceTimeoutError", (name, call)
        assert "IPU_EMULATOR_HOST_SYNC_TIMEOUT" in call["message"], call
        assert f"pid {report['stopped_pid']}" in call["message"], call
    assert report["wrong_after"] == 0 and report["errors_after"] == 0, report
    assert report["left"] == [], report


def test_execute_on_a_stopped_ipu_process_is_bounded(model_path):
    assert_bounded(run_program("execute", model_path), ["execute"])


def test_wait_on_a_stopped_ipu_process_is_bounded(model_path):
    report = run_program("wait", model_path)
    assert_bounded(report, ["wait"])


@pytest.mark.parametrize("case", ["poll-wait", "poll-done"])
def test_polled_futures_on_a_stopped_ipu_process_all_fail_within_the_bound(model_path, case):
    """Six futures polled with wait(0.1) or done(), never waited on without a timeout:
    all fail together with the named error within the host sync timeout (1 s) and a
    margin, not one per wait nor never; once continued, the runner answers right."""
    report = run_program(case, model_path)
    polled = report["polled"]
    assert all(0 <= s <= float(SYNC) + 2.5 for s in polled["seconds"]), polled
    assert max(polled["seconds"]) - min(polled["seconds"]) < 1.0, polled
    for err in polled["errors"]:
        assert err is not None and err[0] == "DeviceTimeoutError", polled
        assert "IPU_EMULATOR_HOST_SYNC_TIMEOUT" in err[1], err
        assert f"pid {report['stopped_pid']}" in err[1], err
    assert report["wrong_after"] == 0 and report["errors_after"] == 0, report
    assert report["left"] == [], report


def test_execute_async_with_full_rings_is_bounded(model_path):
    report = run_program("async-full", model_path)
    assert_bounded(report, ["executeAsync (rings full)"])


def test_execute_async_while_another_thread_is_inside_execute_is_bounded(model_path):
    report = run_program("async-thread", model_path)
    assert not report["thread_alive"]
    assert_bounded(report, ["execute (thread)", "executeAsync (another thread inside execute)"])


def test_close_with_a_stopped_ipu_process_is_bounded(model_path):
    """The runner on the program's own device: its close names the stopped device (the
    device is the caller's to close); the device's close kills the stopped process."""
    report = run_program("close", model_path)
    calls = {c["call"]: c for c in report["calls"]}
    assert [c["call"] for c in report["calls"] if c["hung"]] == [], report
    close = calls["runner.close"]
    assert close["error"] is None or close["error"] == "DeviceTimeoutError", close
    if close["error"]:
        assert "IPU_EMULATOR_HOST_SYNC_TIMEOUT" in close["message"]
        assert f"IPU process pid {report['stopped_pid']}, stopped (state T)" in close["message"]
    assert calls["device.close"]["error"] is None
    assert report["ipu_alive"] is False
    assert report["left"] == []


def test_a_stopped_daemon_bounds_close_and_attach_and_releases_locally(model_path, daemon):
    """The daemon stopped: the runner's and the device's close return within the bound
    (released locally), an attach fails with the named error; continued, the IPU is free
    again and a new runner answers right."""
    dpid = str(daemon.status()["daemon_pid"])
    report = run_program("daemon-close", model_path, dpid, **{wire.ENV_VAR: daemon.socket})
    calls = {c["call"]: c for c in report["calls"]}
    assert [c["call"] for c in report["calls"] if c["hung"]] == [], report
    assert calls["runner.close"]["error"] is None and calls["device.close"]["error"] is None
    attach = calls["attach"]
    assert attach["error"] == "DeviceTimeoutError", attach
    assert attach["message"].startswith(f"the IPU emulator daemon at {daemon.socket} (pid {dpid}, "
                                        "stopped (state T)) did not answer "), attach
    assert report["again_right"] is True and report["left"] == []


def test_a_stopped_daemon_does_not_stop_requests(model_path, daemon):
    """Requests go to the IPU processes: a stopped daemon does not delay them."""
    dpid = str(daemon.status()["daemon_pid"])
    report = run_program("daemon-execute", model_path, dpid, **{wire.ENV_VAR: daemon.socket})
    assert report["right"] is True and report["calls"][0]["error"] is None
    assert not report["calls"][0]["hung"]
    assert report["wrong_after"] == 0 and report["again_right"] and report["left"] == []


def test_a_stopped_template_process_bounds_attach_and_forks_nothing_stale(model_path):
    """The template process IPU processes are forked from, stopped: two attaches each end
    within the bound (plus a fresh start); continued, it forks nothing for the requests
    given up on (a second IPU process on a device's rings), so both devices answer right."""
    report = run_program("template", model_path, STOPPED_PEER_HANG="60")
    assert [c for c in report["calls"] if c["error"] or c["hung"]] == [], report
    # the bound (1 s) and a fresh start, not the template's own 30 s each
    assert [c for c in report["calls"] if c["seconds"] >= 25] == [], report
    assert report["wrong_after"] == 0 and report["errors_after"] == 0, report
    assert report["ipu_processes"] == [] and report["left"] == [], report
