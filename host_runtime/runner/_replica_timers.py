"""The timers of a replica: partial dynamic batches and requests that cannot run.

A :class:`ReplicaTimers` belongs to one :class:`~host_runtime.runner._replica.Replica`
(its *owner*), which it sees only through :class:`TimerOwner`: the open partial
batch, and three non-blocking actions. It refers to its owner weakly (a replica
nobody references is freed at once, by reference counting), and is told the open
partial batch where it is on the request path (``next_deadline``, ``kick``).
Timers fire from whichever thread drives the replica (a caller waiting for a
result: ``Completion`` sleeps until ``next_deadline`` and calls ``fire``), or from a
small watchdog thread while nobody waits and ``flush_on_waiting_outputs`` is off.
Firing never blocks: one thread fires at a time (another that finds it firing
returns), and a busy submitter (the replica's submit lock) means the timer is
retried shortly.

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
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

from host_runtime.errors import DeviceTimeoutError, ModelRuntimeError
from host_runtime.memory import InputMemoryView, OutputMemoryView
from host_runtime.runner._requests import Request, Transfer
from host_runtime._sleepers import Sleepers
from host_runtime.runner.config import FlushCallback

__all__ = ["Phantom", "ReplicaTimers", "TimerOwner"]

_log = logging.getLogger("host_runtime.runner._replica")
_RETRY = 0.001
"""Seconds before a timer that could not act (a submitter held the lock) is fired again."""

MakeFlushRequest = Callable[[Any, Any], Optional[Request]]
"""``(inputs, outputs)`` the flush callback gave -> a request (None: nothing usable)."""
MergePhantom = Callable[[Request, Request], Optional[int]]
"""``(phantom request, flushed extra)`` -> transfers once complete (None: still missing)."""


@dataclass
class Phantom:
    """A request the device cannot run (inputs missing): it times out on the host."""

    request: Request
    tensor_id: str
    deadline: float
    callback_called: bool = False
    transfers: int | None = None     # completed by the flush callback, waiting to be sent


class TimerOwner(Protocol):
    """What the timers need of the replica they belong to (``Replica`` implements it)."""

    @property
    def closed(self) -> bool: ...

    @property
    def partial(self) -> Transfer | None:
        """The open partial batch (dynamic batching), if any."""

    def try_publish_partial(self, tr: Transfer, extra: Request | None) -> bool:
        """Pack ``extra`` into ``tr`` and publish ``tr`` padded with zeros (if still open);
        False, doing nothing, if a submitter holds the submit lock."""

    def try_send(self, request: Request, transfers: int) -> bool:
        """Send ``request`` to the device; False, doing nothing, if a submitter holds the
        submit lock."""

    def fire_timers(self) -> None:
        """Fire the due timers now and wake the replica's waiters (the watchdog's step)."""


class ReplicaTimers:
    """Deadlines of one replica, the phantoms it parks, and its watchdog thread."""

    def __init__(self, owner: TimerOwner, rid: int, *, timeout_ns: int,
                 partial_flush_ns: int | None, flush_callback: FlushCallback | None,
                 make_flush_request: MakeFlushRequest, merge_phantom: MergePhantom,
                 waits_for: str, watchdog: bool) -> None:
        """``waits_for``: the input a device waiting on a partial batch waits for (the
        first non-frozen one Main reads); ``watchdog``: fire timers when nobody waits."""
        self._owner = weakref.ref(owner)
        self._rid = rid
        self._timeout_ns = timeout_ns
        self._flush_ns = partial_flush_ns
        self._flush_callback = flush_callback
        self._make_flush_request = make_flush_request
        self._merge_phantom = merge_phantom
        self._waits_for = waits_for
        self._use_watchdog = watchdog
        self._lock = threading.Lock()             # guards _phantoms
        # one thread fires at a time (re-entrant: a nested call takes it, sees _fires and
        # returns, and its release is its own; see fire)
        self._firing = threading.RLock()
        self._fires = False
        self._phantoms: list[Phantom] = []
        self._watchdog: threading.Thread | None = None
        # taken as ``with self._watch_mutex`` (C-level __enter__: an interrupt cannot leave
        # it held, as it can inside Condition.__enter__); Sleepers: see _sleepers
        self._watch_mutex = threading.Lock()
        self._watch_wake = Sleepers(self._watch_mutex)

    # ------------------------------------------------------------------ phantoms
    def add_phantom(self, req: Request, tensor_id: str, partial: Transfer | None) -> None:
        """Park ``req``, which lacks ``tensor_id`` (``partial``: the owner's open batch)."""
        ns = self._timeout_ns
        deadline = float("inf") if ns == 0 else time.monotonic() + ns / 1e9
        with self._lock:
            self._phantoms.append(Phantom(req, tensor_id, deadline))
        self.kick(partial)

    def take_phantoms(self) -> list[Phantom]:
        """Remove and return every phantom (the replica failed or closed)."""
        with self._lock:
            phantoms, self._phantoms = self._phantoms, []
        return phantoms

    # ------------------------------------------------------------------ firing
    @property
    def has_phantoms(self) -> bool:
        """A phantom is waiting (its deadline counts in next_deadline)."""
        return bool(self._phantoms)

    def next_deadline(self, partial: Transfer | None) -> float:
        """When the next timer is due (monotonic), given the owner's open partial batch."""
        d = float("inf")
        flush = self._flush_ns
        if partial is not None and flush is not None:
            d = partial.t_open + flush / 1e9
        for ph in self._phantoms:
            d = min(d, ph.deadline)
        return d

    def fire(self, now: float) -> None:
        """Flush a partial batch whose time is up; time out phantoms. Never blocks on submit."""
        owner = self._owner()
        if owner is None:
            return
        firing = self._firing
        try:   # taken inside the try, released at once: as the submit lock (_submission)
            if firing.acquire(blocking=False) and not self._fires:
                self._fires = True    # (this thread fires: a nested call returns)
                try:
                    self._fire(owner, now)
                finally:
                    self._fires = False
        finally:
            try:
                firing.release()
            except RuntimeError:   # not taken: another thread fires
                pass

    def _fire(self, owner: TimerOwner, now: float) -> None:
        tr = owner.partial
        flush = self._flush_ns
        if tr is not None and flush is not None and tr.t_open + flush / 1e9 <= now:
            self._flush_partial(owner, tr)
        with self._lock:
            due = [ph for ph in self._phantoms if ph.deadline <= now]
        for ph in due:
            self._expire_phantom(owner, ph)

    def _call_flush_callback(self, tensor_id: str) -> Optional[Request]:
        """Seed 001, 3.7: ``flush_callback(tensor_id, inputs, outputs)`` gets the tensor the
        device waits for and an empty InputMemoryView and OutputMemoryView: it may fill
        them (the C++ callback points its ``inputs``/``outputs`` at the data to flush with)
        or return ``(inputs, outputs)``. Nothing given: the partial batch is padded with
        zeros, a request missing inputs times out."""
        cb = self._flush_callback
        if cb is None:
            return None
        given_in, given_out = InputMemoryView(), OutputMemoryView()
        try:
            result = cb(tensor_id, given_in, given_out)
        except Exception:
            _log.exception("replica %d: flush_callback failed for tensor %r", self._rid, tensor_id)
            return None
        inputs: Any      # whatever the user's callback gave: make_flush_request checks it
        outputs: Any
        if result is None:
            if not given_in and not given_out:
                return None
            inputs, outputs = given_in, given_out
        else:
            try:
                inputs, outputs = result
            except (TypeError, ValueError):
                _log.error("replica %d: flush_callback must fill its inputs/outputs or return "
                           "(inputs, outputs) or None, got %r", self._rid, result)
                return None
        try:
            return self._make_flush_request(inputs, outputs)
        except ModelRuntimeError as exc:
            _log.error("replica %d: flush_callback returned unusable data: %s", self._rid, exc)
            return None

    def _flush_partial(self, owner: TimerOwner, tr: Transfer) -> None:
        # Seed 001, 3.7: the callback is called once per timeout, so a retry (a submitter
        # held the lock) reuses what it gave instead of asking again.
        if not tr.flush_asked:
            tr.flush_asked = True
            tr.flush_extra = self._call_flush_callback(self._waits_for)
        if owner.try_publish_partial(tr, tr.flush_extra):
            tr.flush_extra = None

    def _expire_phantom(self, owner: TimerOwner, ph: Phantom) -> None:
        if not ph.callback_called:
            ph.callback_called = True
            extra = self._call_flush_callback(ph.tensor_id)
            if extra is not None:
                ph.transfers = self._merge_phantom(ph.request, extra)
        if ph.transfers is not None:        # complete now: send it
            with self._lock:
                if ph not in self._phantoms:
                    return
                self._phantoms.remove(ph)
            if not owner.try_send(ph.request, ph.transfers):
                with self._lock:    # busy submitter: try again on the next step
                    ph.deadline = time.monotonic()
                    self._phantoms.append(ph)
            return
        with self._lock:
            if ph not in self._phantoms:
                return
            self._phantoms.remove(ph)
        ms = self._timeout_ns / 1e6
        ph.request.fail(DeviceTimeoutError(
            f"replica {self._rid}: the device timed out after {ms:g} ms waiting for input "
            f"{ph.tensor_id!r}, which the request does not provide (validate_io_params is off; "
            "with a fused model, give the inputs of the sub-graph the 'index' selects)"))

    # ------------------------------------------------------------------ watchdog
    def kick(self, partial: Transfer | None) -> None:
        """A deadline was added: make sure the watchdog (if used) will fire it."""
        if not self._use_watchdog or self.next_deadline(partial) == float("inf"):
            return
        if self._watchdog is None or not self._watchdog.is_alive():
            self._watchdog = threading.Thread(target=self._watch, daemon=True,
                                              name=f"model-runner-watchdog-{self._rid}")
            self._watchdog.start()
        else:
            with self._watch_mutex:
                self._watch_wake.notify_all()

    def close(self) -> None:
        """The replica closed: wake the watchdog, which then exits."""
        with self._watch_mutex:
            self._watch_wake.notify_all()

    def _watch(self) -> None:
        """Fire timers when nobody waits (flush_on_waiting_outputs off). Exits when idle,
        or once the owner is closed or gone."""
        while True:
            owner = self._owner()
            if owner is None or owner.closed:
                return
            d = self.next_deadline(owner.partial)
            if d == float("inf"):
                return
            now = time.monotonic()
            if d > now:
                del owner      # not kept alive while waiting
                with self._watch_mutex:
                    self._watch_wake.wait(d - now)
                continue
            owner.fire_timers()
            if self.next_deadline(owner.partial) <= now:
                del owner      # could not act (a submitter is busy): again shortly
                with self._watch_mutex:
                    self._watch_wake.wait(_RETRY)
