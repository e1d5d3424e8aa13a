"""The ring's C core takes SIGRTMIN+6 only when it needs it and nobody else has it.

Untimed semaphore waits (woken by a watchdog's signal at the end of each
slice) save a kernel timer per wait; the benchmark in shm/_ringcore.c says
they pay. But a library must not take a signal from its application: the
handler is installed by the first untimed wait, only over the default
disposition, and never with IPU_EMULATOR_RING_UNTIMED_WAITS=0. Each case runs
in a fresh interpreter, since dispositions are process-wide.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from shm import ring as ring_mod

pytestmark = pytest.mark.skipif(ring_mod._ringcore is None, reason="needs the C core")

_WAIT = """
import signal, time
import shm
from shm import Ring, RingTimeoutError
WAKE = signal.SIGRTMIN + 6
def caught():
    # the kernel's view (signal.getsignal only knows handlers set from Python)
    for line in open("/proc/self/status"):
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (WAKE - 1) & 1)
def wait_once():
    r = Ring.create(64, 2)
    try:
        t0 = time.monotonic()
        try:
            r.acquire_read(0.2)      # several slices: untimed waits if allowed
        except RingTimeoutError:
            pass
        assert 0.15 < time.monotonic() - t0 < 5, time.monotonic() - t0
    finally:
        r.close(); r.unlink()
"""


def _run(body: str, **env: str) -> str:
    code = _WAIT + textwrap.dedent(body)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, **env), timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.strip()


def test_import_takes_no_signal_and_the_first_long_wait_installs_the_handler() -> None:
    out = _run("""
        print(caught())
        wait_once()
        print(caught())
    """)
    assert out.split() == ["False", "True"]


def test_an_applications_handler_is_kept_and_waits_still_time_out() -> None:
    out = _run("""
        got = []
        signal.signal(WAKE, lambda signum, frame: got.append(signum))
        wait_once()
        signal.raise_signal(WAKE)    # still the application's handler
        print(got == [WAKE])
    """)
    assert out == "True"


def test_the_setting_turns_untimed_waits_off() -> None:
    out = _run("""
        wait_once()
        print(caught())
    """, IPU_EMULATOR_RING_UNTIMED_WAITS="0")
    assert out == "False"
