"""Threads that sleep, their lock released, until another wakes them or their time is up.

:class:`Sleepers` is the ``wait(timeout)`` / ``notify_all()`` of ``threading.Condition``
over a plain lock, safe from an interrupt (KeyboardInterrupt, a signal handler's
exception) at any point CPython checks for one. ``Condition.wait`` releases its lock
before the ``try`` whose ``finally`` takes it back: an interrupt there (at the return of
the release) leaves the lock released, and the ``with`` around the wait then releases
an unlocked lock (``RuntimeError``), or one another thread has taken since. Here the
release is inside the ``try``, and a flag set just before it (no check between them)
says whether the ``finally`` must take the lock back. Every wait is timed: a sleeper an
interrupted ``notify_all`` did not wake wakes when its time is up.
"""

from __future__ import annotations

import _thread
from typing import Any

__all__ = ["Sleepers", "sleep_released"]

_new_lock = _thread.allocate_lock


class Sleepers:
    """The threads sleeping on ``lock`` (see the module docstring)."""

    __slots__ = ("_lock", "_sleeping")

    def __init__(self, lock: Any) -> None:
        self._lock = lock
        self._sleeping: list[Any] = []    # one held lock per sleeper, released to wake it

    def wait(self, timeout: float) -> None:
        """``lock`` held: release it, sleep until ``notify_all`` or ``timeout`` seconds,
        hold it again (also when interrupted while asleep)."""
        sleep_released(self._lock, self._sleeping, timeout)

    def notify_all(self) -> None:
        """``lock`` held: wake every sleeper."""
        sleeping, self._sleeping = self._sleeping, []
        for waiter in sleeping:
            waiter.release()


def sleep_released(lock: Any, sleeping: list[Any], timeout: float | None) -> bool:
    """``lock`` held (once): release it, sleep until a waker releases the lock this call
    puts in ``sleeping`` (see :meth:`Sleepers.notify_all`) or ``timeout`` seconds (None:
    no bound), hold ``lock`` again (also when interrupted while asleep). Whether it was
    woken."""
    waiter = _new_lock()
    waiter.acquire()
    released = False
    try:
        sleeping.append(waiter)
        released = True        # (no check between this and the release)
        lock.release()
        return waiter.acquire(True, -1 if timeout is None else max(timeout, 0.0))
    finally:
        if released:
            lock.acquire()
        try:   # not woken (its time is up, or interrupted): forgotten
            sleeping.remove(waiter)
        except ValueError:     # woken (or taken by an interrupted notify_all)
            pass
