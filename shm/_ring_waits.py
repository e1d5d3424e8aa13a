"""Token waits, interrupts, the peer watch and the doorbell of a ring's end.

Every blocking call of a ring comes down to taking one token of one of its two
semaphores (``free`` for the producer, ``full`` for the consumer; see the drawing and
"Waiting" in shm/ring.py). This module is that wait on the Python path, and everything
that may end it early:

- the token bank (``_spare_free``/``_spare_full``): a token taken and not yet used by
  the call that took it (an exception raised as the wait returned) is kept for the
  next call, which uses it instead of waiting (see ``_acquire_token``); the C core
  banks in the same lists;
- a short adaptive spin before sleeping (``ring_spin_us``);
- :meth:`interrupt`/:meth:`resume`: another thread of this process wakes this
  process's waiters with one posted token each, which each takes back;
- the peer watch (:meth:`set_peer`): a thread of ``shm.liveness`` notified of the
  peer's exit wakes the waiters, or a wait checks the peer every ``PEER_CHECK`` s;
- the doorbell (:meth:`set_doorbell`): a consumer blocked elsewhere asks every
  publish on this ring to signal it.

:class:`_RingWaits` is one of the concept classes ``shm.ring.Ring`` is made of; what
it reads of the others is declared at the top of its body.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from typing import Any, Callable

import posix_ipc

from ._ring_layout import _ACQUIRED, _DOORBELL, _INVALID, _PUBLISHED, _RELEASED
from ._ring_life import _ClosedWords
from .errors import PeerDiedError, RingTimeoutError, ShmError, WaitInterrupted, WouldBlock
from ._semaphore import SharedSemaphore
from .liveness import PeerWatch, notify_on_exit
from .settings import ShmSettings
from .spin import spin_until, us_to_ns

_log = logging.getLogger(__name__)

PEER_CHECK = 0.05
"""Seconds between checks of the peer process (after ``set_peer``) during a wait: a
process's death posts no semaphore. Waits without a peer are never cut."""

_SPIN_MIN_NS = 2000
"""Floor of an adapting spin budget (the ring's ``ring_spin_us`` if lower); see _spin."""



