"""Submitting a replica's requests: laying them into its input rings, in order.

Submits are serialised by one lock, so the order in which transfers are
published is the order the device sees them, and the order in which
:class:`~host_runtime.runner._completion.Completion` drains them. A submitter
that finds an input ring full drives the replica (or waits for the drainer)
instead of blocking, so unwaited futures cannot deadlock it.

- batching off: each transfer of a request is laid whole (``TransferPath.lay_whole``);
- dynamic batching: samples are packed into the open partial transfer, published
  when full; the replica's timers flush it (``try_publish_partial``);
- a request missing an input the device would wait for (``validate_io_params``
  off) is never sent: it is parked with the timers as a *phantom*;
- the fused path (:meth:`Submission.run_fused`): a plain ``execute`` on an idle
  replica is written, waited for and read under the submit lock, with no
  ``Request`` or ``Transfer`` (``IPU_EMULATOR_RUNNER_FUSED=0`` turns it off).

Every transfer gets the next number of the replica (``Transfer.seq``, see
``_transfer``). An exception that is none of ours (KeyboardInterrupt, an
exception a signal handler raises) may interrupt a submitter anywhere: a
transfer half written is completed with the request's own data so that the
device's iteration completes (``_writing`` / ``_finish_writing``, idempotent:
done by the interrupted thread, else by the next one in), the request fails as
abandoned and its outputs go nowhere; the transfer ``run_fused`` was reading
becomes one in flight whose remaining outputs the next drainer reads and drops.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable

import numpy as np

from shm import Ring, RingInvalidatedError, RingTimeoutError, ShmError, WouldBlock

from host_runtime._again import again
from host_runtime.errors import (DeviceLostError, DeviceTimeoutError, InvalidStateError,
                                 ModelRuntimeError,
                                 SequenceMismatchError)
from ipu_emulator.trace import recorder

from host_runtime.runner import _tracing
from host_runtime.runner._completion import Completion
from host_runtime.runner._life import ReplicaLife
from host_runtime.runner._replica_timers import ReplicaTimers
from host_runtime.runner._requests import Request, Transfer
from host_runtime.runner._transfer import NotTaken, TransferPath, consumed_from
from host_runtime.runner.monitoring import RequestMonitor

__all__ = ["Submission"]

_native_id = threading.get_native_id
_thread_ids = threading.local()
"""``.native_id``: ``_native_id()`` of this thread (a system call), kept per thread."""
os.register_at_fork(after_in_child=lambda: _thread_ids.__dict__.clear())   # its own thread
_clock = time.perf_counter_ns
_ROOM_WAIT = 0.05
"""Seconds a submitter waits for a full ring's slot before it looks again (it drives)."""
_WRITE_ERRORS = (ShmError, OSError)


