"""Errors of the shared-memory wire.

Classes say who caused the failure: the peer process died
(:class:`PeerDiedError`), someone invalidated the ring
(:class:`RingInvalidatedError`), this process closed the object
(:class:`ShmClosedError`; :class:`ShmForkedError`: another process, of which this one
is a fork, made it), a wait ran out of time (:class:`RingTimeoutError`),
or a non-blocking call would have had to wait (:class:`WouldBlock`).
The operating system refused a resource: this process (or the system) has no
file descriptor left (:class:`OutOfFileDescriptorsError`), /dev/shm or the
memory behind it is full (:class:`ShmFullError`), the file-size limit is below
the size asked (:class:`FileSizeLimitError`); ``shm.limits`` names them.
"""

from __future__ import annotations

import reprlib

__all__ = [
    "ShmError",
    "PeerDiedError",
    "RingInvalidatedError",
    "RingTimeoutError",
    "ShmClosedError",
    "ShmForkedError",
    "WouldBlock",
    "WaitInterrupted",
    "OutOfFileDescriptorsError",
    "ShmFullError",
    "FileSizeLimitError",
    "echo",
]


class ShmError(Exception):
    """Base class of every error raised by :mod:`shm`."""


class PeerDiedError(ShmError):
    """The process at the other end of a ring is gone (or a zombie)."""

    def __init__(self, message: str, pid: int) -> None:
        super().__init__(message)
        self.pid = pid


class RingInvalidatedError(ShmError):
    """The ring was invalidated (by either side) and refuses further use until reset."""


class RingTimeoutError(ShmError, TimeoutError):
    """A blocking wait on a ring did not complete within its timeout."""


class ShmClosedError(ShmError):
    """The object was closed by this process and cannot be used any more."""


class ShmForkedError(ShmClosedError):
    """The object was made by another process (this one is a ``fork()`` of it): the ring's
    other end is the creator's peer, so this process may not use it. ``owner_pid`` is the
    process that made the object."""

    def __init__(self, message: str, owner_pid: int) -> None:
        super().__init__(message)
        self.owner_pid = owner_pid


class WouldBlock(ShmError):
    """A non-blocking call found no slot ready (ring full or empty)."""


class WaitInterrupted(ShmError):
    """A wait on a ring was interrupted by another thread of this process
    (``Ring.interrupt()``), e.g. one that saw the peer process die."""


class OutOfFileDescriptorsError(ShmError, OSError):
    """No file descriptor left: this process is at its ``RLIMIT_NOFILE`` (``errno``
    EMFILE) or the system's file table is full (ENFILE). ``soft``/``hard``: the limit;
    ``open_fds``: how many this process had open (None when it could not be counted)."""

    def __init__(self, message: str, *, errno: int, soft: int, hard: int,
                 open_fds: int | None) -> None:
        super().__init__(message)
        self.errno = errno
        self.soft, self.hard, self.open_fds = soft, hard, open_fds


class ShmFullError(ShmError, MemoryError):
    """/dev/shm (or the memory that backs it) cannot hold what was asked: ``needed``
    bytes against ``free`` (None when /dev/shm cannot be asked)."""

    def __init__(self, message: str, *, needed: int | None, free: int | None) -> None:
        super().__init__(message)
        self.needed, self.free = needed, free


class FileSizeLimitError(ShmError, OSError):
    """The file-size limit (``RLIMIT_FSIZE``, ``soft``/``hard`` bytes) is smaller than the
    shared-memory object asked (``needed`` bytes): the kernel refuses to size it (EFBIG)."""

    def __init__(self, message: str, *, needed: int | None, soft: int, hard: int) -> None:
        super().__init__(message)
        self.needed, self.soft, self.hard = needed, soft, hard


# -- echoing values into messages ------------------------------------------------

_REPR = reprlib.Repr()
_REPR.maxlevel = 3
_REPR.maxlist = _REPR.maxtuple = _REPR.maxset = _REPR.maxfrozenset = _REPR.maxdeque = 8
_REPR.maxdict = 6
_REPR.maxstring = 60
_REPR.maxlong = 60
_REPR.maxother = 60


def echo(value: object, limit: int = 80, *, quote: bool = True) -> str:
    """``value`` as a message shows it: ``repr`` (``str`` for text with ``quote=False``),
    at most about ``limit`` characters. A longer text keeps its head and tail around
    ``...`` and says its total size; a container shows its first items, nested at most
    three deep, and says how many it holds. The work is bounded by ``limit``, not by the
    value: a 7 MB string or a list of a billion items costs the same as a short one.

    Every message that echoes what a user gave (an option, a shape, a config value, a
    file field) goes through this, so that no error line grows with its input.
    """
    limit = max(int(limit), 16)
    if isinstance(value, (str, bytes, bytearray)):
        n = len(value)
        unit = "chars" if isinstance(value, str) else "bytes"
        shown = value if quote or not isinstance(value, str) else None
        if n <= limit:
            text = repr(value) if shown is not None else str(value)
            if len(text) <= limit + 2:
                return text
        # keep about 2/3 head and 1/3 tail, measured after repr's escapes
        head, tail = value[: (2 * limit) // 3], value[n - limit // 3:]
        if shown is not None:
            h, t = repr(head), repr(tail)
            h = h[: (2 * limit) // 3 + 1]
            t = t[len(t) - limit // 3 - 1:] if len(t) > limit // 3 + 1 else t
            return f"{h}...{t} ({n} {unit})"
        return f"{str(head)}...{str(tail)} ({n} {unit})"
    try:
        text = _REPR.repr(value)
    except Exception as exc:   # a broken __repr__ must not hide the error being reported
        text = f"<{type(value).__name__} whose repr failed: {type(exc).__name__}>"
    try:
        count = len(value) if isinstance(value, (list, tuple, dict, set, frozenset)) else None
    except Exception:   # pragma: no cover
        count = None
    if len(text) > limit:
        text = text[:limit] + "..."
    elif count is None or "..." not in text:
        return text
    if count is None:
        return text
    return f"{text} ({count} item{'' if count == 1 else 's'})"
