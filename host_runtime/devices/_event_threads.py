"""The threads that read device links' event rings, kept between links.

A device link reads its IPU process's event ring on a thread while it lives
(``host_runtime.devices._link``). Starting a thread costs about 60 us, and more
while the CPUs are busy (an IPU process loading): ``Thread.start()`` waits until
the new thread has run. A runner's construction paid that every time. So a thread
whose link has ended waits, idle, for the next link for :data:`IDLE_SECONDS`
before it ends, and a link given a waiting thread does not wait for it at all.

:func:`serve` runs ``fn(*args)`` on such a thread and returns a :class:`Service`,
which says whether it still runs and joins it. A waiting thread is a daemon
thread named :data:`IDLE_NAME` (a running one is named by its link); it holds
nothing of the link it served. A process forked from this one starts with none.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable

__all__ = ["IDLE_NAME", "IDLE_SECONDS", "Service", "serve"]

IDLE_SECONDS = 5.0
"""How long a thread waits for its next link before it ends."""

IDLE_NAME = "ipu-events-idle"
"""The name of a thread waiting for its next link."""


class Service:
    """One link's turn on an event thread: ``fn(*args)`` running, then done."""

    __slots__ = ("_done", "ident")

    def __init__(self) -> None:
        self._done = threading.Lock()
        self._done.acquire()   # released when fn returns (or raises)
        self.ident: int | None = None   # the thread's, once it runs fn

    def is_alive(self) -> bool:
        """``fn`` has not returned yet (it may not have started)."""
        return self._done.locked()

    def is_current(self) -> bool:
        """The caller is the thread running ``fn`` (e.g. a callback of it)."""
        return self.ident == threading.get_ident()

    def join(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` s (None: for ever) for ``fn`` to return; whether it did."""
        if self._done.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            self._done.release()
            return True
        return False


_Job = tuple[Callable[..., Any], tuple[Any, ...], str, Service]


class _Worker:
    __slots__ = ("wake", "job")

    def __init__(self) -> None:
        self.wake = threading.Lock()
        self.wake.acquire()   # released when a job is given
        self.job: _Job | None = None


_lock = threading.Lock()
_idle: list[_Worker] = []   # waiting threads, the most recently idle last


def serve(fn: Callable[..., Any], args: tuple[Any, ...], name: str) -> Service:
    """Run ``fn(*args)`` on an event thread named ``name``: a waiting one (not waited
    for), or a new one."""
    service = Service()
    job: _Job = (fn, args, name, service)
    with _lock:
        worker = _idle.pop() if _idle else None
    if worker is not None:
        worker.job = job
        worker.wake.release()
        return service
    # the job goes through the worker, not the thread's arguments: a Thread keeps those
    # until its target returns, and this one serves other links after this one
    worker = _Worker()
    worker.job = job
    del job
    threading.Thread(target=_work, args=(worker,), name=name, daemon=True).start()
    return service


def _work(me: _Worker) -> None:
    thread = threading.current_thread()
    job, me.job = me.job, None
    while job is not None:
        fn, args, name, service = job
        thread.name = name
        service.ident = threading.get_ident()
        try:
            fn(*args)
        except BaseException:
            service._done.release()
            raise   # (the thread ends)
        # nothing of the link is held while this thread waits; it is waiting (idle, and
        # so taken by the next link) before its link can see the service ended
        del fn, args, job
        thread.name = IDLE_NAME
        with _lock:
            _idle.append(me)
        service._done.release()
        del service
        job = _next(me)


def _next(me: _Worker) -> _Job | None:
    """The next job given to ``me`` (idle already), or None after IDLE_SECONDS without one."""
    if not me.wake.acquire(timeout=IDLE_SECONDS):
        with _lock:
            if me in _idle:   # nobody took it meanwhile: end
                _idle.remove(me)
                return None
        me.wake.acquire()   # taken at the last moment: its job is being given
    job, me.job = me.job, None
    return job


def _forget_in_child() -> None:
    """A forked child has none of the parent's threads."""
    global _lock
    _lock = threading.Lock()
    _idle.clear()


os.register_at_fork(after_in_child=_forget_in_child)
