"""``SpscRingBuffer``: a fixed-size, single-producer, single-consumer ring of slots (in process).

The seed's lock-free ring (10.2.3) in Python: one producer thread, one
consumer thread, a condition variable for the blocking calls. Blocking calls
return early once the ring is invalidated, so always check ``isValid()``
after ``writeLock()``/``readLock()``.

A producer waiting for a free slot is bounded by the host sync timeout
(``IPU_EMULATOR_HOST_SYNC_TIMEOUT``, read when the ring is made): the consumer
of a queue's ring is the device's side, and a device that takes nothing for
that long is stopped or stuck, so ``writeLock()`` raises DeviceTimeoutError
naming the ring and (``peer``) the device's IPU processes. A consumer
(``readLock()``, the device's side) waits for the application without bound,
as a device waits for its host's data; its ``timeout_cb`` reports the wait. Re-exported by ``host_runtime.queues._queues``.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Generic, Optional, TypeVar

from host_runtime._deadline import host_sync_timeout
from host_runtime.errors import BadRequestError, DeviceTimeoutError, InvalidStateError

__all__ = ["SpscRingBuffer"]

T = TypeVar("T")


class SpscRingBuffer(Generic[T]):
    """A fixed-size, single-producer, single-consumer ring of slots.

    ``factory`` builds the slot objects (``writeLock()`` returns one to be
    filled in place); without it, slots hold whatever ``write(obj)`` stored.
    The read-timeout callback is called with the ring every ``timeout_ns``
    while ``readLock()`` waits, until a buffer becomes readable.
    """

    ReadTimeoutCallback = Callable[["SpscRingBuffer[Any]"], None]
    """Signature of the function called when ``readLock()`` times out (seed 002, 10.2.3)."""

    def __init__(self, num_buffers: int, label: str,
                 timeout_cb: Optional[Callable[["SpscRingBuffer[T]"], None]] = None,
                 timeout_ns: int = 0, factory: Optional[Callable[[], T]] = None, *,
                 peer: Optional[Callable[[], str]] = None) -> None:
        """``peer()`` describes the consumer's side in a DeviceTimeoutError of
        ``writeLock()`` (e.g. the device's IPU processes and their states)."""
        n = int(num_buffers)
        if n < 1:
            raise BadRequestError(f"SpscRingBuffer {label!r}: num_buffers must be >= 1, got {n}")
        if int(timeout_ns) < 0:
            raise BadRequestError(f"SpscRingBuffer {label!r}: timeout_ns must be >= 0, got {timeout_ns}")
        self._n = n
        self._label = str(label)
        self._factory = factory
        self._slots: list[Any] = [factory() if factory else None for _ in range(n)]
        self._timeout_cb = timeout_cb
        self._timeout_s = int(timeout_ns) / 1e9
        # taken as ``with self._mutex`` (a C-level __enter__): ``with`` on the Condition runs
        # Python code after the lock is taken, where a KeyboardInterrupt would leave it held
        self._mutex = threading.Lock()
        self._cond = threading.Condition(self._mutex)
        self._written = 0     # slots published by writeComplete()
        self._locked = 0      # slots handed out by readLock() (next read = this index)
        self._released = 0    # slots freed by readComplete() (oldest read-locked)
        self._write_locked = False
        self._valid = True
        self._sync_s = host_sync_timeout()
        self._peer = peer

    # ------------------------------------------------------------- producer
    def write(self, obj: T) -> None:
        """Lock a slot, store ``obj`` in it and publish it."""
        self.writeLock()
        if not self._valid:
            return
        with self._mutex:
            self._slots[self._written % self._n] = obj
        self.writeComplete()

    def writeLock(self) -> T:
        """Block until a slot is free (or the ring is invalidated) and return it; at most
        the host sync timeout (then DeviceTimeoutError: the consumer took nothing)."""
        with self._mutex:
            deadline = None
            while self._valid and not self._write_locked and self._written - self._released >= self._n:
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self._sync_s
                elif now >= deadline:
                    raise self._full_error()
                self._cond.wait(deadline - now)
            if self._valid:
                self._write_locked = True
            return self._slots[self._written % self._n]  # type: ignore[no-any-return]

    def writeLocked(self) -> Optional[T]:
        """The slot ``writeLock()`` handed out and not yet published, or None."""
        with self._mutex:
            if not self._write_locked:
                return None
            return self._slots[self._written % self._n]  # type: ignore[no-any-return]

    def writeAbort(self) -> None:
        """Unlock the slot ``writeLock()`` handed out without publishing it (the next
        ``writeLock()`` returns the same slot)."""
        with self._mutex:
            self._write_locked = False

    def _full_error(self) -> DeviceTimeoutError:
        peer = self._peer() if self._peer is not None else ""
        return DeviceTimeoutError(
            f"SpscRingBuffer {self._label!r}: all {self._n} buffers stayed full for "
            f"{self._sync_s:g} s: the consumer took nothing (the host sync timeout, "
            f"IPU_EMULATOR_HOST_SYNC_TIMEOUT)" + (f"; {peer}" if peer else ""))

    def writeComplete(self) -> None:
        with self._mutex:
            if not self._valid:
                return
            if not self._write_locked:
                raise InvalidStateError(
                    f"SpscRingBuffer {self._label!r}: writeComplete() without writeLock()")
            self._write_locked = False
            self._written += 1
            self._cond.notify_all()

    # ------------------------------------------------------------- consumer
    def readLock(self) -> T:
        """Block until a slot is readable (or the ring is invalidated) and lock it."""
        with self._mutex:
            deadline = None
            if self._timeout_cb is not None and self._timeout_s > 0:
                deadline = time.monotonic() + self._timeout_s
            while self._valid and self._locked >= self._written:
                if deadline is None:
                    self._cond.wait()
                    continue
                left = deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                cb = self._timeout_cb
                self._cond.release()
                try:
                    if cb is not None:
                        cb(self)
                finally:
                    self._cond.acquire()
                deadline = time.monotonic() + self._timeout_s
            if not self._valid:
                return self._slots[self._locked % self._n]  # type: ignore[no-any-return]
            slot = self._slots[self._locked % self._n]
            self._locked += 1
            return slot  # type: ignore[no-any-return]

    def readComplete(self) -> None:
        """Free the oldest read-locked slot."""
        with self._mutex:
            if not self._valid:
                return
            if self._released >= self._locked:
                raise InvalidStateError(
                    f"SpscRingBuffer {self._label!r}: readComplete() without readLock()")
            self._released += 1
            self._cond.notify_all()

    def readUnlock(self, count: int = 1) -> None:
        """Put the ``count`` newest read-locked slots back (not completed): the next
        ``readLock()`` returns them again, oldest first. For a consumer whose use of
        them failed (e.g. a transfer that could not be made)."""
        with self._mutex:
            if not 0 <= count <= self._locked - self._released:
                raise InvalidStateError(
                    f"SpscRingBuffer {self._label!r}: readUnlock({count}) with "
                    f"{self._locked - self._released} slot(s) read-locked")
            self._locked -= count
            self._cond.notify_all()

    def readReset(self) -> None:
        """Put every read-locked slot back at the front of the reading queue."""
        with self._mutex:
            self._locked = self._released
            self._cond.notify_all()

    def readAvailable(self) -> bool:
        with self._mutex:
            return self._locked < self._written

    # ------------------------------------------------------------- state
    def invalidate(self) -> None:
        """Make every blocking call return at once; what they return is invalid."""
        with self._mutex:
            self._valid = False
            self._cond.notify_all()

    def reset(self) -> None:
        """Back to the initial state: empty, valid, nothing locked."""
        with self._mutex:
            self._written = self._locked = self._released = 0
            self._write_locked = False
            self._valid = True
            if self._factory is not None:
                self._slots = [self._factory() for _ in range(self._n)]
            else:
                self._slots = [None] * self._n
            self._cond.notify_all()

    def isValid(self) -> bool:
        return self._valid

    def getState(self, prefix: str = "") -> str:
        with self._mutex:
            return (f"{prefix}{self._label}: valid={self._valid} buffers={self._n} "
                    f"written={self._written} read_locked={self._locked - self._released} "
                    f"readable={self._written - self._locked} "
                    f"free={self._n - (self._written - self._released)} "
                    f"write_locked={self._write_locked}")

    def numBuffers(self) -> int:
        return self._n

    def label(self) -> str:
        return self._label

    def __repr__(self) -> str:
        return f"<SpscRingBuffer {self.getState()}>"
