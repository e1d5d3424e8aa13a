"""The exits of a device's IPU processes, as a cue for its event thread.

A device's event thread (``host_runtime.devices._link``) waits on the event ring with
no time slice when every IPU process of the device can be watched by pidfd: the exit
thread of :mod:`shm.liveness` calls :meth:`ExitCue._exited` when one of them exits, and
that interrupts the thread's wait (``Ring.interrupt``). An idle device then costs no
CPU: nothing wakes its thread until an event or an exit. Where a process cannot be
watched that way (a loopback IPU is a thread of this process; no pidfds, or none
left; ``IPU_EMULATOR_RING_PEER_THREAD=0``) the thread reads in slices and looks at
the processes between them.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Sequence

from shm import ShmError
from shm.liveness import notify_on_exit
from shm.settings import ShmSettings

__all__ = ["ExitCue"]


class ExitCue:
    """One event thread's subscription to the exits of its device's IPU processes."""

    __slots__ = ("seen", "_events", "_cancels")

    def __init__(self, events: Any) -> None:
        self.seen = False    # a process exited (set from the exit thread)
        self._events = events
        self._cancels: list[Callable[[], None]] = []

    @classmethod
    def watch(cls, pids: Sequence[int], events: Any) -> "ExitCue | None":
        """A cue for the exit of any of ``pids``, or None if one cannot be watched."""
        if os.getpid() in pids or not ShmSettings.current().ring_peer_thread:
            return None   # a loopback IPU (a thread of this process), or no exit thread
        cue = cls(events)
        for pid in pids:
            try:
                cancel = notify_on_exit(pid, cue._exited)
            except OSError:   # out of descriptors (the exit thread's pipe, a pidfd)
                cancel = None
            if cancel is None:
                cue.close()
                return None
            cue._cancels.append(cancel)
        return cue

    def _exited(self) -> None:
        self.seen = True
        try:
            self._events.interrupt()   # the thread takes the interrupt back (resume)
        except ShmError:   # closed meanwhile: the thread is ending anyway
            pass

    def close(self) -> None:
        cancels, self._cancels = self._cancels, []
        for cancel in cancels:
            cancel()
