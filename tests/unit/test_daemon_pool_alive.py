"""The daemon's look at an IPU process before it lends it (``PooledIpu.alive``).

The daemon's IPU processes are forked by its template process, which reaps one that
dies and reports the exit over its socket a moment later. An attach read in that
moment must not lend the dead process: the pid itself says it is gone."""

from __future__ import annotations

import subprocess
import sys

from ipu_emulator.daemon._pool import PooledIpu
from ipu_emulator.ipu.launcher import IpuSpec


class _Reported:
    """An IPU process whose exit its template has not reported yet."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def alive(self) -> bool:
        return True   # as far as the template's reports go

    def returncode(self) -> None:
        return None


def test_a_process_gone_before_its_exit_was_reported_is_not_alive(tmp_path) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()   # reaped: the pid names no process (as after the template reaped it)
    ipu = PooledIpu(IpuSpec(ipu_id=0), str(tmp_path))
    ipu.proc = _Reported(child.pid)   # type: ignore[assignment]
    assert not ipu.alive()
    running = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                               stdin=subprocess.PIPE)
    try:
        ipu.proc = _Reported(running.pid)   # type: ignore[assignment]
        assert ipu.alive()
    finally:
        ipu.proc = None
        running.communicate(b"")
