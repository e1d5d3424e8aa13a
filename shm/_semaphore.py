"""A ring's semaphores: process-shared POSIX semaphores inside the ring's own segment.

Each ring has two (``free`` and ``full``, see "Waiting" in shm/ring.py), each on a
cache line of the ring's header (the drawing there). They are made with
``sem_init(pshared=1)`` by the ring's creator and used through their address by
both ends: a ring is one /dev/shm object, and neither end pays the creation,
opening or unlinking of named semaphores (``sem_open`` and ``sem_unlink`` each
create or remove a file of /dev/shm; glibc's named semaphores are the same
``sem_t`` in a mapping of their own). The C core (shm/_ringcore.c) uses the same
addresses; this module is the Python path's handle, through libc with ``ctypes``.

:class:`SharedSemaphore` has the calls of ``posix_ipc.Semaphore`` the ring uses
(``acquire``, ``release``, ``value``) with the same errors (``posix_ipc.BusyError``
when no token came in time, ``posix_ipc.SignalError`` when a signal ended the wait),
and :meth:`SharedSemaphore.take_into`, which banks the token it takes in the same C
call (see ``_RingWaits._acquire_token``). It holds a buffer export of the mapping:
the mapping stays while the handle lives, so it is never unmapped under a waiter.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import os
import time
from typing import Any

import posix_ipc

__all__ = ["SharedSemaphore", "SEM_BYTES"]

SEM_BYTES = 64
"""Bytes the layout gives each semaphore (a cache line; glibc's ``sem_t`` is 32 on
64-bit Linux, 16 on 32-bit)."""

# The process's libc (libpthread before glibc 2.34): through CDLL for the calls that may
# block (they release the GIL), through PyDLL for those that never do (they keep it, as
# posix_ipc's do: no other thread of this process runs in the middle of a post, a
# try-wait or a read of the value, and no GIL hand-over is paid for them).
_libc = ctypes.CDLL(None, use_errno=True)
_libc_held = ctypes.PyDLL(None, use_errno=True)


def _fn(name: str, *argtypes: Any, blocking: bool = False) -> Any:
    fn = getattr(_libc if blocking else _libc_held, name)
    fn.argtypes = list(argtypes)
    fn.restype = ctypes.c_int
    return fn


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_sem_init = _fn("sem_init", ctypes.c_void_p, ctypes.c_int, ctypes.c_uint)
_sem_post = _fn("sem_post", ctypes.c_void_p)
_sem_wait = _fn("sem_wait", ctypes.c_void_p, blocking=True)
_sem_trywait = _fn("sem_trywait", ctypes.c_void_p)
_sem_getvalue = _fn("sem_getvalue", ctypes.c_void_p, ctypes.POINTER(ctypes.c_int))
try:   # glibc 2.30+: a deadline on CLOCK_MONOTONIC (a wall-clock step cannot move it)
    _sem_clockwait = _fn("sem_clockwait", ctypes.c_void_p, ctypes.c_int,
                         ctypes.POINTER(_Timespec), blocking=True)
except AttributeError:   # pragma: no cover - older C libraries
    _sem_clockwait = None
_sem_timedwait = _fn("sem_timedwait", ctypes.c_void_p, ctypes.POINTER(_Timespec),
                     blocking=True)

_consume: Any = collections.deque(maxlen=0).extend
_ok: Any = (0).__eq__     # a sem_* call's result: 0 when it took a token


class SharedSemaphore:
    """The semaphore at ``offset`` of the writable buffer ``buf`` (a ring's mapping)."""

    __slots__ = ("_anchor", "_addr", "_what")

    def __init__(self, buf: Any, offset: int, what: str) -> None:
        # holds an export of the mapping: it is not unmapped while this handle lives
        self._anchor = ctypes.c_char.from_buffer(buf, offset)
        self._addr = ctypes.addressof(self._anchor)
        self._what = what

    def init(self, value: int) -> None:
        """``sem_init`` (process-shared) with ``value`` tokens: by the ring's creator only,
        before any other process can reach the ring."""
        if _sem_init(self._addr, 1, value) != 0:
            raise _os_error(f"sem_init of {self._what}")

    def release(self) -> None:
        """Post one token."""
        if _sem_post(self._addr) != 0:
            raise _os_error(f"sem_post of {self._what}")

    @property
    def value(self) -> int:
        """Tokens there now."""
        v = ctypes.c_int()
        if _sem_getvalue(self._addr, ctypes.byref(v)) != 0:   # pragma: no cover
            raise _os_error(f"sem_getvalue of {self._what}")
        return max(0, v.value)

    def acquire(self, timeout: float | None = None) -> None:
        """Take one token, waiting up to ``timeout`` s (None: no deadline; 0: none)."""
        spare: list[Any] = []
        self.take_into(spare, timeout)

    def take_into(self, spare: list[Any], timeout: float | None) -> None:
        """:meth:`acquire`, with the token appended to ``spare`` in the same C call that
        takes it (nothing can interrupt between the two: no Python code runs there)."""
        n = len(spare)
        addr = self._addr
        if timeout is None:
            _consume(map(spare.append, filter(_ok, map(_sem_wait, (addr,)))))
        elif timeout <= 0:
            _consume(map(spare.append, filter(_ok, map(_sem_trywait, (addr,)))))
        elif _sem_clockwait is not None:
            ts = _deadline(time.monotonic(), timeout)
            _consume(map(spare.append, filter(_ok, map(
                _sem_clockwait, (addr,), (time.CLOCK_MONOTONIC,), (ctypes.byref(ts),)))))
        else:   # pragma: no cover - older C libraries
            ts = _deadline(time.time(), timeout)
            _consume(map(spare.append, filter(_ok, map(
                _sem_timedwait, (addr,), (ctypes.byref(ts),)))))
        if len(spare) > n:
            return
        err = ctypes.get_errno()
        if err in (errno.EAGAIN, errno.ETIMEDOUT):
            raise posix_ipc.BusyError(f"{self._what}: no token within {timeout} s")
        if err == errno.EINTR:
            raise posix_ipc.SignalError(f"{self._what}: the wait was interrupted by a signal")
        raise _os_error(f"waiting on {self._what}", err)   # pragma: no cover

    def __repr__(self) -> str:
        return f"SharedSemaphore({self._what!r}, value={self.value})"


def _deadline(now: float, timeout: float) -> _Timespec:
    at = now + timeout
    sec = int(at)
    return _Timespec(sec, int((at - sec) * 1e9))


def _os_error(what: str, err: int | None = None) -> OSError:
    err = ctypes.get_errno() if err is None else err
    return OSError(err, f"{what}: {os.strerror(err)}")
