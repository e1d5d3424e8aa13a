"""Errors of the shared-memory wire.

Classes say who caused the failure: the peer process died
(:class:`PeerDiedError`), someone invalidated the ring
(:class:`RingInvalidatedError`), this process closed the object
(:class:`ShmClosedError`; :class:`ShmForkedError`: another process, of which this one
is a fork, made it), a wait ran out of time (:class:`RingTimeoutError`),
or a non-blocking call would have had to wait (:class:`WouldBlock`).
"""

from __future__ import annotations

__all__ = [
    "ShmError",
    "PeerDiedError",
    "RingInvalidatedError",
    "RingTimeoutError",
    "ShmClosedError",
    "ShmForkedError",
    "WouldBlock",
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
