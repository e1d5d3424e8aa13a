"""The host end of one device's control and event rings.

``ProcessLink`` implements :class:`host_runtime.devices.link.DeviceLink` for a device of
one IPU (``GroupLink`` holds one per IPU process of a bigger device). Requests go out on the control ring
from the caller's thread; one service thread per device reads the event ring
and

- resolves the request futures (DONE / ERROR / STOPPED, matched by ``seq``),
- hands NEED / OUT events to the active session's ``StreamServicer`` (which
  calls the user's callbacks, on this thread),
- notices a dead IPU process (the event ring watches it, ``_watch_exit``: its waits
  fail with PeerDiedError when it exits; where it cannot, a poll of every process of
  the device each ``_POLL`` seconds) and fails every pending request at once with
  one ``DeviceLostError`` naming the device and how it died.

So a request made through callbacks touches two threads (the caller's and
this one); the fast path of ``QueueManager`` touches only the caller's.
"""

from __future__ import annotations

import _thread
import concurrent.futures as cf
import functools
import itertools
import logging
import os
import threading
import weakref
from typing import Any, Callable, Sequence

import time

from shm import PeerDiedError, RingTimeoutError, ShmError, describe_process, process_state
from shm.settings import ShmSettings

from host_runtime._again import again
from host_runtime._sleepers import sleep_released
from host_runtime._deadline import host_sync_timeout
from host_runtime.devices import _event_threads as event_threads
from host_runtime.devices._first import FIRST_SEQ
from host_runtime.devices.link import StreamServicer
from host_runtime.settings import HostSettings
from host_runtime.errors import (ApplicationRuntimeError, DeviceRuntimeError,
                                 RecoverableRuntimeError, RecoveryAction,
                                 UnrecoverableRuntimeError)
from host_runtime.errors import (BadRequestError, DeviceExecutionError, DeviceLostError,
                                 InvalidStateError, ModelRuntimeError, PackageHashMismatchError,
                                 PopefError, RemoteTraceback, SharedMemoryFullError)
from ipu_emulator import ipu_protocol
from ipu_emulator.ipu.launcher import (IpuConnection, IpuProcessError,
                                          describe_returncode)
from ipu_emulator.ipu_protocol import ErrorKind, Message, Op

__all__ = ["Answer", "ProcessLink", "error_from_body"]

_log = logging.getLogger(__name__)

_POLL = 0.25   # the event thread's slice where its ring cannot watch the process (_watch_exit)


_RUNTIME_ERRORS: dict[str, type[DeviceRuntimeError]] = {
    ErrorKind.APPLICATION.value: ApplicationRuntimeError,
    ErrorKind.RECOVERABLE.value: RecoverableRuntimeError,
    ErrorKind.UNRECOVERABLE.value: UnrecoverableRuntimeError,
}


def error_from_body(body: Any, device: str) -> ModelRuntimeError:
    """The host exception for an ERROR event's body."""
    body = body if isinstance(body, dict) else {}
    kind = body.get("kind", ErrorKind.PROTOCOL.value)
    message = str(body.get("message", "unknown device error"))
    tb = str(body.get("traceback", ""))
    exc: ModelRuntimeError
    if kind == ErrorKind.PACKAGE_HASH.value:
        exc = PackageHashMismatchError(message)
    elif kind in (ErrorKind.MEMORY.value, ErrorKind.REQUEST.value):
        exc = BadRequestError(message)
    elif kind == ErrorKind.SHM_FULL.value:
        exc = SharedMemoryFullError(f"{device}: {message}")
    elif kind == ErrorKind.EXECUTABLE.value:
        exc = PopefError(f"the executable is damaged: {message}")
    elif kind == ErrorKind.STATE.value:
        exc = InvalidStateError(message)
    elif kind in _RUNTIME_ERRORS:
        program = body.get("program")
        fields: dict[str, Any] = {"ipu": device,
                                  "program": program if isinstance(program, int) else None}
        if kind == ErrorKind.RECOVERABLE.value:
            action = body.get("action")
            fields["recovery_action"] = RecoveryAction(
                action if action in RecoveryAction.__members__ else "IPU_RESET")
        exc = _RUNTIME_ERRORS[kind](f"{device}: {message}", **fields)
    else:
        exc = DeviceExecutionError(f"{device}: {message}")
    if tb:
        exc.__cause__ = RemoteTraceback(tb)
    return exc


