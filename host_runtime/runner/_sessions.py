"""How a ``ModelRunner``'s replicas get their sessions: devices attached (all or none),
sessions opened with their direct anchors claimed, ring depths, the save programs.

:class:`ReplicaSessions` holds the model, the runner's config and layout, never the
runner: a replica restarted by ``auto_reset`` opens its new session here.
"""

from __future__ import annotations

import functools
from typing import Optional

import numpy as np

from host_runtime import popef
from host_runtime.devices import Device, DeviceManager, DeviceWaitConfig, paced_by_requests
from host_runtime.memory import OutputMemoryView, TensorMemory
from host_runtime.queues import RingSizeMultiplierProdType, ring_size_multiplier_factory
from host_runtime.runner._intake import RequestIntake
from host_runtime.runner._layout import ModelLayout
from host_runtime.runner._read_order import unnumbered_outputs_of
from host_runtime.runner._life import ReplicaSession, SaveFn
from host_runtime.runner._replica import ReplicaSetup
from host_runtime.runner._transfer import PathOptions
from host_runtime.runner.config import ModelRunnerConfig
from host_runtime.runner.monitoring import RequestMonitor
from host_runtime.session import LaunchPolicy, Session, SessionConfig, check_model_fits
from host_runtime.session.predicates import PopefDataUsagePolicy
from host_runtime.settings import HostSettings

__all__ = ["ReplicaSessions"]

_MAX = 2**63 - 1
_FLOOR_SLOTS = 8
"""Slots a Main anchor's ring gets at least where they fit in ``_FLOOR_BYTES``."""
_FLOOR_BYTES = 4 << 20


