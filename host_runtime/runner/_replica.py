"""One replica of a ModelRunner: a Session whose Main runs in a device-side loop.

::

    caller thread (execute / executeAsync)          IPU process (Main in a loop)
    --------------------------------------          ----------------------------
    Submission: under the submit lock, lay ---> input rings ---> read inputs
            each transfer into the rings                          run the graph
            (TransferPath: whole, packed,                         write outputs
            host shared memory, fused)                                 |
    Completion: whoever waits *drives*:   <--- output rings <----------+
            it takes the drain role, reads
            the oldest transfer's outputs
            into the requests' memory and
            completes them (the futures)

A replica is four parts, each a class a reader can hold in mind, and data flows
one way (runner -> replica -> transfer -> ring; results come back through the
request's future, whose driver is the replica's Completion):

- :class:`~host_runtime.runner._life.ReplicaLife`: attach, load, notice a lost
  device, reset (``auto_reset``), close;
- :class:`~host_runtime.runner._submission.Submission`: sending requests;
- :class:`~host_runtime.runner._completion.Completion`: transfers in flight and
  the threads that wait for them;
- :class:`~host_runtime.runner._replica_timers.ReplicaTimers`: partial dynamic
  batches and requests that cannot run (inputs missing with ``validate_io_params``
  off), fired by waiting threads or, when ``flush_on_waiting_outputs`` is off, by a
  small watchdog thread.

:class:`Replica` wires them and is the timers' owner. There are no runner threads:
a request touches only its caller's thread (and the IPU process).

Failure: the main-loop future failing (device lost, device program error)
invalidates this replica's rings, which wakes every waiter at once; all
requests in flight fail with that error. The next request restarts the
replica when ``auto_reset`` is on, else it raises ``DeviceLostError``.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from shm import Ring

from host_runtime._again import again
from host_runtime._lifetime import weak_method
from host_runtime.errors import ModelRuntimeError
from host_runtime.runner._batching import TensorSpec
from host_runtime.runner._completion import Completion
from host_runtime.runner._intake import RequestIntake
from host_runtime.runner._life import ReplicaLife, ReplicaSession, SaveFn
from host_runtime.runner._replica_timers import ReplicaTimers
from host_runtime.runner._requests import Driver, Request, Transfer
from host_runtime.runner import _tracing
from host_runtime.runner._submission import Submission
from host_runtime.runner._transfer import PathOptions
from host_runtime.runner.config import FlushCallback
from host_runtime.runner.monitoring import RequestMonitor
from host_runtime.session import DROP_STOP_TIMEOUT
from host_runtime.settings import HostSettings

__all__ = ["Replica", "ReplicaSession", "ReplicaSetup", "SaveFn", "rerun_load_everywhere"]


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
    intake: RequestIntake                   # makes the flush callback's data a request
    options: PathOptions                    # the fast paths taken
    settings: HostSettings                  # the runner's (taken when it was made)
    unnumbered: frozenset[str] = frozenset()   # outputs carrying no request's number


class Replica:
    """One replica (see the module docstring): the timers' ``TimerOwner``."""

    def __init__(self, setup: ReplicaSetup) -> None:
        self.setup = setup
        self.rid = rid = setup.replica_id
        # the device waits for the first input Main reads (setup.inputs is in read order);
        # frozen ones are always there
        waits_for = next((n for n in setup.inputs if n not in setup.frozen_main), "")
        self._timers = timers = ReplicaTimers(
            self, rid, timeout_ns=setup.timeout_ns, partial_flush_ns=setup.partial_flush_ns,
            flush_callback=setup.flush_callback,
            make_flush_request=weak_method(self._flush_request),
            merge_phantom=setup.intake.merge_phantom, waits_for=waits_for,
            watchdog=setup.watchdog)
        self._life = life = ReplicaLife(
            rid, setup.open_session, setup.inputs, setup.outputs, setup.frozen_main,
            setup.dynamic, setup.batch, setup.options, setup.auto_reset,
            on_lost=weak_method(self._lost), settings=setup.settings,
            unnumbered=setup.unnumbered)
        self._completion = completion = Completion(life, timers, setup.monitor)
        self._submission = Submission(life, completion, timers, setup.monitor, setup.dynamic,
                                      setup.batch)
        completion.finish_unfinished = weak_method(self._submission.try_finish)
        self.driver: Driver = completion
        """What the requests of this replica wait on (``Request.driver``)."""
        # the hot calls, bound once (one call frame less; neither refers back to self)
        self.run_idle = self._submission.run_fused
        self.submit = self._submission.submit
        life.open()

    @property
    def session(self) -> ReplicaSession | None:
        return self._life.session

    def input_rings(self) -> dict[str, Ring]:
        """The host ends of the current session's Main input rings, by anchor name (for
        inspection: their depth, the thread hint)."""
        path = self._life.path
        return {i.name: i.ring for i in reversed(path.inputs)} if path is not None else {}

    def output_rings(self) -> dict[str, Ring]:
        """The host ends of the current session's Main output rings, by anchor name."""
        path = self._life.path
        return {n: o.ring for n, o in path.outputs.items()} if path is not None else {}

    @property
    def _loop(self) -> cf.Future[None] | None:
        """The device's main-loop future (tests)."""
        return self._life.loop

    def _lost(self, err: ModelRuntimeError) -> None:
        self._completion.fail_all(err)

    def _flush_request(self, inputs: Any, outputs: Any) -> Optional[Request]:
        return self.setup.intake.build(self.driver, self.rid, inputs or {},
                                       outputs if outputs else {}, time.perf_counter_ns(),
                                       internal=True).request

    # -- running requests ----------------------------------------------------------------
    # run_idle(inputs, t_received): the fused path (Submission.run_fused): the outputs of a
    #   plain request, or None if the replica is not idle (nothing done)
    # submit(req, transfers, phantom=None): send req; its result comes through its future

    def execute(self, req: Request, transfers: int, phantom: str | None = None) -> None:
        """Send ``req`` and wait for it; raises its error."""
        self.submit(req, transfers, phantom)
        self.wait(req)

    def announce(self) -> None:
        """Tracing started after this replica was made: name it on the timeline (its
        runner, model and IPU processes), as its attach did when traced."""
        life = self._life
        if life.session is not None:
            _tracing.life("running", life.trace_key, life.rid, time.monotonic_ns(),
                          life.session)

    def wait(self, req: Request) -> None:
        """Wait for ``req``, sent; raises its error."""
        self._completion.wait_for(req, None)   # interrupted: req stays in flight, answered
        if req.error is not None:
            raise again(req.error)

    def rerun_load(self, values: dict[str, memoryview]) -> None:
        """New data for the Load programs' inputs (handle -> bytes), loaded in place on this
        replica's device (``ReplicaLife.rerun_load``) once what is in flight has finished."""
        completion, sub = self._completion, self._submission
        for tr in list(completion.inflight):
            for seg in tr.segments:
                completion.wait_for(seg[0], None)
        with sub.lock:
            sub.reload(values)

    def reload_due(self, values: dict[str, memoryview]) -> None:
        """``values`` (handle -> bytes) are loaded before the next request (an interrupted
        ``update_load_inputs`` did not reach this replica): as after an interrupted
        ``rerun_load``."""
        life = self._life
        if not life.closed:
            life.reloading = {**(life.reloading or {}), **values}

    # -- TimerOwner (see _replica_timers) -----------------------------------------------
    @property
    def closed(self) -> bool:
        return self._life.closed

    @property
    def partial(self) -> Transfer | None:
        return self._completion.open

    def try_publish_partial(self, tr: Transfer, extra: Request | None) -> bool:
        return self._submission.try_publish_partial(tr, extra)

    def try_send(self, request: Request, transfers: int) -> bool:
        return self._submission.try_send(request, transfers)

    def fire_timers(self) -> None:
        self._completion.fire_timers()

    # -- lifetime ----------------------------------------------------------------------
    def close(self, save: SaveFn | None = None, dropped: bool = False) -> None:
        """Stop the loop, optionally run the save programs, close the session (idempotent).

        Bounded: a device that does not stop within the stop timeout, or the host sync
        timeout without an answer (a stopped or stuck IPU process), is killed and the
        replica's resources released. ``dropped``: the runner was dropped; the bound is
        ``DROP_STOP_TIMEOUT``."""
        life = self._life
        if not life.mark_closed():
            return
        self._completion.close_all(life.closed_error())
        self._timers.close()
        life.close(save, DROP_STOP_TIMEOUT if dropped else self.setup.settings.stop_timeout)


def rerun_load_everywhere(replicas: list[Replica], call_lock: Callable[[int], Any],
                          values: dict[str, memoryview]) -> None:
    """``update_load_inputs``: ``values`` (handle -> bytes) loaded on every replica in turn
    (each under its call lock, ``call_lock(rid)``, None: none). Cut short (KeyboardInterrupt,
    a signal handler's exception, a replica's failure), the replicas not reached yet load
    them before their next request, as one it was interrupted on does: none answers with
    the old values."""
    reached = 0   # the replicas before it have the new values
    try:
        for rid, rep in enumerate(replicas):
            lock = call_lock(rid)
            with lock if lock is not None else contextlib.nullcontext():
                rep.rerun_load(values)
            reached = rid + 1
    except BaseException:
        for rep in replicas[reached:]:
            rep.reload_due(values)
        raise
