"""One attached device (seed 002, section 10.1.1): its IPUs, its IPU processes and the
sessions bound to it.

A Device knows its sessions only as ``ActiveSession`` (a Protocol below: what the
device calls on them) and gives them, for internal use, its ``link`` (a
:class:`host_runtime.devices.link.DeviceLink`), its ``lock`` and the session
bookkeeping ``bind_session`` / ``forget_session`` / ``sessions`` / ``kill``.
``Device.close()`` (or leaving its ``with`` block, or dropping the last reference)
shuts the processes down and releases the IPUs.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from typing import Callable, Protocol, runtime_checkable

from host_runtime.devices._daemon_client import DaemonAttachment
from host_runtime.devices._ipu_group import make_link
from host_runtime.devices.link import DeviceLink, StreamServicer
from host_runtime._again import again
from host_runtime._fork import check_owner
from host_runtime._lifetime import close_owned
from host_runtime.errors import BadRequestError, InvalidStateError
from host_runtime.settings import HostSettings
from ipu_emulator.ipu.launcher import IpuConnection, kill_all, shutdown_all
from ipu_emulator.system import IpuLocks

__all__ = ["ActiveSession", "Device"]

_log = logging.getLogger("host_runtime.devices._manager")

_SHUTDOWN_TIMEOUT = 5.0
"""Seconds close() waits for the IPU processes to obey SHUTDOWN (at most the host sync
timeout) before it terminates them (kills a stopped one)."""


@runtime_checkable
class ActiveSession(Protocol):
    """What a Device calls on the sessions bound to it (``host_runtime.session.Session``).

    The device holds them weakly: a session owns its device, not the reverse.
    """

    def bindToDevice(self, device: "Device") -> None:
        """Bind to ``device`` and load onto it (``Device.bindToSession``)."""

    def main_loop_running(self) -> bool:
        """Whether the session's main loop runs on the device now (nothing else can)."""

    def deactivate(self, implicit_save: bool) -> None:
        """Another session takes the device (called with the device lock held): run the
        save programs (``implicit_save``) and forget being loaded; InvalidStateError
        while the main loop runs."""

    def device_detached(self, device: "Device") -> None:
        """``device`` was closed: the session is no longer bound to it."""


# Devices to close at exit. Weak: a device nobody references is closed at once by its
# __del__ (see host_runtime._lifetime); a session that attached its device owns it.
_live_devices: "weakref.WeakSet[Device]" = weakref.WeakSet()


@atexit.register
def _close_live_devices() -> None:
    close_owned(_live_devices, lambda d: d._owner_pid)


