"""The one wait strategy: poll for a near answer, block for a far one.

Waking a process that sleeps on a semaphore costs tens of microseconds on this
project's VMs, on both sides; an answer that is near is cheaper to poll for, one
that is far must cost nothing while it is awaited. Every waiter that polls
before it blocks does it here:

- :class:`PollEstimate` is the policy of a waiter in Python: poll only while a
  moving estimate of its recent waits says the answer comes within the budget,
  block otherwise (an idle or slow peer costs no core), and back off for a few
  waits after a poll found its CPU shared. The IPU process waiting for an input
  (``ipu_emulator.ipu._stream_io``, budget ``Settings.device_spin_us``) and the
  host waiting for an output (``host_runtime.runner``, budget
  ``Settings.runner_spin_us``) each keep one. Use::

      est = PollEstimate(budget_ns, shared_ns)
      t0 = time.perf_counter_ns()
      est.poll(ring.readable)              # True: ready now; False: block
      ... block on the ring ...
      est.record(time.perf_counter_ns() - t0)

- :func:`spin_until` is the loop itself (``PollEstimate.poll`` calls it; the
  ring's pure-Python path calls it with its own adapting budget,
  ``Settings.ring_spin_us``, which ``spin`` in ``shm/_ringcore.c`` mirrors).

Every poll starts with ``HOT_NS`` of polling without yields: the peer runs on
another CPU (the IPU process keeps off its host thread's) and its answer, when
near, is seen at once instead of on a yield's return (measured: a [1,4] execute
/ in-process onnxruntime went from 1.39 to 1.25). After that the CPU is yielded
between polls: a ``sched_yield`` that takes longer than
``Settings.yielded_us`` (``shared_ns``) ran another task on this CPU, likely the
peer, and the poll then gives up so that the wake-up lets the scheduler put the
two on different CPUs.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

__all__ = ["NEVER", "HOT_NS", "PollEstimate", "spin_until", "us_to_ns"]

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


class PollEstimate:
    """When a waiter polls before it blocks: one per waiter (not thread-safe).

    ``budget_ns``: the longest poll (0: never poll). ``shared_ns``: a yield between
    polls that took longer ran another task on this CPU; the poll then gives up and
    the next ``backoff`` polls are skipped (NEVER: never give up; see the module
    docstring). The estimate is a moving average of recent waits, each sample capped
    at ``4 * budget_ns`` so that an idle spell is forgotten after a few quick waits;
    polling is off while it exceeds ``3 * budget_ns`` (waits that block include a
    wake-up, so a threshold of one budget could keep polling off for a peer that
    would answer within it).
    """

    __slots__ = ("budget_ns", "shared_ns", "backoff", "est_ns", "_skip")

    CAP = 4
    """Samples are capped at CAP x budget."""
    OFF = 3
    """Polling is off while the estimate exceeds OFF x budget."""

    def __init__(self, budget_ns: int, shared_ns: int = NEVER, backoff: int = 8) -> None:
        if budget_ns < 0 or shared_ns <= 0 or backoff < 0:
            raise ValueError(f"PollEstimate(budget_ns={budget_ns!r}, shared_ns={shared_ns!r}, "
                             f"backoff={backoff!r}): expected budget_ns >= 0, shared_ns > 0, "
                             "backoff >= 0")
        self.budget_ns = budget_ns
        self.shared_ns = shared_ns
        self.backoff = backoff
        self.est_ns = 0          # the moving estimate of a wait (ns)
        self._skip = 0           # polls still to skip after a shared CPU

    def worth_polling(self) -> bool:
        """True if a poll now is likely to find the answer (recent waits were short)."""
        return 0 < self.budget_ns and self.est_ns <= self.OFF * self.budget_ns

    def poll(self, ready: Callable[[], Any]) -> bool:
        """Poll ``ready()`` for up to the budget if worth it: True once it is true, False
        if the caller should block instead (not polled, budget spent, or CPU shared)."""
        budget = self.budget_ns
        if not budget or self.est_ns > self.OFF * budget:
            return False
        if self._skip:
            self._skip -= 1
            return False
        return spin_until(ready, budget, self.shared_ns, on_shared=self._back_off)

    def record(self, waited_ns: int) -> None:
        """Count one wait of ``waited_ns`` (0: the answer was there at once)."""
        cap = self.CAP * self.budget_ns
        self.est_ns = (7 * self.est_ns + (waited_ns if waited_ns < cap else cap)) >> 3

    def _back_off(self) -> None:
        # a yield ran another task: on a busy machine, or with both ends on one CPU, each
        # such yield may give away the rest of a time slice, so skip the next polls too.
        # A number of polls, not a raised estimate: waits that block include a wake-up,
        # so a raised estimate could keep polling off for good on two idle CPUs.
        self._skip = self.backoff
