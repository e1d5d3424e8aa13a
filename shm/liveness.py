"""Is a process still alive?

A process counts as dead when its pid is gone, when it is a zombie (exited,
not yet reaped by its parent), or when the pid now belongs to a different
process (its start time changed since we first looked: pid reuse).
"""

from __future__ import annotations

import os

import psutil

__all__ = ["pid_alive", "PeerWatch"]


def pid_alive(pid: int) -> bool:
    """True if ``pid`` is a running (non-zombie) process."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, belongs to someone else
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # pragma: no cover - access denied etc.: it exists
        return True


class PeerWatch:
    """Liveness of one peer process, guarded against pid reuse."""

    __slots__ = ("pid", "_proc", "_dead_reason")

    def __init__(self, pid: int) -> None:
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            raise ValueError(f"peer pid must be a positive int, got {pid!r}")
        self.pid = pid
        self._dead_reason: str | None = None
        try:
            self._proc: psutil.Process | None = psutil.Process(pid)
            self._proc.create_time()  # cached by psutil for is_running()
        except psutil.NoSuchProcess:
            self._proc = None
            self._dead_reason = "does not exist"

    def dead_reason(self) -> str | None:
        """None while alive; else why it counts as dead (stays dead once dead)."""
        if self._dead_reason is not None:
            return self._dead_reason
        proc = self._proc
        assert proc is not None
        try:
            if not proc.is_running():  # gone, or pid reused (start time differs)
                self._dead_reason = "exited"
            elif proc.status() == psutil.STATUS_ZOMBIE:
                self._dead_reason = "exited (zombie, not yet reaped)"
        except psutil.NoSuchProcess:
            self._dead_reason = "exited"
        except psutil.Error:  # pragma: no cover - access denied: assume alive
            return None
        return self._dead_reason

    def alive(self) -> bool:
        return self.dead_reason() is None