class _Guard(_thread.RLock):   # type: ignore[misc]
    """The lock and condition of an :class:`Answer`, safe from an interrupt
    (KeyboardInterrupt, a signal handler's exception) at any point CPython checks for one.

    ``threading.Condition`` is not: its ``__enter__`` is Python code that may raise with
    the lock taken (at the return of the lock's own ``__enter__``), so the ``with`` never
    releases it and the event thread then blocks on the future for ever. This lock's
    ``__enter__`` / ``__exit__`` are the C ones; ``wait`` / ``notify_all`` are those of
    :class:`host_runtime._sleepers.Sleepers` (the release inside the ``try``
    whose ``finally`` takes the lock back)."""

    def __init__(self) -> None:
        super().__init__()
        self._sleeping: list[Any] = []    # one held lock per sleeper, released to wake it

    def wait(self, timeout: float | None = None) -> bool:
        """The lock held (once): release it, sleep until ``notify_all`` or ``timeout`` s,
        hold it again (also when interrupted while asleep)."""
        return sleep_released(self, self._sleeping, timeout)

    def notify_all(self) -> None:
        """The lock held: wake every sleeper."""
        sleeping, self._sleeping = self._sleeping, []
        for waiter in sleeping:
            waiter.release()

    notify = notify_all   # (a Future wakes all; nothing else calls it)


class Answer(cf.Future[Any]):
    """A ``concurrent.futures.Future`` an interrupt cannot break: the answer of a request
    (:meth:`ProcessLink.request`) and a session's main loop. Its ``result``, ``done``,
    ``exception`` and ``add_done_callback``, called from a thread a signal handler
    interrupts, never leave its lock held (see :class:`_Guard`)."""

    def __init__(self) -> None:
        super().__init__()
        self._condition = _Guard()   # type: ignore[assignment]


