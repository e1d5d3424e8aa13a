"""Session: links a model to a device and services its streams (seed 002, 10.2.4; seed 003).

::

    user thread                      device service thread          IPU process
    -----------                      ---------------------          -----------
    runMainPrograms() --RUN------------------------------------->   Main program
                                                                      input ring empty:
                                     <-------------------NEED(i)--    post NEED, wait
                                     callback(slot view) -> publish -> read slot
                                                                      output written:
                                     <--------------------OUT(i)--    publish, post OUT
                                     callback(read-only view), release
                      <----------------------------------DONE-----    program finished

One SPSC ring per anchor (slot = one transfer, ``sizeInBytes``), created by
the session when it is first bound; input rings are produced by the host,
output rings by the device. PopEF tensor/feed data is bound to its anchors
automatically unless ``SessionConfig.pred_tensor_data`` says USE_USER_DATA.

Two sessions may share a device: binding the other one runs this one's save
programs, and this one's load programs run again before its next Main.

The fast path for ``QueueManager`` / ``ModelRunner`` (docs/design.md
section 8) is ``session.direct``, a :class:`host_runtime.session._fastpath.DirectStreams`
the session owns: the caller claims anchors as *direct* and reads/writes their
rings itself, and ``direct.start_main_loop()`` keeps Main running on the device
until ``stop()``. The per-anchor callbacks, rings and servicing live in
:mod:`host_runtime.session._streams`. The session reaches its device through
``Device.link`` / ``Device.lock`` and is, for the device, an ``ActiveSession``
(:mod:`host_runtime.devices._manager`).
"""

from __future__ import annotations

import enum
import logging
import os
import secrets
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from shm import Region

from host_runtime import popef
from host_runtime._fork import check_owner, current_pid, foreign
from host_runtime.devices import ShardedLoad
from host_runtime.devices import wait
from host_runtime.devices import load_spec_region, translated
from host_runtime.popef import check_model
from host_runtime.popef.reader import file_identity as popef_file_identity
from host_runtime.popef.reader import file_span as popef_file_span
from host_runtime.session._fastpath import DirectStreams
from host_runtime.session._streams import StreamTable, callback_failure
from host_runtime.session._constants import SharedConstants, constants_bytes, shared_constants
from host_runtime.session._weights import SharedWeights, check_fits, is_shared, shared_weights
from host_runtime.devices import Device, DeviceManager, DeviceWaitConfig
from host_runtime.errors import (BadRequestError, DeviceExecutionError, DeviceLostError,
                                 DeviceTimeoutError, InvalidStateError, ModelRuntimeError,
                                 PopefError)
from host_runtime.session.predicates import AnchorCallbackPredicate, PopefDataUsagePredicate
from host_runtime.settings import HostSettings
from ipu_emulator.executable import ExecutableError, ExecutableHeader, read_header, weights_span
from ipu_emulator.faults import table_for as fault_table_for
from ipu_emulator.fit import misfit
from ipu_emulator.ipu_protocol import LoadSpec, Op, WeightsFile

__all__ = [
    "LaunchPolicy",
    "SessionConfig",
    "CallbackInfo",
    "CallbackHandle",
    "CallbackFactory",
    "Session",
]

_log = logging.getLogger(__name__)

CallbackHandle = Callable[[memoryview], None]
"""Called with one transfer: writable for inputs, read-only (valid during the call) for outputs."""

DROP_STOP_TIMEOUT = 1.0
"""Seconds a dropped session (or runner) waits for its own device to stop before it kills
the device's IPU processes: ``__del__`` must not block for long."""


class LaunchPolicy(enum.Enum):
    """When a session acquires its device (if not given one with bindToDevice)."""

    Deferred = 0
    """On first use (a run, or a fast-path call)."""
    Immediate = 1
    """In the constructor."""


@dataclass
class SessionConfig:
    """Session configuration; defaults as in the seed."""

    policy: LaunchPolicy = LaunchPolicy.Deferred
    pred_tensor_data: PopefDataUsagePredicate | None = None
    check_package_hash: bool = True
    wait_config: DeviceWaitConfig = field(default_factory=DeviceWaitConfig)
    max_look_ahead: str = "unlimited"
    ring_depth: Callable[[popef.Anchor], int] | None = None
    settings: HostSettings | None = None
    """The knobs the session, its rings and the device it attaches use (``ModelRunner``
    passes its own); None: ``host_runtime.settings.current()`` when the session is made."""
    """Internal (ModelRunner, QueueManager users): slots of each anchor's stream ring, e.g. a
    ``host_runtime.queues._queues.ring_size_multiplier_factory`` function. Main anchors are still
    capped at ``max_look_ahead + 1`` when that is a number; every ring at 64 MiB and 1024
    slots. None: 8 slots for Main anchors ("unlimited") or ``max_look_ahead + 1``, 2 for
    load/save-only anchors."""

    def look_ahead(self) -> int | None:
        """``max_look_ahead`` as a number (None for "unlimited"); BadRequestError if invalid."""
        value = self.max_look_ahead
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
        text = str(value).strip()
        if text == "unlimited":
            return None
        if text.isdigit():
            return int(text)
        raise BadRequestError(
            f'max_look_ahead must be "unlimited" or an unsigned integer, got {value!r}')


