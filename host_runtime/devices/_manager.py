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

The device itself (its sessions, its close) is :mod:`._device`; how to wait for
one is :mod:`._wait`; both are re-exported here.

IPU model devices (``createIpuModelDevice``, ``createSmallIpuModelDevice``)
are private to the caller: they take no machine lock; the small one has 4
tiles per IPU, so only small executables fit.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from typing import Any, Callable, Iterable

from host_runtime.devices import _partition
from host_runtime.devices._daemon_client import DaemonAttachment, DaemonClient, daemon_from_env
from host_runtime.devices._device import ActiveSession as ActiveSession, Device as Device
from host_runtime.devices._first import first_request
from host_runtime.devices._shm_space import translated
from host_runtime.devices._wait import (DeviceConstraints as DeviceConstraints,
                                        DeviceWaitConfig as DeviceWaitConfig,
                                        DeviceWaitStrategy as DeviceWaitStrategy,
                                        waiting_elsewhere)
from host_runtime.errors import (BadRequestError, DeviceUnavailableError,
                                 ResourceLimitError)
from host_runtime.popef.model import Model
from host_runtime.settings import HostSettings
from ipu_emulator import ipu_protocol
from ipu_emulator.ipu.forkserver import SPAWN_TIMEOUT
from ipu_emulator.ipu.launcher import IpuConnection, IpuSpec, launch_ipu, prestart
from ipu_emulator.system import (IpuLocks, SystemConfig, SystemConfigError, device_groups,
                                 emulator_home, load_system_config)
from ipu_emulator.vipu import device_ids
from shm import FileSizeLimitError, OutOfFileDescriptorsError, remove_dead

__all__ = [
    "DeviceWaitStrategy",
    "DeviceWaitConfig",
    "DeviceConstraints",
    "Device",
    "DeviceManager",
]   # and, internal: ActiveSession

_log = logging.getLogger(__name__)

_SMALL_MODEL_TILES = 4

_reclaimed = False


def _reclaim_once() -> None:
    """The first DeviceManager of a process unlinks the shared-memory objects (of its tag)
    whose creator died without unlinking them: a host killed with its IPU processes (a
    SIGTERM to the process group, as ``timeout`` sends) leaves its rings and regions, which
    no process of its own is left to remove."""
    global _reclaimed
    if _reclaimed:
        return
    _reclaimed = True
    try:
        remove_dead()
    except OSError as exc:   # /dev/shm unreadable: nothing to reclaim from here
        _log.debug("reclaiming shared memory of dead processes: %s", exc)


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


_Held = list[tuple[int, tuple[int, ...], "IpuLocks | DaemonAttachment"]]


