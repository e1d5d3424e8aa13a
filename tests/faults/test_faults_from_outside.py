"""Faults given from outside an unchanged host program (fresh processes): the
environment (``IPU_EMULATOR_FAULTS``: JSON text, a YAML file), a daemon holding them
(``--faults``) and a live command into a running daemon (``daemon faults --add``); a
bad schedule refused at the start naming the field and the value."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.daemon_rig import DaemonRig

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.usefixtures("private_machine"), pytest.mark.embedded_only]
SHAPE = (1, 4)


def host(model_path: str, requests: int, auto_reset: bool, **env: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-m", "tests.faults.faulted_host_program",
                           model_path, str(requests), "1" if auto_reset else "0"],
                          cwd=REPO, env=dict(os.environ, **env), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.split("\n")[:-1]


def test_an_unchanged_program_under_IPU_EMULATOR_FAULTS(model_path, tmp_path):
    faults = tmp_path / "faults.yaml"
    faults.write_text("- {kind: recoverable_error, action: FULL_RESET, after: 1}\n"
                      "- {kind: application_error, after: 3}\n")
    lines = host(model_path, 6, True, IPU_EMULATOR_FAULTS=str(faults))
    assert lines == ["ok",                                      # Main run 0
                     "RecoverableRuntimeError FULL_RESET -",        # run 1: not auto_reset's
                     "RecoverableRuntimeError FULL_RESET RecoverableRuntimeError",  # new runner
                     "ok",                                          # run 2
                     "ApplicationRuntimeError - -",                 # run 3: reset after it
                     "ok"]


def test_a_bad_schedule_is_refused_when_the_runner_starts(model_path):
    proc = subprocess.run([sys.executable, "-m", "tests.faults.faulted_host_program",
                           model_path, "1", "0"], cwd=REPO, capture_output=True, text=True,
                          env=dict(os.environ, IPU_EMULATOR_FAULTS='[{"kind": "hang", "times": 0}]'),
                          timeout=120)
    assert proc.returncode != 0
    assert "SettingsError: IPU_EMULATOR_FAULTS: fault 0: field 'times' = 0: expected an " \
           "integer in 1.." in proc.stderr


def test_a_daemon_holding_faults_and_a_live_injection(model_path, tmp_path):
    faults = tmp_path / "faults.json"
    faults.write_text('[{"kind": "unrecoverable_error", "after": 1}]')
    rig = DaemonRig(tmp_path, num_ipus=1, args=("--faults", str(faults)))
    try:
        lines = host(model_path, 4, True, IPU_EMULATOR_DAEMON=rig.socket)
        assert lines == ["ok", "UnrecoverableRuntimeError - -",
                         "UnrecoverableRuntimeError - UnrecoverableRuntimeError", "ok"]
        add = subprocess.run([sys.executable, "-m", "tools.cli", "daemon", "faults", "--socket",
                              rig.socket, "--add", '{"kind": "crash", "after": 0}'], cwd=REPO,
                             env=rig.env, capture_output=True, text=True, timeout=60)
        assert add.returncode == 0, add.stderr
        assert 'fault 0: {"kind": "unrecoverable_error", "after": 1}  runs seen 3, fired 1' \
            in add.stdout
        assert 'fault 1: {"kind": "crash"}  runs seen 0, fired 0' in add.stdout
        lines = host(model_path, 2, True, IPU_EMULATOR_DAEMON=rig.socket)
        assert lines == ["DeviceLostError - RemoteTraceback", "ok"]    # restarted by the daemon
        bad = subprocess.run([sys.executable, "-m", "tools.cli", "daemon", "faults", "--socket",
                              rig.socket, "--add", '{"kind": "slow", "delay_ms": -1}'], cwd=REPO,
                             env=rig.env, capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and "field 'delay_ms' = -1" in bad.stderr
    finally:
        rig.stop()


def test_a_daemon_refuses_a_bad_schedule_at_its_start(tmp_path):
    (tmp_path / "f.yaml").write_text("- {kind: recoverable_error, action: RESET}\n")
    proc = subprocess.run([sys.executable, "-m", "tools.cli", "daemon", "--socket",
                           str(tmp_path / "d.sock"), "--faults", str(tmp_path / "f.yaml")],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--faults (" in proc.stderr and \
        "fault 0: field 'action' = 'RESET': expected one of IPU_RESET" in proc.stderr