@dataclass(frozen=True)
class CallbackInfo:
    """What a CallbackFactory is told about the anchor it makes a callback for."""

    anchor: popef.Anchor

    def name(self) -> str:
        return self.anchor.name()

    def handle(self) -> str:
        return self.anchor.handle()

    def tensorInfo(self) -> popef.TensorInfo:
        return self.anchor.tensorInfo()

    def isInput(self) -> bool:
        return self.anchor.type() is popef.TensorType.INPUT


CallbackFactory = Callable[[CallbackInfo], "CallbackHandle | None"]


class _FastPathSide:
    """What the session's fast path needs of it (``SessionCore``), holding the session
    weakly: the session owns its DirectStreams, which owns this."""

    __slots__ = ("_ref",)

    def __init__(self, session: "Session") -> None:
        self._ref = weakref.ref(session)

    def _session(self) -> "Session":
        session = self._ref()
        if session is None:
            raise InvalidStateError("the session is closed")
        return session

    def device(self) -> Device | None:
        session = self._ref()
        return None if session is None else session.device()

    def require_device(self) -> Device:
        return self._session()._require_device()

    def activate(self) -> None:
        self._session()._activate()

    def prepare_main(self, dev: Device) -> list[int]:
        return self._session()._prepare_main(dev)

    def push_modes(self) -> None:
        self._session()._push_modes()

    def wake_streams(self) -> None:
        session = self._ref()
        if session is not None:
            session._wake_streams()