class ProcessLink:
    """Requests to, and events from, one IPU process (a ``DeviceLink``)."""

    def __init__(self, description: str, processes: list[IpuConnection],
                 settings: HostSettings | None = None) -> None:
        if not processes:
            raise ValueError("a device needs at least one IPU process")
        s = settings if settings is not None else HostSettings.current()
        self.description = description
        self._procs = processes
        self._primary = processes[0]
        self._seq = itertools.count(1)
        self._pending: dict[int, tuple[cf.Future[None], Op]] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._start_lock = threading.Lock()   # the first requests wait for READY once
        self._servicer: "weakref.ref[StreamServicer] | None" = None   # weakly: the session owns it
        self._lost: DeviceLostError | None = None
        self._lost_lock = threading.Lock()
        self._thread: event_threads.Service | None = None
        self._closing = False   # close(), or quiesce() ending the event thread early
        self._started = False
        self._final_seq: int | None = None   # the event thread ends after this answer
        self._last_event = time.monotonic()  # when the last event came (the peer's progress)
        self._servicing = False              # a stream callback of the host runs now
        self.sync_timeout = s.host_sync_timeout   # taken when the device is made
        self._start_timeout = s.start_timeout
        # the request sent before this link was made (_first): (op, body, answer)
        self._first = _adopt_first(self._primary, self._pending)
        if self._first is not None:
            self._seq = itertools.count(FIRST_SEQ + 1)

    # -- lifecycle ----------------------------------------------------------------

    def start(self) -> None:
        """Wait until every IPU process is ready; start the service thread (idempotent)."""
        self._ready()
        self._serve_events()

    def _ready(self) -> None:
        """Wait until every IPU process is ready (once): requests may be sent then. One
        thread reads READY from the event rings; the others wait for it."""
        if self._started:
            return
        with self._start_lock:
            if self._started:
                return
            try:
                for proc in self._procs:
                    self._wait_ready(proc)
            except IpuProcessError as exc:
                raise DeviceLostError(f"{self.description}: {exc}") from exc
            self._started = True

    def _serve_events(self) -> None:
        """Start the service thread (once): the first request's answer waits on the events
        ring until it reads it, so the first request is sent before it is started."""
        if self._thread is not None or self._closing:
            return
        with self._lock:   # (two first requests of two threads: one thread)
            if self._thread is not None:
                return
            # The thread refers to the link weakly (see _serve): the device owns the link.
            # It is one kept between links (host_runtime.devices._event_threads).
            events = self._primary.events
            self._thread = event_threads.serve(
                _serve, (weakref.ref(self, functools.partial(_link_gone, events, os.getpid())),
                         events),
                f"ipu-events-{self._primary.pid}")

    def _wait_ready(self, proc: IpuConnection) -> None:
        """``proc.wait_ready()`` (its own start timeout: a fresh process may import for a
        while), but a process stopped (state T) for the host sync timeout fails then."""
        from host_runtime.errors import DeviceTimeoutError

        sync = self.sync_timeout
        deadline = time.monotonic() + self._start_timeout
        while True:
            left = deadline - time.monotonic()
            try:
                proc.wait_ready(max(0.0, min(sync, left)))
                return
            except IpuProcessError as exc:
                if not proc.alive() or time.monotonic() >= deadline:
                    raise
                if process_state(proc.pid) in ("T", "t"):
                    raise DeviceTimeoutError(
                        f"{self.description}: IPU process {describe_process(proc.pid)} did "
                        f"not become ready within {sync:g} s (the host sync timeout, "
                        "IPU_EMULATOR_HOST_SYNC_TIMEOUT)") from exc

    def close(self, timeout: float = 1.0) -> None:
        """Stop serving; fail what is pending (idempotent). Processes are shut down by the owner.

        The service thread is a daemon: if a user callback holds it, it is not waited for
        longer than ``timeout`` (it ends when the callback returns)."""
        self._closing = True
        t = self._thread
        if t is not None and not t.is_current():
            t.join(timeout)
        self._fail_all(InvalidStateError(f"{self.description} was detached"))

    @property
    def last_unanswered(self) -> bool:
        """Its event ring is a daemon's (one made here: SHUTDOWN's BYE ends the thread)."""
        return not getattr(self._primary.events, "owner", True)

    def quiesce(self, timeout: float = 1.0) -> None:
        """End the event thread before a daemon's event ring goes back to the daemon.

        A daemon's IPU process answers the daemon on the same ring once this host
        releases it: a thread of ours still reading there would take those answers.
        After a request sent as the last (a closing session's STOP) the thread is ended
        here, its answer not waited for: the daemon skips what this host left unread,
        and its HOST 0 (which resets the process) follows that request on the control
        ring. Otherwise a PING's answer is the last event the thread reads (no waiting
        for a slice to end). With an event ring of our own, SHUTDOWN's BYE ends the
        thread instead.
        """
        t = self._thread
        if (t is None or not t.is_alive() or t.is_current()
                or self._lost is not None or not self.last_unanswered):
            return
        if self._final_seq is not None:
            self._closing = True    # the thread reads no further event
            events = self._primary.events
            events.interrupt()      # ... and leaves its wait now
            t.join(timeout)
            events.resume()
            return
        seq = next(self._seq) & 0x7FFFFFFF
        fut: cf.Future[None] = Answer()
        with self._lock:
            self._pending[seq] = (fut, Op.PING)
        self._final_seq = seq
        try:
            self._send(Message(Op.PING, seq=seq))
        except BaseException:   # device gone: the thread notices by itself
            with self._lock:
                self._pending.pop(seq, None)
            return
        t.join(timeout)

    def wake(self) -> None:
        """Wake the event thread at once (its processes have exited): invalidate the event
        ring if this host made it (embedded; a daemon's rings outlive this host)."""
        if self._thread is None or not self._thread.is_alive():
            return
        events = self._primary.events
        if getattr(events, "owner", False) and not events.closed:
            try:
                events.invalidate()
            except ShmError:   # pragma: no cover - closed meanwhile
                pass

    @property
    def lost(self) -> DeviceLostError | None:
        return self._lost

    def check(self) -> DeviceLostError | None:
        """Like ``lost`` but first polls the processes (does not wait for the service thread)."""
        if self._lost is None and self._dead_process() is not None:
            return self.mark_lost()
        return self._lost

    @property
    def started(self) -> bool:
        return self._started

    @property
    def pid(self) -> int:
        return self._primary.pid

    def set_servicer(self, servicer: StreamServicer | None) -> None:
        """The active session's stream servicer (held weakly: the session owns it)."""
        self._servicer = None if servicer is None else weakref.ref(servicer)

    # -- requests -------------------------------------------------------------------

    def request(self, op: Op, body: Any = None, value: int = 0,
                last: bool = False) -> "cf.Future[None]":
        """Send a request; the future resolves on its DONE (or fails on ERROR / loss).

        ``last``: its answer is the last event this host reads (the device is about to
        go back to a daemon: :meth:`quiesce` then needs no PING of its own)."""
        fut: cf.Future[None] = Answer()
        if self._lost is None and self._dead_process() is not None:
            self.mark_lost()   # e.g. a secondary IPU of the device died since the last poll
        if self._lost is not None:
            fut.set_exception(self._lost)
            return fut
        if not self._started:
            self._ready()
        if self._thread is not None and not self._thread.is_alive():
            fut.set_exception(InvalidStateError(
                f"{self.description}: its event service is not running (detached or failed)"))
            return fut
        seq = next(self._seq) & 0x7FFFFFFF
        with self._lock:
            self._pending[seq] = (fut, op)
        if last:
            self._final_seq = seq
        try:
            self._send(Message(op, seq=seq, value=value, body=body))
        except Exception as exc:
            with self._lock:
                self._pending.pop(seq, None)
            if last:
                self._final_seq = None
            fut.set_exception(self._translate(exc))
        # An interrupt (KeyboardInterrupt, a signal handler's exception) is the caller's:
        # the request stays pending (it may have gone; its answer, or close(), resolves it)
        if self._thread is None:   # the first request: the IPU process works on it meanwhile
            self._serve_events()
        return fut

    def take_first(self) -> tuple[Op, Any, "cf.Future[None]"] | None:
        """The request the IPU process was sent first, before this link was made (see
        :mod:`host_runtime.devices._first`): its op, body and answer (once; None if there
        was none). Its answer is read from now on."""
        first, self._first = self._first, None
        if first is not None:
            self._ready()
            self._serve_events()
        return first

    def call(self, op: Op, body: Any = None, timeout: float | None = None) -> None:
        """Send a request and wait for its completion (raising its error); bounded by
        ``timeout`` and the host sync timeout (see :func:`wait`)."""
        wait(self.request(op, body), timeout, f"{op.name} on {self.description}",
             pids=self.pids(), progress=lambda: self.progress, sync=self.sync_timeout)

    def pids(self) -> list[int]:
        """The pids of the link's IPU processes."""
        return [p.pid for p in self._procs]

    @property
    def progress(self) -> float:
        """When the device last showed progress: its last event, or now while the host
        services one of its stream events (the device waits for the host then, e.g. for a
        queue the application fills: not the device's lack of progress)."""
        return time.monotonic() if self._servicing else self._last_event

    def notify(self, op: Op, body: Any = None) -> None:
        """Send a message that is not answered (MODES)."""
        if self._lost is not None:
            raise again(self._lost)
        if not self._started:
            self.start()
        try:
            self._send(Message(op, body=body))
        except BaseException as exc:
            raise self._translate(exc) from exc

    def _send(self, msg: Message) -> None:
        with self._send_lock:
            ipu_protocol.send(self._primary.control, msg)

    def _translate(self, exc: BaseException) -> BaseException:
        if isinstance(exc, PeerDiedError):
            return self.mark_lost()
        if isinstance(exc, ShmError):
            return InvalidStateError(f"{self.description}: {exc}")
        return exc

    # -- events -----------------------------------------------------------------------

    def _dispatch(self, msg: Message) -> None:
        op = msg.op
        if op is Op.NEED or op is Op.OUT:
            ref = self._servicer
            servicer = ref() if ref is not None else None
            if servicer is None:
                _log.warning("%s: %s for stream %d with no session bound", self.description,
                             op.name, msg.index)
                return
            if op is Op.NEED:
                servicer.on_need(msg.index)
            else:
                servicer.on_out(msg.index)
            return
        if op in (Op.DONE, Op.ERROR, Op.STOPPED):
            with self._lock:
                entry = self._pending.pop(msg.seq, None)
            if entry is None:
                _log.debug("%s: %s for unknown request %d", self.description, op.name, msg.seq)
                return
            fut, req = entry
            if op is Op.DONE:
                fut.set_result(None)
            elif op is Op.STOPPED:
                if req is Op.LOOP:
                    fut.set_result(None)
                else:
                    fut.set_exception(InvalidStateError(
                        f"{self.description}: stop() interrupted the running programs"))
            else:
                fut.set_exception(error_from_body(msg.body, self.description))
            return
        if op is Op.BYE:
            self._fail_all(InvalidStateError(f"{self.description} was shut down"))
            return
        _log.debug("%s: ignoring event %s", self.description, op.name)

    # -- failure ----------------------------------------------------------------------

    def _dead_process(self) -> IpuConnection | None:
        for proc in self._procs:
            if not proc.alive():
                return proc
        return None

    def mark_lost(self) -> DeviceLostError:
        """Declare the device lost (a process of it is dead); fail everything pending."""
        with self._lost_lock:
            if self._lost is not None:
                return self._lost
            err = self._lost = self._lost_error()
        _log.warning("%s", err)
        self._fail_all(err)
        return err

    def adopt_lost(self, error: DeviceLostError) -> None:
        """Declare the device lost with ``error``, found elsewhere (another IPU of its
        group died), unless it is lost already; fail everything pending."""
        with self._lost_lock:
            if self._lost is not None:
                return
            self._lost = error
        self._fail_all(error)

    def _lost_error(self) -> DeviceLostError:
        proc = self._dead_process()
        if proc is None:
            # the ring saw the peer die before poll() reaped it
            proc = self._primary
            proc.wait_exit(2.0)
        err = DeviceLostError(f"{self.description}: IPU process {proc.pid} "
                              f"{describe_returncode(proc.returncode())}")
        tail = proc.log_tail()
        if tail:
            err.__cause__ = RemoteTraceback(tail)
        return err

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for fut, _ in pending.values():
            if not fut.done():
                fut.set_exception(error)


