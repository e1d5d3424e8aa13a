"""How the IPU process waits for an input transfer that is not there yet: it tells the
host (a NEED event, for a stream in event mode), polls briefly while recent inputs came
quickly (a host sending requests back to back), then blocks through
``StreamHost.wait_on`` (``shm.spin.PollEstimate``: an idle or slow host costs this
process no core)."""

from __future__ import annotations

import time
from typing import Any, Callable, Protocol, TypeVar

from shm import Ring, RingTimeoutError
from shm.spin import NEVER, PollEstimate, us_to_ns

from ipu_emulator.ipu_protocol import Message, Op
from ipu_emulator.settings import IpuSettings
from ipu_emulator.trace import recorder

__all__ = ["InputWait", "WaitHost"]

_T = TypeVar("_T")

C_POLL_NS = 10_000
"""Between two runs of Main done back to back in C, how long the C step polls for the next
inputs before it returns to Python (which then polls and blocks as :class:`InputWait` says):
a host that sends its next request as soon as it has read an answer ([1,4] ``execute``)
takes 3-5 us to send it, while the way back to this module's poll through the serving loop
took longer, so the request waited for the IPU process."""

_BACKOFF_POLLS = 8
"""Polls skipped (blocking at once) after one whose yield ran another task (measured: with
the load at 11 on 2 CPUs each such yield cost 0.3-2.3 ms)."""


class WaitHost(Protocol):
    """What the waits need of the IPU process that runs them (``process.DeviceProcess``)."""

    keeps_apart: bool          # True: this process keeps off the host's CPU (never yield)

    def post(self, msg: Message) -> None:
        """Post an event (NEED, OUT) to the host."""

    def wait_on(self, fn: Callable[..., _T]) -> _T:
        """Call a blocking ring operation, re-checking the control ring and the host between
        slices; raises when the run must stop."""


class InputWait:
    """The waits for inputs of one ``_RingIO``; ``est`` learns how long they take."""

    def __init__(self, dev: WaitHost) -> None:
        self._dev = dev
        s = getattr(dev, "settings", None)   # this process's (its launch's), read once
        if not isinstance(s, IpuSettings):
            s = IpuSettings.current()
        self._yielded_ns = us_to_ns(s.yielded_us, NEVER)
        self.est = PollEstimate(us_to_ns(s.device_spin_us), self._yielded_ns, _BACKOFF_POLLS)
        self.idle_since: int | None = None   # (traced) waiting for a run's first transfer
        self.idle_until = 0                  # (traced) when the last such wait ended

    def c_poll_ns(self) -> int:
        """How long the C step may poll for the next inputs between runs (0: not at all):
        only while recent inputs came quickly and this process keeps off the host's CPU
        (it then polls on a CPU of its own, never beside the host's submitting thread)."""
        return C_POLL_NS if self._dev.keeps_apart and self.est.worth_polling() else 0

    def read_slow(self, ring: Ring, index: int, need_event: bool, idle: bool = False
                  ) -> tuple[memoryview, int]:
        """The next transfer of input stream ``index`` (its ``ring``) once it is not there
        at once: tell the host (``need_event``), then wait (acquired; the caller releases
        it). ``idle``: the program run has moved no transfer yet; on a timeline it begins
        when this one comes (the wait is the gap before it, ``idle_since``/``idle_until``)."""
        if need_event:
            self._dev.post(Message(Op.NEED, index=index))
        if not recorder.ON:
            return self.wait_read(ring)
        t0 = time.monotonic_ns()
        if idle:
            self.idle_since = t0
            got = self.wait_read(ring)   # a STOP here leaves idle_since: the run never began
            self.idle_since, self.idle_until = None, time.monotonic_ns()
            return got
        try:
            return self.wait_read(ring)
        finally:
            recorder.ipu(recorder.I_WAIT, t0, time.monotonic_ns() - t0, index, 0)

    def wait_read(self, ring: Ring) -> tuple[memoryview, int]:
        """Wait for an input transfer: poll briefly while recent inputs came quickly, then
        block."""
        clock = time.perf_counter_ns
        t0 = clock()
        if self.poll(ring.readable):
            try:
                got = ring.acquire_read(0)
                self.est.record(clock() - t0)
                return got
            except RingTimeoutError:
                pass
        got = self._dev.wait_on(ring.acquire_read)
        self.est.record(clock() - t0)
        return got

    def poll(self, ready: Callable[[], Any]) -> bool:
        """Poll ``ready()`` if recent waits were short; True once it is true, False if this
        process should block instead. The poll yields to the host if it shares this CPU,
        and a long yield means it does: block instead (unless keeping apart), so that the
        wake-up lets the scheduler move one of us to an idle CPU (two polling processes on
        one CPU are never separated)."""
        est = self.est
        est.shared_ns = NEVER if self._dev.keeps_apart else self._yielded_ns
        return est.poll(ready)