class _Submitter:
    """The submit lock, the replica made ready for a request, free input slots: what every
    way of submitting needs (``Submission`` is the ways)."""

    def __init__(self, life: ReplicaLife, completion: Completion, timers: ReplicaTimers,
                 monitor: RequestMonitor, dynamic: bool, batch: int) -> None:
        # Re-entrant only to know its holder (_held): an interrupt may come as acquire()
        # returns, before a try could see it, so every taker acquires inside its try and
        # its finally releases at once (RuntimeError: this thread did not take it; asking
        # first would be a call, where an interrupt may come before the release); a taker
        # that finds this thread holding it (a drainer inside a submitter) treats it as
        # busy, as with a Lock.
        self.lock = threading.RLock()
        self._held: Callable[[], bool] = getattr(self.lock, "_is_owned")   # by this thread
        self._life = life
        self._completion = completion
        self._timers = timers
        self._monitor = monitor
        self._dynamic = dynamic
        self._batch = batch
        self._hint_tid = 0             # the thread id last written into the input rings
        self._hint_path: TransferPath | None = None   # ... into these rings
        self._seq = 0                  # the number of the last transfer sent
        self._writing: Transfer | None = None   # the transfer whose inputs are being laid
        # run_fused's request (number, inputs, t_received) until it is read or abandoned
        self._fused: tuple[int, dict[str, np.ndarray], int] | None = None

    # ------------------------------------------------------------------ helpers
    def _usable(self) -> TransferPath:
        """Lock held: the replica usable (reset if it must be; raises if it cannot be
        used); its rings."""
        life = self._life
        if life.reloading is not None and life.error is None and not life.closed:
            self.reload({})   # an interrupted rerun_load: finished first
        if not life.looks_well() and not life.usable():
            self._completion.clear()
            self._writing = None
            self._fused = None
            self._monitor.reset_chain()
            self._monitor.record_reset(life.error)
            life.reset()
        path = life.path
        assert path is not None
        return path

    def reload(self, values: dict[str, memoryview]) -> None:
        """Lock held: new values for inputs of the Load programs (``ReplicaLife.rerun_load``)
        once no request is in flight; what is left of abandoned requests (transfers whose
        requests are done, a write or a fused read that was interrupted) is forgotten: the
        main loop's stop resets the rings."""
        completion = self._completion
        if completion.open is not None or any(not seg[0].done for tr in completion.inflight
                                              for seg in tr.segments):
            raise InvalidStateError(
                f"replica {self._life.rid}: requests were sent while the Load programs' "
                "inputs were being replaced; replace them when no request is in flight")
        self._life.rerun_load(values, self._forget)

    def _forget(self) -> None:
        """The rings were reset: nothing is in flight, being written or read."""
        self._completion.clear()
        self._writing = None
        self._fused = None

    def _number(self, tr: Transfer) -> None:
        self._seq = tr.seq = self._seq + 1

    def _hint(self, path: TransferPath) -> None:
        """Tell the IPU process which thread submits (lock held)."""
        try:
            tid = _thread_ids.native_id   # a system call: once per thread
        except AttributeError:
            tid = _thread_ids.native_id = _native_id()
        if tid != self._hint_tid or path is not self._hint_path:
            path.hint_thread(tid)
            self._hint_tid, self._hint_path = tid, path

    def _acquire(self, ring: Ring) -> memoryview:
        """A free slot of ``ring``; drives the replica (or waits) while it is full, for no
        longer than the host sync timeout without a free slot."""
        try:
            return ring.try_acquire_write()
        except WouldBlock:
            pass
        if not recorder.ON:
            return self._wait_for_slot(ring)
        t0 = time.monotonic_ns()
        try:
            return self._wait_for_slot(ring)
        finally:
            _tracing.wait("wait for a free slot", t0)

    def _wait_for_slot(self, ring: Ring) -> memoryview:
        give_up = 0.0
        while True:
            try:
                return ring.try_acquire_write()
            except WouldBlock:
                pass
            self._life.raise_if_closed()
            now = time.monotonic()
            if not give_up:
                give_up = now + self._life.sync_s
            elif now >= give_up:
                raise self._life.stalled_error("waiting for a free slot of an input ring")
            if self._completion.try_drive(time.monotonic() + _ROOM_WAIT):
                continue
            try:
                return ring.acquire_write(timeout=_ROOM_WAIT)
            except RingTimeoutError:
                continue

    def _take_lock(self) -> None:
        """The submit lock (busy: a non-blocking try failed), waited for no longer than the
        host sync timeout (another thread's request holds it while it waits for a device
        that makes no progress). A timed acquire costs ~0.35 us more: tried second."""
        if not self.lock.acquire(timeout=self._life.sync_s):
            raise self._life.stalled_error("waiting for another thread's request to this "
                                           "replica")

    def _seal(self, path: TransferPath, tr: Transfer, pad: bool) -> None:
        self._writing = tr           # idempotent (see TransferPath.seal)
        path.seal(tr, pad)
        self._completion.publish_open(tr)
        self._writing = None    # last: an interrupt before it leaves this to be finished

    def _write_failed(self, exc: BaseException) -> ModelRuntimeError:
        err = self._life.translate(exc)
        if isinstance(err, DeviceLostError):
            self._completion.fail_all(err)
        return err