def _adopt_first(proc: Any, pending: dict[int, tuple["cf.Future[None]", Op]]
                 ) -> tuple[Op, Any, "cf.Future[None]"] | None:
    """The first request ``proc`` was sent (``DaemonIpu.first``), pending in ``pending``."""
    first = getattr(proc, "first", None)
    if first is None:
        return None
    seq, op, body = first
    assert seq == FIRST_SEQ
    fut: cf.Future[None] = Answer()
    pending[seq] = (fut, op)
    return op, body, fut


def _link_gone(events: Any, owner: int, _: object) -> None:
    """The link died: its event thread leaves its wait now, reading nothing more.

    Collected in a cycle, a device's objects are finalized in any order: its daemon
    attachment may close its connection (the daemon then resets the IPU process) before
    the device's own close ends this thread, which would take the reset's answer from
    the daemon. A weak reference's callback runs before any finalizer of the cycle.
    Not in a process forked from the link's (``owner``): its copy of the ring would
    wake the parent's thread, which it counts as its own."""
    if os.getpid() != owner:
        return
    try:
        events.interrupt()
    except ShmError:   # closed already
        pass


def _serve(ref: "weakref.ref[ProcessLink]", events: Any) -> None:
    """The service thread: read events, hand each to the link while it lives.

    Between events it holds only the event ring, not the link: a device nobody
    references is freed (and closed, which sends SHUTDOWN: the BYE ends this thread).
    """
    try:
        _serve_events(ref, events)
    except BaseException as exc:  # never leave requests waiting on a dead thread
        link = ref()
        if link is not None:
            _log.exception("%s: event service failed", link.description)
            link._fail_all(InvalidStateError(f"{link.description}: event service failed: {exc}"))
        raise