class Session:
    """Links a model to a device: loads it, runs its programs, services its streams.

    Besides the seed's API, marked "Internal": ``direct`` (the fast path of QueueManager
    and ModelRunner) and what a Device calls on its sessions (``main_loop_running``,
    ``deactivate``, ``device_detached``: the ``devices._manager.ActiveSession`` protocol).
    """

    ProgIdxType = int
    """The index of a program of the executable (C++ ``popef::ProgramFlow::ProgramIndexType``)."""
    ProgramsAndAnchorsMap = dict[int, list[popef.Anchor]]
    """Program index -> its anchors (what ``anchorsNotConnectedToCallbacks`` returns)."""

    def __init__(self, model: popef.Model | str | Sequence[str],
                 config: SessionConfig | None = None) -> None:
        self._owner_pid = current_pid()   # fork: see host_runtime._fork
        self._config = config if config is not None else SessionConfig()
        if not isinstance(self._config, SessionConfig):
            raise BadRequestError(f"config must be a SessionConfig, got {config!r}")
        self._settings = (self._config.settings if self._config.settings is not None
                          else HostSettings.current())
        # the fault schedule its IPUs follow (ipu_emulator.faults), kept for the session's life
        self._fault_table = fault_table_for(self._settings.faults)
        if isinstance(model, popef.Model):
            self._model = model
        elif isinstance(model, (str, os.PathLike)):
            self._model = popef.load_model([os.fspath(model)])
        elif isinstance(model, (list, tuple)) and model:
            self._model = popef.load_model([os.fspath(p) for p in model])
        else:
            raise BadRequestError(
                f"Session needs a popef.Model or a list of PopEF paths, got {model!r}")
        check_model(self._model)   # the rules of ipu_emulator.validate (once per Model)
        self._exe = self._model.executable.payload()
        try:
            self._header = read_header(self._exe)
        except ExecutableError as exc:
            raise PopefError(f"executable {self._model.executable.name()!r}: {exc}") from exc
        self._streams = StreamTable(self._model, self._config.pred_tensor_data,
                                    self._config.look_ahead(), self._config.ring_depth,
                                    self._settings)
        self._flow = self._streams.flow
        self._direct = DirectStreams(self._streams, _FastPathSide(self),
                                     self._settings.stop_timeout)
        self._queue_managers: list[Any] = []
        self._key = secrets.token_hex(8)
        self._device: Device | None = None
        self._owns_device = False
        self._spec_region: Region | None = None
        self._memory_region: Region | None = None
        # the executable's weights section: in a region shared by every session of the same
        # bytes (host_runtime.session._weights), not in this session's executable region
        self._weights_at, self._weights_len = _weights_span(self._exe, self._header)
        self._weights: SharedWeights | None = None
        # constant inputs (PopEF tensor data of the Load programs, frozen inputs): their
        # values in one region shared by every session of the same values
        # (host_runtime.session._constants); those the device was last loaded with
        self._constants: SharedConstants | None = None
        self._constants_loaded: dict[str, tuple[Callable[[memoryview], None], memoryview]] = {}
        self._sharded: ShardedLoad | None = None   # a multi-IPU executable's resources
        self._loaded = False             # our executable is loaded and we are the active session
        self._need_load_programs = True
        self._load_ran = False
        self._stopped = False
        self._modes_sent: list[int] | None = None
        self._closed = False
        # a run whose caller an exception (KeyboardInterrupt, a signal handler's) took away
        # while it waited: it goes on on the device; the next run waits for it first
        self._abandoned: tuple[Any, str] | None = None
        if self._config.policy is LaunchPolicy.Immediate:
            self._acquire_device()

    # -- the seed's API: device -------------------------------------------------------------

    def bindToDevice(self, device: Device) -> None:
        """Bind to ``device`` and load the executable onto it (unbinding any previous device)."""
        self._check_open()
        if not isinstance(device, Device):
            raise BadRequestError(f"bindToDevice expects a Device, got {device!r}")
        if self._device is not None and self._device is not device:
            self._unbind(run_save=True)
        self._device = device
        with device.lock:
            self._activate()

    def unloadFromDevice(self) -> None:
        """Unload from the bound device (its save programs run first if they can)."""
        self._check_open()
        if self._device is None:
            raise InvalidStateError("unloadFromDevice: the session is not bound to a device")
        self._unbind(run_save=True)

    def runLoadPrograms(self) -> None:
        """Run the load programs (copy weights and constants to the device)."""
        self._run(self._flow.load(), "load programs", phase="load")

    def runMainPrograms(self) -> None:
        """Run the main programs (after the load programs, if this binding has not run them)."""
        self._run(self._flow.main(), "main programs", phase="main")

    def runSavePrograms(self) -> None:
        """Run the save programs (copy chosen device tensors back to the host)."""
        self._run(self._flow.save(), "save programs", phase="save")

    def runPrograms(self, progs: Sequence[int]) -> None:
        """Run the given programs once each, in order (no implicit load)."""
        items = list(progs)
        if not all(isinstance(p, int) and not isinstance(p, bool) for p in items):
            raise BadRequestError(f"runPrograms expects a list of program indices, got {progs!r}")
        self._run(items, f"programs {items}", phase=None)

    def stop(self) -> None:
        """Send the stop signal: running programs end; nothing runs until reload()."""
        self.stop_within(self._settings.stop_timeout)

    def stop_within(self, timeout: float, kill_if_hung: bool = False) -> None:
        """Internal (ModelRunner): stop(), waiting up to ``timeout`` s for the device (and
        at most the host sync timeout without an answer). ``kill_if_hung`` (close, or a
        dropped owner): a device of ours that does not answer in time has its IPU
        processes killed instead."""
        check_owner(self._owner_pid, "Session")
        if self._closed:
            return
        self._disconnect_queues()
        dev = self._device
        self._stopped = True
        if dev is None or not self._loaded or not dev.isActiveSession(self) or dev.link.lost:
            return
        try:
            fut = dev.link.request(Op.STOP)
            # wake a program waiting on a stream now, not at its next check of the
            # control ring; reload() resets the rings
            self._wake_streams()
            wait(fut, timeout, f"stop on {dev.describe()}", pids=dev.pids(),
                 progress=lambda: dev.link.progress,
                 sync=dev.link.sync_timeout)
        except DeviceLostError:
            pass
        except DeviceTimeoutError as exc:
            if not (kill_if_hung and self._owns_device):
                raise
            _log.warning("%s: %s; killing its IPU processes", dev.describe(), exc)
            dev.kill()

    def _wake_streams(self) -> None:
        """After a STOP: invalidate the stream rings (and a sharded model's IPU-Links, which
        are reset before each run) so that a program waiting on one takes the STOP now."""
        self._streams.invalidate_rings()
        sharded = self._sharded
        if sharded is not None:
            for ring in sharded.links.values():
                if not ring.closed:
                    ring.invalidate()

    def reload(self) -> None:
        """Load the executable again on the bound device (after stop(), or to start afresh)."""
        self._check_open()
        dev = self._device
        if dev is None:
            raise InvalidStateError("reload: the session is not bound to a device")
        if self._direct.loop_running():
            raise InvalidStateError("reload: the main loop is running; stop() the session first")
        with dev.lock:
            dev.bind_session(self, self._streams)
            self._streams.reset_rings()
            self._load(fresh=True)
            self._stopped = False

    def isStopped(self) -> bool:
        return self._stopped

    # -- internal: the fast path ----------------------------------------------------------

    @property
    def direct(self) -> DirectStreams:
        """Internal (QueueManager, ModelRunner): the session's fast path: claim anchors,
        their rings, the main loop, failures (:mod:`host_runtime.session._fastpath`)."""
        check_owner(self._owner_pid, "Session")
        return self._direct

    def createQueueManager(self, *args: Any, **kwargs: Any) -> Any:
        """Create a QueueManager for this session (arguments as QueueManager's, after the
        session). The session owns it: stop() disconnects its queues."""
        self._check_open()
        from host_runtime.queues import QueueManager

        qm = QueueManager(self, *args, **kwargs)
        self._queue_managers.append(qm)
        return qm

    # -- the seed's API: callbacks ------------------------------------------------------------

    def setCallbackForAnchor(self, anchor_handle: str, callback: CallbackHandle | None) -> None:
        """Set the callback of one anchor (None removes the user's callback)."""
        self._streams.set_callback(anchor_handle, callback)

    def setUserInputHandler(self, factory: CallbackFactory,
                            anchor_callback_predicate: AnchorCallbackPredicate | None = None,
                            skip_connected: bool = False) -> None:
        """Call ``factory`` once per input anchor, those fed from PopEF data included (seed
        002); then the predicate decides: BIND_USER_CB binds what the factory returned (None
        keeps the anchor's callback, PopEF data included), BIND_EMPTY_CB an empty callback
        (but an anchor the PopEF file feeds keeps its data: ``predProgramFlowMain(flow)``
        leaves the Load program's weights to the file), SKIP_CB nothing.
        ``skip_connected``: skip anchors that have a callback (or data). Anchors a
        QueueManager or ModelRunner services directly are skipped."""
        self._streams.set_handler(self.getInputAnchors(), factory, anchor_callback_predicate,
                                  skip_connected, CallbackInfo)

    def setUserOutputHandler(self, factory: CallbackFactory,
                             anchor_callback_predicate: AnchorCallbackPredicate | None = None,
                             skip_connected: bool = False) -> None:
        """Call ``factory`` once per output anchor; the predicate decides what is bound (as
        ``setUserInputHandler``)."""
        self._streams.set_handler(self.getUserOutputAnchors(), factory,
                                  anchor_callback_predicate, skip_connected, CallbackInfo)

    def anchorsNotConnectedToCallbacks(self, progs: Sequence[int]) -> dict[int, list[popef.Anchor]]:
        """For each program: its anchors that have no callback (nor PopEF data, nor a queue)."""
        return self._streams.not_connected(progs)

    def errorIfAnchorsAreNotConnectedToCallbacks(self, progs: Sequence[int]) -> None:
        """Raise InvalidStateError listing each program's unconnected anchors."""
        missing = self.anchorsNotConnectedToCallbacks(progs)
        if missing:
            parts = "; ".join(f"program {p}: " + ", ".join(repr(a.name()) for a in anchors)
                              for p, anchors in sorted(missing.items()))
            raise InvalidStateError(
                f"anchors not connected to callbacks: {parts}. Bind them with "
                "setCallbackForAnchor / setUserInputHandler / setUserOutputHandler (or a "
                "QueueManager)")

    # -- the seed's API: anchors and model -------------------------------------------------------

    def getInputAnchors(self) -> list[popef.Anchor]:
        """All input anchors (user-fed and PopEF-data-fed)."""
        return self._streams.of_type(popef.TensorType.INPUT)

    def getOutputAnchors(self) -> list[popef.Anchor]:
        return self._streams.of_type(popef.TensorType.OUTPUT)

    def getUserInputAnchors(self) -> list[popef.Anchor]:
        """Inputs the user must feed: those not bound to PopEF tensor or feed data."""
        return [a for a in self.getInputAnchors() if a.handle() not in self._streams.popef_cbs]

    def getUserOutputAnchors(self) -> list[popef.Anchor]:
        """Outputs the user handles (all outputs: PopEF data never feeds an output)."""
        return self.getOutputAnchors()

    def getPopefInputAnchors(self) -> list[popef.Anchor]:
        """Inputs fed automatically from the model's PopEF tensor or feed data."""
        return [a for a in self.getInputAnchors() if a.handle() in self._streams.popef_cbs]

    def model(self) -> popef.Model:
        return self._model

    def device(self) -> Device | None:
        """The bound device, if any."""
        return self._device

    def config(self) -> SessionConfig:
        return self._config

    # -- lifetime ---------------------------------------------------------------------------------

    def _disconnect_queues(self) -> None:
        """Wake every QueueManager reader/writer of this session (stop and close)."""
        for qm in list(self._queue_managers):
            try:
                qm.disconnectAll()
            except Exception:
                _log.exception("disconnecting %r failed", qm)

    def close(self) -> None:
        """Stop, unload (no implicit save), destroy the rings; idempotent.

        Bounded: a device that does not answer within the host sync timeout (a stopped or
        stuck IPU process) is killed if the session attached it itself; a device of the
        caller's is left to the caller (DeviceTimeoutError naming its IPU processes), the
        session's own resources are released either way."""
        self.close_within(self._settings.stop_timeout, kill_if_hung=True)

    def close_within(self, stop_timeout: float, kill_if_hung: bool) -> None:
        """Internal (ModelRunner): close(), stopping within ``stop_timeout`` s (see
        ``stop_within``). In a process forked from the session's creator it only marks
        this process's copy closed: nothing of the creator's is stopped or unlinked."""
        if self._closed:
            return
        if foreign(self._owner_pid):
            self._closed = True
            return
        try:
            self._disconnect_queues()
            dev = self._device
            busy = False
            if dev is not None:
                busy = not dev.lock.acquire(blocking=False)
                if not busy:
                    dev.lock.release()
            if busy or self._direct.loop_running():
                # a program of ours may be running on another thread
                self.stop_within(stop_timeout, kill_if_hung)
            if self._device is not None:
                self._unbind(run_save=False)
        finally:
            self._closed = True
            self._streams.close()
            for region in (self._spec_region, self._memory_region):
                if region is not None:
                    region.close()
                    region.unlink()
            self._spec_region = self._memory_region = None
            self._weights = None   # the last session of these weights frees their region
            self._constants = None   # and of these constants
            if self._sharded is not None:
                self._sharded.close()
                self._sharded = None

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Dropped: nothing can use the session any more. Close it now, without blocking
        # for long on a device that does not answer.
        if not getattr(self, "_closed", True):
            try:
                self.close_within(DROP_STOP_TIMEOUT, kill_if_hung=True)
            except Exception:
                pass

    def __repr__(self) -> str:
        where = self._device.describe() if self._device is not None else "unbound"
        return f"<Session {self._header.name!r} {where}>"

    # -- binding internals ------------------------------------------------------------------------

    def _check_open(self) -> None:
        check_owner(self._owner_pid, "Session")
        if self._closed:
            raise InvalidStateError("the session is closed")

    def _acquire_device(self) -> Device:
        self._share_weights()   # while the IPU process starts (its template may be starting)
        dev = DeviceManager(settings=self._settings).getDevice(self._model, wait_config=self._config.wait_config)
        self._owns_device = True
        try:
            self.bindToDevice(dev)
        except BaseException:
            self._device = None
            self._owns_device = False
            dev.close()
            raise
        return dev

    def adopt_device(self, device: Device) -> None:
        """Internal (ModelRunner): bind to ``device`` and own it, as if this session had
        attached it: the session
        closes it when it unbinds or closes (ModelRunner attaches its replicas' devices
        all at once, then hands one to each replica's session)."""
        self.bindToDevice(device)
        self._owns_device = True

    def _require_device(self) -> Device:
        self._check_open()
        if self._device is None:
            return self._acquire_device()
        return self._device

    def _activate(self) -> None:
        """Make this session the device's active one, loaded. Caller holds the device lock."""
        dev = self._device
        assert dev is not None
        if not dev.isActiveSession(self):
            self._loaded = False
        dev.bind_session(self, self._streams)
        if not self._loaded:
            self._load(fresh=False)

    def _push_modes(self) -> None:
        """Send the stream modes now if loaded and active (they change with claims)."""
        dev = self._device
        if (dev is not None and self._loaded and dev.link.lost is None
                and dev.isActiveSession(self)):
            self._send_modes(dev)

    # -- internal: for the device (host_runtime.devices._manager.ActiveSession) -----------------

    def main_loop_running(self) -> bool:
        """Internal (Device): whether this session's main loop runs on its device."""
        return self._direct.loop_running()

    def deactivate(self, implicit_save: bool) -> None:
        """Internal (Device): another session takes the device (called under its lock)."""
        if self._direct.loop_running():
            dev = self._device
            raise InvalidStateError(
                f"{dev.describe() if dev else 'the device'} is running the main loop of another "
                "session; stop() that session (or end its loop) before binding this one")
        if implicit_save:
            self._implicit_save()
        self._loaded = False

    def _implicit_save(self) -> None:
        dev = self._device
        save = self._flow.save()
        if (dev is None or not self._loaded or not self._load_ran or self._stopped or not save
                or dev.link.lost is not None or self._direct.loop_running()):
            return
        if self._streams.not_connected(save):
            _log.debug("skipping implicit save programs of %r: anchors not connected", self)
            return
        self._request_run(dev, save, "implicit save programs")

    def _unbind(self, run_save: bool) -> None:
        dev = self._device
        if dev is None:
            return
        try:
            with dev.lock:
                if dev.isAttached() and dev.link.lost is None and dev.link.started:
                    if run_save and dev.isActiveSession(self):
                        try:
                            self._implicit_save()
                        except ModelRuntimeError as exc:
                            _log.warning("implicit save programs of %r failed: %s", self, exc)
                    # also when another session is active: the device caches ours (not
                    # needed when the device goes with this session: closing it drops all)
                    if not (self._owns_device and set(dev.sessions()) <= {self}):
                        try:
                            dev.link.call(Op.UNLOAD, {"key": self._key},
                                           timeout=self._settings.stop_timeout)
                        except ModelRuntimeError as exc:
                            _log.debug("unload from %s: %s", dev.describe(), exc)
                dev.forget_session(self)
        finally:
            self._device = None
            self._loaded = False
            self._need_load_programs = True
            self._load_ran = False
            self._modes_sent = None
            if self._owns_device:
                self._owns_device = False
                dev.close()

    def device_detached(self, dev: Device) -> None:
        """Internal (Device): Device.close() calls this for each session bound to it."""
        if self._device is dev:
            self._device = None
            self._loaded = False
            self._owns_device = False
            self._need_load_programs = True
            self._load_ran = False

    def _ensure_resources(self, dev: Device) -> None:
        extra = [] if self._memory_region is not None else [
            ("the device memory region", max(64, self._header.memory_bytes)),
            ("the executable region", self._weights_at)] + (
            [("the weights region", self._weights_len)]
            if self._weights is None and self._weights_len and self._weights_file(dev) is None
            else []) + (
            [("the constants region", constants_bytes(
                {h: v for h, (_, v) in self._streams.constants().items()}))]
            if self._constants is None and self._streams.constants() else [])
        self._streams.ensure_rings(dev.link.pid, extra)
        if self._memory_region is None:
            size = max(64, self._header.memory_bytes)
            with translated("the device memory region", size):
                # backed by the IPU process where it will touch it (not where it reads
                # constants in place): ipu_emulator.ipu._constants.memory_ranges
                self._memory_region = Region.create(size, kind="mem", prefault=False,
                                                    backed=0)

    def _load(self, fresh: bool, keep_load_constants: bool = False) -> None:
        """Send LOAD (caller holds the device lock and is the active session).
        ``keep_load_constants``: the constant inputs only Load programs read stay those
        of the last LOAD (no Load program runs before the next request)."""
        dev = self._device
        assert dev is not None
        self._ensure_resources(dev)
        header = self._header
        wrong = misfit(header.name, header.ipu_version,
                       max(header.memory_bytes, header.required_bytes), None,
                       device=dev.describe(), device_version=dev.ipuVersion(),
                       device_ipus=dev.numIpus(), tiles_per_ipu=dev.tilesPerIpu(),
                       memory_per_tile=dev.memoryPerTile())
        if wrong is not None:
            raise BadRequestError(wrong[1])
        modes = self._streams.modes()
        constants, same = self._constants_to_load(keep_load_constants)
        if not same:   # the device's cached copy of the executable streams them otherwise
            fresh = True
        if self._header.num_ipus > 1 and self._load_sharded(dev, modes, fresh):
            self._constants_loaded = constants
            return
        weights_file = self._weights_file(dev)
        if weights_file is None:
            self._share_weights(dev)
        spec = LoadSpec(
            key=self._key, fresh=bool(fresh), executable_size=self._weights_at,
            memory_region=self._memory_region.name if self._memory_region else None,
            check_package_hash=bool(self._config.check_package_hash),
            streams=self._streams.load_spec(modes), prepack=bool(self._settings.prepack),
            weights_file=weights_file,
            weights_region=(self._weights.name if weights_file is None
                            and self._weights is not None else None),
            constants=self._constants.spec() if self._constants is not None else None)
        # the executable stays where it is; only "fresh", modes and weights change
        self._spec_region = load_spec_region(self._spec_region, spec,
                                             memoryview(self._exe)[:self._weights_at])
        load: dict[str, Any] = {"spec_region": self._spec_region.name}
        if self._fault_table is not None:
            load["faults"] = [self._fault_table.name]
        try:
            dev.link.call(Op.LOAD, load, timeout=self._settings.load_timeout)
        finally:
            if self._settings.prepack:
                # the IPU process keeps its own (prepacked) copy and let go of the shared
                # one: the region lives only while a session of these weights loads
                self._weights = None
        self._modes_sent = modes
        self._constants_loaded = constants
        self._loaded = True
        self._need_load_programs = True
        self._load_ran = False

    def _constants_to_load(self, keep_load_constants: bool) -> tuple[
            dict[str, tuple[Callable[[memoryview], None], memoryview]], bool]:
        """The constant inputs the next LOAD names (handle -> (callback, value)), their
        region held in ``self._constants``; and whether they are those of the last LOAD.
        ``keep_load_constants``: see :meth:`_load`."""
        constants = self._streams.constants()
        if keep_load_constants:
            only = self._streams.load_only
            constants = {**{h: cv for h, cv in constants.items() if h not in only},
                         **{h: cv for h, cv in self._constants_loaded.items() if h in only}}
        same = constants.keys() == self._constants_loaded.keys() and all(
            cv is self._constants_loaded[h] for h, cv in constants.items())
        if not constants:
            self._constants = None
        elif self._constants is None or not same:
            self._constants = shared_constants({h: v for h, (_, v) in constants.items()})
        return constants, same

    def _sync_constants(self, progs: Sequence[int]) -> None:
        """Before ``progs`` run: if the constant inputs are not those the device was loaded
        with (a callback set on one, or a new value) and ``progs`` read them, load again so
        that they read them as they are now. An input only Load programs read changes at
        the next Load run: until then the device keeps what the last Load wrote, as a real
        one does."""
        now = {h: cb for h, (cb, _) in self._streams.constants().items()}
        was = {h: cb for h, (cb, _) in self._constants_loaded.items()}
        changed = {h for h in now.keys() | was.keys() if now.get(h) is not was.get(h)}
        loads = bool(set(progs) & set(self._flow.load()))
        if changed and (loads or not changed <= self._streams.load_only):
            need, ran = self._need_load_programs, self._load_ran
            self._load(fresh=True, keep_load_constants=not loads)
            self._need_load_programs, self._load_ran = need, ran

    def freeze_input(self, anchor_handle: str, data: memoryview) -> None:
        """Internal (ModelRunner): feed input ``anchor_handle`` from ``data``, a value that
        never changes (a frozen input): its value goes once into shared memory for every
        session of this process that has the same value, instead of through this session's
        ring. The caller sees to it that a Main iteration still reads some stream (else the
        device's main loop would not wait for requests)."""
        self._streams.set_constant(anchor_handle, data)

    def _weights_file(self, dev: Device | None = None) -> WeightsFile | None:
        """With prepacking on, where an IPU process reads the weights itself: the PopEF
        file they were read from, while it is unchanged (it takes its own copy at once;
        no shared region is needed). None: they go through the shared region, also where
        an IPU process of ``dev`` runs as another user (a daemon's), which cannot open
        this process's snapshot of the file (``/proc/<pid>/fd/``)."""
        if not (self._weights_len and self._settings.prepack
                and isinstance(self._exe, memoryview)):
            return None
        if dev is not None and not _same_user(dev.pids()):
            return None
        view = self._exe[self._weights_at:self._weights_at + self._weights_len]
        span = popef_file_span(view)
        if span is None:
            return None
        # the file as this process read (and checks) it: an IPU process that finds it so
        # need not checksum the weights again
        return WeightsFile(span[0], span[1], self._weights_len,
                           tuple(popef_file_identity(view) or ()))

    def _share_weights(self, dev: Device | None = None) -> None:
        """Hold the region of the executable's weights (made if this process has none)."""
        if self._weights is None and self._weights_len and self._weights_file(dev) is None:
            check_fits(self._header.name, self._weights_len, self.memory_per_replica(), 1,
                       bool(self._settings.prepack),
                       held=is_shared(self._exe, self._weights_at, self._weights_len))
            self._weights = shared_weights(self._exe, self._weights_at, self._weights_len)

    def memory_per_replica(self) -> int:
        """Internal (ModelRunner): bytes of /dev/shm a session of this model takes besides
        its weights and rings (its executable and device memory regions)."""
        return self._weights_at + max(64, self._header.memory_bytes)

    def weights_bytes(self) -> int:
        """Internal (ModelRunner): bytes of the executable's weights section (0: none)."""
        return self._weights_len

    def _load_sharded(self, dev: Device, modes: list[int], fresh: bool) -> bool:
        """A multi-IPU executable: each IPU of the device gets its part (host_runtime.devices._ipu_group)."""
        if self._sharded is None:
            self._sharded = ShardedLoad.of(self._exe, self._key)
            if self._sharded is None:
                return False
        rings = self._streams.rings
        self._sharded.load(dev.link, self._streams.load_spec(modes),
                           self._config.check_package_hash, fresh, self._settings.load_timeout,
                           lambda h, pid: rings[h].set_peer(pid),
                           [self._fault_table.name] if self._fault_table is not None else None,
                           self._constants.spec() if self._constants is not None else None)
        self._modes_sent = modes
        self._loaded = True
        self._need_load_programs = True
        self._load_ran = False
        return True

    def _send_modes(self, dev: Device) -> None:
        modes = self._streams.modes()
        if modes != self._modes_sent:
            dev.link.notify(Op.MODES, modes)
            self._modes_sent = modes

    # -- running --------------------------------------------------------------------------------------

    def _run(self, progs: list[int], what: str, phase: str | None) -> None:
        dev = self._require_device()
        with dev.lock:
            self._activate()
            self._check_runnable()
            if phase == "main" and self._need_load_programs:
                self._run_checked(dev, self._flow.load(), "load programs")
                self._need_load_programs = False
                self._load_ran = True
            self._run_checked(dev, progs, what)
            if phase == "load":
                self._need_load_programs = False
                self._load_ran = True

    def _check_runnable(self) -> None:
        if self._stopped:
            raise InvalidStateError("the session is stopped; call reload() before running programs")
        if self._direct.loop_running():
            raise InvalidStateError("the main loop is running; stop() it before running programs")

    def _prepare_main(self, dev: Device) -> list[int]:
        """Before the main loop (DirectStreams.start_main_loop, device lock held): activate,
        check runnable, run the load programs if this binding has not, check the Main
        anchors are connected, send the modes; the Main programs."""
        self._activate()
        self._check_runnable()
        main = self._flow.main()
        if not main:
            raise InvalidStateError("the model has no main programs")
        if self._need_load_programs:
            self._run_checked(dev, self._flow.load(), "load programs")
            self._need_load_programs = False
            self._load_ran = True
        self.errorIfAnchorsAreNotConnectedToCallbacks(main)
        self._sync_constants(main)
        self._send_modes(dev)
        return list(main)

    def _run_checked(self, dev: Device, progs: list[int], what: str) -> None:
        if not progs:
            return
        self.errorIfAnchorsAreNotConnectedToCallbacks(progs)
        self._request_run(dev, progs, what)

    def _request_run(self, dev: Device, progs: list[int], what: str) -> None:
        if self._abandoned is not None:
            self._finish_abandoned(dev)
        self._sync_constants(progs)
        self._send_modes(dev)
        self._streams.clear_callback_errors()
        fut = dev.link.request(Op.RUN, list(progs))
        try:
            wait(fut, None, f"{what} on {dev.describe()}", pids=dev.pids(),
                 progress=lambda: dev.link.progress,
                 sync=dev.link.sync_timeout)
        except ModelRuntimeError as exc:
            if not isinstance(exc, DeviceExecutionError):
                raise
            new = self._streams.with_callback_error(exc, what)
            if new is exc:
                raise
            raise new from new.__cause__
        except BaseException:
            # Abandoned (KeyboardInterrupt, a signal handler's exception): the run goes on
            # on the device, its callbacks are called as for any run; the next run waits
            # for it, so that its callbacks' errors are not taken for the next one's.
            self._abandoned = (fut, what)
            raise
        failed = self._streams.take_callback_error()
        if failed is not None:
            raise callback_failure(what, *failed)

    def _finish_abandoned(self, dev: Device) -> None:
        """Wait for the run a caller abandoned (see _request_run); its outcome, which nobody
        waits for any more, is logged (an interrupt of this wait leaves it to the next)."""
        assert self._abandoned is not None
        fut, what = self._abandoned
        try:
            wait(fut, None, f"{what} (abandoned) on {dev.describe()}", pids=dev.pids(),
                 progress=lambda: dev.link.progress, sync=dev.link.sync_timeout)
        except ModelRuntimeError as exc:
            self._abandoned = None
            if not isinstance(exc, DeviceExecutionError):
                raise
            _log.info("an abandoned run of %s failed: %s", what, exc)
        self._abandoned = None
        failed = self._streams.take_callback_error()
        if failed is not None:
            _log.info("an abandoned run of %s: the callback of anchor %r raised %r", what,
                      *failed)


def _weights_span(exe: bytes | memoryview, header: ExecutableHeader) -> tuple[int, int]:
    """(offset, length) of the executable's weights section ((len, 0): none)."""
    if header.num_ipus > 1:
        return len(exe), 0   # a multi-IPU executable's parts carry their own weights
    try:
        return weights_span(exe)
    except ExecutableError as exc:
        raise PopefError(f"executable {header.name!r}: {exc}") from exc


def _same_user(pids: list[int]) -> bool:
    """Whether every process of ``pids`` runs as this process's user (None known: yes)."""
    uid = os.getuid()
    for pid in pids:
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                return False
        except OSError:
            continue
    return True
