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
import copy
import functools
import logging
import os
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np

from host_runtime import popef
from host_runtime._fork import check_owner, current_pid, foreign
from host_runtime._lifetime import close_owned
from host_runtime.errors import BadRequestError, InvalidStateError, PopefError
from host_runtime.memory import OutputMemory, check_owned
from host_runtime.popef import check_model, files_key, keep_model, kept_model
from host_runtime.popef.reader import PendingChecksums
from host_runtime.runner._host_tail import HostTail
from host_runtime.runner._intake import RequestIntake
from host_runtime.runner._layout import ModelLayout
from host_runtime.runner._replica import Replica, rerun_load_everywhere
from host_runtime.runner._sessions import ReplicaSessions
from host_runtime.runner._requests import OutputFuture, Request
from host_runtime.runner.config import DataDesc, ModelRunnerConfig
from host_runtime.runner.monitoring import RequestMonitor
from host_runtime.settings import HostSettings
from ipu_emulator import trace
from ipu_emulator.faults import table_for as fault_table_for

if TYPE_CHECKING:  # pragma: no cover
    # host_runtime.runner.runner_metrics imports prometheus_client (~60 ms): metrics_collector()
    # imports it on first use. It does not import this module (see MonitoredRunner).
    from host_runtime.runner.runner_metrics import ModelRunnerCollector

__all__ = ["ModelRunner", "OutputFuture"]

_log = logging.getLogger(__name__)


_live_runners: "weakref.WeakSet[ModelRunner]" = weakref.WeakSet()
_atexit_registered = False


def _announce_live_runners() -> None:
    """Tracing started: the runners made before it name their replicas on the timeline
    (their requests would be ``runner ?``)."""
    for runner in list(_live_runners):
        for rep in list(runner._replicas):
            rep.announce()


trace.on_start(_announce_live_runners)


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


def _load_model(source: Any, pending: PendingChecksums
                ) -> tuple[popef.Model, Callable[[], None], bool]:
    """The model of ``source``; what to call once its checksums have passed (a model read
    from files is kept for the next runner of the same files: ``popef._cache``); and
    whether runners share it (kept: ``ModelRunner.model`` shows a copy of its own)."""
    if isinstance(source, popef.Model):
        check_model(source)   # the rules of ipu_emulator.validate (once per Model)
        return source, _nothing, False
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
    key = files_key(paths)
    model = kept_model(key)
    if model is not None:
        return model, _nothing, True
    model = popef.load_model(paths, pending=pending)
    check_model(model)
    return model, functools.partial(keep_model, key, model, paths), key is not None


def _nothing() -> None:
    pass


def _damaged_first(pending: PendingChecksums, exc: BaseException) -> None:
    """A runner that failed: the checksums of its file are waited for, and a damaged
    payload's PopefError is raised over ``exc`` (an interrupt stays what it is)."""
    try:
        pending.wait()
    except PopefError:
        if isinstance(exc, Exception):
            raise


def _overload(output_data: Any, replica_id: Any) -> tuple[Any, Any]:
    """The seed's ``execute(input_data, replica_id)``: an int where the outputs go is the
    replica (given twice: refused)."""
    if isinstance(output_data, (int, np.integer)) and not isinstance(output_data, bool):
        if replica_id != 0:
            raise BadRequestError(
                f"replica_id given twice: {output_data!r} as the second positional argument "
                f"(execute(input_data, replica_id)) and replica_id={replica_id!r}")
        return None, output_data
    return output_data, replica_id


def _desc(a: popef.Anchor, contains: bool = False) -> DataDesc:
    info = a.tensorInfo()
    return DataDesc(a.name(), info.sizeInBytes(), info.shape(), info.dataType(), contains)