class ReplicaSessions:
    """Sessions for the replicas of one runner (see the module docstring)."""

    def __init__(self, model: popef.Model, cfg: ModelRunnerConfig, layout: ModelLayout,
                 settings: HostSettings) -> None:
        self._model = model
        self._settings = settings   # the runner's (taken when it was made)
        self._config = cfg
        self._layout = layout
        self._attached: dict[int, Device] = {}
        # a model that /dev/shm or memory cannot hold in every replica: refused before any
        # device is attached or process started (SharedMemoryFullError with the sizes)
        check_model_fits(model, cfg.replication_factor, bool(settings.prepack))
        # frozen inputs held once in shared memory, not written with each request: those
        # of the Load program, and those of Main while Main still streams some input on
        # every iteration (else its loop would not wait for requests); on several IPUs,
        # while each IPU that reads one still waits for each request (paced_by_requests)
        streamed = [a for a in layout.main_inputs if a.name() not in layout.frozen]
        frozen_main = [n for n in layout.frozen if n not in layout.frozen_load]
        if streamed and frozen_main and model.metadata.numIpus() > 1:
            handles = {a.name(): a.handle() for a in model.metadata.anchors()}
            flow = model.metadata.programFlow()
            if not paced_by_requests(model.executable.payload(), flow.main(),
                                     [handles[n] for n in frozen_main],
                                     [a.handle() for a in streamed]):
                streamed = []
        self._shared_frozen = {n: v for n, v in layout.frozen.items()
                               if n in layout.frozen_load or streamed}
        if not cfg.replica_to_device and not HostSettings.read("daemon"):
            # IPU processes of our own (not a daemon's): their template starts now
            DeviceManager(settings=settings).prepare_launch()

    def remember_frozen(self, values: dict[str, np.ndarray]) -> None:
        """New values of inputs only the Load programs read: sessions opened from now on
        (a replica restarted by ``auto_reset``) feed these."""
        self._shared_frozen.update(values)

    def release_unadopted(self) -> None:
        """Close the devices attached for replicas that did not take them (a failed start)."""
        for dev in self._attached.values():
            dev.close()
        self._attached.clear()

    def setup(self, rid: int, monitor: RequestMonitor, intake: RequestIntake) -> ReplicaSetup:
        """What replica ``rid`` is told."""
        cfg = self._config
        lay = self._layout
        direct_in = {n: spec for n, spec in lay.direct_inputs().items()
                     if n not in self._shared_frozen}
        flush_ns: Optional[int]
        if cfg.is_batch_size_timeout_enabled:
            flush_ns = cfg.batch_size_timeout_ns
            if cfg.replication_factor > 1:
                flush_ns = min(flush_ns, cfg.data_parallel_timeout_ns)
        else:
            flush_ns = cfg.timeout_ns or None
        if flush_ns is not None and flush_ns >= _MAX:
            flush_ns = None
        return ReplicaSetup(
            replica_id=rid, inputs=direct_in, outputs=dict(lay.out_specs),
            frozen_main={n: v for n, v in lay.frozen.items() if n in direct_in},
            dynamic=lay.dynamic, batch=lay.batch, timeout_ns=cfg.timeout_ns,
            partial_flush_ns=flush_ns, flush_callback=cfg.flush_callback,
            auto_reset=cfg.auto_reset, monitor=monitor,
            open_session=functools.partial(self.open_session, rid),
            watchdog=not cfg.flush_on_waiting_outputs,
            intake=intake,
            options=PathOptions.of(self._settings),
            settings=self._settings,
            unnumbered=unnumbered_outputs_of(self._model, lay.out_specs, {
                spec.handle for spec in direct_in.values()}))

    def attach_devices(self) -> None:
        """Attach the devices of every replica that has none in replica_to_device at once.

        All or none: a runner that held some replicas' IPUs while waiting for the others
        could deadlock with another runner doing the same. Each replica's session then
        adopts its device (and releases it on close); a replica restarted by auto_reset
        attaches a fresh device on its own."""
        cfg = self._config
        need = [r for r in range(cfg.replication_factor)
                if cfg.replica_to_device.get(r) is None]
        if len(need) < 2:
            return
        devices = DeviceManager(settings=self._settings).get_devices_all_or_none(
            self._model, len(need), cfg.device_wait_config or DeviceWaitConfig())
        self._attached = dict(zip(need, devices))

    def open_session(self, rid: int) -> ReplicaSession:
        """A session for replica ``rid``, its direct anchors claimed (a ``Session``; typed
        as what the replica uses of it, which mypy checks ``Session`` provides)."""
        cfg = self._config
        frozen = self._layout.frozen     # whatever else would feed them (PopEF data too)
        pred = None
        if frozen:
            def pred(anchor: popef.Anchor) -> PopefDataUsagePolicy:
                return (PopefDataUsagePolicy.USE_USER_DATA if anchor.name() in frozen
                        else PopefDataUsagePolicy.USE_POPEF_DATA_IF_ANY)
        sc = SessionConfig(policy=LaunchPolicy.Deferred, pred_tensor_data=pred,
                           check_package_hash=bool(cfg.check_package_hash),
                           wait_config=cfg.device_wait_config or DeviceWaitConfig(),
                           max_look_ahead=cfg.max_look_ahead,
                           ring_depth=self.ring_depths(), settings=self._settings)
        s = Session(self._model, sc)
        try:
            for name, value in self._shared_frozen.items():
                anchor = self._model.metadata.anchor(name)
                assert anchor is not None   # checked by ModelLayout
                # one copy in shared memory for every replica (host_runtime.session._constants)
                s.freeze_input(anchor.handle(), memoryview(value).cast("B"))  # type: ignore[arg-type]
            device = cfg.replica_to_device.get(rid)
            if device is not None and device.isAttached():
                s.bindToDevice(device)
            elif rid in self._attached:
                dev = self._attached.pop(rid)
                try:
                    s.adopt_device(dev)
                except BaseException:
                    dev.close()
                    raise
            for spec in (*self._layout.in_specs.values(), *self._layout.out_specs.values()):
                if spec.name not in self._shared_frozen:
                    s.direct.claim(spec.handle)
        except BaseException:
            s.close()
            raise
        return s

    def ring_depths(self) -> RingSizeMultiplierProdType:
        """Slots of the session's stream rings (seed: ring size = multiplier x batch size).

        The seed's ring holds references to user samples; here a slot of a Main anchor's
        ring holds one whole transfer: the model's batch of samples (along ``batching_dim``
        when set), in shared memory. So a Main ring of ``ring_buffer_size_multiplier``
        slots holds multiplier x batch size samples, as the seed says, without the memory
        of a slot per sample. That is the least a Main ring holds: a slot here is also the
        device's memory for a transfer in flight (the IPU process computes in place, and
        the host reads outputs in place), so where transfers are small the Main rings get
        up to ``_FLOOR_SLOTS`` slots, as many as the largest transfer fits in
        ``_FLOOR_BYTES``, enough that the host and the device do not wait for each other's
        every step (docs/design.md section 10). Load/save
        anchors move once per program run: 2. The session caps Main rings at
        ``max_look_ahead + 1`` when that is a number (no more transfers prepared ahead than
        that option allows; ``"0"``: one slot) and every ring at 1024 slots and 64 MiB."""
        multiplier = self._config.ring_buffer_size_multiplier
        main = frozenset(self._model.metadata.programFlow().main())
        sizes = [a.tensorInfo().sizeInBytes() for a in self._model.metadata.anchors()
                 if main.intersection(a.programs())]
        # one depth for every Main ring, from the largest transfer: the rings stay in step,
        # so the IPU process binds each slot once (a slot's address is part of a binding)
        floor = min(_FLOOR_SLOTS, _FLOOR_BYTES // max(1, *sizes))
        return ring_size_multiplier_factory.ringSizeMultForMainProgs(
            self._model, max(multiplier, floor), 2)

    def saver(self, rid: int) -> SaveFn | None:
        """Runs the save programs of replica ``rid`` into the config's outputs (None: the
        model has none)."""
        anchors = self._layout.save_outputs
        if not self._layout.has_save_programs:
            return None
        store = self._config.replica_to_save_programs_outputs

        def save(session: ReplicaSession) -> None:
            outs = store.get(rid)
            if outs is None:
                outs = store[rid] = OutputMemoryView()
            for a in anchors:
                dest = outs.get(a.name())
                if dest is None:
                    info = a.tensorInfo()
                    dest = TensorMemory.allocate(info.shape(), info.numpyDType())
                    outs[a.name()] = dest
                flat = np.asarray(dest).reshape(-1).view(np.uint8)

                def cb(view: memoryview, _flat: np.ndarray = flat) -> None:
                    _flat[:len(view)] = np.frombuffer(view, np.uint8)
                session.setCallbackForAnchor(a.handle(), cb)
            session.runSavePrograms()
        return save

