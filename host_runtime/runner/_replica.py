"""One replica of a ModelRunner: a Session whose Main runs in a device-side loop.

::

    caller thread (execute / executeAsync)          IPU process (Main in a loop)
    --------------------------------------          ----------------------------
    submit: under the submit lock, write each  ---> input rings ---> read inputs
            input straight into its ring slot                         run the graph
            (whole transfers; dynamic batches                         write outputs
            are packed across requests)                                    |
    wait:   whoever waits *drives*: it takes   <--- output rings <---------+
            the drain role, reads the oldest
            transfer's outputs into the
            requests' memory and completes them

There are no runner threads: a request touches only its caller's thread (and
the IPU process). A waiter that finds another thread draining sleeps on a
condition the drainer notifies after each transfer. A submitter that finds an
input ring full drains (or waits for the drainer) instead of blocking, so
unwaited futures cannot deadlock the replica.

A plain ``execute`` on an idle replica (nothing in flight, small whole transfers)
takes a fused path instead, ``Replica.run_idle``: write, wait, read, under the
submit lock, with no Request or Transfer (~2 us less on a [1,4] request).

Timers (partial dynamic batches, requests that cannot run because inputs are
missing with ``validate_io_params`` off) are a ``ReplicaTimers`` the replica
owns (``_replica_timers``), driven by waiting threads, or by a small watchdog
thread when ``flush_on_waiting_outputs`` is off. An ``ExitWatch`` (``shm.liveness``)
notices a dead IPU process before a request is sent to it.

Sequence numbers: every transfer gets the next number of the replica (1, 2,
...; ``Transfer.seq``), and every input slot of it carries that number in its
tag (``ipu_protocol.stream_tag``); the IPU process copies it onto the outputs.
Whoever reads an output checks it (``_mismatch``): another number is a
``SequenceMismatchError`` that fails the replica as a lost device, never an
answer.

Abandoned requests: an exception that is none of ours (KeyboardInterrupt, an
exception a signal handler raises) may interrupt a thread anywhere in here.
Nothing a request sent may then stay half done, or the next request would get
its outputs:

- a transfer half written (some inputs published, a slot acquired and not
  published) is completed, with the request's own data, so that the device's
  iteration completes (``_writing`` / ``_finish_writing``, idempotent: done by
  the interrupted thread, else by the next one in);
- the transfer ``run_idle`` was reading becomes an in-flight transfer whose
  remaining outputs the next drainer reads and throws away (``_abandon_idle``);
- a read interrupted in ``_drain`` after the slot was consumed loses that
  output: the transfer's requests fail, the rest of it is drained
  (``_read_interrupted``); the drain role is always given back.

Failure: the main-loop future failing (device lost, device program error)
invalidates this replica's rings, which wakes every waiter at once; all
requests in flight fail with that error. The next request restarts the
replica when ``auto_reset`` is on, else it raises ``DeviceLostError``.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Optional, Protocol

import numpy as np

from shm import (ExitWatch, PeerDiedError, Ring, RingInvalidatedError, RingTimeoutError, ShmError,
                 WouldBlock)
from shm.spin import NEVER, PollEstimate, us_to_ns

from host_runtime.errors import (DeviceLostError, DeviceTimeoutError, InvalidStateError,
                                 ModelRuntimeError, SequenceMismatchError)
from host_runtime.memory import PARALLEL_MIN_BYTES, copy_bytes
from host_runtime.memory import SHARED_MIN_BYTES, shared_location
from host_runtime.runner._batching import TensorSpec
from host_runtime.runner._replica_timers import MakeFlushRequest, MergePhantom, ReplicaTimers
from host_runtime.runner._requests import Request, Transfer, raisable
from host_runtime.runner.config import FlushCallback
from host_runtime.runner.monitoring import RequestMonitor
from host_runtime.session import DROP_STOP_TIMEOUT
from host_runtime.settings import HostSettings
from ipu_emulator.ipu_protocol import (SEQ_SHIFT, TAG_KIND_MASK, TAG_SHARED,
                                       host_memory_descriptor)

__all__ = ["Replica", "ReplicaSession", "ReplicaSetup", "SaveFn"]

_log = logging.getLogger(__name__)

_SLICE = 0.25          # seconds between re-checks of a blocked drain
_ONE_CPU = len(os.sched_getaffinity(0)) < 2
_native_id = threading.get_native_id
"""On one CPU a poll that finds the CPU shared blocks instead. On several the IPU
process moves off the host's CPU (ipu_emulator.ipu._placement), and blocking would only
let the wake-up put the host back beside it."""
_thread_ids = threading.local()
"""``.native_id``: ``_native_id()`` of this thread (a system call), kept per thread."""
os.register_at_fork(after_in_child=lambda: _thread_ids.__dict__.clear())   # its own thread
_U8 = np.dtype(np.uint8)
_INF = float("inf")
_READ_MAX = 4096
"""Outputs up to this size (bytes) are read with ring.read() (a copy, then the slot is free)."""


def _bytes_view(arr: np.ndarray) -> memoryview:
    """A flat byte memoryview of a C-contiguous array (no copy)."""
    if arr.size == 0:   # a zero-size tensor: memoryview cannot cast zeros in its shape
        return memoryview(bytearray())
    return memoryview(arr).cast("B")  # type: ignore[arg-type]


class DeviceProcesses(Protocol):
    def pids(self) -> list[int]:
        """The pids of the device's IPU processes."""


class DirectPath(Protocol):
    """What a replica uses of ``session.direct`` (the fast path, docs/design.md
    section 8; ``host_runtime.session._fastpath.DirectStreams``)."""

    def input_ring(self, handle: str) -> Ring: ...
    def output_ring(self, handle: str) -> Ring: ...
    def start_main_loop(self) -> cf.Future[None]: ...
    def stop_main_loop(self, timeout: float = ...) -> None: ...
    def failure(self) -> ModelRuntimeError | None: ...
    def translate(self, exc: BaseException) -> BaseException: ...


