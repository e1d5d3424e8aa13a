"""The host sync timeout: the bound on every host call that waits on a peer.

A host call that waits on an IPU process or a daemon (``execute``, ``wait``,
a queue operation, ``close``, attach and release) ends within the host sync
timeout when the peer makes no progress, with an error that names what it
waited for. ``IPU_EMULATOR_HOST_SYNC_TIMEOUT`` (seconds, default 60, modelled
on Poplar's ``target.hostSyncTimeout``) sets it; it is read from the environment
when a device (its link) or a queue's ring is made, and per request to a daemon,
so a test can change it with the environment.

Where it bounds (each names the peer's pid and state, ``stopped (state T)`` for
a SIGSTOPped one, via :func:`shm.describe_process`):

- ``host_runtime.devices._link.wait``: a session's LOAD, RUN (run programs, save
  programs), STOP and UNLOAD, and ending a main loop: DeviceTimeoutError after
  that long without an event from the device (a LOAD, which has its own timeout,
  also counts a peer running on a CPU as progress);
- ``Session.close`` / ``ModelRunner.close``: a device that does not stop in time is
  killed if the session attached it, and everything is released;
- ``Device.close``: IPU processes that ignore SHUTDOWN that long are terminated
  (a stopped one killed);
- the daemon client: hello, attach (DeviceTimeoutError naming the daemon's pid
  and state) and release (given up locally: the daemon takes the closed
  connection as a release when it runs again);
- ``SpscRingBuffer.writeLock`` (queue ``enqueue``/``flush``): a ring whose device
  side took nothing that long raises DeviceTimeoutError.
- ``ModelRunner`` requests (``execute``, ``OutputFuture.wait``, a submit finding
  the input rings full or another thread's request holding the replica): the
  request is given up, the replica stays usable (host_runtime.runner).
"""

from __future__ import annotations

from shm.settings import current

__all__ = ["host_sync_timeout"]


def host_sync_timeout() -> float:
    """The host sync timeout in seconds, from the environment now."""
    return current().host_sync_timeout
