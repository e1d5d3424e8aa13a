"""Attaching a session's device while the session makes its rings.

Attaching waits on another process (a daemon's answer, an IPU process starting) for
most of its time; making the rings and regions a session loads with is this
process's own work and needs no device. :func:`attach_meanwhile` does the two at
once: the attach in a short-lived thread (in a copy of the caller's context, as
``asyncio.to_thread`` runs one), the work in the caller's. The work starts once the
attach waits on another process (``host_runtime.devices.waiting_elsewhere``: its
request sent) or has ended: started at once, it would hold the interpreter while the
attach thread has yet to send anything, and the two would run one after the other.
"""

from __future__ import annotations

import contextvars
import threading
from typing import Callable

from host_runtime.devices import Device, tell_when_waiting

__all__ = ["attach_meanwhile"]


class _Attaching:
    """The attach thread's outcome, and whether the caller gave up on it."""

    def __init__(self, attach: Callable[[], Device]) -> None:
        self._attach = attach
        self._lock = threading.Lock()
        self._abandoned = False
        self.waiting = threading.Event()   # the attach waits on another process, or ended
        self.device: Device | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        tell_when_waiting(self.waiting.set)
        try:
            dev: Device | None = self._attach()
        except BaseException as exc:   # handed to the caller, who raises it
            self.error, dev = exc, None
        finally:
            self.waiting.set()
        with self._lock:
            self.device = dev
            orphan = self._abandoned
        if orphan and dev is not None:   # the caller failed meanwhile: nobody will use it
            dev.close()

    def abandon(self) -> None:
        """The caller failed: close the device now if attached, or once it is."""
        with self._lock:
            self._abandoned = True
            dev, self.device = self.device, None
        if dev is not None:
            dev.close()


def attach_meanwhile(attach: Callable[[], Device], work: Callable[[], None]) -> Device:
    """``attach()`` in a thread while ``work()`` runs in this one (from when the attach
    waits on another process); the device attached.

    ``attach``'s error is raised once ``work`` is done; if ``work`` raises, the attach is
    waited for and its device closed before that error is raised (if this thread is
    interrupted while it waits, the device is closed when it comes).
    """
    state = _Attaching(attach)
    context = contextvars.copy_context()   # what the caller's context says holds there too
    thread = threading.Thread(target=context.run, args=(state.run,),
                              name="ipu-emulator attach", daemon=True)
    thread.start()
    try:
        state.waiting.wait()
        work()
    except BaseException:
        try:
            thread.join()   # the device is closed now: nothing of it outlives the error
        finally:
            state.abandon()   # (if the join is interrupted, once it is attached)
        raise
    try:
        thread.join()
    except BaseException:
        state.abandon()
        raise
    error, state.error = state.error, None
    if error is not None:
        try:
            raise error
        finally:
            del error   # no cycle: the traceback holds this frame
    assert state.device is not None
    return state.device
