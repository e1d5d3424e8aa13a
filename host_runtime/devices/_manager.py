"""Device management (seed 002, section 10.1.1): wait strategies, Device, DeviceManager.

The machine's emulated IPUs are configured by :mod:`ipu_emulator.system`.
``DeviceManager.getDevice`` takes IPUs exclusively (OS file locks the kernel
drops when a holder dies) and, in embedded mode, starts one IPU process per
attached IPU. ``Device.close()`` (or leaving its ``with`` block) shuts the
processes down and releases the IPUs.

Daemon mode: when ``IPU_EMULATOR_DAEMON`` names the socket of an
``ipu-emulator daemon`` (or ``DeviceManager(daemon=path)``), the machine is
the daemon's pool, attaching asks the daemon (its attach is the exclusive
one, not the lock files) and the device gets the daemon's warm IPU processes
(:mod:`host_runtime.devices._daemon_client`); closing it hands them back.

Sessions: a Device knows its sessions only as ``ActiveSession`` (a Protocol below:
what the device calls on them) and gives them, for internal use, its ``link`` (a
:class:`host_runtime.devices.link.DeviceLink`), its ``lock`` and the session
bookkeeping ``bind_session`` / ``forget_session`` / ``sessions`` / ``kill``.

IPU model devices (``createIpuModelDevice``, ``createSmallIpuModelDevice``)
are private to the caller: they take no machine lock; the small one has 4
tiles per IPU, so only small executables fit.
"""

from __future__ import annotations

import atexit
import enum
import functools
import logging
import os
import threading
import time
import weakref
from datetime import timedelta
from typing import Any, Callable, Protocol, runtime_checkable

from host_runtime.devices._daemon_client import DaemonAttachment, DaemonClient, daemon_from_env
from host_runtime.devices._ipu_group import make_link
from host_runtime.devices.link import DeviceLink, StreamServicer
from host_runtime._fork import check_owner
from host_runtime._lifetime import close_owned
from host_runtime.devices._shm_space import translated
from host_runtime.errors import (BadRequestError, DeviceUnavailableError, InvalidStateError,
                                 ResourceLimitError)
from host_runtime.popef.model import Model
from host_runtime.settings import HostSettings
from ipu_emulator.ipu.forkserver import SPAWN_TIMEOUT
from ipu_emulator.ipu.launcher import (IpuConnection, IpuSpec, kill_all, launch_ipu, prestart,
                                       shutdown_all)
from ipu_emulator.system import (IpuLocks, SystemConfig, SystemConfigError, device_groups,
                                 emulator_home, load_system_config)
from shm import OutOfFileDescriptorsError

__all__ = [
    "DeviceWaitStrategy",
    "DeviceWaitConfig",
    "DeviceConstraints",
    "Device",
    "DeviceManager",
]   # and, internal: ActiveSession

_log = logging.getLogger(__name__)

_SMALL_MODEL_TILES = 4


_SHUTDOWN_TIMEOUT = 5.0
"""Seconds close() waits for the IPU processes to obey SHUTDOWN (at most the host sync
timeout) before it terminates them (kills a stopped one)."""

_IPU_RING_BYTES = 2 << 20
"""About what one IPU process's control and event rings take in /dev/shm (for messages)."""

class DeviceWaitStrategy(enum.Enum):
    """How to wait for a device to become available."""

    NO_WAIT = 0
    """Fail at once if no device is free."""
    WAIT_WITH_TIMEOUT = 1
    """Retry every ``sleepTime`` until ``timeout`` has passed."""
    WAIT_FOREVER = 2
    """Retry every ``sleepTime`` until a device is free."""


def _as_timedelta(value: Any, what: str) -> timedelta:
    if isinstance(value, timedelta):
        td = value
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        td = timedelta(seconds=value)
    else:
        raise BadRequestError(f"{what} must be a datetime.timedelta (or seconds), got {value!r}")
    if td < timedelta(0):
        raise BadRequestError(f"{what} must not be negative, got {td}")
    return td


