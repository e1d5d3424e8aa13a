"""Timers of a replica (partial dynamic batches, requests that cannot run) and its
watch on the device's processes.

Timers fire from whichever thread drives the replica (a caller waiting for a
result), or from a small watchdog thread while nobody waits and
``flush_on_waiting_outputs`` is off. Firing never blocks on the submit lock:
a busy submitter means the timer is retried on the next drive step.

- a *partial* transfer (dynamic batching) is flushed after
  ``partial_flush_ns``: ``flush_callback(tensor_id, inputs, outputs)``, told the
  input the device waits for (the first non-frozen one Main reads), may give extra
  samples, the rest is padded with zeros and published;
- a *phantom* (``validate_io_params`` off and the device would wait for an
  input the request lacks) is never sent; after ``timeout_ns`` the flush
  callback may complete it, otherwise it fails with ``DeviceTimeoutError``.
"""

from __future__ import annotations

import logging
import os
import select
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from shm import ShmError

from host_runtime.runner._requests import Request
from host_runtime.errors import DeviceTimeoutError, ModelRuntimeError

if TYPE_CHECKING:  # pragma: no cover
    from host_runtime.runner._replica import ReplicaSetup, Transfer

__all__ = ["Phantom", "PidWatch", "ReplicaTimers"]

_log = logging.getLogger("host_runtime.runner._replica")


@dataclass
class Phantom:
    """A request the device cannot run (inputs missing): it times out on the host."""

    request: Request
    tensor_id: str
    deadline: float
    callback_called: bool = False


class PidWatch:
    """pidfds of a device's IPU processes: ``dead_pid()`` polls them (~0.3 us)."""

    def __init__(self) -> None:
        self._fds: list[tuple[int, int]] = []
        self._poll: Any = None
        self._all = False

    def watch(self, pids: list[int]) -> None:
        self.close()
        poller = select.poll()
        for pid in pids:
            try:
                fd = os.pidfd_open(pid)
            except (AttributeError, OSError):   # no pidfd support, or already gone and reaped
                continue
            self._fds.append((fd, pid))
            poller.register(fd, select.POLLIN)
        self._poll = poller if self._fds else None
        self._all = len(self._fds) == len(pids)

    @property
    def active(self) -> bool:
        """True if ``dead_pid()`` watches every process it was given a pid of."""
        return self._poll is not None and self._all

    def dead_pid(self) -> int | None:
        """The pid of a process of the device that has exited, if any."""
        if self._poll is None:
            return None
        ready = self._poll.poll(0)
        if not ready:
            return None
        fd = ready[0][0]
        return next(p for f, p in self._fds if f == fd)

    def __del__(self) -> None:
        self.close()

    def close(self) -> None:
        for fd, _ in self._fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds = []
        self._poll = None