class ModelRunner:
    """Inference on a PopEF model: ``execute`` / ``executeAsync`` with the seeds' semantics."""

    def __init__(self, model: Any, config: Optional[ModelRunnerConfig] = None) -> None:
        self._replicas: list[Replica] = []
        self._model_shared = False   # the model is popef._cache's (see model)
        self._closed = True
        self._owner_pid = current_pid()   # fork: see host_runtime._fork
        cfg = config if config is not None else ModelRunnerConfig()
        if not isinstance(cfg, ModelRunnerConfig):
            raise BadRequestError(f"config must be a ModelRunnerConfig, got {type(cfg).__name__}")
        cfg.validate()
        # the settings now (environment, override blocks): the runner keeps them for its life
        self._settings = settings = HostSettings.current()
        # the fault schedule its IPUs follow (ipu_emulator.faults; its sessions hold it too)
        self._fault_table = fault_table_for(settings.faults)
        self._config = cfg.copy()
        # The caller reads the save programs' outputs from its own dict after close().
        self._config.replica_to_save_programs_outputs = cfg.replica_to_save_programs_outputs
        self._config.read_only()    # config() returns it: changes are refused, not ignored
        # the file's checksums are computed while the model is checked, the IPU processes'
        # template starts (ReplicaSessions) and the devices load it (each IPU process
        # checks the executable's own checksum before it runs anything of it); a damaged
        # file is refused here all the same
        pending = PendingChecksums()
        try:
            self._model, keep, self._model_shared = _load_model(model, pending)
            # thread_safe: one mutex per replica, held for each execute/executeAsync call
            self._call_locks: list[threading.RLock] = (
                [threading.RLock() for _ in range(cfg.replication_factor)]
                if cfg.thread_safe else [])
            self._layout = lay = ModelLayout(self._model, cfg)
            # the non-tensor tail (ZipMap) the host computes on each result, if any
            self._tail = HostTail.of(self._model)
            self._intake = RequestIntake(lay, cfg.validate_io_params, settings.runner_plain)
            self._monitors = [RequestMonitor(cfg.request_tracepoints_buffer_size)
                              for _ in range(cfg.replication_factor)]
            self._sessions = sessions = ReplicaSessions(self._model, self._config, lay,
                                                        settings)
            self._closed = False
            try:
                sessions.attach_devices()
                for r in range(cfg.replication_factor):
                    self._replicas.append(
                        Replica(sessions.setup(r, self._monitors[r], self._intake)))
            except BaseException:
                self.close()
                raise
            finally:
                sessions.release_unadopted()   # devices not taken by a session: ours
        except BaseException as exc:
            _damaged_first(pending, exc)
            raise
        try:
            pending.wait()
        except BaseException:
            self.close()
            raise
        keep()   # checked whole: the next runner of these files takes it as it is
        _live_runners.add(self)
        _register_exit_hook()

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

    # ================================================================== the seed's API
    def execute(self, input_data: Any, output_data: Any = None, replica_id: int = 0) -> Any:
        """Run one request synchronously; see the module docstring for what it returns.

        An input frozen by ``ModelRunnerConfig.frozen_inputs`` is no longer required (seed
        000/001, frozen inputs); given anyway, it is ignored and the frozen value is used.

        ``execute(inputs, replica_id)`` with the replica as the second positional argument
        is the seed's ``execute(input_data, replica_id)`` overload.

        In a process forked from the runner's creator: ForkedProcessError (its rings are
        the creator's), before anything is touched; also for empty_shared arrays the
        creator made."""
        check_owner(self._owner_pid, "ModelRunner")
        if output_data is not None:   # (None: nothing to resolve)
            output_data, replica_id = _overload(output_data, replica_id)
        check_owned(input_data, output_data)
        try:
            if self._call_locks:
                lock = _lock_of(self._call_locks, replica_id)
                if lock is not None and self._layout.dynamic:   # (the lock: while laying)
                    return _execute_gathered(lock, self._replica(replica_id), self, input_data,
                                             output_data)
                if lock is not None:
                    with lock:
                        return self._execute(input_data, output_data, replica_id)
            if self._tail is None:   # _execute without its call
                return self._execute_device(input_data, output_data, replica_id)
            return self._execute(input_data, output_data, replica_id)
        except Exception as exc:
            self._record_raised(exc, replica_id)
            raise

    def _execute(self, input_data: Any, output_data: Any, replica_id: int) -> Any:
        results = self._execute_device(input_data, output_data, replica_id)
        tail = self._tail
        return results if tail is None else tail.complete(results, output_data)

    def _execute_device(self, input_data: Any, output_data: Any, replica_id: int) -> Any:
        t0 = time.perf_counter_ns()
        reps = self._replicas   # emptied by close(): _replica() reports it
        if replica_id.__class__ is int and 0 <= replica_id < len(reps):
            rep = reps[replica_id]
        else:
            rep = self._replica(replica_id)
        intake = self._intake
        if intake.is_plain(input_data, output_data):
            results = rep.run_idle(input_data, t0)   # the fused path, when the replica is idle
            if results is not None:
                return results
            req = intake.build_plain(rep.driver, rep.rid, input_data, None, t0, True)
            assert req is not None
            rep.execute(req, 1)
            return req.results
        if output_data is not None:   # the common request into the user's memory
            req = intake.build_plain(rep.driver, rep.rid, input_data, output_data, t0, True)
            if req is not None:
                rep.execute(req, 1)
                return None
        req, transfers, phantom, view_mode = intake.build(rep.driver, rep.rid, input_data,
                                                          output_data, t0)
        rep.execute(req, transfers, phantom)
        return _results(req, output_data, view_mode)

    def executeAsync(self, input_data: Any, output_data: Any = None,
                     replica_id: int = 0) -> OutputFuture:
        """Queue one request; returns an ``OutputFuture`` (frozen inputs, and
        ``executeAsync(inputs, replica_id)``, as for ``execute``)."""
        check_owner(self._owner_pid, "ModelRunner")
        if output_data is not None:   # (None: nothing to resolve)
            output_data, replica_id = _overload(output_data, replica_id)
        check_owned(input_data, output_data)
        try:
            if self._call_locks:
                lock = _lock_of(self._call_locks, replica_id)
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
        req = self._intake.build_plain(rep.driver, rep.rid, input_data, output_data, t0, False)
        if req is not None:
            transfers, phantom = 1, None
        else:
            req, transfers, phantom, _ = self._intake.build(rep.driver, rep.rid, input_data,
                                                            output_data, t0)
        rep.submit(req, transfers, phantom)
        return OutputFuture(req, self._tail)

    def update_load_inputs(self, values: dict[str, Any]) -> None:
        """Not part of the seed's API (PopRT's ``LightRunner.update_weights``): new values
        for inputs only the Load programs read (weights the PopEF file carries, or frozen
        inputs of Load), loaded in place: on every replica, once its requests in flight
        have finished, Main's loop stops, the Load programs run again on the same device
        with the new data, and Main loops again. The values stay the runner's (a replica
        restarted by ``auto_reset`` loads them too). A call cut short (an interrupt, a
        replica's failure) leaves no replica on the old values: one it did not reach loads
        the new ones before its next request."""
        lay = self._layout
        typed: dict[str, np.ndarray] = {}
        for name, value in values.items():
            anchor = self._model.metadata.anchor(name)
            if anchor is None or name not in lay.load_only:
                raise BadRequestError(
                    f"update_load_inputs: {name!r} is not an input only the Load programs "
                    "read; expected one of " + (", ".join(sorted(lay.load_only)) or "(none)"))
            typed[name] = lay.typed_value(anchor, value)
        handles = {self._model.metadata.anchor(n).handle(): v  # type: ignore[union-attr]
                   for n, v in typed.items()}
        self._sessions.remember_frozen(typed)
        rerun_load_everywhere([self._replica(rid) for rid in range(len(self._replicas))],
                              functools.partial(_lock_of, self._call_locks),
                              {h: memoryview(v).cast("B")  # type: ignore[arg-type]
                               for h, v in handles.items()})

    def getExecuteInputs(self) -> list[DataDesc]:
        """Inputs each execute call needs (frozen inputs and PopEF-fed tensors excluded)."""
        return [_desc(a) for a in self._layout.exec_inputs]

    def getExecuteOutputs(self) -> list[DataDesc]:
        return [_desc(a) for a in self._layout.main_outputs]

    def getModelInputs(self) -> list[DataDesc]:
        """Every input of the model, including those its PopEF files carry (weights)."""
        lay = self._layout
        return [_desc(a, a.name() in lay.with_data) for a in lay.inputs_all]

    def getModelOutputs(self) -> list[DataDesc]:
        """Every output of the model, including those of the save programs."""
        return [_desc(a) for a in self._layout.outputs_all]

    def device_pids(self, replica_id: int = 0) -> list[int]:
        """The pids of the IPU processes serving replica ``replica_id`` (not part of the
        seed's API: for diagnostics, ps and top, and the project's tools); empty if its
        device has no processes of its own (a loopback device) or the runner is closed."""
        session = self._replica(replica_id).session
        device = session.device() if session is not None else None
        return device.pids() if device is not None else []

    def config(self) -> ModelRunnerConfig:
        """The runner's configuration (the reference's const reference): read-only, setting
        an option raises InvalidStateError; ``config().copy()`` is a mutable copy for
        another runner."""
        return self._config

    @property
    def model(self) -> popef.Model:
        """The runner's model. One read from files, which runners of the same files share,
        is shown as a copy of its own (made at the first call): a change a program makes
        to it stays there."""
        if self._model_shared:
            self._model, self._model_shared = copy.deepcopy(self._model), False
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

    def request_monitors(self) -> list[RequestMonitor]:
        """One request monitor per replica (not part of the seed's API: what
        ``metrics_collector`` reads)."""
        return list(self._monitors)

    def faults_injected(self) -> dict[str, int]:
        """Runs affected by injected faults (``ipu_emulator.faults``), by kind, counted
        over the schedule this runner's IPUs follow (not part of the seed's API)."""
        counts: dict[str, int] = {}
        if self._fault_table is not None:
            for fault, _, fired in self._fault_table.counts():
                counts[fault.kind] = counts.get(fault.kind, 0) + fired
        return counts

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
            save = self._sessions.saver(rep.rid) if self._config.run_save_programs else None
            try:
                rep.close(save, dropped)
            except Exception as exc:  # close every replica, then report
                errors.append(exc)
        if errors:
            raise errors[0]

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
                f"inputs={[a.name() for a in self._layout.exec_inputs]} "
                f"outputs={[a.name() for a in self._layout.main_outputs]}>")