class DeviceWaitConfig:
    """How ``DeviceManager`` waits for a device. Defaults: NO_WAIT, 0 s, 15 s.

    The C++ constructors, spelt positionally or with keywords:

    - ``DeviceWaitConfig()``: NO_WAIT;
    - ``DeviceWaitConfig(strategy, timeout=timedelta(0), sleepTime=timedelta(seconds=15))``
      (``strategy=`` may be a keyword too);
    - ``DeviceWaitConfig(timeout, sleepTime=timedelta(seconds=15))``: WAIT_WITH_TIMEOUT, and so
      is ``DeviceWaitConfig(timeout=..., sleepTime=...)`` without a strategy.

    Durations are ``timedelta`` or seconds. ``sleepTime`` alone (no strategy, no timeout) is
    refused: it would mean NO_WAIT, which never sleeps.
    """

    __slots__ = ("strategy", "timeout", "sleepTime")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        names = ("strategy", "timeout", "sleepTime")
        if set(kwargs) - set(names):
            raise BadRequestError(
                "DeviceWaitConfig takes (strategy, timeout, sleepTime) or (timeout, sleepTime); "
                f"unexpected keyword(s) {sorted(set(kwargs) - set(names))}")
        if args and not isinstance(args[0], DeviceWaitStrategy):
            # DeviceWaitConfig(timeout, sleepTime): the C++ WAIT_WITH_TIMEOUT constructor
            if len(args) > 2 or "strategy" in kwargs or "timeout" in kwargs \
                    or (len(args) == 2 and "sleepTime" in kwargs):
                raise BadRequestError(
                    "DeviceWaitConfig(timeout, sleepTime) takes at most those two arguments, "
                    f"got {args!r} {kwargs!r}")
            if not isinstance(args[0], (timedelta, int, float)) or isinstance(args[0], bool):
                raise BadRequestError(
                    "strategy must be a DeviceWaitStrategy (or the first argument a timeout: "
                    f"timedelta or seconds), got {args[0]!r}")
            values = {"strategy": DeviceWaitStrategy.WAIT_WITH_TIMEOUT, "timeout": args[0]}
            if len(args) == 2:
                values["sleepTime"] = args[1]
        else:
            if len(args) > 3:
                raise BadRequestError(
                    "DeviceWaitConfig(strategy, timeout, sleepTime) takes at most three "
                    f"arguments, got {len(args)}")
            values = dict(zip(names, args))
        for k, v in kwargs.items():
            if k in values:
                raise BadRequestError(f"DeviceWaitConfig got {k} twice")
            values[k] = v
        if "strategy" not in values:
            if "timeout" in values:
                values["strategy"] = DeviceWaitStrategy.WAIT_WITH_TIMEOUT
            elif "sleepTime" in values:
                raise BadRequestError(
                    "DeviceWaitConfig(sleepTime=...) without a strategy or a timeout would mean "
                    "NO_WAIT, which never sleeps; give the strategy (DeviceWaitStrategy."
                    "WAIT_WITH_TIMEOUT or WAIT_FOREVER) or a timeout")
        strategy = values.get("strategy", DeviceWaitStrategy.NO_WAIT)
        if not isinstance(strategy, DeviceWaitStrategy):
            raise BadRequestError(f"strategy must be a DeviceWaitStrategy, got {strategy!r}")
        self.strategy: DeviceWaitStrategy = strategy
        self.timeout: timedelta = _as_timedelta(values.get("timeout", timedelta(0)), "timeout")
        self.sleepTime: timedelta = _as_timedelta(values.get("sleepTime", timedelta(seconds=15)),
                                                  "sleepTime")

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, DeviceWaitConfig) and self.strategy == other.strategy
                and self.timeout == other.timeout and self.sleepTime == other.sleepTime)

    def __repr__(self) -> str:
        return (f"DeviceWaitConfig({self.strategy.name}, timeout={self.timeout!r}, "
                f"sleepTime={self.sleepTime!r})")


class DeviceConstraints:
    """Requirements the device must meet (remote buffers: every emulated IPU has them)."""

    __slots__ = ("requiresRemoteBuffersSupport",)

    def __init__(self, requiresRemoteBuffersSupport: bool = False) -> None:
        self.requiresRemoteBuffersSupport = bool(requiresRemoteBuffersSupport)

    def __bool__(self) -> bool:
        return self.requiresRemoteBuffersSupport

    def __repr__(self) -> str:
        return f"DeviceConstraints(requiresRemoteBuffersSupport={self.requiresRemoteBuffersSupport})"


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
        if self._owner_pid != os.getpid():
            return
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
            if self._locks is not None:
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
            raise lost

    def isActiveSession(self, session: ActiveSession) -> bool:
        active = self._active
        return active is not None and active() is session

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