class Device:
    """One or more attached emulated IPUs and their IPU processes.

    Made by :class:`DeviceManager`. ``close()`` (alias ``detach()``) unbinds
    its sessions, stops the IPU processes and releases the IPUs; it is
    idempotent and the device is a context manager.
    """

    def __init__(self, *, device_id: int, ipus: tuple[int, ...], ipu_version: int,
                 tiles_per_ipu: int, memory_per_tile: int, processes: list[IpuConnection],
                 locks: IpuLocks | DaemonAttachment | None, is_ipu_model: bool = False,
                 settings: HostSettings | None = None) -> None:
        self._id = device_id
        self._ipus = ipus
        self._ipu_version = ipu_version
        self._tiles = tiles_per_ipu
        self._memory_per_tile = memory_per_tile
        self._processes = processes
        self._locks = locks
        self._is_model = is_ipu_model
        self._owner_pid = os.getpid()
        self._closed = False
        self._lock = threading.RLock()
        self._active: "weakref.ref[ActiveSession] | None" = None   # sessions own devices: weak
        self._sessions: "weakref.WeakSet[ActiveSession]" = weakref.WeakSet()
        self._link: DeviceLink = make_link(self.describe(), processes, settings)
        _live_devices.add(self)

    # -- the seed's API -----------------------------------------------------------------

    def ipuVersion(self) -> int:
        """The architecture version of the device's IPUs (2 or 21)."""
        return self._ipu_version

    # -- Python conveniences --------------------------------------------------------------

    @property
    def id(self) -> int:
        """Device id (-1 for IPU models)."""
        return self._id

    def getId(self) -> int:
        return self._id

    def numIpus(self) -> int:
        return len(self._processes)

    def ipus(self) -> list[int]:
        """Machine IPU numbers this device holds (empty for IPU models)."""
        return list(self._ipus)

    def tilesPerIpu(self) -> int:
        return self._tiles

    def memoryPerTile(self) -> int:
        return self._memory_per_tile

    def memoryBytes(self) -> int:
        """Device memory: IPUs x tiles x memory per tile."""
        return self.numIpus() * self._tiles * self._memory_per_tile

    def isIpuModel(self) -> bool:
        return self._is_model

    def isAttached(self) -> bool:
        return not self._closed

    def pids(self) -> list[int]:
        """The pids of this device's IPU processes (primary first)."""
        return [p.pid for p in self._processes]

    def describe(self) -> str:
        if self._is_model:
            return f"IPU model device ({self.numIpus()} x ipu{self._ipu_version}, {self._tiles} tiles)"
        ipus = ",".join(map(str, self._ipus))
        return f"device {self._id} (ipu {ipus})"

    # -- lifetime -----------------------------------------------------------------------

    def close(self) -> None:
        """Unbind sessions, stop the IPU processes, release the IPUs (idempotent).

        In a process forked from the owner this does nothing: the owner still uses them.
        """
        self.close_then(None)

    def close_then(self, meanwhile: Callable[[], None] | None) -> None:
        """Internal (Session): close(), running ``meanwhile`` (the session's own closing)
        while the IPUs are given back: a daemon's answer to the release is read after it.
        ``meanwhile`` runs once, whatever happens (not in a forked child)."""
        if self._owner_pid != os.getpid():
            return
        pending = [meanwhile] if meanwhile is not None else []

        def once() -> None:
            while pending:
                pending.pop()()
        try:
            self._close(once)
        finally:
            once()   # (if the close did not come to it)

    def _close(self, meanwhile: Callable[[], None]) -> None:
        # A program may be running on another thread (holding the lock, perhaps waiting for
        # input that never comes): do not wait for it; closing the link fails it.
        got = self._lock.acquire(timeout=0.5)
        try:
            if self._closed:
                return
            self._closed = True
            sessions = list(self._sessions)
            self._active = None
        finally:
            if got:
                self._lock.release()
        self._link.quiesce()   # a daemon's processes: our event thread ends first
        for s in sessions:
            try:
                s.device_detached(self)
            except Exception:  # pragma: no cover - best effort
                _log.exception("detaching %s from %s", s, self.describe())
        self._link.close(timeout=0.0)
        try:
            # SHUTDOWN to every IPU process, then wait for all exits together; BYE ends
            # the event thread
            shutdown_all(self._processes,
                         timeout=min(_SHUTDOWN_TIMEOUT, self._link.sync_timeout))
            self._link.wake()    # (or, if the process died, this does)
            for proc in self._processes:
                proc.close()
        finally:
            # Not joined: the event thread holds no device, and ends on the BYE, or (a
            # daemon's process says no BYE; a dead one cannot) when the closed ring wakes
            # it (at once: Ring.close interrupts this process's waits).
            self._link.close(timeout=0.0)
            if isinstance(self._locks, DaemonAttachment):
                self._locks.release(meanwhile)
            elif self._locks is not None:
                self._locks.release()
            _live_devices.discard(self)

    detach = close

    def kill(self) -> None:
        """Internal (Session): SIGKILL the IPU processes (a hung device whose owner was
        dropped); the link notices the loss and fails what waits on it."""
        check_owner(self._owner_pid, "Device")
        kill_all(self._processes)   # all at once, then wait for all
        self._link.check()

    def __del__(self) -> None:
        # The last reference is gone: nothing can use the device any more. Release it
        # now (reference counting runs this at once) rather than at exit.
        if not getattr(self, "_closed", True):
            try:
                self.close()
            except Exception:  # pragma: no cover - best effort
                _log.debug("closing %s when it was dropped", self.describe(), exc_info=True)

    def __enter__(self) -> "Device":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "attached" if not self._closed else "detached"
        return f"<Device {self.describe()} {state} pids={self.pids()}>"

    # -- for Session (seed: protected isActiveSession / bindToSession / unbindSession) ----

    @property
    def link(self) -> DeviceLink:
        """Internal (Session and its fast path): the link to the IPU process(es): requests
        (LOAD, RUN, LOOP, STOP, MODES, ...) and whether the device is lost."""
        return self._link

    @property
    def processes(self) -> list[IpuConnection]:
        """Internal (loopback devices, tests): the connections to the device's IPU
        processes, primary first."""
        return list(self._processes)

    @property
    def lock(self) -> threading.RLock:
        """Internal (Session): held while a session binds, loads or runs programs on the
        device (one at a time); re-entrant."""
        return self._lock

    def _check_open(self) -> None:
        check_owner(self._owner_pid, "Device")
        if self._closed:
            raise InvalidStateError(f"{self.describe()} is detached")
        lost = self._link.lost
        if lost is not None:
            raise again(lost)

    def isActiveSession(self, session: ActiveSession) -> bool:
        active = self._active
        return active is not None and active() is session

    def looping_for_another(self, session: ActiveSession) -> bool:
        """Internal (Session): another session than ``session`` runs its main loop here (a
        request waits for that loop to end)."""
        active = self._active() if self._active is not None else None
        return active is not None and active is not session and active.main_loop_running()

    def bindToSession(self, session: ActiveSession) -> None:
        """Make ``session`` this device's active session, its executable loaded.

        Seed: protected, for Session (``Session.bindToDevice`` is the public way). The
        session that was active runs its save programs first (``unbindSession``)."""
        if not isinstance(session, ActiveSession):
            raise BadRequestError(f"bindToSession expects a Session, got {session!r}")
        session.bindToDevice(self)

    def unbindSession(self) -> None:
        """Unbind the active session, if any: its save programs run (when it ran its load
        programs), it stays bound to this device and loads again before it next runs.

        Seed: protected, for Session."""
        check_owner(self._owner_pid, "Device")
        with self._lock:
            active = self._active() if self._active is not None else None
            if active is None:
                return
            if active.main_loop_running():
                raise InvalidStateError(
                    f"unbindSession: {self.describe()} is running the main loop of its active "
                    "session (a ModelRunner's, or a QueueManager's); stop() that session first")
            active.deactivate(implicit_save=True)
            self._unbind_session(active)

    def bind_session(self, session: ActiveSession, servicer: StreamServicer) -> None:
        """Internal (Session): make ``session`` the active one, ``servicer`` servicing its
        stream events; the previous one runs its save programs first. Raises the
        DeviceLostError of a lost device, InvalidStateError once detached."""
        with self._lock:
            self._check_open()
            self._sessions.add(session)
            previous = self._active() if self._active is not None else None
            if previous is session:
                return
            if previous is not None:
                previous.deactivate(implicit_save=True)
            self._active = weakref.ref(session)
            self._link.set_servicer(servicer)

    def _unbind_session(self, session: ActiveSession) -> None:
        with self._lock:
            if self.isActiveSession(session):
                self._active = None
                self._link.set_servicer(None)

    def forget_session(self, session: ActiveSession) -> None:
        """Internal (Session): ``session`` unbinds from this device."""
        with self._lock:
            self._unbind_session(session)
            self._sessions.discard(session)

    def sessions(self) -> list[ActiveSession]:
        """Internal (Session): the sessions bound to this device (active or not)."""
        return list(self._sessions)