class ReplicaSession(Protocol):
    """What a replica uses of its ``Session``: exactly these members (the fast path, its
    lifetime, and what the save programs need). ``host_runtime.session.Session``
    implements it; ``ModelRunner`` opens the sessions."""

    @property
    def direct(self) -> DirectPath: ...
    # lifetime
    def device(self) -> DeviceProcesses | None: ...
    def stop(self) -> None: ...
    def stop_within(self, timeout: float, kill_if_hung: bool = False) -> None: ...
    def close(self) -> None: ...
    def close_within(self, stop_timeout: float, kill_if_hung: bool) -> None: ...
    # the save programs (ModelRunner's SaveFn)
    def setCallbackForAnchor(self, anchor_handle: str,
                             callback: Callable[[memoryview], None] | None) -> None: ...
    def runSavePrograms(self) -> None: ...


SaveFn = Callable[[ReplicaSession], None]
"""Runs the save programs on a replica's session before it closes."""


@dataclass
class ReplicaSetup:
    """What the runner tells each replica (built once per ModelRunner)."""

    replica_id: int
    inputs: dict[str, TensorSpec]           # direct Main inputs (incl. frozen), in Main read order
    outputs: dict[str, TensorSpec]          # Main outputs
    frozen_main: dict[str, np.ndarray]      # frozen Main inputs, typed, model shape
    dynamic: bool
    batch: int                              # dynamic: samples per transfer
    timeout_ns: int
    partial_flush_ns: Optional[int]         # None: never flush a partial batch on a timer
    flush_callback: Optional[FlushCallback]
    auto_reset: bool
    monitor: RequestMonitor
    open_session: Callable[[], ReplicaSession]  # a bound Session with direct anchors claimed
    watchdog: bool                          # flush partials even when nobody waits
    make_flush_request: MakeFlushRequest    # flush_callback result -> request
    merge_phantom: MergePhantom             # -> transfers once complete
    settings: HostSettings                  # the runner's (taken when it was made)