def _watch_exit(events: Any, pid: int) -> bool:
    """Have the event ring watch IPU process ``pid`` as its peer (``Ring.set_peer``): its
    waits then fail with PeerDiedError once it exits, woken by the exit thread of
    ``shm.liveness``. Whether it does: not where ``pid`` is this process (a loopback
    IPU), with ``IPU_EMULATOR_RING_PEER_THREAD=0`` (no such thread) or with no descriptor
    to spare; the event thread then looks at the device's processes every ``_POLL`` s."""
    if pid == os.getpid() or not ShmSettings.current().ring_peer_thread:
        return False
    try:
        events.set_peer(pid)
    except OSError:   # out of descriptors (the exit thread's pipe): waits check in slices
        return False
    return True


def _serve_events(ref: "weakref.ref[ProcessLink]", events: Any) -> None:
    link = ref()
    if link is None:
        return
    # no time slice where the event ring wakes this thread when the IPU process exits
    # (PeerDiedError): an idle device's thread sleeps until an event or that exit
    slice_s = None if _watch_exit(events, link._primary.pid) else _POLL
    del link
    while True:
        link = ref()
        if link is None or link._closing:
            return
        del link
        try:
            msg = ipu_protocol.receive(events, timeout=slice_s)
        except RingTimeoutError:
            link = ref()
            if link is not None and link._dead_process() is not None:
                link.mark_lost()
                return
            continue
        except PeerDiedError:
            link = ref()
            if link is not None:
                link.mark_lost()
            return
        except ShmError as exc:
            link = ref()
            if link is not None and not link._closing:
                _log.warning("%s: event ring failed: %s", link.description, exc)
                link.mark_lost()
            return
        except ipu_protocol.ProtocolError as exc:
            _log.error("bad event on %s: %s", events.name, exc)
            continue
        link = ref()
        if link is None:
            return
        link._last_event = time.monotonic()
        link._servicing = True
        try:
            link._dispatch(msg)
        except Exception:  # never let a bug kill the service thread
            _log.exception("%s: while handling %s", link.description, msg.op.name)
        finally:
            link._servicing = False
            link._last_event = time.monotonic()
        if msg.op is Op.BYE or (msg.seq == link._final_seq and msg.op is not Op.NEED
                                and msg.op is not Op.OUT):
            return
        del link, msg