def _bind_args(what: str, names: tuple[str, ...], args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> dict[str, Any]:
    if len(args) > len(names) or set(kwargs) - set(names):
        raise BadRequestError(f"{what} takes ({', '.join(names)}) after its first argument, "
                              f"got {args!r} {kwargs!r}")
    values = dict(zip(names, args))
    for k, v in kwargs.items():
        if k in values:
            raise BadRequestError(f"{what} got {k} twice")
        values[k] = v
    return values


def _model_needs(model: Model) -> tuple[int, int]:
    md = model.metadata
    return md.numIpus(), md.ipuVersion()


class DeviceManager:
    """Selects and attaches devices of the emulated machine."""

    def __init__(self, system: SystemConfig | None = None, *,
                 launcher: Callable[..., IpuConnection] | None = None,
                 daemon: str | None = None, settings: HostSettings | None = None) -> None:
        """``launcher(spec, log_dir=...) -> IpuConnection`` starts (or, for a daemon, hands
        out) one IPU process; the default starts it here (embedded mode).

        ``daemon``: the socket of an ``ipu-emulator daemon`` whose IPUs to use (default
        ``$IPU_EMULATOR_DAEMON`` unless a ``launcher`` is given); its pool is the machine
        unless ``system`` is given. IPU models stay private to this process.

        ``settings``: the knobs of the devices made here and of their IPU processes
        (``host_runtime.settings``; default: ``current()`` now).
        """
        self.settings = settings if settings is not None else HostSettings.current()
        path = daemon if daemon is not None else (None if launcher is not None
                                                  else daemon_from_env())
        self._daemon = DaemonClient(path, self.settings) if path else None
        try:
            if system is not None:
                self._system = system
            elif self._daemon is not None:
                self._system = self._daemon.system(emulator_home())
            else:
                self._system = load_system_config()
        except SystemConfigError as exc:
            raise BadRequestError(str(exc)) from exc
        # the launch's wait for the fork server is a host call: bounded by the host sync
        # timeout too
        self._own_launcher = launcher is None
        self._launcher = (launcher if launcher is not None
                          else functools.partial(launch_ipu, settings=self.settings,
                                                 spawn_wait=min(SPAWN_TIMEOUT,
                                                                self.settings.host_sync_timeout)))

    @property
    def system(self) -> SystemConfig:
        return self._system

    def prepare_launch(self) -> None:
        """Internal (ModelRunner): IPU processes will be started soon; start what they are
        forked from now, in the background, while the model is read (nothing through a
        daemon, or with a launcher of the caller's)."""
        if self._daemon is None and self._own_launcher:
            prestart(log_dir=self._system.log_dir, settings=self.settings)

    @property
    def daemon(self) -> str | None:
        """The daemon's socket path in daemon mode, else None (embedded)."""
        return None if self._daemon is None else self._daemon.path

    def ipuHardwareVersion(self) -> int:
        """2 or 21 for the machine's IPUs; 0 if it has none."""
        return self._system.ipu_version_number if self._system.num_ipus > 0 else 0

    # -- machine devices --------------------------------------------------------------------

    def getDevice(self, model_or_num_ipus: Model | int, *args: Any, **kwargs: Any) -> Device:
        """``getDevice(model, wait_config=...)`` or ``getDevice(num_ipus, device_options={},
        wait_config=..., constrains=...)``; raises DeviceUnavailableError."""
        num_ipus, version, wait_config = self._parse_get(model_or_num_ipus, args, kwargs)
        return self._acquire(self._candidates(num_ipus, version), wait_config,
                             f"a device of {num_ipus} IPU(s)")[0]

    def tryGetDevice(self, model_or_num_ipus: Model | int, *args: Any, **kwargs: Any
                     ) -> Device | None:
        """Like :meth:`getDevice` but returns None when no device is available."""
        try:
            return self.getDevice(model_or_num_ipus, *args, **kwargs)
        except DeviceUnavailableError:
            return None

    def getSpecificDevice(self, device_id: int, *args: Any, **kwargs: Any) -> Device:
        """``getSpecificDevice(device_id, model_or_device_options=None, wait_config=...)``."""
        if not isinstance(device_id, int) or isinstance(device_id, bool):
            raise BadRequestError(f"device_id must be an int, got {device_id!r}")
        groups = device_groups(self._system.num_ipus)
        if not 0 <= device_id < len(groups):
            raise DeviceUnavailableError(
                f"device id {device_id} does not exist; this machine has {self._system.num_ipus} "
                f"IPU(s) and device ids 0..{len(groups) - 1}")
        wait_config = self._wait_config(args[1:] if args else (), kwargs)
        first = args[0] if args else kwargs.get("model", kwargs.get("device_options"))
        if isinstance(first, Model):
            _, version = _model_needs(first)
            self._check_version(version)
        return self._acquire([(device_id, groups[device_id])], wait_config,
                             f"device {device_id}")[0]

    def tryGetSpecificDevice(self, device_id: int, *args: Any, **kwargs: Any) -> Device | None:
        try:
            return self.getSpecificDevice(device_id, *args, **kwargs)
        except DeviceUnavailableError:
            return None

    # -- IPU models ---------------------------------------------------------------------------

    def createIpuModelDevice(self, model_or_num_ipus: Model | int, *args: Any,
                             **kwargs: Any) -> Device:
        """A private IPU model (no machine lock), as in the seed's two overloads:

        ``createIpuModelDevice(num_ipus, ipu_version=2, tiles_per_ipu=0)`` or
        ``createIpuModelDevice(model, tiles_per_ipu=0)``; 0 tiles means 1472.
        """
        if isinstance(model_or_num_ipus, Model):
            names: tuple[str, ...] = ("tiles_per_ipu",)
        else:
            names = ("ipu_version", "tiles_per_ipu")
        values = _bind_args("createIpuModelDevice", names, args, kwargs)
        if isinstance(model_or_num_ipus, Model):
            num_ipus, ipu_version = _model_needs(model_or_num_ipus)
        else:
            num_ipus, ipu_version = model_or_num_ipus, values.get("ipu_version", 2)
        tiles = values.get("tiles_per_ipu", 0) or self._system.tiles_per_ipu
        return self._model_device(num_ipus, ipu_version, tiles)

    def createSmallIpuModelDevice(self, model_or_num_ipus: Model | int,
                                  ipu_version: int = 2) -> Device:
        """A private IPU model with 4 tiles per IPU: only small programs fit."""
        if isinstance(model_or_num_ipus, Model):
            num_ipus, ipu_version = _model_needs(model_or_num_ipus)
        else:
            num_ipus = model_or_num_ipus
        return self._model_device(num_ipus, ipu_version, _SMALL_MODEL_TILES)

    def _model_device(self, num_ipus: Any, ipu_version: Any, tiles: Any) -> Device:
        if not isinstance(num_ipus, int) or isinstance(num_ipus, bool) or not 1 <= num_ipus <= 64:
            raise BadRequestError(f"num_ipus must be an int in 1..64, got {num_ipus!r}")
        if ipu_version not in (2, 21):
            raise BadRequestError(f"ipu_version must be 2 or 21, got {ipu_version!r}")
        if not isinstance(tiles, int) or tiles <= 0:
            raise BadRequestError(f"tiles_per_ipu must be a positive int, got {tiles!r}")
        sysc = self._system
        specs = [IpuSpec(ipu_id=-1, ipu_version=ipu_version, tiles_per_ipu=tiles,
                         memory_per_tile=sysc.memory_per_tile,
                         num_ipus=num_ipus if k == 0 else 1,
                         compute_threads=sysc.compute_threads,
                         label=f"IPU model {k}" if num_ipus > 1 else "IPU model")
                 for k in range(num_ipus)]
        procs = self._launch(specs)
        return Device(device_id=-1, ipus=(), ipu_version=ipu_version, tiles_per_ipu=tiles,
                      memory_per_tile=sysc.memory_per_tile, processes=procs, locks=None,
                      is_ipu_model=True, settings=self.settings)

    # -- internals ---------------------------------------------------------------------------

    def _wait_config(self, rest: tuple[Any, ...], kwargs: dict[str, Any]) -> "DeviceWaitConfig":
        wc = kwargs.get("wait_config", rest[0] if rest else None)
        if wc is None:
            return DeviceWaitConfig()
        if not isinstance(wc, DeviceWaitConfig):
            raise BadRequestError(f"wait_config must be a DeviceWaitConfig, got {wc!r}")
        return wc

    def _parse_get(self, first: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
                   ) -> tuple[int, int, DeviceWaitConfig]:
        allowed = {"wait_config", "device_options", "constrains", "constraints", "model",
                   "num_ipus"}
        unknown = set(kwargs) - allowed
        if unknown:
            raise BadRequestError(f"getDevice got unexpected arguments {sorted(unknown)}")
        if isinstance(first, Model):
            num_ipus, version = _model_needs(first)
            wait_config = self._wait_config(args, kwargs)
            self._check_version(version)
        elif isinstance(first, int) and not isinstance(first, bool):
            num_ipus, version = first, self._system.ipu_version_number
            # getDevice(num_ipus, device_options, wait_config, constrains)
            wait_config = self._wait_config(args[1:], kwargs)
            options = args[0] if args else kwargs.get("device_options")
            if options is not None and not isinstance(options, dict):
                raise BadRequestError(f"device_options must be a dict, got {options!r}")
        else:
            raise BadRequestError(
                f"getDevice expects a popef.Model or a number of IPUs, got {first!r}")
        return num_ipus, version, wait_config

    def _check_version(self, version: int) -> None:
        have = self._system.ipu_version_number
        if version != have:
            raise DeviceUnavailableError(
                f"the model needs ipu{version} IPUs, but this machine's IPUs are ipu{have} "
                f"(IPU_EMULATOR_IPU_VERSION / config file)")

    def _candidates(self, num_ipus: Any, version: int) -> list[tuple[int, tuple[int, ...]]]:
        n = self._system.num_ipus
        if not isinstance(num_ipus, int) or num_ipus < 1:
            raise BadRequestError(f"num_ipus must be a positive int, got {num_ipus!r}")
        if num_ipus & (num_ipus - 1):
            raise DeviceUnavailableError(
                f"asked for a device of {num_ipus} IPUs; devices have a power of two IPUs "
                "(1, 2, 4, ...)")
        if num_ipus > n:
            raise DeviceUnavailableError(
                f"asked for a device of {num_ipus} IPU(s), but this machine has {n} IPU(s)")
        return [(i, g) for i, g in enumerate(device_groups(n)) if len(g) == num_ipus]

    def _acquire(self, candidates: list[tuple[int, tuple[int, ...]]],
                 wait_config: DeviceWaitConfig, what: str, count: int = 1) -> list[Device]:
        """``count`` devices from ``candidates``, all or none.

        Each attempt reserves devices until it holds ``count``; short of that it releases
        what it holds before waiting, so that two callers that each need several devices
        (a ModelRunner's replicas) can never hold some and wait forever for the others."""
        strategy = wait_config.strategy
        sleep = max(wait_config.sleepTime.total_seconds(), 0.001)
        start = time.monotonic()
        deadline = (start + wait_config.timeout.total_seconds()
                    if strategy is DeviceWaitStrategy.WAIT_WITH_TIMEOUT else None)
        attempts = 0
        while True:
            attempts += 1
            busy: dict[int, int | None] = {}
            held: list[tuple[int, tuple[int, ...], IpuLocks | DaemonAttachment]] = []
            for device_id, ipus in candidates:
                got = self._reserve(device_id, ipus)
                if isinstance(got, dict):
                    busy.update(got)
                    continue
                held.append((device_id, ipus, got))
                if len(held) == count:
                    return self._devices_from(held)
            for _, _, locks in held:
                locks.release()
            if strategy is DeviceWaitStrategy.NO_WAIT:
                break
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                break
            pause = sleep if deadline is None else min(sleep, deadline - now)
            time.sleep(max(pause, 0.0))
        held_text = ", ".join(f"ipu {i} by pid {pid}" if pid else f"ipu {i} (holder unknown)"
                              for i, pid in sorted(busy.items()))
        waited = time.monotonic() - start
        raise DeviceUnavailableError(
            f"no device available: asked for {what} with {strategy.name}"
            + (f" (waited {waited:.1f} s, {attempts} attempts)" if attempts > 1 else "")
            + f"; busy: {held_text or 'none, but too few devices exist'}"
            + (f" (daemon at {self._daemon.path})" if self._daemon is not None else ""))

    def _devices_from(self, held: list[tuple[int, tuple[int, ...], IpuLocks | DaemonAttachment]]
                      ) -> list[Device]:
        """Start (or take over) the IPU processes of reserved devices; all or none."""
        devices: list[Device] = []
        try:
            for k, (device_id, ipus, locks) in enumerate(held):
                try:
                    devices.append(self._machine_device(device_id, ipus, locks))
                except BaseException:
                    for _, _, rest in held[k:]:
                        rest.release()
                    raise
        except BaseException:
            for dev in devices:
                dev.close()
            raise
        return devices

    def get_devices_all_or_none(self, model: Model, count: int,
                                wait_config: "DeviceWaitConfig | None" = None) -> list[Device]:
        """``count`` devices for ``model``, all or none, attached at once (a ModelRunner's
        replicas: a runner holding some while waiting for the others could deadlock with
        another doing the same). Internal to this package and the runner, not part of the
        seed's API; DeviceUnavailableError when the machine cannot hold ``count``."""
        num_ipus, version, wc = self._parse_get(
            model, (), {"wait_config": wait_config if wait_config is not None
                        else DeviceWaitConfig()})
        candidates = self._candidates(num_ipus, version)
        disjoint: set[int] = set()
        for _, ipus in candidates:
            if disjoint.isdisjoint(ipus):
                disjoint.update(ipus)
        possible = len(disjoint) // max(num_ipus, 1)
        if count > possible:
            raise DeviceUnavailableError(
                f"no device available: asked for {count} devices of {num_ipus} IPU(s) with "
                f"{wc.strategy.name}, but this machine has {self._system.num_ipus} IPU(s): "
                f"at most {possible} such devices")
        return self._acquire(candidates, wc, f"{count} devices of {num_ipus} IPU(s)", count)

    def _reserve(self, device_id: int, ipus: tuple[int, ...]
                 ) -> IpuLocks | DaemonAttachment | dict[int, int | None]:
        """Hold ``ipus`` exclusively, or ``{ipu: holder pid or None}`` of the busy ones."""
        if self._daemon is not None:
            return self._daemon.try_attach(device_id, ipus)
        try:
            return IpuLocks.try_acquire(self._system.lock_dir, ipus)
        except OutOfFileDescriptorsError as exc:
            raise ResourceLimitError(f"cannot attach ipus {list(ipus)}: {exc}") from exc

    def _machine_device(self, device_id: int, ipus: tuple[int, ...],
                        locks: IpuLocks | DaemonAttachment) -> Device:
        sysc = self._system
        specs = [IpuSpec(ipu_id=i, ipu_version=sysc.ipu_version_number,
                         tiles_per_ipu=sysc.tiles_per_ipu, memory_per_tile=sysc.memory_per_tile,
                         num_ipus=len(ipus) if k == 0 else 1,
                         compute_threads=sysc.compute_threads,
                         label=f"device {device_id} (ipu {i})")
                 for k, i in enumerate(ipus)]
        procs = self._launch(specs, locks.launcher if isinstance(locks, DaemonAttachment)
                             else None)
        return Device(device_id=device_id, ipus=ipus, ipu_version=sysc.ipu_version_number,
                      tiles_per_ipu=sysc.tiles_per_ipu, memory_per_tile=sysc.memory_per_tile,
                      processes=procs, locks=locks, settings=self.settings)

    def _launch(self, specs: list[IpuSpec], launcher: Callable[..., IpuConnection] | None = None
                ) -> list[IpuConnection]:
        """One connection per spec from ``launcher`` (a daemon attachment's) or our own."""
        launch = launcher if launcher is not None else self._launcher
        procs: list[IpuConnection] = []
        try:
            for spec in specs:
                # the IPU process's control and event rings live in /dev/shm too
                with translated(f"the process and the control and event rings of IPU "
                                f"{spec.ipu_id}", _IPU_RING_BYTES):
                    procs.append(launch(spec, log_dir=self._system.log_dir))
        except BaseException:
            for p in procs:
                if launcher is None:   # a daemon's processes stay warm
                    p.kill()
                p.close()
            raise
        return procs
