"""Completing a replica's requests: its transfers in flight, in the device's order, and
the threads that wait for them.

There are no runner threads: whoever waits for a request *drives* its replica.
It takes the drain role, reads the oldest transfer's outputs into its requests'
memory (``TransferPath.take``) and completes the requests it finished, until its
own is done. A waiter that finds another thread draining sleeps until the
drainer notifies it, its own deadline, or the replica's next timer (which it
then fires itself): a waiter sleeps until the earliest of its deadline and its
data, never in fixed slices.

Silence is the replica's, not a waiter's: ``_since`` is when the device last made
progress (a transfer completed) or was given work while idle (its oldest transfer
published). Any wait on any request of the replica, timed, untimed or ``done()``,
compares it with the host sync timeout; the first to find the device silent that long
fails every request in flight on the replica at once (``_give_up``), so a future
polled with ``wait(0.1)`` or ``done()`` fails as soon as one waited on without a
timeout would, and six futures fail together, not one host sync timeout each.

:class:`Completion` is also the requests' :class:`~host_runtime.runner._requests.Driver`
(``OutputFuture.wait`` calls :meth:`Completion.wait_for`).
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable

from shm import Ring, RingInvalidatedError, RingTimeoutError, ShmError

from ipu_emulator.trace import recorder

from host_runtime.errors import InvalidStateError, ModelRuntimeError, SequenceMismatchError
from host_runtime.runner._life import ReplicaLife
from host_runtime.runner import _tracing
from host_runtime.runner._replica_timers import Phantom, ReplicaTimers
from host_runtime._sleepers import Sleepers
from host_runtime.runner._requests import Request, Transfer
from host_runtime.runner._transfer import TransferPath, consumed_from
from host_runtime.runner.monitoring import RequestMonitor

__all__ = ["Completion"]

_INF = float("inf")
_LOST = (RingInvalidatedError, ShmError, OSError, SequenceMismatchError)
"""What a read raises when the device is lost (or its streams are out of step)."""
_RETRY = 0.001
"""Seconds before a timer that could not act (a submitter held its lock) is fired again."""


class Completion:
    """The transfers in flight of one replica and the drain role (module docstring)."""

    def __init__(self, life: ReplicaLife, timers: ReplicaTimers, monitor: RequestMonitor) -> None:
        self._life = life
        self._timers = timers
        self._monitor = monitor
        # The hot path takes the condition's lock itself (``with self._cv`` is a Python-level
        # __enter__/__exit__: ~0.2 us more per use).
        self._lock = threading.Lock()
        self._cv = Sleepers(self._lock)   # (threading.Condition is not interrupt-safe)
        self._waiters = 0              # threads in self._cv.wait (notify only if any)
        self.inflight: collections.deque[Transfer] = collections.deque()
        self.open: Transfer | None = None    # the partial batch being packed (registered)
        self.draining = False
        self.stalled = False    # a wait gave up on the device (host sync timeout), no
                                # transfer has completed since
        self._drained = 0       # transfers completed
        # monotonic time of the device's last progress, or of its oldest transfer's
        # publishing if it was idle before (the host sync timeout counts from it)
        self._since = time.monotonic()
        # Submission.try_finish (held weakly): lay an interrupted writer's transfer
        self.finish_unfinished: Callable[[Transfer], bool] | None = None

    # -- what submitters tell (with the submit lock held) --------------------------------
    def register(self, tr: Transfer) -> None:
        """``tr`` (numbered) takes its place in the device's order before its first input
        is published; drainers wait for it until ``published``."""
        self.inflight.append(tr)     # one step (no call): an interrupt cannot split it

    def published(self, tr: Transfer) -> None:
        """``tr`` is published: the device will write its outputs after those before it."""
        with self._lock:
            tr.published = True
            if self.inflight and self.inflight[0] is tr:   # the device was idle till now
                self._since = time.monotonic()
            if self._waiters:
                self._cv.notify_all()

    def register_open(self, tr: Transfer) -> None:
        """``tr`` holds input slots being packed (its place in the device's order is taken)."""
        self.open = tr               # (in this order, no call between: see register)
        self.inflight.append(tr)

    def publish_open(self, tr: Transfer) -> None:
        """The open ``tr`` is published (full, or flushed)."""
        with self._lock:
            tr.published = True
            if self.inflight and self.inflight[0] is tr:   # the device was idle till now
                self._since = time.monotonic()
            if self.open is tr:
                self.open = None
            if self._waiters:
                self._cv.notify_all()

    # -- a stalled device (the host sync timeout) ----------------------------------------
    def stall(self, err: ModelRuntimeError | None = None) -> None:
        """A wait gave up on the device (``err``): see ``ReplicaLife.stalled``."""
        self.stalled = self._life.stalled(err, self.fail_all)

    def settle(self) -> None:
        """Submit lock held, the replica stalled: drive it until a transfer completes (or
        nothing is on the device), for no longer than the host sync timeout."""
        life = self._life
        give_up = time.monotonic() + life.sync_s
        while self.stalled:
            head = self.inflight[0] if self.inflight else None
            if head is None or not head.published:
                self.stalled = False
                return
            if time.monotonic() >= give_up:
                raise life.stalled_error("waiting for the device to finish earlier requests")
            if not self.try_drive(give_up):
                with self._lock:
                    self._sleep(give_up)

    def _silent(self, now: float) -> bool:
        """The device has work (its oldest transfer published) and made no progress for
        the host sync timeout (see the module docstring)."""
        head = self.inflight[0] if self.inflight else None
        return (head is not None and head.published and self._life.error is None
                and now - self._since >= self._life.sync_s)

    def _give_up(self, req: Request) -> None:
        """The device was silent for the host sync timeout: every request in flight on the
        replica fails with the named error (their outputs, when they come, go nowhere: the
        transfers stay in the device's order and are drained into nothing), the replica is
        stalled, and if ``req`` is among them its error is raised."""
        err = self._life.stalled_error("waiting for the outputs of a request")
        with self._lock:
            if not self._silent(time.monotonic()):   # another waiter saw to it, or progress
                return
            self._since = time.monotonic()   # one give-up per silent host sync timeout
            pending = [seg[0] for tr in self.inflight if tr.published for seg in tr.segments]
        mine = False
        for r in pending:
            if not r.done:
                mine = mine or r is req
                r.dests = {}
                r.fail(err)
        self.stall(err)
        if mine:
            try:
                raise err
            finally:   # (this frame holding the error it raised: a reference cycle)
                del err

    # -- waiting ---------------------------------------------------------------------
    def record_error(self, error: BaseException, request: Request | None = None, *,
                     received: int = 0, samples: int = 0) -> None:
        """A request failed (``request``, from Request.fail; or the fused path's, which
        arrived at ``received``): count it by class; on a timeline, its slice."""
        self._monitor.record_error(error)
        if recorder.ON:
            if request is not None:
                received, samples = request.t_received, request.samples
            _tracing.failed(self._life.trace_key, self._life.rid, samples, received, error)

    def _timer_due(self) -> float:
        """When the next timer is due (monotonic; inf: none)."""
        timers = self._timers
        if self.open is None and not timers.has_phantoms:
            return _INF
        return timers.next_deadline(self.open)

    def _sleep(self, end: float | None) -> bool:
        """Lock held: sleep until notified, ``end`` or the next timer; False if ``end``
        has passed."""
        now = time.monotonic()
        if end is not None and now >= end:
            return False
        until = self._timer_due()
        wait = until - now
        if wait <= 0:
            wait = _RETRY         # a timer is due but could not act: fired again after this
        if end is not None:
            wait = min(wait, end - now)
        self._waiters += 1
        try:
            self._cv.wait(self._life.wait_slice if wait == _INF else wait)
        finally:
            self._waiters -= 1
        return True

    def fire_timers(self) -> None:
        """Fire the timers that are due (from any thread; they guard themselves)."""
        self._timers.fire(time.monotonic())
        with self._lock:
            if self._waiters:
                self._cv.notify_all()

    def wait_for(self, req: Request, timeout: float | None) -> bool:
        """Drive this replica until ``req`` is done or ``timeout`` seconds pass.

        Interrupted (KeyboardInterrupt, a signal handler's exception), the drain role is
        given back and ``req`` stays in flight: a later wait still gets its answer."""
        end = None if timeout is None else time.monotonic() + timeout
        lock = self._lock
        life = self._life
        while not req.done:
            if life.closed:
                req.fail(life.closed_error())
                break
            mine = False     # this thread holds the drain role (given back in finally)
            try:
                with lock:
                    if req.done:
                        break
                    if self.draining:
                        self._sleep(end)   # till notified, a timer or end (checked below)
                    else:
                        self.draining = mine = True   # one step: an interrupt cannot split it
                        head = self.inflight[0] if self.inflight else None
                if not mine:
                    if self._timer_due() <= time.monotonic():
                        self.fire_timers()
                elif (end is None and head is not None and head.published
                        and self.open is None and not self._timers.has_phantoms):
                    # _drive_step's common case, inline: no timer, no deadline, the
                    # oldest transfer is on the device: drain it
                    try:
                        self._drain(head, self._life.wait_slice)
                    except RingTimeoutError:
                        pass
                    except _LOST as exc:
                        self.fail_all(life.translate(exc))
                else:
                    self._drive_step(end)
            finally:
                if mine:
                    with lock:
                        self.draining = False
                        if self._waiters:
                            self._cv.notify_all()
            if req.done:
                break
            now = time.monotonic()
            if self._silent(now):
                self._give_up(req)   # the device has work and did none of it: all fail
                if req.done:
                    break
            if end is not None and now >= end:
                return False
        return True

    def try_drive(self, end: float) -> bool:
        """One drive step if nobody else drives (a submitter making room in a full ring);
        False if another thread holds the role."""
        mine = False
        try:
            with self._lock:
                if self.draining:
                    return False
                self.draining = mine = True
            self._drive_step(end)
        finally:
            if mine:
                with self._lock:
                    self.draining = False
                    if self._waiters:
                        self._cv.notify_all()
        return True

    def _drive_step(self, end: float | None) -> None:
        """Drain role held: fire due timers, then drain (or wait for) one transfer, for
        no longer than the earliest of ``end`` and the next timer."""
        now = time.monotonic()
        if self._timer_due() <= now:
            self._timers.fire(now)    # may complete the caller's request: it looks first
            if self._timer_due() <= now:     # could not act (a submitter is busy): shortly
                with self._lock:
                    self._waiters += 1
                    try:
                        self._cv.wait(_RETRY)
                    finally:
                        self._waiters -= 1
            return
        limit = min(self._timer_due(), _INF if end is None else end)
        with self._lock:
            head = self.inflight[0] if self.inflight else None
            unfinished = (head is not None and not head.published and head is not self.open
                          and self._life.error is None)
            if (head is None or not head.published) and not unfinished:
                if self._life.error is not None and head is not None:
                    self.inflight.popleft()
                    return
                wait = limit - now
                if wait > 0 or limit == _INF:
                    self._waiters += 1
                    try:
                        self._cv.wait(self._life.wait_slice if limit == _INF else wait)
                    finally:
                        self._waiters -= 1
                return
        assert head is not None   # (unfinished, or published: see above)
        if unfinished:
            # being laid, or its writer was interrupted and nobody submits: finish it here
            finish = self.finish_unfinished
            if finish is None or not finish(head):
                with self._lock:      # a submitter lays it: it notifies once published
                    if not head.published:
                        self._waiters += 1
                        try:
                            self._cv.wait(_RETRY * 10)
                        finally:
                            self._waiters -= 1
            return
        try:
            self._drain(head, self._life.wait_slice if limit == _INF else max(0.0, limit - now))
        except RingTimeoutError:
            return
        except _LOST as exc:
            self.fail_all(self._life.translate(exc))

    def _drain(self, tr: Transfer, timeout: float) -> None:
        """Read ``tr``'s outputs into its requests' memory and complete what finished."""
        path = self._life.path
        assert path is not None
        rid = self._life.rid
        if tr.unsettled:   # another interrupt came while the interrupted reader sorted it out
            _read_interrupted(rid, tr, path, "KeyboardInterrupt")
        try:
            path.take(tr, timeout, len(self.inflight) > 1)
        except (ShmError, OSError, ModelRuntimeError):
            raise
        except BaseException as exc:   # KeyboardInterrupt, a signal handler's exception
            tr.unsettled = True        # first (no call before it): see _read_interrupted
            _read_interrupted(rid, tr, path, type(exc).__name__)
            raise
        finished: list[Request] = []
        now = time.perf_counter_ns()
        progress = time.monotonic()
        segs = tr.segments
        count = len(segs)
        with self._lock:
            self._since = progress
            self.stalled = False
            # Resumable: ``tr.settled`` says how many segments were counted down, and no
            # call (where an interrupt lands) comes between counting one down and moving
            # it on, nor between a request's last segment and marking it done. An
            # interrupted drainer leaves ``tr`` at the head, its outputs read: the next
            # one (take returns at once) counts down the rest and removes it.
            while tr.settled < count:
                req = segs[tr.settled][0]
                req.remaining -= 1
                tr.settled += 1
                if req.remaining == 0 and not req.done:
                    req.t_completed = now
                    req.done = True
                    finished.append(req)
            if self.inflight and self.inflight[0] is tr:
                self.inflight.popleft()
        self._drained += 1
        mon = self._monitor
        for req in finished:
            if not req.internal:
                started = mon.record(req.t_received, req.t_prepared, req.t_completed, req.t_laid)
                if recorder.ON:
                    _tracing.request(self._life.trace_key, req, started)

    # -- failure and close -------------------------------------------------------------
    def fail_all(self, err: ModelRuntimeError) -> None:
        """The device is lost (or failed): every request in flight or parked fails with
        ``err``, every waiter wakes."""
        with self._lock:
            self._life.set_error(err, nobody_heard=not self.inflight and self.open is None)
            pending = list(self.inflight)
        phantoms = self._timers.take_phantoms()
        self._life.invalidate_rings()   # wakes every thread blocked on one of them
        _fail_requests(pending, phantoms, err)
        with self._lock:
            self._cv.notify_all()

    def close_all(self, err: ModelRuntimeError) -> None:
        """The replica closes: forget what is in flight, fail its requests with ``err``."""
        with self._lock:
            pending = list(self.inflight)
            self.inflight.clear()
            self.open = None
            self._cv.notify_all()
        _fail_requests(pending, self._timers.take_phantoms(), err)

    def clear(self) -> None:
        """The replica is reset (new rings): nothing of the old ones is in flight."""
        with self._lock:
            self.inflight.clear()
            self.open = None


def _fail_requests(pending: list[Transfer], phantoms: list[Phantom],
                   err: ModelRuntimeError) -> None:
    """Every request of the ``pending`` transfers and every parked one fails with ``err``."""
    for tr in pending:
        for seg in tr.segments:
            seg[0].fail(err)
    for ph in phantoms:
        ph.request.fail(err)


def _read_interrupted(rid: int, tr: Transfer, path: TransferPath, why: str) -> None:
    """A drainer of replica ``rid`` reading output ``tr.next_output`` of ``tr`` was
    interrupted (``why``: the exception's class; ``tr.unsettled`` set). If the output was
    consumed (its slot acquired, or the ring's last read carries ``tr``'s number) it is
    lost: ``tr``'s requests fail and the rest of ``tr`` is drained into nothing. Else
    ``tr`` is intact and the next drainer goes on.

    Idempotent while ``tr.unsettled``: interrupted in here, the next drainer of ``tr``
    does it again (nothing reads the ring meanwhile: ``tr`` is the oldest in flight).
    ``next_output`` moves on and ``unsettled`` is cleared in one step, after the
    requests have failed (else a request could complete without the lost output)."""
    index = tr.next_output
    if index >= len(tr.outputs):   # every output was read: the interrupt came after
        tr.unsettled = False
        return
    ring = path.output_ring(tr, index)
    if ring.unreleased():
        ring.release()
    elif not consumed_from(ring, tr.seq):
        tr.unsettled = False
        return    # not consumed: the output is still on its way
    name = tr.outputs[index].name
    err = InvalidStateError(
        f"replica {rid}: output {name!r} of the request was lost: the thread "
        f"reading it was interrupted by {why}")
    for seg in tr.segments:
        seg[0].dests = {}
        seg[0].fail(err)
    tr.next_output = index + 1     # (no call between these two)
    tr.unsettled = False
