"""Is a process still alive?

A process counts as dead when its pid is gone, when it is a zombie (exited,
not yet reaped by its parent), or when the pid now belongs to a different
process (its start time changed since we first looked: pid reuse).
"""

from __future__ import annotations

import os
import select
import threading
import time
import weakref
from typing import Callable

__all__ = ["pid_alive", "process_state", "describe_process", "PeerWatch", "ExitWatch",
           "notify_on_exit"]


def pid_alive(pid: int) -> bool:
    """True if ``pid`` is a running (non-zombie) process."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, belongs to someone else
    try:   # its state letter (Linux): a tenth of psutil's cost
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2:][:1] != b"Z"
    except FileNotFoundError:
        return False
    except (OSError, ValueError):   # no /proc: ask psutil
        pass
    import psutil   # here: an IPU process that never asks does not import it (~10 ms)

    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:  # pragma: no cover - access denied etc.: it exists
        return True


_STATES = {"R": "running", "S": "sleeping", "D": "in an uninterruptible wait",
           "T": "stopped", "t": "stopped by a debugger", "Z": "a zombie", "X": "dead",
           "I": "idle"}


def process_state(pid: int) -> str | None:
    """The one-letter state of ``pid`` from ``/proc/<pid>/stat`` (``T``: stopped, as by
    SIGSTOP; ``R``, ``S``, ``D``, ``Z``, ...), or None if there is no such process."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            raw = f.read(512)
    except OSError:
        return None
    # "pid (comm) S ...": comm may hold spaces and parentheses; the state follows the last ")"
    end = raw.rfind(b")")
    if end < 0 or end + 2 >= len(raw):
        return None
    return raw[end + 2:end + 3].decode("ascii", "replace")


def describe_process(pid: int) -> str:
    """``pid`` and its state for an error message: "pid 123, stopped (state T)"."""
    state = process_state(pid)
    if state is None:
        return f"pid {pid}, gone"
    return f"pid {pid}, {_STATES.get(state, 'state ' + state)} (state {state})"


class ExitWatch:
    """Exits of a set of processes, by pidfd: the one way the layers above watch processes.

    ``dead_pid()`` answers without blocking (one ``poll(0)``, about 0.3 us), ``wait(timeout)``
    blocks until one of them exits. A pidfd names the process itself, so pid reuse cannot
    fool it, and a zombie counts as exited. Where ``pidfd_open`` is missing (or a process
    had already been reaped when the watch began) it falls back to ``pid_alive`` for that
    pid; ``exact`` says whether every pid is watched by pidfd.

    Thread-safe without a lock: ``dead_pid()`` polls a shared ``select.poll`` object (about
    0.5 us), or a fresh one when another thread is inside that poll at the same moment;
    ``wait()`` uses a poll object of its own. (``select.select`` is never used: it fails on
    descriptors above 1023.)
    """

    __slots__ = ("_fds", "_poller", "_fallback", "__weakref__")

    def __init__(self, pids: "list[int] | tuple[int, ...]" = ()) -> None:
        self._fds: dict[int, int] = {}          # fd -> pid
        self._fallback: list[int] = []
        self._poller = select.poll()
        for pid in pids:
            if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
                self.close()
                raise ValueError(f"pid must be a positive int, got {pid!r}")
            try:
                fd = os.pidfd_open(pid)
            except (AttributeError, OSError):   # no pidfd support, or already gone and reaped
                self._fallback.append(pid)
                continue
            self._fds[fd] = pid
            self._poller.register(fd, select.POLLIN)

    @property
    def pids(self) -> list[int]:
        return list(self._fds.values()) + self._fallback

    @property
    def exact(self) -> bool:
        """True if every process is watched by pidfd (no pid checks needed)."""
        return not self._fallback

    def dead_pid(self) -> int | None:
        """The pid of a watched process that has exited, if any; never blocks (one poll(0))."""
        if self._fallback:
            return self.wait(0.0)
        try:
            ready = self._poller.poll(0)
        except RuntimeError:   # another thread is inside poll() on this object: a fresh one
            ready = _poll(list(self._fds), 0)
        return self._fds.get(ready[0][0]) if ready else None

    def wait(self, timeout: float | None) -> int | None:
        """Block up to ``timeout`` s (None: forever) for an exit; the pid, or None."""
        for pid in self._fallback:
            if not pid_alive(pid):
                return pid
        fds = list(self._fds)
        if not fds:
            return None
        if self._fallback and timeout is None:
            timeout = 0.05   # the fallback pids are checked by polling
        ready = _poll(fds, -1 if timeout is None else max(0, int(timeout * 1000)))
        if ready:   # a poll object of its own: any number of threads may wait
            return self._fds.get(ready[0][0])
        for pid in self._fallback:
            if not pid_alive(pid):
                return pid
        return None

    def close(self) -> None:
        fds, self._fds = self._fds, {}
        self._fallback = []
        self._poller = select.poll()   # a poll racing this close sees no closed descriptor
        for fd in fds:
            try:
                os.close(fd)
            except OSError:   # pragma: no cover
                pass

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:   # pragma: no cover - interpreter shutdown
            pass


