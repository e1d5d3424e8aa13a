"""``PidWatch``: has one of a device's IPU processes exited? One ``poll(0)`` of pidfds.

A replica asks before every request (``Replica._check_device``), so this is on the
request path: about 0.45 us a call, where ``shm.ExitWatch.dead_pid`` (the general,
thread-safe watch, which locks around its poll and falls back to pid checks) takes
about 1.0 us. The replica's calls are serialised by its submit lock, so no lock here.
"""

from __future__ import annotations

import os
import select

__all__ = ["PidWatch"]


class PidWatch:
    """pidfds of a device's IPU processes: ``dead_pid()`` polls them (~0.45 us)."""

    def __init__(self) -> None:
        self._fds: list[tuple[int, int]] = []
        self._poll: select.poll | None = None
        self._all = False

    def watch(self, pids: list[int]) -> None:
        self.close()
        poller = select.poll()
        for pid in pids:
            try:
                fd = os.pidfd_open(pid)
            except (AttributeError, OSError):   # no pidfd support, or already gone and reaped
                continue
            self._fds.append((fd, pid))
            poller.register(fd, select.POLLIN)
        self._poll = poller if self._fds else None
        self._all = len(self._fds) == len(pids)

    @property
    def active(self) -> bool:
        """True if ``dead_pid()`` watches every process it was given a pid of."""
        return self._poll is not None and self._all

    def dead_pid(self) -> int | None:
        """The pid of a process of the device that has exited, if any."""
        if self._poll is None:
            return None
        ready = self._poll.poll(0)
        if not ready:
            return None
        fd = ready[0][0]
        return next(p for f, p in self._fds if f == fd)

    def __del__(self) -> None:
        self.close()

    def close(self) -> None:
        for fd, _ in self._fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = []
        self._poll = None
