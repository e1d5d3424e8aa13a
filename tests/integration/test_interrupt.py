"""A result always belongs to its request, whatever interrupts the host.

From the outside (tests/integration/interrupt_program.py, a fresh interpreter): SIGINT
every 50 ms into a loop of ``execute`` (or ``executeAsync`` + ``wait``, or both) for
~1 s; every answer is compared with numpy. 0 wrong answers; the runner answers right
after; nothing is left in /dev/shm once it is closed. Embedded and through the daemon.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from ipu_emulator.daemon import socket_protocol as wire

pytestmark = pytest.mark.usefixtures("private_machine")

SHAPE = (1, 4)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOST = re.compile(r"InvalidStateError: replica 0: output 'tensor_C' of the request was lost: "
                  r"the thread reading it was interrupted by KeyboardInterrupt")
"""The one error an interrupted wait may cost its own future (an output consumed just as
the interrupt came), never an answer."""


def run_program(model_path: str, how: str, seconds: float = 1.0,
                socket: str | None = None, **extra: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), **extra)
    env.pop(wire.ENV_VAR, None)
    if socket is not None:
        env[wire.ENV_VAR] = socket
    proc = subprocess.run(
        [sys.executable, "-m", "tests.integration.interrupt_program", model_path, str(seconds),
         how], env=env, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(lines[-1][len("RESULT "):])


def check(result: dict) -> None:
    assert result["wrong"] == 0, result
    assert result["wrong_after"] == 0, result
    assert result["left"] == [], result
    assert result["interrupted"] > 0 and result["right"] > 0, result
    assert all(LOST.fullmatch(e) for e in result["errors"]), result


@pytest.mark.parametrize("how", ["execute", "async", "mixed"])
def test_sigint_every_50_ms_into_a_loop_gives_no_wrong_answer(model_path, how):
    check(run_program(model_path, how))


def test_sigint_every_50_ms_through_the_daemon_gives_no_wrong_answer(model_path, daemon):
    check(run_program(model_path, "mixed", socket=daemon.socket))


def test_sigint_every_50_ms_with_the_rings_pure_python_path(model_path):
    """The rings' Python path (no C core) keeps a token an interrupted call took."""
    check(run_program(model_path, "mixed", IPU_EMULATOR_RING_C="0"))


CALLBACK_ERROR = re.compile(
    r"(after: )?DeviceExecutionError: main programs: the callback of anchor "
    r"'(tensor_A|tensor_C)' raised ValueError: (input|output) callback of request N failed")


@pytest.mark.parametrize("how", ["callbacks", "queues", "queues_late"])
def test_a_session_under_sigint_and_raising_callbacks_gives_no_wrong_answer(model_path, how):
    """tests/integration/interrupt_session_program.py: SIGINT every 50 ms into
    ``runMainPrograms`` (and the queues' enqueues), user callbacks that raise: every run
    that returns delivered its own result, every output buffer holds its own request's
    result, a callback's error is reported by the run it failed (never a later one)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    env.pop(wire.ENV_VAR, None)
    proc = subprocess.run(
        [sys.executable, "-m", "tests.integration.interrupt_session_program", model_path,
         "1", how], env=env, capture_output=True, text=True, timeout=240, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads([ln for ln in proc.stdout.splitlines()
                         if ln.startswith("RESULT ")][-1][len("RESULT "):])
    assert (result["wrong"], result["wrong_after"], result["misattributed"], result["left"]) \
        == (0, 0, 0, []), result
    assert result["interrupted"] > 0 and result["right"] > 0, result
    assert all(CALLBACK_ERROR.fullmatch(e) for e in result["errors"]), result
    if how == "callbacks":   # requests 7k and 11k raise in their callbacks
        assert result["errors"], result
