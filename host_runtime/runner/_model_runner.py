"""``ModelRunner``: load a PopEF model on emulated IPUs and run requests (seeds 000, 001, 002).

A runner owns one ``Session`` per replica (each on its own device, Main
running in a device-side loop; see ``_replica``). This module is the API
surface: it checks every request before anything is sent (names, shapes,
dtypes, sizes, batch sizes, replica ids -> ``BadRequestError`` that names the
tensor, what was expected and what was given; the runner stays usable),
allocates or borrows output memory, and returns results the way the seeds'
listings read them.

Results:

- ``execute(InputMemoryView)`` -> ``OutputMemory`` (name -> ``TensorMemory``;
  ``np.frombuffer(result[name], dtype)`` works);
- ``execute(dict of numpy)`` -> dict of numpy arrays;
- ``execute(inputs, outputs)`` writes into the caller's memory, returns None;
- ``executeAsync(...)`` -> ``OutputFuture`` (``wait()``, ``future[name]``).
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Iterable, Mapping, NoReturn, Optional

import numpy as np

from host_runtime import popef
from host_runtime._fork import check_owner, current_pid, foreign
from host_runtime._lifetime import close_owned, weak_method
from host_runtime.devices import Device, DeviceManager, DeviceWaitConfig
from host_runtime.settings import HostSettings
from host_runtime.errors import BadRequestError, InvalidStateError
from host_runtime.memory import (InputMemoryView, OutputMemory, OutputMemoryView,
                                        PopefPaths, TensorMemory, TensorMemoryView,
                                        as_readable_array, as_writable_array, check_owned)
from host_runtime.popef import check_model
from host_runtime.queues import RingSizeMultiplierProdType, ring_size_multiplier_factory
from host_runtime.runner._batching import TensorSpec
from host_runtime.runner._read_order import main_read_order
from host_runtime.runner._replica import Replica, ReplicaSession, ReplicaSetup, SaveFn
from host_runtime.runner._requests import OutputFuture, Request, raisable
from host_runtime.runner.config import DataDesc, ModelRunnerConfig
from host_runtime.runner.monitoring import RequestMonitor
from host_runtime.session import LaunchPolicy, Session, SessionConfig
from host_runtime.session.predicates import PopefDataUsagePolicy

if TYPE_CHECKING:  # pragma: no cover
    # host_runtime.runner.runner_metrics imports prometheus_client (~60 ms): metrics_collector()
    # imports it on first use. It does not import this module (see MonitoredRunner).
    from host_runtime.runner.runner_metrics import ModelRunnerCollector

__all__ = ["ModelRunner", "OutputFuture"]

_log = logging.getLogger(__name__)

INDEX_NAME = "index"
_MAX = 2**63 - 1

_live_runners: "weakref.WeakSet[ModelRunner]" = weakref.WeakSet()
_atexit_registered = False


def _close_live_runners() -> None:
    """At exit, close runners the program did not close (the seeds' listings never do),
    before the device manager's own exit hook stops their devices underneath them."""
    close_owned(_live_runners, lambda r: r._owner_pid)


def _register_exit_hook() -> None:
    # atexit runs hooks last-registered-first: registering after host_runtime.devices._manager
    # was imported (by the first session) makes this one run before the devices' hook.
    global _atexit_registered
    if not _atexit_registered:
        _atexit_registered = True
        atexit.register(_close_live_runners)


def _gone() -> NoReturn:
    raise InvalidStateError("the ModelRunner was dropped")


def _load_model(source: Any) -> popef.Model:
    if isinstance(source, popef.Model):
        check_model(source)   # the rules of ipu_emulator.validate (once per Model)
        return source
    if isinstance(source, (str, os.PathLike)):
        paths = [os.fspath(source)]
    elif isinstance(source, (list, tuple)):
        paths = [os.fspath(p) for p in source]
    else:
        raise BadRequestError(
            "ModelRunner expects a PopEF path, a list of paths, PopefPaths or a popef.Model, "
            f"got {type(source).__name__}")
    if not paths:
        raise BadRequestError("ModelRunner needs at least one PopEF file, got an empty list")
    model = popef.load_model(paths)
    check_model(model)
    return model


def _desc(a: popef.Anchor, contains: bool = False) -> DataDesc:
    info = a.tensorInfo()
    return DataDesc(a.name(), info.sizeInBytes(), info.shape(), info.dataType(), contains)


class ModelRunner:
    """Inference on a PopEF model: ``execute`` / ``executeAsync`` with the seeds' semantics."""

    def __init__(self, model: Any, config: Optional[ModelRunnerConfig] = None) -> None:
        self._replicas: list[Replica] = []
        self._closed = True
        self._owner_pid = current_pid()   # fork: see host_runtime._fork
        cfg = config if config is not None else ModelRunnerConfig()
        if not isinstance(cfg, ModelRunnerConfig):
            raise BadRequestError(f"config must be a ModelRunnerConfig, got {type(cfg).__name__}")
        cfg.validate()
        # the settings now (environment, override blocks): the runner keeps them for its life
        self._settings = HostSettings.current()
        self._config = cfg.copy()
        # The caller reads the save programs' outputs from its own dict after close().
        self._config.replica_to_save_programs_outputs = cfg.replica_to_save_programs_outputs
        self._model = _load_model(model)
        # thread_safe: one mutex per replica, held for each execute/executeAsync call
        self._call_locks: list[threading.RLock] = (
            [threading.RLock() for _ in range(cfg.replication_factor)] if cfg.thread_safe else [])
        self._classify()
        self._monitors = [RequestMonitor(cfg.request_tracepoints_buffer_size)
                          for _ in range(cfg.replication_factor)]
        self._closed = False
        self._attached: dict[int, Device] = {}
        try:
            self._attach_devices()
            for r in range(cfg.replication_factor):
                self._replicas.append(Replica(self._setup(r)))
        except BaseException:
            self.close()
            raise
        finally:
            for dev in self._attached.values():   # not taken by a session: ours to release
                dev.close()
            self._attached.clear()
        _live_runners.add(self)
        _register_exit_hook()

    # ================================================================== model layout
    def _classify(self) -> None:
        cfg = self._config
        md = self._model.metadata
        flow = md.programFlow()
        main, load, save = set(flow.main()), set(flow.load()), set(flow.save())
        with_data = {t.anchor for t in self._model.tensors} | {f.anchor for f in self._model.feeds}
        anchors = md.anchors()
        self._inputs_all = [a for a in anchors if a.type() == popef.TensorType.INPUT]
        self._outputs_all = [a for a in anchors if a.type() == popef.TensorType.OUTPUT]
        by_name = {a.name(): a for a in anchors}
        self._with_data = with_data

        def in_main(a: popef.Anchor) -> bool:
            return bool(main.intersection(a.programs()))

        # frozen inputs: typed, exact model shape
        self._frozen: dict[str, np.ndarray] = {}
        for name, value in cfg.frozen_inputs.items():
            a = by_name.get(name)
            if a is None or a.type() != popef.TensorType.INPUT:
                raise BadRequestError(
                    f"ModelRunnerConfig.frozen_inputs: the model has no input {name!r}; expected "
                    "one of " + ", ".join(repr(x.name()) for x in self._inputs_all))
            spec = self._spec(a, None, True)
            arr = as_readable_array(value, name)
            spec.samples_of(arr)   # exact shape / size check
            self._frozen[name] = np.ascontiguousarray(spec.typed(arr, spec.batch))
        self._frozen_load = {n: v for n, v in self._frozen.items() if not in_main(by_name[n])}
        for a in self._inputs_all:
            if a.name() in self._frozen or a.name() in with_data:
                continue
            if load.intersection(a.programs()) and not in_main(a):
                raise BadRequestError(
                    f"input {a.name()!r} of the load program has no tensor data in the PopEF "
                    "file; give its value in ModelRunnerConfig.frozen_inputs")

        # the anchors a request may carry, and the layout of batches
        batch_dim: Optional[int] = cfg.batching_dim if cfg.batching_enabled else 0
        self._dynamic = cfg.batching_enabled
        self._main_inputs = [a for a in self._inputs_all
                             if in_main(a) and a.name() not in with_data]
        self._exec_inputs = [a for a in self._main_inputs if a.name() not in self._frozen]
        self._main_outputs = [a for a in self._outputs_all if in_main(a)]
        self._fused = bool(md.subgraphs()) and by_name.get(INDEX_NAME) is not None
        self._in_specs = {a.name(): self._spec(a, batch_dim, True) for a in self._main_inputs}
        # the order Main reads its inputs: the device waits for the first one missing
        self._read_rank = {n: k for k, n in enumerate(main_read_order(self._model))}
        self._out_specs = {a.name(): self._spec(a, batch_dim, False) for a in self._main_outputs}
        self._exec_specs = {a.name(): self._in_specs[a.name()] for a in self._exec_inputs}
        self._all_outputs = tuple(self._out_specs.values())
        # The common request (see _build_plain): whole-batch tensors of the model's
        # dtype and shape for every execute input, outputs allocated by the runner.
        self._plain_ok = not self._dynamic and not self._fused
        self._plain_outputs = [(s.name, s.shape_for(s.batch), s.dtype) for s in self._all_outputs]
        self._plain_transfers = [self._all_outputs]
        if self._dynamic:
            self._batch = self._check_dynamic(cfg.batching_dim)
        else:
            self._batch = 1
        # fused models: what each sub-graph reads and writes
        self._sub_inputs: list[list[str]] = []
        self._sub_outputs: list[tuple[TensorSpec, ...]] = []
        if self._fused:
            subs = md.subgraphs()
            k = 0
            while f"graph{k}" in subs:
                members = set(subs[f"graph{k}"])
                self._sub_inputs.append([n for n in self._in_specs if n in members])
                self._sub_outputs.append(tuple(s for n, s in self._out_specs.items()
                                               if n in members))
                k += 1
        # save programs: where their outputs go
        self._save_outputs = [a for a in self._outputs_all if save.intersection(a.programs())]
        for rid, view in cfg.replica_to_save_programs_outputs.items():
            known = {a.name(): a for a in self._save_outputs}
            for name, mem in dict(view).items():
                a = known.get(name)
                if a is None:
                    raise BadRequestError(
                        f"ModelRunnerConfig.replica_to_save_programs_outputs[{rid}]: {name!r} is "
                        "not an output of the save programs; expected one of "
                        + (", ".join(repr(n) for n in known) or "(none)"))
                arr = as_writable_array(mem, name)
                if arr.nbytes < a.tensorInfo().sizeInBytes():
                    raise BadRequestError(
                        f"save output {name!r} of replica {rid}: expected at least "
                        f"{a.tensorInfo().sizeInBytes()} bytes, got {arr.nbytes}")

    def _spec(self, a: popef.Anchor, batch_dim: Optional[int], is_input: bool) -> TensorSpec:
        info = a.tensorInfo()
        bd = batch_dim
        if (a.name() == INDEX_NAME and self._config.batching_enabled) or not info.shape():
            bd = None     # scalars, and a fused model's index under dynamic batching
        return TensorSpec(a.name(), a.handle(), tuple(info.shape()), info.numpyDType(),
                          is_input, bd, self._config.batching_enabled and bd is not None)

    def _check_dynamic(self, dim: int) -> int:
        specs = [s for s in (*self._in_specs.values(), *self._out_specs.values())
                 if s.name != INDEX_NAME]
        batches = set()
        for s in specs:
            if s.batch_dim is None:
                raise BadRequestError(
                    f"batching_dim={dim}: tensor {s.name!r} has shape {list(s.shape)}, which has "
                    f"no dimension {dim}; expected every input and output to have it")
            batches.add(s.batch)
        if len(batches) > 1:
            detail = ", ".join(f"{s.name} {list(s.shape)}" for s in specs)
            raise BadRequestError(f"batching_dim={dim}: the tensors disagree on the batch size "
                                  f"along dimension {dim}: {detail}")
        return batches.pop() if batches else 1

    # ================================================================== replicas
    def _setup(self, rid: int) -> ReplicaSetup:
        cfg = self._config
        direct_in = {n: self._in_specs[n] for n in self._by_read_order(self._in_specs)}
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
            replica_id=rid, inputs=direct_in, outputs=dict(self._out_specs),
            frozen_main={n: v for n, v in self._frozen.items() if n in direct_in},
            dynamic=self._dynamic, batch=self._batch, timeout_ns=cfg.timeout_ns,
            partial_flush_ns=flush_ns, flush_callback=cfg.flush_callback,
            auto_reset=cfg.auto_reset, monitor=self._monitors[rid],
            open_session=functools.partial(weak_method(self._open_session, _gone), rid),
            watchdog=not cfg.flush_on_waiting_outputs,
            make_flush_request=functools.partial(weak_method(self._flush_request), rid),
            merge_phantom=weak_method(self._merge_phantom), settings=self._settings)

    def _attach_devices(self) -> None:
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
        devices = DeviceManager(settings=self._settings)._getDevices(
            self._model, len(need), cfg.device_wait_config or DeviceWaitConfig())
        self._attached = dict(zip(need, devices))

    def _open_session(self, rid: int) -> ReplicaSession:
        """A session for replica ``rid``, its direct anchors claimed (a ``Session``; typed
        as what the replica uses of it, which mypy checks ``Session`` provides)."""
        cfg = self._config
        frozen_load = self._frozen_load
        pred = None
        if frozen_load:
            def pred(anchor: popef.Anchor) -> PopefDataUsagePolicy:
                return (PopefDataUsagePolicy.USE_USER_DATA if anchor.name() in frozen_load
                        else PopefDataUsagePolicy.USE_POPEF_DATA_IF_ANY)
        sc = SessionConfig(policy=LaunchPolicy.Deferred, pred_tensor_data=pred,
                           check_package_hash=bool(cfg.check_package_hash),
                           wait_config=cfg.device_wait_config or DeviceWaitConfig(),
                           max_look_ahead=cfg.max_look_ahead,
                           ring_depth=self._ring_depths(), settings=self._settings)
        s = Session(self._model, sc)
        try:
            for name, value in frozen_load.items():
                data = memoryview(value).cast("B")  # type: ignore[arg-type]

                def feed(view: memoryview, _d: memoryview = data) -> None:
                    view[:len(_d)] = _d
                anchor = self._model.metadata.anchor(name)
                assert anchor is not None   # checked in _classify
                s.setCallbackForAnchor(anchor.handle(), feed)
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
            for spec in (*self._in_specs.values(), *self._out_specs.values()):
                s.direct.claim(spec.handle)
        except BaseException:
            s.close()
            raise
        return s

    def _ring_depths(self) -> RingSizeMultiplierProdType:
        """Slots of the session's stream rings (seed: ring size = multiplier x batch size).

        The seed's ring holds references to user samples; here a slot of a Main anchor's
        ring holds one whole transfer: the model's batch of samples (along ``batching_dim``
        when set), in shared memory. So a Main ring of ``ring_buffer_size_multiplier``
        slots holds multiplier x batch size samples, as the seed says, without the memory
        of a slot per sample. No floor: one slot still makes progress (a submitter that
        finds a ring full drains outputs). Load/save anchors move once per program run: 2.
        The session caps Main rings at ``max_look_ahead + 1`` when that is a number (no
        more transfers prepared ahead than that option allows) and every ring at 1024 slots
        and 64 MiB (at least one slot)."""
        main = self._config.ring_buffer_size_multiplier
        return ring_size_multiplier_factory.ringSizeMultForMainProgs(self._model, main, 2)

    def _replica(self, replica_id: Any) -> Replica:
        if self._closed:
            raise InvalidStateError("the ModelRunner is closed")
        if isinstance(replica_id, bool) or not isinstance(replica_id, (int, np.integer)):
            raise BadRequestError(f"replica_id must be an int, got {replica_id!r}")
        n = len(self._replicas)
        if not 0 <= replica_id < n:
            raise BadRequestError(f"replica_id {replica_id} is out of range; expected 0..{n - 1} "
                                  f"(replication_factor is {n})")
        return self._replicas[replica_id]

    # ================================================================== requests
    def _build(self, rep: Replica, inputs: Any, outputs: Any, t0: int, internal: bool = False
               ) -> tuple[Request, int, Optional[str], bool]:
        """Check a request and make it; returns (request, transfers, phantom tensor, view-mode)."""
        if type(inputs) is not dict and not isinstance(inputs, Mapping):
            raise BadRequestError(f"inputs must be an InputMemoryView or a dict of name -> array, "
                                  f"got {type(inputs).__name__}")
        view_mode = isinstance(inputs, InputMemoryView)
        validate = self._config.validate_io_params and not internal
        dynamic = self._dynamic
        specs = self._exec_specs
        given: dict[str, np.ndarray] = {}
        counts: dict[str, int] = {}
        for name, value in inputs.items():
            spec = specs.get(name)
            if spec is None:
                if name in self._frozen:
                    continue   # seed: a frozen input is no longer required; the frozen value wins
                raise self._unknown_input(name)
            arr = value if type(value) is np.ndarray else as_readable_array(value, name)
            if arr.dtype == spec.dtype and arr.shape == spec.shape:
                given[name] = arr
                counts[name] = 1 if not dynamic else spec.batch
                continue
            samples = spec.samples_of(arr)
            given[name] = spec.typed(arr, samples)
            if spec.batch_dim is None:
                counts[name] = 1 if not dynamic else -1
            else:
                counts[name] = samples if dynamic else samples // spec.batch
        if validate and len(given) != len(specs):
            missing = [n for n in specs if n not in given]
            raise BadRequestError(
                "missing input tensor(s) " + ", ".join(repr(n) for n in missing)
                + "; the model's execute inputs are " + ", ".join(repr(n) for n in specs)
                + " (set validate_io_params = False to give only some of them)")
        units = {v for v in counts.values() if v != -1}
        if len(units) > 1:
            what = "samples" if dynamic else "transfers of the model's batch"
            detail = ", ".join(f"{k} has {v}" for k, v in counts.items() if v != -1)
            raise BadRequestError(f"the request's tensors disagree on the batch size ({what}): "
                                  f"{detail}")
        n_units = units.pop() if units else 1
        transfers = 1 if dynamic else n_units     # dynamic: packed by the replica
        samples = n_units

        # what the device reads and writes, transfer by transfer
        publish, per_transfer, phantom = self._plan(given, transfers)

        # outputs
        dests: dict[str, Optional[np.ndarray]] = {}
        results: dict[str, Any] = {}
        produced: dict[str, TensorSpec] = {}
        for outs in per_transfer:
            for s in outs:
                produced[s.name] = s
        if outputs is None:
            for name, s in produced.items():
                mem = TensorMemory.allocate(s.shape_for(self._out_samples(s, n_units)), s.dtype)
                dests[name] = mem
                results[name] = mem
        else:
            if type(outputs) is not dict and not isinstance(outputs, Mapping):
                raise BadRequestError(f"outputs must be an OutputMemoryView or a dict of name -> "
                                      f"array, got {type(outputs).__name__}")
            for name, value in outputs.items():
                found = self._out_specs.get(name)
                if found is None:
                    raise BadRequestError(
                        f"unknown output tensor {name!r}; the model's execute outputs are "
                        + ", ".join(repr(n) for n in self._out_specs))
                s = found
                arr = as_writable_array(value, name)
                want = self._out_samples(s, n_units)
                shape = s.shape_for(want)
                if arr.dtype == s.dtype and tuple(arr.shape) == shape:
                    typed = arr
                else:
                    typed = self._check_output(s, arr, shape)
                dests[name] = typed
                results[name] = typed.view(TensorMemoryView)
            if validate:
                missing = [n for n in self._out_specs if n not in dests]
                if missing:
                    raise BadRequestError(
                        "missing output tensor(s) " + ", ".join(repr(n) for n in missing)
                        + "; give memory for every output: " + ", ".join(
                            repr(n) for n in self._out_specs))
        req = Request(rep, rep.rid, samples, publish, dests, results, per_transfer, t0,
                      internal=internal, given=given)
        return req, transfers, phantom, view_mode

    def _build_plain(self, rep: Replica, inputs: Any, outputs: Any, t0: int,
                     plain_results: bool) -> Optional[Request]:
        """``_build`` for the common request, or None when ``inputs`` is not one.

        The common request: a plain dict holding exactly the model's execute
        inputs, each an ndarray of the input's dtype and whole shape; outputs
        allocated by the runner (``plain_results``: as plain ndarrays, for
        ``execute``; else as TensorMemory, for futures). Anything else takes
        ``_build``, which checks and reports it.
        """
        if not self._is_plain(inputs, outputs):
            return None
        given = dict(inputs)
        results: dict[str, Any] = {}
        if plain_results:
            empty = np.empty
            for name, shape, dtype in self._plain_outputs:
                results[name] = empty(shape, dtype)
        else:
            for name, shape, dtype in self._plain_outputs:
                results[name] = TensorMemory.allocate(shape, dtype)
        return Request(rep, rep.rid, 1, given, dict(results), results, self._plain_transfers, t0,
                       False, given)

    def _is_plain(self, inputs: Any, outputs: Any) -> bool:
        """Whether ``inputs`` and ``outputs`` make the common request (see _build_plain)."""
        if not self._plain_ok or outputs is not None or inputs.__class__ is not dict:
            return False
        specs = self._exec_specs
        if len(inputs) != len(specs):
            return False
        for name, value in inputs.items():
            spec = specs.get(name)
            if (spec is None or value.__class__ is not np.ndarray or value.dtype is not spec.dtype
                    or value.shape != spec.shape):
                return False
        return True

    def _out_samples(self, s: TensorSpec, n_units: int) -> int:
        if s.batch_dim is None:
            return s.batch
        return n_units if self._dynamic else n_units * s.batch

    @staticmethod
    def _check_output(s: TensorSpec, arr: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        raw = arr.dtype == np.uint8 and s.dtype != np.uint8
        need = int(np.prod(shape, dtype=np.int64)) * s.dtype.itemsize
        if raw:
            if arr.nbytes < need:
                raise BadRequestError(
                    f"output {s.name!r}: the buffer is too small; expected {need} bytes "
                    f"(shape {list(shape)}, dtype {s.dtype}), got {arr.nbytes} bytes")
            return arr.reshape(-1)[:need].view(s.dtype).reshape(shape)
        if arr.dtype != s.dtype:
            raise BadRequestError(f"output {s.name!r}: expected dtype {s.dtype}, got {arr.dtype}")
        raise BadRequestError(f"output {s.name!r}: expected shape {list(shape)} for this request, "
                              f"got shape {list(arr.shape)}")

    def _unknown_input(self, name: str) -> BadRequestError:
        return BadRequestError(
            f"unknown input tensor {name!r}; the model's execute inputs are "
            + ", ".join(repr(n) for n in self._exec_specs))

    def _by_read_order(self, names: Iterable[str]) -> list[str]:
        """``names`` in the order the Main programs read them (unread ones last)."""
        rank = self._read_rank
        return sorted(names, key=lambda n: rank.get(n, len(rank)))

    def _plan(self, given: dict[str, np.ndarray], transfers: int
              ) -> tuple[dict[str, np.ndarray], list[tuple[TensorSpec, ...]], Optional[str]]:
        """(inputs to publish, outputs written per transfer, first missing input or None)."""
        if not self._fused:
            missing = self._by_read_order(n for n in self._exec_specs if n not in given)
            return given, [self._all_outputs] * transfers, (missing[0] if missing else None)
        index = given.get(INDEX_NAME)
        if index is None:
            return {}, [()] * transfers, INDEX_NAME
        values = np.asarray(index).reshape(-1)
        per_unit = max(1, values.size // max(1, transfers))
        ks = [int(values[t * per_unit]) for t in range(transfers)]
        n_sub = len(self._sub_inputs)
        for k in ks:
            if not 0 <= k < n_sub:
                raise BadRequestError(f"input {INDEX_NAME!r}: expected a sub-graph number "
                                      f"0..{n_sub - 1}, got {k}")
        if len(set(ks)) > 1:
            raise BadRequestError(
                f"input {INDEX_NAME!r}: every transfer of one request must select the same "
                f"sub-graph, got {ks}; send one request per sub-graph")
        needed = [INDEX_NAME, *self._sub_inputs[ks[0]]]
        missing = self._by_read_order(n for n in needed
                                      if n not in given and n not in self._frozen)
        publish = {n: given[n] for n in needed if n in given}
        return publish, [self._sub_outputs[k] for k in ks], (missing[0] if missing else None)

    def _flush_request(self, rid: int, inputs: Any, outputs: Any) -> Optional[Request]:
        rep = self._replicas[rid]
        req, _t, _p, _v = self._build(rep, inputs or {}, outputs if outputs else {}, 
                                      time.perf_counter_ns(), internal=True)
        return req

    def _merge_phantom(self, req: Request, extra: Request) -> Optional[int]:
        given = dict(req.given)
        given.update(extra.given)
        transfers = len(req.outputs_per_transfer)
        publish, per_transfer, missing = self._plan(given, transfers)
        if missing is not None:
            return None
        req.given = given
        req.inputs = publish
        req.outputs_per_transfer = per_transfer
        for name, dest in extra.dests.items():
            if dest is not None:
                req.dests[name] = dest
        return transfers

    # ================================================================== the seed's API
    def execute(self, input_data: Any, output_data: Any = None, replica_id: int = 0) -> Any:
        """Run one request synchronously; see the module docstring for what it returns.

        An input frozen by ``ModelRunnerConfig.frozen_inputs`` is no longer required (seed
        000/001, frozen inputs); given anyway, it is ignored and the frozen value is used.

        In a process forked from the runner's creator: ForkedProcessError (its rings are
        the creator's), before anything is touched; also for empty_shared arrays the
        creator made."""
        check_owner(self._owner_pid, "ModelRunner")
        check_owned(input_data, output_data)
        try:
            if self._call_locks:
                lock = self._call_lock(replica_id)
                if lock is not None:
                    with lock:
                        return self._execute(input_data, output_data, replica_id)
            return self._execute(input_data, output_data, replica_id)
        except Exception as exc:
            self._record_raised(exc, replica_id)
            raise

    def _call_lock(self, replica_id: Any) -> Optional[threading.RLock]:
        locks = self._call_locks
        if locks and isinstance(replica_id, int) and 0 <= replica_id < len(locks):
            return locks[replica_id]
        return None

    def _execute(self, input_data: Any, output_data: Any, replica_id: int) -> Any:
        t0 = time.perf_counter_ns()
        reps = self._replicas   # emptied by close(): _replica() reports it
        if replica_id.__class__ is int and 0 <= replica_id < len(reps):
            rep = reps[replica_id]
        else:
            rep = self._replica(replica_id)
        if self._is_plain(input_data, output_data):
            results = rep.run_idle(input_data, t0)   # the fused path, when the replica is idle
            if results is not None:
                return results
        req = self._build_plain(rep, input_data, output_data, t0, True)
        if req is not None:
            rep.submit(req, 1, None)
            rep.wait_for(req, None)
            if req.error is not None:
                raise raisable(req.error)
            return req.results
        req, transfers, phantom, view_mode = self._build(rep, input_data, output_data, t0)
        rep.submit(req, transfers, phantom)
        rep.wait_for(req, None)
        if req.error is not None:
            raise raisable(req.error)
        if output_data is not None:
            return None
        if view_mode:
            return OutputMemory(req.results)
        return {k: v.view(np.ndarray) for k, v in req.results.items()}

    def executeAsync(self, input_data: Any, output_data: Any = None,
                     replica_id: int = 0) -> OutputFuture:
        """Queue one request; returns an ``OutputFuture`` (frozen inputs as for ``execute``)."""
        check_owner(self._owner_pid, "ModelRunner")
        check_owned(input_data, output_data)
        try:
            if self._call_locks:
                lock = self._call_lock(replica_id)
                if lock is not None:
                    with lock:
                        return self._execute_async(input_data, output_data, replica_id)
            return self._execute_async(input_data, output_data, replica_id)
        except Exception as exc:
            self._record_raised(exc, replica_id)
            raise

    def _record_raised(self, exc: BaseException, replica_id: Any) -> None:
        """Count an error execute/executeAsync raises (metrics: errors by class)."""
        monitors = getattr(self, "_monitors", ())
        if isinstance(replica_id, (int, np.integer)) and 0 <= replica_id < len(monitors):
            monitors[replica_id].record_raised(exc)

    def _execute_async(self, input_data: Any, output_data: Any, replica_id: int) -> OutputFuture:
        t0 = time.perf_counter_ns()
        reps = self._replicas   # emptied by close(): _replica() reports it
        if replica_id.__class__ is int and 0 <= replica_id < len(reps):
            rep = reps[replica_id]
        else:
            rep = self._replica(replica_id)
        req = self._build_plain(rep, input_data, output_data, t0, False)
        if req is not None:
            transfers, phantom = 1, None
        else:
            req, transfers, phantom, _ = self._build(rep, input_data, output_data, t0)
        req.description = f"request to replica {replica_id}"
        rep.submit(req, transfers, phantom)
        return OutputFuture(req)

    def getExecuteInputs(self) -> list[DataDesc]:
        """Inputs each execute call needs (frozen inputs and PopEF-fed tensors excluded)."""
        return [_desc(a) for a in self._exec_inputs]

    def getExecuteOutputs(self) -> list[DataDesc]:
        return [_desc(a) for a in self._main_outputs]

    def getModelInputs(self) -> list[DataDesc]:
        """Every input of the model, including those its PopEF files carry (weights)."""
        return [_desc(a, a.name() in self._with_data) for a in self._inputs_all]

    def getModelOutputs(self) -> list[DataDesc]:
        """Every output of the model, including those of the save programs."""
        return [_desc(a) for a in self._outputs_all]

    def config(self) -> ModelRunnerConfig:
        return self._config

    @property
    def model(self) -> popef.Model:
        return self._model

    # ------------------------------------------------------------------ monitoring
    def _monitor(self, replica_id: int) -> RequestMonitor:
        if isinstance(replica_id, bool) or not isinstance(replica_id, (int, np.integer)) \
                or not 0 <= replica_id < len(self._monitors):
            raise BadRequestError(f"replica_id {replica_id!r} is out of range; expected "
                                  f"0..{len(self._monitors) - 1}")
        return self._monitors[replica_id]

    def getTimeTrace(self, time_info: Optional[dict] = None, replica_id: int = 0,  # type: ignore[type-arg]
                     cur: int = -1) -> dict:  # type: ignore[type-arg]
        """Phase durations (us) of the last request (``cur`` indexes the trace buffer)."""
        return self._monitor(replica_id).time_trace({} if time_info is None else time_info, cur)

    def getMonitoringStatisticsPercentile(self, monitoring_info: Optional[dict] = None,  # type: ignore[type-arg]
                                          quantile: float = 0.9, replica_id: int = 0) -> dict:  # type: ignore[type-arg]
        info = {} if monitoring_info is None else monitoring_info
        return self._monitor(replica_id).percentile(info, quantile)

    def getMonitoringStatisticsMean(self, monitoring_info: Optional[dict] = None,  # type: ignore[type-arg]
                                    replica_id: int = 0) -> dict:  # type: ignore[type-arg]
        info = {} if monitoring_info is None else monitoring_info
        return self._monitor(replica_id).mean(info)

    def getMonitoringStatisticsTotalCount(self, monitoring_info: Optional[dict] = None,  # type: ignore[type-arg]
                                          replica_id: int = 0) -> dict:  # type: ignore[type-arg]
        info = {} if monitoring_info is None else monitoring_info
        return self._monitor(replica_id).total_count(info)

    def metrics_collector(self, register_default: bool = False) -> "ModelRunnerCollector":
        """These statistics as a ``prometheus_client`` collector (see host_runtime.runner.runner_metrics):
        register it in your registry (``.add(other_runner)`` puts more runners in it), or
        ``register_default=True`` adds this runner to the collector registered in
        ``prometheus_client.REGISTRY``. Holds the runner weakly."""
        # Lazy: the one import of prometheus_client (~60 ms), paid by those who ask for
        # metrics (tests/unit/test_import_graph.py lists this import as LAZY).
        from host_runtime.runner.runner_metrics import collector_for
        return collector_for(self, register_default)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Unload the model and release the IPUs (running save programs if configured).

        In a process forked from the runner's creator it only marks this process's copy
        closed: the creator's runner, rings and IPUs are untouched."""
        self._close(dropped=False)

    def _close(self, dropped: bool) -> None:
        if getattr(self, "_closed", True) and not getattr(self, "_replicas", None):
            return
        if foreign(getattr(self, "_owner_pid", 0)):
            # Forked child: forget our copy (its replicas' sessions and devices do nothing
            # of the creator's when dropped here either; see host_runtime._fork).
            self._closed = True
            self._replicas = []
            return
        self._closed = True
        replicas, self._replicas = self._replicas, []
        errors: list[BaseException] = []
        for rep in replicas:
            save = self._saver(rep.rid) if self._config.run_save_programs else None
            try:
                rep.close(save, dropped)
            except Exception as exc:  # close every replica, then report
                errors.append(exc)
        if errors:
            raise errors[0]

    def _saver(self, rid: int) -> SaveFn | None:
        anchors = self._save_outputs
        flow = self._model.metadata.programFlow()
        if not flow.save():
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

    def __enter__(self) -> "ModelRunner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Dropped (reference counting runs this at once): give the IPUs back now, without
        # blocking for long on a device that does not answer (see Replica.close).
        try:
            self._close(dropped=True)
        except Exception:  # pragma: no cover - best effort at garbage collection
            pass

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._replicas)} replica(s)"
        return (f"<ModelRunner {self._model.metadata.executable()!r} {state} "
                f"inputs={[a.name() for a in self._exec_inputs]} "
                f"outputs={[a.name() for a in self._main_outputs]}>")
