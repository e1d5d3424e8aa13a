"""The host sync timeout: the bound on every host call that waits on a peer.

A host call that waits on an IPU process or a daemon (``execute``, ``wait``,
a queue operation, ``close``, attach and release) ends within the host sync
timeout when the peer makes no progress, with an error that names what it
waited for. ``IPU_EMULATOR_HOST_SYNC_TIMEOUT`` (seconds, default 60, modelled
on Poplar's ``target.hostSyncTimeout``) sets it; it is read when the object
that waits is made, so a test can change it with the environment.
"""

from __future__ import annotations

from shm.settings import current

__all__ = ["host_sync_timeout"]


def host_sync_timeout() -> float:
    """The host sync timeout in seconds, from the environment now."""
    return current().host_sync_timeout