def _execute_gathered(lock: threading.RLock, rep: Replica, runner: ModelRunner,
                      input_data: Any, output_data: Any) -> Any:
    """``execute`` of a thread-safe runner with dynamic batching: the replica's lock
    covers laying the request, not waiting for it (several callers' samples gather in one
    transfer: a caller waiting with the lock held kept the others from filling its batch,
    each served only when the batch timeout padded it, or never without one)."""
    with lock:
        req, transfers, phantom, view_mode = runner._intake.build(
            rep.driver, rep.rid, input_data, output_data, time.perf_counter_ns())
        rep.submit(req, transfers, phantom)
    rep.wait(req)
    results, tail = _results(req, output_data, view_mode), runner._tail
    return results if tail is None else tail.complete(results, output_data)


def _results(req: Request, output_data: Any, view_mode: bool) -> Any:
    """What ``execute`` returns of the done request ``req``: nothing when it wrote into
    ``output_data``, else its outputs (an ``OutputMemory`` for a view-mode request)."""
    if output_data is not None:
        return None
    if view_mode:
        return OutputMemory(req.results)
    return {k: v.view(np.ndarray) for k, v in req.results.items()}


def _lock_of(locks: list[threading.RLock], replica_id: Any) -> Optional[threading.RLock]:
    """``thread_safe``: the lock of replica ``replica_id`` (None for a bad id: the call
    reports it)."""
    if locks and isinstance(replica_id, int) and 0 <= replica_id < len(locks):
        return locks[replica_id]
    return None

