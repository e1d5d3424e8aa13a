"""The one spin policy: poll for up to a budget of nanoseconds, then let the caller block.

Waking a process that sleeps on a semaphore costs tens of microseconds on this
project's VMs, on both sides; an answer that is near is cheaper to poll for.
Every Python waiter that polls before it blocks does it with :func:`spin_until`:

- ``shm.ring.Ring._spin`` (pure-Python path; budget ``Settings.ring_spin_us``,
  adapting: doubled after a spin that found its token, halved after one that
  did not; no ``sched_yield``). The C core (``shm/_ringcore.c``, ``spin``)
  does the same in C with the budget ``shm.ring`` hands it from the same field.
- ``ipu_emulator.ipu._stream_io._RingIO._poll`` (an IPU process waiting for
  an input; budget ``Settings.device_spin_us``);
- ``host_runtime.runner._replica.Replica._spin`` (the host waiting for an
  output; budget ``Settings.runner_spin_us``).

Every poll starts with ``HOT_NS`` of polling without yields: the peer runs on
another CPU (the IPU process keeps off its host thread's) and its answer, when
near, is seen at once instead of on a yield's return (measured: a [1,4] execute
/ in-process onnxruntime went from 1.39 to 1.25).

The last two also keep a moving estimate of their recent waits and do not poll
while waits are much longer than the budget (an idle or slow peer must not cost
a core), and they yield the CPU between polls: a ``sched_yield`` that takes
longer than ``Settings.yielded_us`` ran another task on this CPU, likely the
peer, and when the caller says so (``shared_ns``) the poll gives up so that the
wake-up lets the scheduler put the two on different CPUs.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

__all__ = ["NEVER", "HOT_NS", "spin_until", "us_to_ns"]

HOT_NS = 4000
"""The first nanoseconds of a poll, which do not yield the CPU between polls."""

NEVER = 1 << 62
"""A ``shared_ns`` that no yield reaches: never give up because the CPU is shared."""


def us_to_ns(us: float, zero: int = 0) -> int:
    """Microseconds (a Settings field) as integer nanoseconds; 0 becomes ``zero``."""
    return int(us * 1000) or zero


def spin_until(ready: Callable[[], Any], budget_ns: int, shared_ns: int = NEVER,
               yield_cpu: bool = True, on_shared: Callable[[], None] | None = None) -> bool:
    """Poll ``ready()`` until it is true (True) or ``budget_ns`` has passed (False).

    With ``yield_cpu`` the CPU is yielded between polls (the peer may share it), and a
    yield that took longer than ``shared_ns`` ends the poll at once (False), after
    calling ``on_shared()`` if given.
    """
    clock = time.perf_counter_ns
    start = clock()
    stop = start + budget_ns
    # the first HOT_NS without yields: an answer that near is seen at once, where a
    # yield (a system call) would see it only on return
    hot = min(stop, start + HOT_NS)
    while not ready():
        if clock() >= hot:
            break
    else:
        return True
    if not yield_cpu:
        while not ready():
            if clock() >= stop:
                return False
        return True
    yield_now = os.sched_yield
    if shared_ns >= NEVER:   # no clock read after each yield (a turn of the poll is shorter)
        while not ready():
            if clock() >= stop:
                return False
            yield_now()
        return True
    while not ready():
        t = clock()
        if t >= stop:
            return False
        yield_now()
        if clock() - t > shared_ns:
            if on_shared is not None:
                on_shared()
            return False
    return True
