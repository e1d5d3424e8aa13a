"""The runner's events on the timeline (``ipu_emulator.trace``): requests, a replica's life,
waits for ring slots.

Every caller checks ``recorder.ON`` first (one module attribute read): with tracing
off nothing here runs. A request's instants (``time.perf_counter_ns``, the
monotonic clock on Linux)::

    received  prepared  lay   laid    started   first out  read   completed
       |--prep--|----------queue------|--waiting---|--out----|--cb----|
                        |-transfer in-|
                                          (started: the device is free for it; the
                                           same instant getTimeTrace's read_queue ends)

``lay`` is when the submitter holds the replica (its lock); ``first out`` when the
first output of its first transfer was read; ``read`` when the last output of its
last transfer was read; ``started``, ``prepared`` and ``laid`` are the request
monitor's (``monitoring.RequestMonitor.record``).
"""

from __future__ import annotations

import itertools
import time
from typing import Any

from ipu_emulator.trace import recorder

from host_runtime.runner._requests import Request, Transfer

__all__ = ["request", "fused", "drained", "life", "life_key", "wait", "lay_started"]

_ids = itertools.count(1)
_lives = itertools.count(1)


def life_key() -> int:
    """A replica life's key on the timeline: never reused in this process (an ``id()``
    is, once the life is freed: a later runner's replica would join the earlier's)."""
    return next(_lives)


def lay_started(req: Request) -> None:
    """The submitter holds the replica for ``req``: its trace record begins."""
    req.trace = [time.perf_counter_ns(), 0, 0, []]


def drained(tr: Transfer, now: int) -> None:
    """``tr``'s outputs were all read at ``now``: note it on each request it carries."""
    for seg in tr.segments:
        t = seg[0].trace
        if t is not None:
            if not t[1]:
                t[1] = tr.t_first or now
            t[2] = now
            t[3].append(tr.seq)


def request(key: int, req: Request, started: int) -> None:
    """A request of the replica whose life's ``trace_key`` is ``key`` completed."""
    t = req.trace or [req.t_laid, 0, 0, []]
    instants = (req.t_received, req.t_prepared, t[0], req.t_laid, started, t[1], t[2],
                req.t_completed)
    recorder.host(recorder.H_REQUEST, req.t_received, req.t_completed - req.t_received,
                  (key, req.replica, next(_ids), req.samples, tuple(t[3]), instants))


def failed(key: int, replica: int, samples: int, received: int, error: BaseException
           ) -> None:
    """A request of the replica whose life's ``trace_key`` is ``key`` failed with
    ``error``: from its arrival (``received``, perf_counter ns) to now."""
    recorder.host(recorder.H_FAILED, received, max(0, time.perf_counter_ns() - received),
                  (key, replica, next(_ids), samples, type(error).__name__))


def fused(key: int, replica: int, samples: int, seq: int, instants: tuple[int, ...]) -> None:
    """A request of the fused path (one transfer, ``seq``) completed."""
    recorder.host(recorder.H_REQUEST, instants[0], instants[-1] - instants[0],
                  (key, replica, next(_ids), samples, (seq,), instants))


def life(what: str, key: int, replica: int, t0: int, session: Any) -> None:
    """A replica's ``what`` (attach and load, reset, close) took from ``t0`` (monotonic
    ns) until now; ``key``: its life's ``trace_key``; ``session``: its session (its
    device's IPU processes, its model)."""
    pids: list[int] = []
    model = ""
    try:
        dev = session.device() if session is not None else None
        pids = list(dev.pids()) if dev is not None else []
        model = str(session.model().metadata.executable())
    except Exception:   # a session without these (a stand-in): the event without them
        pass
    recorder.host(recorder.H_LIFE, t0, time.monotonic_ns() - t0,
                  (what, replica, tuple(pids), model, key))


def wait(what: str, t0: int) -> None:
    """This thread waited for ``what`` from ``t0`` (monotonic ns) until now."""
    recorder.host(recorder.H_WAIT, t0, time.monotonic_ns() - t0, (what,))
