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


class _LateReport(_Reported):
    """... whose template reports the exit once asked to wait for it."""

    def __init__(self, pid: int, code: int) -> None:
        super().__init__(pid)
        self.code: int | None = None
        self._later = code

    def alive(self) -> bool:
        return self.code is None

    def returncode(self) -> int | None:
        return self.code

    def wait_exit(self, timeout: float) -> int | None:
        self.code = self._later
        return self.code

    def describe_exit(self) -> str:
        return f"process {self.pid} exited with {self.code}"


def test_a_process_retired_before_its_exit_was_reported_counts_as_a_death(tmp_path) -> None:
    """The daemon's look finds the pid gone before the template's report: retiring it waits
    for the report, so the death is counted (/metrics) and its status kept (exit_status)."""
    from ipu_emulator.daemon._keeper import ProcessKeeper

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    ipu = PooledIpu(IpuSpec(ipu_id=0), str(tmp_path))
    ipu.proc = _LateReport(child.pid, -9)   # type: ignore[assignment]
    died: list[int] = []
    keeper = ProcessKeeper([ipu], lambda i: died.append(i.index))
    assert not ipu.alive()
    keeper.retire(ipu)
    assert died == [0] and keeper._exits[child.pid] == -9
    ipu.proc = None