class Replica:
    """The engine of one replica; see the module docstring. It is the ``TimerOwner`` of
    its timers and the ``Driver`` of its requests."""

    def __init__(self, setup: ReplicaSetup) -> None:
        self.setup = setup
        self.rid = setup.replica_id
        self._submit_lock = threading.Lock()
        # The hot path takes the condition's lock itself (``with self._cv`` is a Python-level
        # __enter__/__exit__: ~0.2 us more per use, five uses per request).
        self._cv_lock = threading.Lock()
        self._cv = threading.Condition(self._cv_lock)
        self._inflight: collections.deque[Transfer] = collections.deque()
        self._partial: Transfer | None = None
        self._draining = False
        self._error: ModelRuntimeError | None = None
        self._error_unheard = False    # no request has been failed with _error yet
        self._closed = False
        self._session: ReplicaSession | None = None
        self._in_rings: dict[str, Ring] = {}
        self._out_rings: dict[str, Ring] = {}
        self._loop: cf.Future[None] | None = None
        self._pids = ExitWatch()       # the device's IPU processes (pidfds)
        self._pids_exact = False       # ... every one of them watched by a pidfd
        # when to poll an output ring before blocking (shm.spin.PollEstimate; budget
        # runner_spin_us). Waking a sleeping process from another CPU costs tens of
        # microseconds on a VM (a [1,4] execute took ~110 us blocking, ~70 us with a 30 us
        # poll); the 100 us budget also keeps the host where it is, instead of woken on the
        # IPU process's CPU where the two take turns (33-35 us per [1,4] request instead
        # of 17-18 us). On one CPU a poll that finds the CPU shared (a sched_yield longer
        # than yielded_us) blocks instead, so a wake-up can separate us.
        self._est = PollEstimate(
            us_to_ns(setup.settings.runner_spin_us),
            us_to_ns(setup.settings.yielded_us, NEVER) if _ONE_CPU else NEVER)
        # the device waits for the first input Main reads (setup.inputs is in read order);
        # frozen ones are always there
        waits_for = next((n for n in setup.inputs if n not in setup.frozen_main), "")
        self._timers = ReplicaTimers(
            self, self.rid, timeout_ns=setup.timeout_ns, partial_flush_ns=setup.partial_flush_ns,
            flush_callback=setup.flush_callback, make_flush_request=setup.make_flush_request,
            merge_phantom=setup.merge_phantom, waits_for=waits_for, watchdog=setup.watchdog)
        self._publish_order = list(reversed(list(setup.inputs.items())))
        self._frozen_bytes = {n: _bytes_view(np.ascontiguousarray(a))
                              for n, a in setup.frozen_main.items()}
        self._in_plan: list[tuple[str, TensorSpec, Ring, memoryview | None]] = []
        # what run_idle needs per output: name, ring, shape and dtype of its result
        self._out_plan: list[tuple[str, Ring, tuple[int, ...], np.dtype]] = []
        self._hint_tid = 0             # the thread id last written into the input rings
        self._seq = 0                  # the number of the last transfer sent (see above)
        self._writing: Transfer | None = None   # the transfer whose inputs are being written
        # an output large enough for host shared memory (see _redirects)
        self._may_redirect = any(s.nbytes >= SHARED_MIN_BYTES for s in setup.outputs.values())
        # run_idle's requests: whole, small transfers (every input written with one ring
        # call, every output read with one, nothing redirected to host shared memory)
        self._fusable = (not setup.dynamic and not self._may_redirect
                         and all(0 < s.nbytes < SHARED_MIN_BYTES for s in setup.inputs.values())
                         and all(0 < s.nbytes <= _READ_MAX for s in setup.outputs.values()))
        self._open()

    # ------------------------------------------------------------------ lifecycle
    def _open(self) -> None:
        s = self.setup.open_session()
        try:
            self._in_rings = {n: s.direct.input_ring(spec.handle) for n, spec in self.setup.inputs.items()}
            self._out_rings = {n: s.direct.output_ring(spec.handle)
                               for n, spec in self.setup.outputs.items()}
            loop = s.direct.start_main_loop()
        except BaseException:
            s.close()
            raise
        self._session = s
        self._loop = loop
        self._error = None
        self._writing = None
        self._hint_tid = 0   # new rings: the next submit tells the IPU process again
        # what _write_whole needs per input, in publish order (last-read first)
        self._in_plan = [(name, spec, self._in_rings[name], self._frozen_bytes.get(name))
                         for name, spec in self._publish_order]
        self._out_plan = [(name, self._out_rings[name], spec.shape_for(spec.batch), spec.dtype)
                          for name, spec in self.setup.outputs.items()]
        dev = s.device()
        self._pids.close()
        self._pids = ExitWatch(dev.pids() if dev is not None else [])
        self._pids_exact = self._pids.exact and bool(self._pids.pids)
        # The device's service thread holds the loop future: refer back weakly, so that a
        # runner nobody references can be collected (and its __del__ release the IPUs).
        ref = weakref.ref(self)

        def on_loop_end(fut: cf.Future[None]) -> None:
            replica = ref()
            if replica is not None:
                replica._on_loop_end(fut)
        loop.add_done_callback(on_loop_end)

    @property
    def session(self) -> ReplicaSession | None:
        return self._session

    # -- TimerOwner (see _replica_timers) ----------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def partial(self) -> Transfer | None:
        return self._partial

    def try_publish_partial(self, tr: Transfer, extra: Request | None) -> bool:
        if not self._submit_lock.acquire(blocking=False):
            return False   # a submitter is busy (it will publish or the timer fires again)
        try:
            if self._writing is not None:
                self._finish_writing()
            if extra is not None and self._partial is tr:
                self._pack(extra)
                extra.t_prepared = time.perf_counter_ns()
            if self._partial is tr:
                self._publish_partial(tr, pad=True)
        except (ShmError, OSError) as exc:
            self._fail_everything(self._translate(exc))
        finally:
            self._submit_lock.release()
        return True

    def try_send(self, request: Request, transfers: int) -> bool:
        if not self._submit_lock.acquire(blocking=False):
            return False
        try:
            if self._writing is not None:
                self._finish_writing()
            if self.setup.dynamic:
                self._pack(request)
            else:
                self._write_whole(request, transfers)
        except (ShmError, OSError) as exc:
            self._fail_everything(self._translate(exc))
        except BaseException as exc:
            self._abandon_request(request, exc)
            raise
        finally:
            self._submit_lock.release()
        return True

    def fire_timers_as_drainer(self) -> None:
        mine = False
        try:
            with self._cv:
                if self._draining:
                    self._cv.wait(0.01)
                    return
                self._draining = mine = True   # one step: an interrupt cannot split it
            self._timers.fire(time.monotonic())
        finally:
            if mine:
                with self._cv:
                    self._draining = False
                    self._cv.notify_all()

    def _on_loop_end(self, fut: cf.Future[None]) -> None:
        """The device's main loop ended: stop() (normal) or a failure."""
        if fut is not self._loop or self._closed:
            return
        exc = fut.exception()
        if exc is None:
            return
        err = exc if isinstance(exc, ModelRuntimeError) else DeviceLostError(str(exc))
        self._fail_everything(err)

    def _fail_everything(self, err: ModelRuntimeError) -> None:
        with self._cv:
            if self._error is None:
                self._error = err
                # nobody was waiting: the next request is the first to hear of it, and gets
                # the error itself (then "unusable after an earlier failure")
                self._error_unheard = not self._inflight and not self._partial
            pending = list(self._inflight)
        phantoms = self._timers.take_phantoms()
        # Wake every thread blocked on one of our rings.
        for ring in [*self._in_rings.values(), *self._out_rings.values()]:
            try:
                ring.invalidate()
            except Exception:   # already closed with its session: nobody can wait on it
                pass
        for tr in pending:
            for seg in tr.segments:
                seg[0].fail(err)
        for ph in phantoms:
            ph.request.fail(err)
        with self._cv:
            self._cv.notify_all()

    def _closed_error(self) -> InvalidStateError:
        return InvalidStateError(f"replica {self.rid}: the ModelRunner was closed")

    def close(self, save: SaveFn | None = None, dropped: bool = False) -> None:
        """Stop the loop, optionally run the save programs, close the session (idempotent).

        Bounded: a device that does not stop within the stop timeout, or the host sync
        timeout without an answer (a stopped or stuck IPU process), is killed and the
        replica's resources released. ``dropped``: the runner was dropped; the bound is
        ``DROP_STOP_TIMEOUT``."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
        closed = self._closed_error()
        with self._cv:
            pending = list(self._inflight)
            self._inflight.clear()
            self._partial = None
            self._cv.notify_all()
        phantoms = self._timers.take_phantoms()
        for tr in pending:
            for seg in tr.segments:
                seg[0].fail(closed)
        for ph in phantoms:
            ph.request.fail(closed)
        self._timers.close()
        s = self._session
        if s is None:
            return
        try:
            healthy = self._error is None and s.direct.failure() is None
            limit = DROP_STOP_TIMEOUT if dropped else self.setup.settings.stop_timeout
            if save is not None and healthy:
                try:
                    s.direct.stop_main_loop(limit)      # stays runnable, device memory kept
                    save(s)
                except ModelRuntimeError as exc:
                    _log.warning("replica %d: save programs failed: %s", self.rid, exc)
                    if isinstance(exc, DeviceTimeoutError):
                        limit = 0.0   # the bound is spent: kill the device, do not wait again
            s.stop_within(limit, kill_if_hung=True)
        finally:
            s.close_within(limit, kill_if_hung=True)
            self._session = None
            self._pids.close()

    # ------------------------------------------------------------------ submit
    def _ensure_usable(self) -> None:
        if self._closed:
            raise InvalidStateError(f"replica {self.rid}: the ModelRunner is closed")
        err = self._error
        if err is None:
            err = self._check_device()
        if err is None:
            return
        if not self.setup.auto_reset:
            if self._error_unheard and err is self._error:
                self._error_unheard = False
                raise raisable(err)
            raise DeviceLostError(
                f"replica {self.rid} is unusable after an earlier failure ({err}); set "
                "ModelRunnerConfig.auto_reset = True to restart the device automatically") from err
        self._reset()

    def _looks_well(self) -> bool:
        """The check before each request: open, no earlier failure, and every IPU process
        alive (one poll of their pidfds, ~0.5 us). False: ``_ensure_usable`` sorts it out."""
        return not (self._closed or self._error is not None or not self._pids_exact
                    or self._pids.dead_pid() is not None)

    def _check_device(self) -> ModelRuntimeError | None:
        """Notice a dead IPU process before a request is sent to it (~0.3 us)."""
        s = self._session
        if s is None:
            return None
        pid = self._pids.dead_pid()
        if pid is None and self._pids_exact:
            # Every IPU process is alive (pidfds, one poll). Other losses fail the
            # main-loop future, which sets self._error.
            return None
        lost = s.direct.failure()
        if lost is None:
            if pid is not None:
                err = s.direct.translate(PeerDiedError(f"IPU process {pid} died", pid))
                lost = err if isinstance(err, ModelRuntimeError) else DeviceLostError(str(err))
        if lost is not None:
            self._fail_everything(lost)
        return lost

    def _reset(self) -> None:
        """auto_reset: restart the device (a new session on a fresh device) and reload."""
        # formatted now: a record holding the error would keep its traceback (and the
        # failed requests' memory) alive for as long as a handler keeps the record
        _log.warning("replica %d: auto_reset after %s", self.rid, str(self._error))
        old = self._session
        self._session = None
        if old is not None:
            try:
                old.stop()
            except ModelRuntimeError:
                pass
            finally:
                old.close()
        with self._cv:
            self._inflight.clear()
            self._partial = None
            self._writing = None
        self.setup.monitor.reset_chain()
        self._open()

    def _hint_thread(self) -> None:
        """Tell the IPU process which thread submits (and, most often, waits): it keeps
        off that thread's CPU (ipu_emulator.ipu._placement reads it from the rings).
        Caller holds the submit lock."""
        try:
            tid = _thread_ids.native_id   # a system call: once per thread
        except AttributeError:
            tid = _thread_ids.native_id = _native_id()
        if tid != self._hint_tid:
            for ring in self._in_rings.values():
                ring.set_user_word(tid)
            self._hint_tid = tid

    def submit(self, req: Request, transfers: int, phantom: str | None = None) -> None:
        """Send ``req`` to the device (or park it as a phantom that will time out)."""
        with self._submit_lock:
            # _ensure_usable only when something is off (its pidfd poll, inline)
            if not self._looks_well():
                self._ensure_usable()
            try:
                if self._writing is not None:
                    self._finish_writing()
                self._hint_thread()
                if phantom is not None:
                    self._timers.add_phantom(req, phantom, self._partial)
                elif self.setup.dynamic:
                    self._pack(req)
                else:
                    self._write_whole(req, transfers)
            except (ShmError, OSError) as exc:
                err = self._translate(exc)
                req.fail(err)
                if isinstance(err, DeviceLostError):
                    self._fail_everything(err)
                raise raisable(err) from None
            except InvalidStateError as exc:
                req.fail(raisable(exc))
                raise
            except BaseException as exc:   # KeyboardInterrupt, a signal handler's exception
                self._abandon_request(req, exc)
                raise
            req.t_prepared = time.perf_counter_ns()

    def run_idle(self, inputs: dict[str, np.ndarray], t_received: int
                 ) -> dict[str, np.ndarray] | None:
        """``execute``'s fused path: run a plain request (``inputs``: the model's execute
        inputs, checked by the caller) start to end and return its outputs, if idle.

        Returns None, having done nothing, unless the replica is idle: usable, no
        request in flight, no partial batch, no phantom, no drainer, small whole
        transfers (``_fusable``). The caller then takes ``submit`` + ``wait_for``.

        Else, under the submit lock for the whole round trip: write the inputs, wait
        for the outputs, make the result arrays from them, record the request. No
        Request or Transfer is made, and nobody else reads the output rings: drainers
        read only transfers in ``_inflight`` (empty, and only submitters, who need
        the submit lock, add to it), and timers act only with a partial batch or a
        phantom (none; both are added under the submit lock too). A submitter on
        another thread waits for the lock, one request long. Errors are counted and
        raised as the general path does: a failed write as in ``submit``, a failed
        read as a failed request after ``wait_for`` (device lost, program error, the
        runner closed).
        """
        if not self._fusable:
            return None
        with self._submit_lock:
            if (self._inflight or self._partial is not None or self._draining
                    or self._writing is not None or self._timers.has_phantoms
                    or not self._looks_well()):
                return None        # busy, or something is off: submit sorts it out
            self._hint_thread()
            self._seq = seq = self._seq + 1
            tag = seq << SEQ_SHIFT      # TAG_DATA, numbered
            results: dict[str, np.ndarray] = {}
            written = False
            error: ModelRuntimeError | None = None
            try:
                try:
                    for name, spec, ring, fb in self._in_plan:   # last-read first (_write_whole)
                        arr = inputs.get(name)
                        src: np.ndarray | memoryview
                        if arr is not None:
                            src = arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)
                        elif fb is not None:
                            src = fb
                        else:
                            continue      # validate_io_params off: the device will not read it
                        try:
                            ring.write(src, tag, 0.0)     # acquire, copy, publish: one C call
                        except RingTimeoutError:    # full (the device still holds a slot)
                            view = self._acquire(ring)
                            view[:spec.nbytes] = memoryview(src).cast("B")  # type: ignore[arg-type]
                            ring.publish(spec.nbytes, tag)
                    written = True
                except (ShmError, OSError) as exc:     # as submit
                    err = self._translate(exc)
                    self.record_error(err)
                    if isinstance(err, DeviceLostError):
                        self._fail_everything(err)
                    raise raisable(err) from None
                except InvalidStateError as exc:
                    self.record_error(raisable(exc))
                    raise
                t_prepared = time.perf_counter_ns()
                try:
                    self._read_outputs(results, seq)
                except (RingInvalidatedError, ShmError, OSError, InvalidStateError,
                        SequenceMismatchError) as exc:
                    error = self._closed_error() if self._closed else self._translate(exc)
                    if not self._closed:
                        self._fail_everything(error)
                        # _fail_everything did not see this request (not in _inflight): it
                        # hears the error, so the next one is told the replica is unusable
                        self._error_unheard = False
            except ModelRuntimeError:
                raise
            except BaseException as exc:   # KeyboardInterrupt, a signal handler's exception
                self._abandon_idle(inputs, seq, written, len(results), t_received, exc)
                raise
        if error is not None:      # as Request.fail, then _execute raising req.error
            self.record_error(error)
            raise raisable(error)
        self.setup.monitor.record(t_received, t_prepared, time.perf_counter_ns())
        return results

    def _read_outputs(self, results: dict[str, np.ndarray], seq: int) -> None:
        """run_idle: wait for each output of transfer ``seq`` and make its result array from
        the ring's copy, into ``results``."""
        expect = seq << SEQ_SHIFT   # TAG_DATA: nothing is redirected on this path
        for name, ring, shape, dtype in self._out_plan:
            t0 = time.perf_counter_ns()
            if not ring.readable():
                self._est.poll(ring.readable)
            while True:
                try:
                    data, tag = ring.read(_SLICE * 4)
                    break
                except RingTimeoutError:   # as wait_for: a long computation, or closed?
                    if self._closed:
                        raise self._closed_error() from None
            if tag != expect:
                raise self._mismatch(name, tag, seq)
            self._est.record(time.perf_counter_ns() - t0)
            # writable, over a copy of the message (cheaper than np.empty and a copy)
            results[name] = np.ndarray(shape, dtype, bytearray(data))

    def _mismatch(self, name: str, tag: int, seq: int) -> SequenceMismatchError:
        """The error of output ``name`` read with ``tag`` for transfer ``seq``."""
        got = tag >> SEQ_SHIFT
        return SequenceMismatchError(
            f"replica {self.rid}: output {name!r} read from the device carries transfer {got}, "
            f"expected transfer {seq}: the replica's streams are out of step, so none of its "
            "results can be trusted", expected=seq, got=got)

    # -- abandoned requests (see the module docstring) ----------------------------------
    def _abandon_request(self, req: Request, exc: BaseException) -> None:
        """``req`` was abandoned by ``exc`` while it was being sent (submit lock held): it
        fails, its outputs go nowhere, and the transfer being written is completed."""
        req.fail(InvalidStateError(
            f"replica {self.rid}: the request was abandoned: {type(exc).__name__} "
            "interrupted it while it was sent"))
        req.dests = {}
        if self._writing is not None:
            try:
                self._finish_writing()
            except (ShmError, OSError):   # the device is gone: the next request hears it
                pass

    def _abandon_idle(self, inputs: dict[str, np.ndarray], seq: int, written: bool,
                      read: int, t_received: int, exc: BaseException) -> None:
        """``run_idle``'s transfer ``seq`` was abandoned by ``exc`` (submit lock held) after
        its inputs were ``written`` (else: some of them) and ``read`` outputs were read:
        it becomes an in-flight transfer of a request nobody waits for, completed if half
        written, whose other outputs the next drainer reads and discards."""
        outputs = tuple(self.setup.outputs.values())
        if written and read < len(outputs):
            # the read interrupted as it returned: was that output consumed?
            last = self._out_plan[read][1].last_read_tag()
            if last is not None and last >> SEQ_SHIFT == seq:
                read += 1
        if written and read >= len(outputs):
            return   # nothing of it is left on the device
        req = Request(self, self.rid, 1, inputs, {}, {}, [outputs], t_received, internal=True)
        req.fail(InvalidStateError(f"replica {self.rid}: the request was abandoned: "
                                   f"{type(exc).__name__} interrupted it"))
        tr = Transfer([(req, 0, 1, 0)], outputs)
        tr.seq = seq
        tr.next_output = read
        if written:
            tr.published = True
        else:
            self._writing = tr
        with self._cv_lock:
            self._inflight.append(tr)
        if not written:
            try:
                self._finish_writing()
            except (ShmError, OSError):   # the device is gone: the next request hears it
                pass

    def _published_in(self, ring: Ring, seq: int) -> bool:
        """Whether the last transfer published on input ``ring`` is number ``seq``."""
        last = ring.last_published_tag()
        return last is not None and last >> SEQ_SHIFT == seq

    def _finish_writing(self) -> None:
        """Publish every input of ``self._writing``, the transfer whose writing an exception
        interrupted (caller holds the submit lock), so that the device's iteration
        completes; its outputs are then drained as any transfer's.

        Idempotent (an exception may interrupt this too; the next submitter finishes it):
        an input the transfer already published is left alone, a slot acquired and not
        published (held) is the one filled and published, with the request's own data.
        """
        tr = self._writing
        if tr is None:
            return
        if self.setup.dynamic:    # its slots are held and filled: pad and publish the rest
            self._publish_partial(tr, pad=True)
            return
        tag = tr.seq << SEQ_SHIFT
        req, t = tr.segments[0][0], tr.segments[0][1]
        for name, spec, ring, fb in self._in_plan:
            src = req.inputs.get(name)
            if (src is None and fb is None) or self._published_in(ring, tr.seq):
                continue
            view = self._acquire(ring)   # the held slot, if one is
            if src is None:
                assert fb is not None   # checked above
                view[:spec.nbytes] = fb
            else:
                slot = np.frombuffer(view, spec.dtype, spec.nbytes // spec.dtype.itemsize
                                     ).reshape(spec.shape)
                b = spec.batch
                slot[...] = src[spec.index(t * b, (t + 1) * b)] if spec.batch_dim is not None \
                    else src
                del slot
            ring.publish(spec.nbytes, tag)
        self._published(tr)
        self._writing = None    # last: an interrupt before it leaves this to be finished

    def _read_interrupted(self, tr: Transfer, index: int, ring: Ring,
                          exc: BaseException) -> None:
        """A drainer reading output ``index`` of ``tr`` from ``ring`` was interrupted by
        ``exc``. If the output was consumed (its slot acquired, or the ring's last read
        carries ``tr``'s number) it is lost: ``tr``'s requests fail and the rest of ``tr``
        is drained into nothing. Else ``tr`` is intact and the next drainer goes on."""
        if ring.unreleased():
            ring.release()
        elif tr.next_output == index:
            last = ring.last_read_tag()
            if last is None or last >> SEQ_SHIFT != tr.seq:
                return    # not consumed: the output is still on its way
        tr.next_output = index + 1
        name = tr.outputs[index].name
        err = InvalidStateError(
            f"replica {self.rid}: output {name!r} of the request was lost: the thread "
            f"reading it was interrupted by {type(exc).__name__}")
        for seg in tr.segments:
            seg[0].dests = {}
            seg[0].fail(err)

    def _translate(self, exc: BaseException) -> ModelRuntimeError:
        if self._error is not None:
            return self._error
        if isinstance(exc, ModelRuntimeError):   # e.g. SequenceMismatchError
            return exc
        s = self._session
        err = s.direct.translate(exc) if s is not None else exc
        if isinstance(err, ModelRuntimeError):
            return err
        return DeviceLostError(f"replica {self.rid}: {exc}")

    def _acquire(self, ring: Ring) -> memoryview:
        """A free slot of ``ring``; drains (or waits for the drainer) while it is full."""
        while True:
            try:
                return ring.try_acquire_write()
            except WouldBlock:
                pass
            if self._closed:
                raise self._closed_error()
            if self._try_drive(time.monotonic() + 0.05):
                continue
            try:
                return ring.acquire_write(timeout=0.05)
            except RingTimeoutError:
                continue

    def _published(self, tr: Transfer) -> None:
        with self._cv:
            tr.published = True
            self._notify()

    def _notify(self) -> None:
        """notify_all() on ``_cv`` (lock held), skipped when no thread waits (~0.3 us)."""
        if self._cv._waiters:  # type: ignore[attr-defined]  # CPython's Condition
            self._cv.notify_all()

    def _write_whole(self, req: Request, transfers: int) -> None:
        outputs = req.outputs_per_transfer
        # Count every transfer before the first is published: another thread may drain
        # (and count down) the first before this loop writes the next.
        req.remaining += transfers
        inputs = req.inputs
        # outputs in host shared memory: the IPU writes them there (sent with a shared input)
        redirects = (self._redirects(req, outputs[0]) if transfers == 1 and self._may_redirect
                     else [])
        for t in range(transfers):
            tr = Transfer([(req, t, 1, 0)], outputs[t])
            self._seq = tr.seq = self._seq + 1
            tag = tr.seq << SEQ_SHIFT
            # Registered before its first input is published (drainers wait until it is
            # published): submits are serialised, so the order of the in-flight deque is
            # the order the device sees (its outputs wait in the rings). An exception
            # before it is published leaves it in _writing, to be completed.
            self._writing = tr          # (then appended: an interrupt cannot come between)
            self._inflight.append(tr)
            # Last-read first: the device wakes once, on the first stream Main reads.
            for name, spec, ring, fb in self._in_plan:
                src = inputs.get(name)
                if src is None and fb is None:
                    continue      # validate_io_params off: the device will not read it
                nbytes = spec.nbytes
                if (transfers == 1 and 0 < nbytes < SHARED_MIN_BYTES and src is not None
                        and src.flags.c_contiguous):
                    # small whole transfer: acquire, copy and publish in one call of the
                    # ring's C core; a full ring takes the path below (it drains)
                    try:
                        ring.write(src, tag, 0.0)
                        continue
                    except RingTimeoutError:
                        pass
                try:
                    view = ring.try_acquire_write()
                except WouldBlock:
                    view = self._acquire(ring)
                if src is None:
                    assert fb is not None   # checked above
                    view[:nbytes] = fb
                    ring.publish(nbytes, tag)
                    continue
                if transfers == 1 and src.flags.c_contiguous:
                    if nbytes >= SHARED_MIN_BYTES and (loc := shared_location(src)) is not None:
                        # in host shared memory: the IPU process reads it in place
                        desc = host_memory_descriptor(loc[0], loc[1], nbytes, redirects)
                        if len(desc) <= nbytes:
                            view[:len(desc)] = desc
                            ring.publish(len(desc), TAG_SHARED | tag)
                            redirects = []   # sent once per transfer
                            continue
                    copy_bytes(view[:nbytes], _bytes_view(src))
                else:
                    slot = np.frombuffer(view, spec.dtype, spec.nbytes // spec.dtype.itemsize
                                         ).reshape(spec.shape)
                    b = spec.batch
                    slot[...] = src[spec.index(t * b, (t + 1) * b)] if spec.batch_dim is not None \
                        else src
                    del slot
                ring.publish(spec.nbytes, tag)
            with self._cv_lock:
                tr.published = True
                self._writing = None   # with it: no call between the two
                if self._cv._waiters:  # type: ignore[attr-defined]  # _notify, inline
                    self._cv.notify_all()

    @staticmethod
    def _redirects(req: Request, outputs: tuple[TensorSpec, ...]
                   ) -> list[tuple[str, str, int, int]]:
        """(handle, region, offset, nbytes) of the outputs whose memory is host shared memory."""
        found = []
        for spec in outputs:
            dest = req.dests.get(spec.name)
            if dest is not None and dest.nbytes == spec.nbytes and spec.nbytes >= SHARED_MIN_BYTES:
                loc = shared_location(dest)
                if loc is not None:
                    found.append((spec.handle, loc[0], loc[1], spec.nbytes))
        return found

    # -- dynamic batching ------------------------------------------------------------
    def _open_partial(self) -> Transfer:
        tr = Transfer([], tuple(self.setup.outputs.values()), t_open=time.monotonic())
        self._seq = tr.seq = self._seq + 1
        for name, spec in self.setup.inputs.items():
            view = self._acquire(self._in_rings[name])
            slot = np.frombuffer(view, spec.dtype, spec.nbytes // spec.dtype.itemsize
                                 ).reshape(spec.shape)
            fz = self.setup.frozen_main.get(name)
            if fz is not None:
                slot[...] = fz
            tr.slots[name] = slot
        # (in this order: an interrupt cannot come between the two; an interrupt before
        # them leaves the slots held, which the next _open_partial acquires again)
        self._partial = tr
        self._inflight.append(tr)
        return tr

    def _pack(self, req: Request) -> None:
        B = self.setup.batch
        n = req.samples
        # Count the segments first (see _write_whole): none is published yet.
        fill = self._partial.samples if self._partial is not None else 0
        s = segments = 0
        while s < n:
            k = min(B - fill, n - s)
            segments += 1
            s += k
            fill = (fill + k) % B
        req.remaining += segments
        s = 0
        while s < n:
            tr = self._partial if self._partial is not None else self._open_partial()
            k = min(B - tr.samples, n - s)
            for name, src in req.inputs.items():
                spec = self.setup.inputs[name]
                tr.slots[name][spec.index(tr.samples, tr.samples + k)] = src[spec.index(s, s + k)]
            tr.segments.append((req, s, k, tr.samples))
            tr.samples += k
            s += k
            if tr.samples == B:
                self._publish_partial(tr)
        if self._partial is not None:
            self._timers.kick(self._partial)

    def _publish_partial(self, tr: Transfer, pad: bool = False) -> None:
        # idempotent (see _finish_writing): an input already published is left alone
        self._writing = tr
        tag = tr.seq << SEQ_SHIFT
        for name, slot in tr.slots.items():
            ring = self._in_rings[name]
            if self._published_in(ring, tr.seq):
                continue
            spec = self.setup.inputs[name]
            if pad and tr.samples < self.setup.batch and name not in self.setup.frozen_main:
                slot[spec.index(tr.samples, self.setup.batch)] = 0
            ring.publish(spec.nbytes, tag)
        tr.slots = {}
        if self._partial is tr:
            self._partial = None
        self._published(tr)
        self._writing = None    # last: an interrupt before it leaves this to be finished

    def record_error(self, error: BaseException) -> None:
        """A request of this replica failed (Request.fail): count it by class."""
        self.setup.monitor.record_error(error)

    # ------------------------------------------------------------------ drive
    def wait_for(self, req: Request, timeout: float | None) -> bool:
        """Drive this replica until ``req`` is done or ``timeout`` seconds pass."""
        end = None if timeout is None else time.monotonic() + timeout
        lock = self._cv_lock
        timers = self._timers
        while not req.done:
            if self._closed:
                req.fail(self._closed_error())
                break
            mine = False     # this thread holds the drain role (given back in finally)
            try:
                with lock:
                    if req.done:
                        break
                    if self._draining:
                        wait = _SLICE
                        if end is not None:
                            wait = min(wait, end - time.monotonic())
                            if wait <= 0:
                                return False
                        self._cv.wait(wait)
                        continue
                    self._draining = mine = True   # one step: an interrupt cannot split it
                    head = self._inflight[0] if self._inflight else None
                if (end is None and head is not None and head.published
                        and self._partial is None and not timers.has_phantoms):
                    # _drive_step's common case, inline: no timer to fire, no deadline,
                    # the oldest transfer is on the device: drain it
                    try:
                        self._drain(head, _SLICE * 4)
                    except RingTimeoutError:
                        pass
                    except (RingInvalidatedError, ShmError, OSError,
                            SequenceMismatchError) as exc:
                        self._fail_everything(self._translate(exc))
                else:
                    self._drive_step(end)
            finally:
                if mine:
                    with lock:
                        self._draining = False
                        if self._cv._waiters:  # type: ignore[attr-defined]  # _notify, inline
                            self._cv.notify_all()
            if end is not None and time.monotonic() >= end and not req.done:
                return False
        return True

    def _try_drive(self, end: float) -> bool:
        """One drive step if nobody else drives; False if another thread holds the role."""
        mine = False
        try:
            with self._cv:
                if self._draining:
                    return False
                self._draining = mine = True
            self._drive_step(end)
        finally:
            if mine:
                with self._cv:
                    self._draining = False
                    self._notify()
        return True

    def _drive_step(self, end: float | None) -> None:
        """Caller holds the drain role: fire due timers, then drain (or wait for) one transfer."""
        now = time.monotonic()
        timers = self._timers
        # timers are due only with a partial batch or a phantom (else the deadline is inf)
        if ((self._partial is not None or timers.has_phantoms)
                and timers.next_deadline(self._partial) <= now):
            timers.fire(now)
        with self._cv_lock:
            head = self._inflight[0] if self._inflight else None
            unfinished = head is not None and head is self._writing
            if (head is None or not head.published) and not unfinished:
                if self._error is not None and head is not None:
                    self._inflight.popleft()
                    return
                wait = min(timers.next_deadline(self._partial), end if end is not None else float("inf"))
                wait = min(_SLICE, max(0.0, wait - now))
                if wait > 0:
                    self._cv.wait(wait)
                return
        if unfinished:   # its writer was interrupted and nobody submits: finish it here
            if self._submit_lock.acquire(blocking=False):
                try:
                    if self._writing is head and self._error is None:
                        self._finish_writing()
                except (ShmError, OSError) as exc:
                    self._fail_everything(self._translate(exc))
                finally:
                    self._submit_lock.release()
            else:
                with self._cv_lock:
                    self._cv.wait(0.01)
            return
        assert head is not None   # (published: see above)
        limit = (timers.next_deadline(self._partial)
                 if self._partial is not None or timers.has_phantoms else _INF)
        if end is not None and end < limit:
            limit = end
        timeout = _SLICE * 4 if limit == _INF else min(_SLICE * 4, max(0.0, limit - now))
        try:
            self._drain(head, timeout)
        except RingTimeoutError:
            return
        except (RingInvalidatedError, ShmError, OSError, SequenceMismatchError) as exc:
            err = self._translate(exc)
            self._fail_everything(err)

    def _drain(self, tr: Transfer, timeout: float) -> None:
        """Read ``tr``'s outputs into its requests' memory and complete what finished.

        Each output's sequence number is checked (a SequenceMismatchError if it is not
        ``tr``'s); an exception that interrupts a read is sorted out by _read_interrupted."""
        dynamic = self.setup.dynamic
        outputs = tr.outputs
        seq = tr.seq
        while tr.next_output < len(outputs):
            index = tr.next_output
            spec = outputs[index]
            ring = self._out_rings[spec.name]
            # a small output is copied out of its slot and the slot released in one call
            small = spec.nbytes <= _READ_MAX
            view: memoryview | bytes
            try:
                if ring.readable():
                    view, tag = ring.read(timeout) if small else ring.acquire_read(timeout)
                    self._est.record(0)
                else:
                    t0 = time.perf_counter_ns()
                    self._est.poll(ring.readable)
                    view, tag = ring.read(timeout) if small else ring.acquire_read(timeout)
                    self._est.record(time.perf_counter_ns() - t0)
                if tag >> SEQ_SHIFT != seq:
                    if not small:
                        ring.release()
                    raise self._mismatch(spec.name, tag, seq)
                if small:
                    if tag & TAG_KIND_MASK != TAG_SHARED:
                        self._copy_out(tr, spec, view, dynamic)
                else:
                    try:
                        if tag & TAG_KIND_MASK != TAG_SHARED:   # else the IPU wrote it into
                            self._copy_out(tr, spec, view, dynamic)   # the request's memory
                    finally:
                        ring.release()
            except (ShmError, OSError, ModelRuntimeError):
                raise
            except BaseException as exc:   # KeyboardInterrupt, a signal handler's exception
                self._read_interrupted(tr, index, ring, exc)
                raise
            tr.next_output = index + 1
        finished: list[Request] = []
        now = time.perf_counter_ns()
        segs = tr.segments
        settled = 0
        try:
            with self._cv_lock:
                if self._inflight and self._inflight[0] is tr:
                    self._inflight.popleft()
                # No call between counting a segment down and marking its request done:
                # an interrupt (checked at calls and loop ends) never splits them, and
                # ``settled`` says how far it got (the finally clause does the rest).
                while settled < len(segs):
                    req = segs[settled][0]
                    req.remaining -= 1
                    settled += 1
                    if req.remaining == 0 and not req.done:
                        req.t_completed = now
                        req.done = True
                        finished.append(req)
        finally:
            if settled < len(segs):
                with self._cv_lock:
                    while settled < len(segs):
                        req = segs[settled][0]
                        req.remaining -= 1
                        settled += 1
                        if req.remaining == 0 and not req.done:
                            req.t_completed = now
                            req.done = True
        mon = self.setup.monitor
        for req in finished:
            if not req.internal:
                mon.record(req.t_received, req.t_prepared, req.t_completed)

    @staticmethod
    def _copy_out(tr: Transfer, spec: TensorSpec, view: memoryview | bytes,
                  dynamic: bool) -> None:
        segs = tr.segments
        if len(segs) == 1 and not dynamic:
            req, t, _, _ = segs[0]
            dest = req.dests.get(spec.name)
            if dest is None:
                return
            nbytes = spec.nbytes
            if dest.nbytes == nbytes and dest.flags.c_contiguous:
                if 0 < nbytes < PARALLEL_MIN_BYTES:   # copy_bytes' one copy, without its calls
                    memoryview(dest).cast("B")[:] = view[:nbytes]  # type: ignore[arg-type]
                elif nbytes:
                    copy_bytes(_bytes_view(dest), view[:nbytes])
                return
        slot = np.frombuffer(view, spec.dtype, spec.nbytes // spec.dtype.itemsize
                             ).reshape(spec.shape)
        f = 1 if dynamic else spec.batch
        for req, rs, cnt, ss in segs:
            dest = req.dests.get(spec.name)
            if dest is None:
                continue
            if spec.batch_dim is None:
                dest[...] = slot
            else:
                dest[spec.index(rs * f, (rs + cnt) * f)] = slot[spec.index(ss * f, (ss + cnt) * f)]
