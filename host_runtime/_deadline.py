"""The host sync timeout: the bound on every host call that waits on a peer.

A host call that waits on an IPU process or a daemon (``execute``, ``wait``,
a queue operation, ``close``, attach and release) ends within the host sync
timeout when the peer makes no progress, with an error that names what it
waited for. The setting ``host_sync_timeout`` (``IPU_EMULATOR_HOST_SYNC_TIMEOUT``,
seconds, default 60, modelled on Poplar's ``target.hostSyncTimeout``) sets it;
a device (its link) and a daemon client take it from their settings when they
are made, a queue's ring when it is made, so a test changes it with
``host_runtime.settings.override`` or the environment.

Where it bounds (each names the peer's pid and state, ``stopped (state T)`` for
a SIGSTOPped one, via :func:`shm.describe_process`):

- ``host_runtime.devices._link.wait``: a session's LOAD, RUN (run programs, save
  programs), STOP and UNLOAD (not waited for while another session's main loop runs
  on the device), and ending a main loop: DeviceTimeoutError after
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

from host_runtime.settings import HostSettings

__all__ = ["host_sync_timeout"]


def host_sync_timeout() -> float:
    """The host sync timeout in seconds now (for what has no settings of its own)."""
    timeout: float = HostSettings.current().host_sync_timeout
    return timeout