class ReplicaTimers:
    """The timer half of ``Replica`` (a mixin: it works on the replica's state)."""

    if TYPE_CHECKING:  # pragma: no cover - provided by Replica
        setup: ReplicaSetup
        rid: int
        _cv: threading.Condition
        _submit_lock: threading.Lock
        _partial: Transfer | None
        _phantoms: list[Phantom]
        _draining: bool
        _closed: bool
        _watchdog: threading.Thread | None
        _watch_wake: threading.Condition

        def _pack(self, req: Request) -> None: ...
        def _write_whole(self, req: Request, transfers: int) -> None: ...
        def _publish_partial(self, tr: Transfer, pad: bool = False) -> None: ...
        def _fail_everything(self, err: ModelRuntimeError) -> None: ...
        def _translate(self, exc: BaseException) -> ModelRuntimeError: ...

    def _add_phantom(self, req: Request, tensor_id: str) -> None:
        ns = self.setup.timeout_ns
        deadline = float("inf") if ns == 0 else time.monotonic() + ns / 1e9
        with self._cv:
            self._phantoms.append(Phantom(req, tensor_id, deadline))
        self._kick_watchdog()

    def _next_deadline(self) -> float:
        d = float("inf")
        tr = self._partial
        flush = self.setup.partial_flush_ns
        if tr is not None and flush is not None:
            d = tr.t_open + flush / 1e9
        for ph in self._phantoms:
            d = min(d, ph.deadline)
        return d

    def _fire_timers(self, now: float) -> None:
        """Flush a partial batch whose time is up; time out phantoms. Never blocks on submit."""
        tr = self._partial
        flush = self.setup.partial_flush_ns
        if tr is not None and flush is not None and tr.t_open + flush / 1e9 <= now:
            self._flush_partial(tr)
        due: list[Phantom] = []
        with self._cv:
            for ph in list(self._phantoms):
                if ph.deadline <= now:
                    due.append(ph)
        for ph in due:
            self._expire_phantom(ph)

    def _call_flush_callback(self, tensor_id: str) -> Optional[Request]:
        """Seed 001, 3.7: ``flush_callback(tensor_id, inputs, outputs)`` gets the tensor the
        device waits for and an empty InputMemoryView and OutputMemoryView: it may fill
        them (the C++ callback points its ``inputs``/``outputs`` at the data to flush with)
        or return ``(inputs, outputs)``. Nothing given: the partial batch is padded with
        zeros, a request missing inputs times out."""
        from host_runtime.memory._views import InputMemoryView, OutputMemoryView

        cb = self.setup.flush_callback
        if cb is None:
            return None
        given_in, given_out = InputMemoryView(), OutputMemoryView()
        try:
            result = cb(tensor_id, given_in, given_out)
        except Exception:
            _log.exception("replica %d: flush_callback failed for tensor %r", self.rid, tensor_id)
            return None
        if result is None:
            if not given_in and not given_out:
                return None
            inputs, outputs = given_in, given_out
        else:
            try:
                inputs, outputs = result
            except (TypeError, ValueError):
                _log.error("replica %d: flush_callback must fill its inputs/outputs or return "
                           "(inputs, outputs) or None, got %r", self.rid, result)
                return None
        try:
            return self.setup.make_flush_request(inputs, outputs)
        except ModelRuntimeError as exc:
            _log.error("replica %d: flush_callback returned unusable data: %s", self.rid, exc)
            return None

    def _flush_partial(self, tr: "Transfer") -> None:
        # the device waits for the first input Main reads (setup.inputs is in read order);
        # frozen ones are always there
        # Seed 001, 3.7: the callback is called once per timeout, so a retry (a submitter
        # held the lock) reuses what it gave instead of asking again.
        if not tr.flush_asked:
            tr.flush_asked = True
            frozen = self.setup.frozen_main
            first = next((n for n in self.setup.inputs if n not in frozen), "")
            tr.flush_extra = self._call_flush_callback(first)
        if not self._submit_lock.acquire(blocking=False):
            return   # a submitter is busy (it will publish or we try again next step)
        try:
            extra, tr.flush_extra = tr.flush_extra, None
            if extra is not None and self._partial is tr:
                self._pack(extra)
                extra.t_prepared = time.perf_counter_ns()
            if self._partial is tr:
                self._publish_partial(tr, pad=True)
        except (ShmError, OSError) as exc:
            self._fail_everything(self._translate(exc))
        finally:
            self._submit_lock.release()

    def _expire_phantom(self, ph: Phantom) -> None:
        if not ph.callback_called:
            ph.callback_called = True
            extra = self._call_flush_callback(ph.tensor_id)
            if extra is not None:
                merged = self.setup.merge_phantom(ph.request, extra)
                if merged is not None:
                    with self._cv:
                        if ph in self._phantoms:
                            self._phantoms.remove(ph)
                    if self._submit_lock.acquire(blocking=False):
                        try:
                            if self.setup.dynamic:
                                self._pack(ph.request)
                            else:
                                self._write_whole(ph.request, merged)
                        except (ShmError, OSError) as exc:
                            self._fail_everything(self._translate(exc))
                        finally:
                            self._submit_lock.release()
                        return
                    with self._cv:    # busy submitter: try again on the next step
                        ph.deadline = time.monotonic()
                        self._phantoms.append(ph)
                    return
        with self._cv:
            if ph not in self._phantoms:
                return
            self._phantoms.remove(ph)
        ms = self.setup.timeout_ns / 1e6
        ph.request.fail(DeviceTimeoutError(
            f"replica {self.rid}: the device timed out after {ms:g} ms waiting for input "
            f"{ph.tensor_id!r}, which the request does not provide (validate_io_params is off; "
            "with a fused model, give the inputs of the sub-graph the 'index' selects)"))

    # ------------------------------------------------------------------ watchdog
    def _kick_watchdog(self) -> None:
        if not self.setup.watchdog or self._next_deadline() == float("inf"):
            return
        if self._watchdog is None or not self._watchdog.is_alive():
            self._watchdog = threading.Thread(target=self._watch, daemon=True,
                                              name=f"model-runner-watchdog-{self.rid}")
            self._watchdog.start()
        else:
            with self._watch_wake:
                self._watch_wake.notify_all()

    def _watch(self) -> None:
        """Fire timers when nobody waits (flush_on_waiting_outputs off). Exits when idle."""
        while not self._closed:
            d = self._next_deadline()
            if d == float("inf"):
                return
            now = time.monotonic()
            if d > now:
                with self._watch_wake:
                    self._watch_wake.wait(min(d - now, 1.0))
                continue
            with self._cv:
                if self._draining:
                    self._cv.wait(0.01)
                    continue
                self._draining = True
            try:
                self._fire_timers(time.monotonic())
            finally:
                with self._cv:
                    self._draining = False
                    self._cv.notify_all()