class Submission(_Submitter):
    """The submit side of one replica (see the module docstring)."""

    # ------------------------------------------------------------------ submit
    def submit(self, req: Request, transfers: int, phantom: str | None = None) -> None:
        """Send ``req`` to the device (or park it as a phantom that will time out)."""
        req.t_prepared = _clock()
        lock = self.lock
        try:
            if not lock.acquire(False):
                self._take_lock()
            if recorder.ON:
                _tracing.lay_started(req)
            life = self._life
            path = life.path if life.looks_well() else self._usable()
            assert path is not None
            if self._completion.stalled:
                self._completion.settle()
            try:
                if self._fused is not None:
                    self._abandon_fused(path, "KeyboardInterrupt")
                if self._writing is not None:
                    self._finish_writing(path)
                self._hint(path)
                if phantom is not None:
                    self._timers.add_phantom(req, phantom, self._completion.open)
                elif self._dynamic:
                    self._pack(path, req)
                else:
                    self._write_whole(path, req, transfers)
            except _WRITE_ERRORS as exc:
                err = self._write_failed(exc)
                req.fail(err)
                raise again(err) from None
            except InvalidStateError as exc:
                req.fail(again(exc))
                raise
            except DeviceTimeoutError as exc:   # no free slot: the device stalled
                req.fail(exc)
                req.dests = {}
                self._completion.stall(exc)
                raise
            except ModelRuntimeError:
                raise
            except BaseException as exc:   # KeyboardInterrupt, a signal handler's exception
                self._abandon_request(req, exc)
                raise
            req.t_laid = _clock()
        finally:
            try:   # first: no call (where an interrupt lands) before it (see __init__)
                lock.release()
            except RuntimeError:   # not taken
                pass

    def try_send(self, request: Request, transfers: int) -> bool:
        """A phantom made whole by the flush callback: send it, unless a submitter is busy."""
        lock = self.lock
        if self._held():   # this thread sends (see __init__): busy
            return False
        try:
            if not lock.acquire(False):
                return False
            path = self._life.path
            if path is not None:
                if self._fused is not None:
                    self._abandon_fused(path, "KeyboardInterrupt")
                if self._writing is not None:
                    self._finish_writing(path)
                if self._dynamic:
                    self._pack(path, request)
                else:
                    self._write_whole(path, request, transfers)
        except _WRITE_ERRORS as exc:
            self._completion.fail_all(self._life.translate(exc))
        except ModelRuntimeError:
            raise
        except BaseException as exc:
            self._abandon_request(request, exc)
            raise
        finally:
            try:   # first: no call (where an interrupt lands) before it (see __init__)
                lock.release()
            except RuntimeError:   # not taken
                pass
        return True

    def _write_whole(self, path: TransferPath, req: Request, transfers: int) -> None:
        outputs = req.outputs_per_transfer
        # Count every transfer before the first is published: another thread may drain
        # (and count down) the first before this loop writes the next.
        req.remaining += transfers
        redirects = path.redirects(req) if transfers == 1 and path.may_redirect else ()
        completion = self._completion
        inflight = completion.inflight
        for t in range(transfers):
            tr = Transfer([(req, t, 1, 0)], outputs[t])
            self._seq = tr.seq = self._seq + 1
            # Registered before its first input is published (drainers wait until it is
            # published): submits are serialised, so the order of the in-flight deque is
            # the order the device sees. Interrupted before it is published, it stays in
            # _writing, to be completed. (Completion.register, inline: no call between.)
            self._writing = tr
            inflight.append(tr)
            path.lay_whole(tr, req, t, transfers, redirects, self._acquire)
            completion.published(tr)
            self._writing = None    # last: an interrupt before it leaves this to be finished

    # -- abandoned requests (see the module docstring) ---------------------------------
    def _abandon_request(self, req: Request, exc: BaseException) -> None:
        """``req`` was abandoned by ``exc`` while it was being sent (lock held): it fails,
        its outputs go nowhere, and the transfer being written is completed."""
        req.fail(InvalidStateError(
            f"replica {self._life.rid}: the request was abandoned: {type(exc).__name__} "
            "interrupted it while it was sent"))
        req.dests = {}
        path = self._life.path
        if self._writing is not None and path is not None:
            try:
                self._finish_writing(path)
            except (ShmError, OSError, ModelRuntimeError):
                pass   # the device is lost: the next request hears of it (reset clears)

    def _finish_writing(self, path: TransferPath) -> None:
        """Publish every input of ``self._writing``, the transfer whose laying an exception
        interrupted (lock held), so that the device's iteration completes; its outputs
        are then drained as any transfer's. Idempotent (see TransferPath.lay_whole)."""
        tr = self._writing
        if tr is None:
            return
        if self._dynamic:    # its slots are held and filled: pad and publish the rest
            self._seal(path, tr, pad=True)
            return
        req, t = tr.segments[0][0], tr.segments[0][1]
        path.lay_whole(tr, req, t, len(req.outputs_per_transfer), [], self._acquire,
                       resume=True)
        self._completion.published(tr)
        self._writing = None    # last: an interrupt before it leaves this to be finished

    def try_finish(self, tr: Transfer) -> bool:
        """A drainer found ``tr`` at the head, unpublished: if its writer was interrupted
        (``_writing``) and nobody submits, finish it; False if a submitter holds the lock
        (it lays or finishes it)."""
        lock = self.lock
        if self._held():   # this thread sends (see __init__): busy
            return False
        try:
            if not lock.acquire(False):
                return False
            path = self._life.path
            if self._writing is tr and path is not None and self._life.error is None:
                self._finish_writing(path)
        except _WRITE_ERRORS as exc:
            self._completion.fail_all(self._life.translate(exc))
        finally:
            try:   # first: no call (where an interrupt lands) before it (see __init__)
                lock.release()
            except RuntimeError:   # not taken
                pass
        return True

    # -- dynamic batching --------------------------------------------------------------
    def _pack(self, path: TransferPath, req: Request) -> None:
        B = self._batch
        n = req.samples
        completion = self._completion
        # Count the segments first (see _write_whole): none is published yet.
        fill = completion.open.samples if completion.open is not None else 0
        s = segments = 0
        while s < n:
            k = min(B - fill, n - s)
            segments += 1
            s += k
            fill = (fill + k) % B
        req.remaining += segments
        s = 0
        while s < n:
            tr = completion.open
            if tr is None:
                tr = path.open_partial(self._acquire)
                self._number(tr)
                completion.register_open(tr)
            k = min(B - tr.samples, n - s)
            path.pack(tr, req, s, k)
            s += k
            if tr.samples == B:
                self._seal(path, tr, pad=False)
        if completion.open is not None:
            self._timers.kick(completion.open)

    def try_publish_partial(self, tr: Transfer, extra: Request | None) -> bool:
        """The timers flush ``tr`` (with ``extra`` samples packed first), padded with
        zeros, unless a submitter is busy (False)."""
        lock = self.lock
        if self._held():   # this thread sends (see __init__): busy
            return False
        try:
            if not lock.acquire(False):
                return False   # a submitter is busy (it publishes, or the timer fires again)
            path = self._life.path
            completion = self._completion
            if path is not None:
                if self._fused is not None:
                    self._abandon_fused(path, "KeyboardInterrupt")
                if self._writing is not None:
                    self._finish_writing(path)
                if extra is not None and completion.open is tr:
                    self._pack(path, extra)
                    extra.t_laid = time.perf_counter_ns()
                if completion.open is tr:
                    self._seal(path, tr, pad=True)
        except _WRITE_ERRORS as exc:
            self._completion.fail_all(self._life.translate(exc))
        finally:
            try:   # first: no call (where an interrupt lands) before it (see __init__)
                lock.release()
            except RuntimeError:   # not taken
                pass
        return True

    # ------------------------------------------------------------------ fused
    def run_fused(self, inputs: dict[str, np.ndarray], t_received: int
                  ) -> dict[str, np.ndarray] | None:
        """``execute``'s fused path: run a plain request (``inputs``: the model's execute
        inputs, checked by the caller) start to end and return its outputs, if idle.

        Returns None, having done nothing, unless the replica is idle and well and its
        requests are fusable (``TransferPath.fusable``); the caller then submits and
        waits. Else, under the submit lock for the whole round trip: nobody else reads
        the output rings (drainers read only transfers in flight: none, and only
        submitters, who need this lock, add to them; timers act only with a partial
        batch or a phantom: none, both added under this lock too). Errors are counted
        and raised as the general path does."""
        path = self._life.path
        if path is None or not path.fusable:
            return None
        t_prepared = _clock()
        lock = self.lock
        try:   # the lock taken inside (see __init__)
            if not lock.acquire(False):
                self._take_lock()
            life = self._life
            completion = self._completion
            if (completion.inflight or completion.open is not None or completion.draining
                    or completion.stalled or self._writing is not None
                    or self._fused is not None or not life.well_but_unpolled()
                    or self._timers.has_phantoms):
                return None        # busy, or something is off: submit sorts it out
            path = life.path       # (a reset by another submitter made new rings)
            if path is None or not path.fusable:
                return None
            self._hint(path)
            t_lay = _clock() if recorder.ON else 0   # tracing (0: off)
            self._seq = seq = self._seq + 1
            # Noted before anything is laid, with no call between this and the call that
            # lays (an interrupt lands at calls): until it is read, whoever takes the lock
            # next finds it here if the interrupted thread could not see to it.
            self._fused = (seq, inputs, t_received)
            try:
                results = path.run_fused(inputs, seq, self._acquire, life.slow_output,
                                         life.wait_slice, life.gone, self._monitor.settle)
                self._fused = None
            except NotTaken:   # the device exited before it took the request: submit resets
                self._fused = None   # it first (auto_reset) or reports it, as if not yet sent
                return None
            except DeviceTimeoutError as exc:   # the device stalled: abandoned, as below
                self._abandon_fused(path, type(exc).__name__, finish=False)
                self._completion.stall(exc)
                completion.record_error(exc, received=t_received)
                raise
            except (RingInvalidatedError, ShmError, OSError, InvalidStateError,
                    SequenceMismatchError) as exc:
                self._fused = None   # the replica fails: a reset clears its rings
                if path.fused_taken < 0 and isinstance(exc, _WRITE_ERRORS):   # laying
                    err = self._write_failed(exc)
                    completion.record_error(err, received=t_received)
                    raise again(err) from None      # as submit
                # reading: as a failed request (its error keeps its cause)
                err = life.closed_error() if life.closed else life.translate(exc)
                if not life.closed:   # fail_all did not see this request (not in flight):
                    completion.fail_all(err)   # it hears the error, so the next one is
                    life.error_unheard = False   # told the replica is unusable
                completion.record_error(err, received=t_received)
                raise again(err)
            except BaseException as exc:   # KeyboardInterrupt, a signal handler's exception
                self._abandon_fused(path, type(exc).__name__)
                raise
        finally:
            try:   # first: no call (where an interrupt lands) before it (see __init__)
                lock.release()
            except RuntimeError:   # not taken
                pass
        now = _clock()
        if not t_lay:   # recorded while the device computes the next request, or when read
            self._monitor.defer(t_received, t_prepared, now, path.t_laid)
        else:
            started = self._monitor.record(t_received, t_prepared, now, path.t_laid)
            _tracing.fused(self._life.trace_key, self._life.rid, path.batch, seq,
                           (t_received, t_prepared, t_lay or path.t_laid, path.t_laid, started,
                            path.t_first, now, now))
        return results

    def _abandon_fused(self, path: TransferPath, why: str, finish: bool = True) -> None:
        """``run_fused``'s request (``_fused``) was abandoned (``why``: the exception's
        class) while laying (``path.fused_taken`` -1) or after reading that many outputs
        (lock held): its transfer becomes one in flight of a request nobody waits for,
        completed if half laid, whose other outputs the next drainer reads and drops.

        Idempotent until its transfer is in flight: another interrupt in here leaves
        ``_fused`` set, and the next thread to take the lock does it again (the rings and
        ``fused_taken`` stay as they were: nothing else reads or lays meanwhile)."""
        fused = self._fused
        if fused is None:
            return
        seq, inputs, t_received = fused
        outputs = path.all_outputs
        read = path.fused_taken
        written = read >= 0
        if written and read < len(outputs):
            # the read interrupted as it returned: was that output consumed?
            if consumed_from(path.output_ring_of(outputs[read].name), seq):
                read += 1
        if written and read >= len(outputs):
            self._fused = None
            return   # nothing of it is left on the device
        req = Request(self._completion, self._life.rid, 1, inputs, {}, {}, [outputs],
                      t_received, internal=True)
        req.fail(InvalidStateError(f"replica {self._life.rid}: the request was abandoned: "
                                   f"{why} interrupted it"))
        tr = Transfer([(req, 0, 1, 0)], outputs)
        tr.seq = seq
        tr.next_output = max(0, read)
        inflight = self._completion.inflight
        # one step (no call before the append): in flight (finished if half laid), _fused None
        if written:
            tr.published = True
        else:
            self._writing = tr
        self._fused = None
        inflight.append(tr)
        if finish and not written:   # else (a stalled device) the next submitter finishes it
            try:
                self._finish_writing(path)
            except (ShmError, OSError):   # the device is gone: the next request hears it
                pass