def wait(fut: "cf.Future[Any]", timeout: float | None, what: str,
         on_timeout: Callable[[], BaseException] | None = None, *,
         pids: Sequence[int] = (), progress: Callable[[], float] | None = None,
         sync: float | None = None) -> Any:
    """``fut.result()``, bounded twice: DeviceTimeoutError after ``timeout`` s (the call's
    own bound, None: none), and after the host sync timeout
    (:func:`host_runtime._deadline.host_sync_timeout`) without progress of the peer.

    ``sync`` is the host sync timeout (default: read now; a link reads it when it is
    made). ``progress()`` is the ``time.monotonic()`` of the peer's last sign of life (its last
    event; default: the start of the wait); ``pids`` are the peer's IPU processes, named in
    the error with their state (``stopped (state T)`` for a SIGSTOPped one). When the call
    has its own ``timeout``, a peer that is running on a CPU (state R: e.g. loading a big
    model) is progress too; without one, only events are. The waiter sleeps until the
    earliest of its result and its deadlines (re-checking ``progress`` at least each
    ``_RECHECK`` s), never in fixed slices past them.

    An interrupt (KeyboardInterrupt, a signal handler's exception) anywhere in it leaves
    nothing held when ``fut`` is an :class:`Answer` (a request's, a session's main loop):
    it sleeps on the answer's own lock, never on a ``threading.Condition``.
    """
    from host_runtime.errors import DeviceTimeoutError

    start = time.monotonic()
    own = None if timeout is None else start + timeout
    if sync is None:
        sync = host_sync_timeout()
    last = start
    while True:
        now = time.monotonic()
        if progress is not None:
            last = max(last, progress())
        quiet = last + sync
        if own is not None and now >= own:
            if on_timeout is not None:
                raise on_timeout()
            raise DeviceTimeoutError(f"{what} did not complete within {timeout:g} s"
                                     + _peers_text(pids)) from None
        if now >= quiet:
            states = [process_state(pid) for pid in pids]
            if own is not None and "R" in states and "T" not in states:
                last = now   # a peer on a CPU works towards the call's own deadline
                continue
            raise DeviceTimeoutError(
                f"{what}: no progress from the device for {sync:g} s (the host sync "
                f"timeout, IPU_EMULATOR_HOST_SYNC_TIMEOUT)" + _peers_text(pids)) from None
        limit = quiet if own is None else min(own, quiet)
        try:
            return fut.result(timeout=max(0.0, min(limit - now, _RECHECK)))
        except cf.TimeoutError:
            continue
        except BaseException as exc:
            if not (fut.done() and not fut.cancelled() and fut.exception(0) is exc):
                raise   # not the answer's (an interrupt of this wait)
            # the answer's failure, which it keeps (one error may fail many answers: a
            # lost device's): raised as a copy, the kept one reset, so that no kept
            # error holds this call's frames (see host_runtime._again)
            exc.with_traceback(None)
            raise again(exc)


_RECHECK = 0.5
"""Seconds between looks at the peer's progress while a waiter has no result yet."""


def _peers_text(pids: Sequence[int]) -> str:
    if not pids:
        return ""
    return "; " + ", ".join(f"IPU process {describe_process(pid)}" for pid in pids)


__all__.append("wait")