class _RingWaits:
    """How this process's calls on a ring wait for a token, and what wakes them early.

    Owns (set by ``__init__``): the token bank, the spin budget, the interrupt
    state, the peer watch. The C core, when there is one, keeps its own record of its
    waiters and interrupts and is told of each change here.
    """

    # -- what the waits read of the ring (its mapping: shm._ring_life; its C core:
    #    shm._ring_handoff) --------------------------------------------------------
    _name: str
    _w: memoryview | _ClosedWords
    _free: SharedSemaphore
    _full: SharedSemaphore
    _num_slots: int
    _pid: int
    _closed: bool
    _core: Any
    _raise_if_unusable: Callable[[], None]

    def __init__(self, settings: ShmSettings) -> None:
        # longest spin before blocking (0 disables spinning) and its floor; see _spin
        self._spin_max_ns = self._spin_ns = us_to_ns(settings.ring_spin_us)
        self._spin_min_ns = min(_SPIN_MIN_NS, self._spin_max_ns)
        # Tokens the Python path took from a semaphore (itself, or through the C core's
        # wait_token/try_token and hand-overs) and has not used yet (see _acquire_token):
        # one is left when an exception interrupts a call between its wait and its use of
        # the slot, and the next call uses it instead of waiting. The C core holds these
        # lists: never rebind them.
        self._spare_full: list[None] = []
        self._spare_free: list[None] = []
        self._peer: PeerWatch | None = None
        # a thread of shm.liveness tells this ring that its peer exited (see set_peer)
        self._peer_thread = settings.ring_peer_thread
        # interrupt(): this process's waits raise WaitInterrupted until resume(). The
        # pure-Python path's bookkeeping of it (the C core keeps its own): threads
        # blocked on [free, full] now, tokens interrupt() posted not yet taken back
        self._interrupted = False
        self._peer_gone = False          # the peer's exit was notified (see set_peer)
        self._peer_notified = False      # ... and will be: waits need no peer check
        self._unnotify: Any = None
        self._wlock = threading.Condition()   # notified as a wait ends (over an RLock: cheaper)
        self._blocked = [0, 0]
        self._pending = [0, 0]

    # -- the peer and interrupts ---------------------------------------------------

    @property
    def peer_pid(self) -> int | None:
        return None if self._peer is None else self._peer.pid

    def set_peer(self, pid: int | None) -> None:
        """Waits fail with PeerDiedError once process ``pid`` is gone (None: stop watching).

        A death posts no semaphore: a thread of ``shm.liveness`` blocked on the peer's
        pidfd (:func:`shm.liveness.notify_on_exit`) wakes this process's waiters when
        it exits, so their waits need no periodic wake. With
        ``IPU_EMULATOR_RING_PEER_THREAD=0`` (or without pidfds) a wait checks the peer
        every ``PEER_CHECK`` seconds instead."""
        peer = None if pid is None else PeerWatch(pid)
        # the old peer's watch ends after the new one's starts: the watching thread keeps
        # running (it ends once nothing is watched); the old one's exit is ignored now
        unwatch_old, self._unnotify = self._unnotify, None
        self._peer = peer
        self._peer_notified = False
        if self._peer_gone:
            self._peer_gone = False
            if self._core is not None and not self._interrupted:
                self._core.resume()
        try:
            if peer is not None and self._peer_thread and peer.alive():
                ref = weakref.ref(self)
                self._unnotify = notify_on_exit(peer.pid, lambda: _peer_exited(ref, peer))
                self._peer_notified = self._unnotify is not None
        finally:
            if unwatch_old is not None:
                unwatch_old()
        if self._core is not None:
            self._core.check_s = 0.0 if peer is None or self._peer_notified else PEER_CHECK

    def _wake_for_peer(self, peer: PeerWatch) -> None:
        """The peer exited (a notification): wake this process's waiters, which then
        raise PeerDiedError, and make later waits see it at once."""
        if peer is not self._peer:
            return   # set_peer changed it meanwhile
        with self._wlock:
            self._peer_gone = True
            self._wake_blocked()
        if self._core is not None:
            self._core.interrupt()

    def interrupt(self) -> None:
        """Wake every thread of this process blocked on this ring (either end); until
        :meth:`resume`, every wait of this process on it raises
        :class:`WaitInterrupted` (its checks of close, invalidation and the peer first).

        Thread-safe, for another thread of this process (the peer process is woken by
        :meth:`invalidate`). It posts a token for each blocked thread, which that
        thread takes back, so the semaphores count what they counted."""
        with self._wlock:
            self._interrupted = True
            self._wake_blocked()
        if self._core is not None:
            self._core.interrupt()

    def _wake_blocked(self) -> None:
        """Post a token for each thread of this process blocked in a Python-path wait
        (``_take``), counted as pending so that the woken thread takes it back. Under
        ``_wlock``; the C core's waiters are woken by ``Core.interrupt``."""
        for i, sem in enumerate((self._free, self._full)):
            for _ in range(self._blocked[i]):
                self._pending[i] += 1
                sem.release()

    def resume(self) -> None:
        """Waits block again after :meth:`interrupt`."""
        with self._wlock:
            self._interrupted = False
        if self._core is not None and not self._peer_gone:
            self._core.resume()

    # -- waiting -------------------------------------------------------------------
    #
    # The Python path (the C core's methods shadow it once a role is taken, see
    # shm._ring_handoff). A wait (_wait, _wait_slow) loops: check the invalid
    # word and close (after close() the words are a stand-in that raises
    # ShmClosedError), interrupt() and the peer; then one wait for a token until
    # the deadline (none for timeout None), cut at PEER_CHECK only when a peer is
    # watched. Whatever ends it early posts the semaphore: a token, invalidate(),
    # interrupt() or close().

    def _check_peer(self, what: str) -> None:
        peer = self._peer
        if peer is not None:
            reason = peer.dead_reason()
            if reason is not None:
                raise PeerDiedError(
                    f"ring {self._name}: peer process {peer.pid} {reason} "
                    f"while this process waited for {what}", peer.pid)

    def _spin(self, sem: SharedSemaphore) -> None:
        """Poll ``sem`` for up to the current spin budget; adapt the budget.

        A token that arrives while spinning saves the poster a futex wake and
        this process a sleep and a wake-up. A spin that runs out wasted its
        budget: halve it, down to a floor of _spin_min_ns (cheap next to a
        wake-up, and enough to notice when spinning starts to pay again).
        """
        budget = self._spin_ns
        if spin_until(lambda: sem.value, budget, yield_cpu=False):
            if budget < self._spin_max_ns:
                self._spin_ns = min(budget * 2, self._spin_max_ns)
        else:
            self._spin_ns = max(budget // 2, self._spin_min_ns)

    def _wait_slow(self, sem: SharedSemaphore, timeout: float | None, what: str,
                   waited: float) -> None:
        """Take a token of ``sem`` within ``timeout`` s (None: no deadline), of which
        ``waited`` s are spent already (by the C core's first wait)."""
        try:
            deadline = None if timeout is None else time.monotonic() - waited + timeout
            peer_check = PEER_CHECK
            tried = False
            while True:
                self._raise_if_unusable()
                self._check_peer(what)
                if self._peer_gone and self._peer is not None:   # notified: it is gone
                    raise PeerDiedError(
                        f"ring {self._name}: peer process {self._peer.pid} exited "
                        f"while this process waited for {what}", self._peer.pid)
                if self._interrupted:
                    raise WaitInterrupted(f"ring {self._name}: the wait for {what} was "
                                          "interrupted (Ring.interrupt) in this process")
                if deadline is None:
                    wait: float | None = None
                else:
                    wait = deadline - time.monotonic()
                    if wait <= 0:
                        if tried:
                            raise RingTimeoutError(f"ring {self._name}: no {what} within "
                                                   f"{timeout:g} s ({self._occupancy()})")
                        wait = 0.0
                tried = True
                if (self._peer is not None and not self._peer_notified
                        and (wait is None or wait > peer_check)):
                    wait = peer_check
                if self._take(sem, wait):
                    return
        except ShmError as exc:  # may be raised in an except clause: hide its context
            exc.__suppress_context__ = True
            raise

    def _take(self, sem: SharedSemaphore, wait: float | None) -> bool:
        """One wait of up to ``wait`` s (None: no deadline; 0: none) for a token of
        ``sem``, banked in the spare list (see _acquire_token); False if none came (time
        up, interrupted, or a signal: a handler that raises propagates) or the one that
        came was one too many (:meth:`_surplus`)."""
        core = self._core
        if core is not None:
            return bool(core.wait_token(sem is self._full, wait)) and not self._surplus(sem)
        i = int(sem is self._full)
        with self._wlock:
            if self._interrupted or self._peer_gone:
                return False
            self._blocked[i] += 1
        got = False
        try:
            self._acquire_token(sem, wait)   # banked in the spare list (see there)
            got = True
        except (posix_ipc.BusyError, posix_ipc.SignalError):
            pass
        finally:
            with self._wlock:
                self._blocked[i] -= 1
                if got and self._pending[i]:   # a token interrupt() posted (see interrupt)
                    self._pending[i] -= 1
                    (self._spare_full if i else self._spare_free).pop()
                    got = False
                # interrupt() posted a token for each thread blocked then; one that left
                # without it (timed out as it came) would leave it in the semaphore, which
                # the peer shares: take back those no blocked thread is left to take
                while self._pending[i] > self._blocked[i]:
                    try:
                        sem.acquire(0)
                    except posix_ipc.BusyError:
                        break
                    self._pending[i] -= 1
                self._wlock.notify_all()
        return got and not self._surplus(sem)

    def _try_token(self, sem: SharedSemaphore) -> bool:
        """Take a token of ``sem`` now if there is one (never one interrupt() posted, nor
        one too many: :meth:`_surplus`), banked in the spare list (see _acquire_token)."""
        core = self._core
        if core is not None:
            return bool(core.try_token(sem is self._full)) and not self._surplus(sem)
        i = int(sem is self._full)
        while True:
            try:
                self._acquire_token(sem, 0)   # banked in the spare list (see there)
            except posix_ipc.BusyError:
                return False
            if not self._pending[i]:
                return not self._surplus(sem)
            with self._wlock:
                if not self._pending[i]:
                    return not self._surplus(sem)
                self._pending[i] -= 1
                (self._spare_full if i else self._spare_free).pop()

    def _acquire_token(self, sem: SharedSemaphore, timeout: float | None) -> None:
        """``sem.acquire(timeout)`` (the path without the C core); the token is banked in
        ``_spare_full``/``_spare_free`` within the same C call (``SharedSemaphore.take_into``),
        so that an exception raised as the wait returns (a signal handler's, checked at
        the end of each call) cannot lose it. Whoever uses the slot takes it from the bank
        in the same step (no call between) as it moves the ring's counter. The C core banks
        the tokens it takes for the Python path in the same lists (``wait_token``,
        ``try_token``, and a token handed over with code ``TOKEN``), and its fast paths
        leave a call to the Python path while a token is banked."""
        sem.take_into(self._spare_full if sem is self._full else self._spare_free, timeout)

    def _banked(self, sem: SharedSemaphore) -> bool:
        """Whether a token of ``sem`` taken by a call an exception interrupted before it
        used it is banked (see _acquire_token); those a reset made stale are dropped
        first (:func:`_drop_stale`)."""
        w = self._w
        if sem is self._full:
            return _drop_stale(self._spare_full, w[_PUBLISHED] - w[_ACQUIRED])
        return _drop_stale(self._spare_free, self._num_slots - (w[_PUBLISHED] - w[_RELEASED]))

    def _surplus(self, sem: SharedSemaphore) -> bool:
        """A token of ``sem`` was just taken (banked): whether it was one too many and is
        dropped. A ``free`` token taken while every slot is in use cannot be real (the
        consumer counts a release before it posts the token; see :func:`_drop_stale`)."""
        w = self._w
        if sem is self._full or w[_PUBLISHED] - w[_RELEASED] < self._num_slots:
            return False
        if self._spare_free:
            del self._spare_free[-1]
        return True

    def _wait(self, sem: SharedSemaphore, timeout: float | None, what: str) -> None:
        """Take one token of ``sem`` (the Python path's wait)."""
        if self._w[_INVALID]:
            self._raise_if_unusable()
        if self._banked(sem):
            return    # one taken by a call an exception interrupted before it used it
        if self._spin_ns and not sem.value:
            self._spin(sem)
        if not self._try_token(sem):
            self._wait_slow(sem, timeout, what, 0.0)
        if self._w[_INVALID]:
            self._raise_if_unusable()

    def _try(self, sem: SharedSemaphore, what: str) -> None:
        if self._w[_INVALID]:
            self._raise_if_unusable()
        if self._banked(sem):
            return    # one taken by a call an exception interrupted before it used it
        if not self._try_token(sem):
            raise WouldBlock(f"ring {self._name}: no {what} ({self._occupancy()})")
        if self._w[_INVALID]:
            self._raise_if_unusable()

    def _occupancy(self) -> str:
        w = self._w
        return (f"{w[_PUBLISHED] - w[_RELEASED]}/{self._num_slots} slots in use, "
                f"{w[_PUBLISHED] - w[_ACQUIRED]} readable")

    def _wait_unblocked(self, timeout: float) -> None:
        """Wait until no thread of this process is blocked on this ring (close(): the
        threads it woke leave their waits and take back the tokens it posted)."""
        if self._core is not None:
            quiet = bool(self._core.wait_unblocked(timeout))
        else:
            with self._wlock:
                quiet = self._wlock.wait_for(lambda: not any(self._blocked), timeout)
        if not quiet:
            _log.warning("ring %s: closed while a thread of this process still waits on it "
                         "after %g s", self._name, timeout)

    def _forget_tokens(self) -> None:
        """reset(): the semaphores were drained (with any token interrupt() posted), so
        no banked or posted token is owed any more."""
        self._spare_full.clear()
        self._spare_free.clear()
        with self._wlock:
            self._pending = [0, 0]
        if self._core is not None:
            self._core.forget_wakes()

    def _stop_peer_watch(self) -> None:
        """Stop the notification of the peer's exit (close())."""
        if self._unnotify is not None:
            self._unnotify()
            self._unnotify = None

    # -- the doorbell --------------------------------------------------------------

    def set_doorbell(self, signum: int) -> None:
        """While ``signum`` is set (0: off), every message published on this ring also
        sends that signal to this process: for a consumer that blocks on other rings for
        a while and must still hear this one at once (the IPU process, waiting for a
        stream while its control ring may bring STOP). The signal's handler is the
        consumer's business; arm it, then check :meth:`readable`, then block, so that
        no message falls between. Choose a signal ignored by default (``SIGURG``): a
        consumer that dies armed leaves the word set, and its pid may be reused."""
        if not isinstance(signum, int) or not 0 <= signum < 256:
            raise ValueError(f"signum must be an int in 0..255, got {signum!r}")
        self._w[_DOORBELL] = (self._pid << 8 | signum) if signum else 0



def _drop_stale(spare: list[None], room: int) -> bool:
    """Drop the banked tokens past ``room``; whether one is left.

    A token banked before the peer reset the ring (a STOP ended this side's run right
    after its wait, or an invalidation woke it: its token is banked as the call raises)
    may be one the reset removed. Each banked ``full`` token stands for a published
    message not yet acquired, each banked ``free`` one for a slot not in use: those past
    ``published - acquired`` (the free slots) are stale, and used they would read an
    unpublished slot (write over an unread one). A stale ``free`` token used while slots
    were free leaves one too many in the semaphore: ``_RingWaits._surplus`` drops it
    when it is taken."""
    if spare:
        stale = len(spare) - room
        if stale > 0:
            del spare[:stale]
    return bool(spare)


def _peer_exited(ref: "weakref.ref[_RingWaits]", peer: PeerWatch) -> None:
    """From shm.liveness's thread: the peer of the Ring behind ``ref`` exited."""
    ring = ref()
    if ring is not None and not ring._closed:
        ring._wake_for_peer(peer)


def _ring_doorbell(word: int) -> None:
    """Send the consumer the signal its doorbell word asks for (see set_doorbell)."""
    try:
        os.kill(word >> 8, word & 0xFF)
    except (ProcessLookupError, PermissionError, ValueError):
        pass   # gone: its peer checks tell