class PeerWatch:
    """Liveness of one peer process, guarded against pid reuse (an ``ExitWatch`` of one pid)."""

    __slots__ = ("pid", "_watch", "_dead_reason")

    def __init__(self, pid: int) -> None:
        if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
            raise ValueError(f"peer pid must be a positive int, got {pid!r}")
        self.pid = pid
        self._dead_reason: str | None = None
        self._watch = _shared_watch(pid)
        if not self._watch.exact and not pid_alive(pid):
            self._dead_reason = "does not exist"

    def dead_reason(self) -> str | None:
        """None while alive; else why it counts as dead (stays dead once dead)."""
        if self._dead_reason is None and self._watch.dead_pid() is not None:
            import psutil

            try:
                zombie = psutil.Process(self.pid).status() == psutil.STATUS_ZOMBIE
            except psutil.Error:
                zombie = False
            self._dead_reason = "exited (zombie, not yet reaped)" if zombie else "exited"
        return self._dead_reason

    def alive(self) -> bool:
        return self.dead_reason() is None


def _poll(fds: list[int], timeout_ms: int) -> list[tuple[int, int]]:
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return poller.poll(timeout_ms)


_watches: "weakref.WeakValueDictionary[int, ExitWatch]" = weakref.WeakValueDictionary()
_watches_lock = threading.Lock()


def _after_fork_in_child() -> None:
    # a thread of the parent may have held the lock at the fork (the watches stay valid:
    # a pidfd names the process, whoever holds it)
    global _watches_lock
    _watches_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _shared_watch(pid: int) -> ExitWatch:
    """One pidfd per live peer however many rings watch it (a ring per anchor adds up)."""
    with _watches_lock:
        w = _watches.get(pid)
        if w is None or w.dead_pid() is not None:   # new, or that process is gone (pid reuse)
            w = ExitWatch([pid])
            _watches[pid] = w
        return w


IDLE_LINGER = 0.05
"""Seconds the exit-watching thread stays once nothing is watched, before it ends; also
how long it keeps polling a process's pidfd after its last subscriber went, for the next
subscriber of that process (a runner made right after one is closed, of the same IPU
process)."""