def _reserve_some(reserve: Callable[[int, tuple[int, ...]],
                                    "IpuLocks | DaemonAttachment | dict[int, int | None]"],
                  candidates: Iterable[tuple[int, tuple[int, ...]]], count: int
                  ) -> tuple[_Held, dict[int, int | None]]:
    """Reserve devices of ``candidates`` in turn until ``count`` are held: what it holds
    and ``{ipu: holder pid or None}`` of the busy IPUs it met. If a reservation raises
    (e.g. out of descriptors), what it held is let go at once, not when the collector
    frees the frames of the exception's traceback."""
    busy: dict[int, int | None] = {}
    held: _Held = []
    try:
        for device_id, ipus in candidates:
            got = reserve(device_id, ipus)
            if isinstance(got, dict):
                busy.update(got)
                continue
            held.append((device_id, ipus, got))
            if len(held) == count:
                break
    except BaseException:
        for _, _, locks in held:
            locks.release()
        raise
    return held, busy


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
        # a V-IPU partition given by the environment: the machine is its IPUs
        part = _partition.given_partition() if launcher is None and system is None else None
        path = daemon if daemon is not None else (
            None if launcher is not None else part.socket if part else daemon_from_env())
        named = {} if part is None or daemon is not None else {"origin": part.socket_source}
        self._daemon = (DaemonClient(path, self.settings, part.name if part else None, **named)
                        if path else None)
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
        self._in_partitions: dict[int, str] = {}   # IPUs found in a daemon's partitions
        _reclaim_once()

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
        if self._daemon is not None and self._daemon.partition is not None:
            _partition.check_device(self._daemon.partition, self._system.num_ipus,
                                    self._daemon.reconfigurable, device_id)
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

    @property
    def partition(self) -> str | None:
        """The V-IPU partition whose IPUs are this machine, else None."""
        return None if self._daemon is None else self._daemon.partition

    @property
    def device_ids(self) -> list[int]:
        """Internal (PopRT's ``DeviceManager``): the ids of the devices this process may
        ask for: its partition's (``docs/vipu.md``), else every device of the machine."""
        d, n = self._daemon, self._system.num_ipus
        return (device_ids(n, d.reconfigurable) if d is not None and d.partition is not None
                else list(range(len(device_groups(n)))))

    def _candidates(self, num_ipus: Any, version: int) -> list[tuple[int, tuple[int, ...]]]:
        n = self._system.num_ipus
        if not isinstance(num_ipus, int) or num_ipus < 1:
            raise BadRequestError(f"num_ipus must be a positive int, got {num_ipus!r}")
        if num_ipus & (num_ipus - 1):
            raise DeviceUnavailableError(
                f"asked for a device of {num_ipus} IPUs; devices have a power of two IPUs "
                "(1, 2, 4, ...)")
        if self._daemon is not None and self._daemon.partition is not None:
            return _partition.candidates(self._daemon.partition, n,
                                         self._daemon.reconfigurable, num_ipus)
        if num_ipus > n:
            raise DeviceUnavailableError(
                f"asked for a device of {num_ipus} IPU(s), but this machine has {n} IPU(s)")
        return [(i, g) for i, g in enumerate(device_groups(n)) if len(g) == num_ipus]

    def _acquire(self, candidates: list[tuple[int, tuple[int, ...]]],
                 wait_config: DeviceWaitConfig, what: str, count: int = 1,
                 cut: int = 0) -> list[Device]:
        """``count`` devices from ``candidates``, all or none; ``cut``: the one device got
        is cut into devices of ``cut`` IPUs (:meth:`_cut`).

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
            held, busy = _reserve_some(self._reserve, candidates, count)
            if len(held) == count:
                return self._devices_from(_partition.cut(held, cut) if cut else held)
            for _, _, locks in held:
                locks.release()
            if strategy is DeviceWaitStrategy.NO_WAIT:
                break
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                break
            pause = sleep if deadline is None else min(sleep, deadline - now)
            waiting_elsewhere()   # for the holder of a busy device
            time.sleep(max(pause, 0.0))
        held_text = _busy_text(busy, self._in_partitions)
        waited = time.monotonic() - start
        detail = (f"with {strategy.name}"
                  + (f" (waited {waited:.1f} s, {attempts} attempts)" if attempts > 1 else "")
                  + f"; busy: {held_text or 'none, but too few devices exist'}"
                  + (f" (daemon at {self._daemon.path})" if self._daemon is not None else ""))
        if self.partition is not None:
            raise _partition.busy(self.partition, what, detail)
        raise DeviceUnavailableError(f"no device available: asked for {what} {detail}")

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
        d, size = self._daemon, self._system.num_ipus
        if (d is not None and d.partition is not None and not d.reconfigurable and count > 1
                and count * num_ipus == size):   # the partition's one device, cut (_partition)
            return self._acquire(self._candidates(size, version), wc,
                                 f"{count} devices of {num_ipus} IPU(s)", cut=num_ipus)
        candidates = self._candidates(num_ipus, version)
        disjoint: set[int] = set()
        for _, ipus in candidates:
            if disjoint.isdisjoint(ipus):
                disjoint.update(ipus)
        possible = len(disjoint) // max(num_ipus, 1)
        if count > possible and self.partition is not None:
            raise _partition.too_few(self.partition, self._system.num_ipus, count, num_ipus)
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
        taken = _partition.kept_for_jobs(self._system, ipus, self._in_partitions)
        if taken:
            return taken
        try:
            return IpuLocks.try_acquire(self._system.lock_dir, ipus)
        except (OutOfFileDescriptorsError, FileSizeLimitError) as exc:
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
        return launch_all(specs, launcher if launcher is not None else self._launcher,
                          warm=launcher is not None, log_dir=self._system.log_dir)


def launch_all(specs: list[IpuSpec], launch: Callable[..., IpuConnection], warm: bool,
               log_dir: str) -> list[IpuConnection]:
    """One connection per spec from ``launch``, all or none; ``warm``: a daemon's processes
    (they stay when one of the others fails; ours are killed)."""
    procs: list[IpuConnection] = []
    try:
        for spec in specs:
            # the IPU process's control and event rings live in /dev/shm too; a first
            # request is for a one-IPU device (host_runtime.devices._first)
            with translated(f"the process and the control and event rings of IPU "
                            f"{spec.ipu_id}", ipu_protocol.RINGS_BYTES), \
                    (contextlib.nullcontext() if len(specs) == 1 else first_request(None)):
                procs.append(launch(spec, log_dir=log_dir))
    except BaseException:
        for p in procs:
            if not warm:
                p.kill()
            p.close()
        raise
    if not warm:
        waiting_elsewhere()   # our IPU processes start meanwhile (ready at the first request)
    return procs


def _busy_text(busy: dict[int, int | None], in_partitions: dict[int, str]) -> str:
    """The holders of busy IPUs, for the error of an attach that found none free."""
    return ", ".join(
        f"ipu {i} by pid {pid}" if pid else f"ipu {i} (in V-IPU partition "
        f"{in_partitions[i]!r}: IPUOF_VIPU_API_PARTITION_ID and the daemon use it)"
        if i in in_partitions else f"ipu {i} (holder unknown)"
        for i, pid in sorted(busy.items()))