class _ExitNotifier:
    """One thread of this process, blocked in ``poll()`` on the pidfds of the processes
    :func:`notify_on_exit` was asked about (and a pipe that tells it the set changed):
    it wakes only when one of them exits, and then calls that process's callbacks.

    A pidfd whose last subscriber went stays polled for ``IDLE_LINGER`` seconds: a new
    subscriber of that process in that time takes it as it is, with no pidfd opened and
    no wake-up of the thread (each is a system call and a wake-up of another thread,
    twice per runner a host makes and closes on one IPU process). The thread ends once
    nothing has been polled for ``IDLE_LINGER`` seconds (the next :func:`notify_on_exit`
    starts another)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._subs: dict[int, dict[int, Callable[[], None]]] = {}   # pid -> {id: callback}
        self._fds: dict[int, int] = {}                              # pid -> pidfd
        self._idle: dict[int, float] = {}   # pid -> when its pidfd goes (no subscriber)
        self._until: float | None = None     # when the thread's poll times out (None: never)
        self._next_id = 0
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)
        threading.Thread(target=self._run, name="shm-peer-exits", daemon=True).start()

    def subscribe(self, pid: int, callback: Callable[[], None]) -> int | None:
        with self._lock:
            # (a pidfd is readable once its process exited)
            if self._idle.pop(pid, None) is not None and _poll([self._fds[pid]], 0):
                # the process polled has exited and the pid is someone else's now: the
                # thread drops that pidfd; this one cannot be watched until it has
                self._idle[pid] = 0.0
                return None
            new = pid not in self._fds
            if new:
                try:
                    self._fds[pid] = os.pidfd_open(pid)
                except OSError:   # gone already (or no such process): the caller checks
                    return None
                self._subs[pid] = {}
            self._next_id += 1
            self._subs[pid][self._next_id] = callback
            ident = self._next_id
            if new:   # a pidfd to poll: wake the thread (under the lock: it closes the
                self._changed()   # pipe under it); one polled already calls every subscriber
        return ident

    def unsubscribe(self, pid: int, ident: int) -> None:
        with self._lock:
            subs = self._subs.get(pid)
            if subs is None or subs.pop(ident, None) is None or subs:
                return
            # polled a while longer, for the next subscriber of that process; the thread
            # sleeps until then (or the process's exit) and drops it
            until = self._idle[pid] = time.monotonic() + IDLE_LINGER
            if self._until is None or until < self._until:
                self._until = until   # (what its poll's timeout will be once woken)
                self._changed()   # its poll would not time out by then: it gets a timeout

    def _changed(self) -> None:
        try:
            os.write(self._w, b"x")
        except BlockingIOError:   # full: it wakes anyway
            pass

    def _drop_idle(self) -> float | None:
        """(Under the lock.) Close the pidfds whose linger is over; seconds until the next
        one's is (None: none lingers)."""
        now = time.monotonic()
        for pid, until in list(self._idle.items()):
            if until <= now:
                del self._idle[pid]
                del self._subs[pid]
                os.close(self._fds.pop(pid))
        return min(self._idle.values()) - now if self._idle else None

    def _run(self) -> None:
        global _notifier
        idle = False   # nothing watched for a whole IDLE_LINGER already
        while True:
            with _notifier_lock, self._lock:
                wait = self._drop_idle()
                if not self._fds and idle:   # nothing to watch: end (under the lock
                    if _notifier is self:    # subscribers take)
                        _notifier = None
                    os.close(self._r)
                    os.close(self._w)
                    return
                by_fd = {fd: pid for pid, fd in self._fds.items()}
                timeout = IDLE_LINGER if not by_fd else wait
                self._until = None if timeout is None else time.monotonic() + timeout
            poller = select.poll()
            poller.register(self._r, select.POLLIN)
            for fd in by_fd:
                poller.register(fd, select.POLLIN)
            # idle: a little longer, for the next subscriber (a runner made right after
            # one is closed) to find the thread running
            ready = poller.poll(None if timeout is None else max(0.0, timeout) * 1e3)
            idle = not by_fd and not ready
            for fd, events in ready:
                if fd == self._r:
                    os.read(self._r, 4096)
                    continue
                pid = by_fd[fd]
                with self._lock:
                    if self._fds.get(pid) != fd or events & select.POLLNVAL:
                        continue   # unsubscribed meanwhile
                    callbacks = list(self._subs.pop(pid).values())
                    del self._fds[pid]
                    self._idle.pop(pid, None)
                os.close(fd)
                for callback in callbacks:
                    try:
                        callback()
                    except Exception:   # pragma: no cover - a callback's own bug
                        pass


_notifier: _ExitNotifier | None = None
_notifier_lock = threading.Lock()


def notify_on_exit(pid: int, callback: Callable[[], None]) -> Callable[[], None] | None:
    """Call ``callback()`` (from a thread of this module's) once process ``pid`` exits;
    returns a function that cancels it, or None if ``pid`` cannot be watched (no pidfds,
    or no such process: check it otherwise).

    The thread is started by the first call: it sleeps in ``poll()`` on the pidfds and
    wakes only when one of them exits, so a waiter needs no periodic wake to see its
    peer die. It never survives ``fork()`` (a child starts its own)."""
    global _notifier
    if not hasattr(os, "pidfd_open"):
        return None
    with _notifier_lock:   # held while subscribing: the thread ends under it when idle
        if _notifier is None:
            _notifier = _ExitNotifier()
        notifier = _notifier
        ident = notifier.subscribe(pid, callback)
    if ident is None:
        return None
    return lambda: notifier.unsubscribe(pid, ident)


def _forget_notifier_after_fork() -> None:
    global _notifier, _notifier_lock
    _notifier = None
    _notifier_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_notifier_after_fork)
