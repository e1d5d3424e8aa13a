"""The IPU process's control wire: a pool process just handed to a host polls for that
host's first request once, before it blocks (``ControlWire.expect_soon``)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from shm import Ring

from ipu_emulator import ipu_protocol
from ipu_emulator.ipu import _control
from ipu_emulator.ipu._control import ControlWire
from ipu_emulator.ipu_protocol import Message, Op


class _Watch:
    receive_timeout = 5.0

    def check(self) -> None:   # pragma: no cover - not reached within the timeout
        raise AssertionError("the wire waited a whole slice")


class _CountedRing:
    """A real ring whose blocking reads and polls are counted."""

    def __init__(self, ring: Ring) -> None:
        self._ring = ring
        self.polls = 0
        self.blocked = 0   # reads that found nothing to read (they would sleep)
        self.on_poll: Any = None
        self.on_block: Any = None   # sends what the blocked read then takes

    def readable(self) -> bool:
        self.polls += 1
        if self.on_poll is not None:
            self.on_poll(self.polls)
        return self._ring.readable()

    def acquire_read(self, timeout: float | None = None) -> Any:
        if not self._ring.readable():
            self.blocked += 1
            if self.on_block is not None:
                self.on_block()
        return self._ring.acquire_read(timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ring, name)


@pytest.fixture
def ring():
    r = Ring.create(ipu_protocol.CONTROL_SLOT_SIZE, 4)
    yield r
    r.close()
    r.unlink()


def _wire(counted: _CountedRing) -> ControlWire:
    return ControlWire(counted, _Watch(),  # type: ignore[arg-type]
                       pool=True, apply_modes=lambda m: None)


def test_a_request_sent_during_the_poll_is_taken_without_blocking(ring, monkeypatch):
    # a budget no descheduling can spend before the fifth look (the request comes then)
    monkeypatch.setattr(_control, "FIRST_REQUEST_POLL_NS", 60_000_000_000)
    counted = _CountedRing(ring)
    wire = _wire(counted)

    def send_on_the_fifth_poll(n: int) -> None:
        if n == 5:
            ipu_protocol.send(ring, Message(Op.PING, seq=7))
    counted.on_poll = send_on_the_fifth_poll
    wire.expect_soon()
    msg = wire.next()
    assert (msg.op, msg.seq) == (Op.PING, 7)
    assert counted.polls == 5 and counted.blocked == 0


def test_without_expect_soon_the_wire_blocks_at_once(ring):
    counted = _CountedRing(ring)
    wire = _wire(counted)
    counted.on_block = lambda: ipu_protocol.send(ring, Message(Op.PING, seq=3))
    assert wire.next().seq == 3
    assert counted.polls == 0 and counted.blocked == 1


def test_the_poll_is_bounded_and_once(ring, monkeypatch):
    monkeypatch.setattr(_control, "FIRST_REQUEST_POLL_NS", 2_000_000)   # 2 ms
    counted = _CountedRing(ring)
    wire = _wire(counted)
    wire.expect_soon()
    # nothing comes during the poll: it gives up, then the read blocks (and gets one)
    seq = iter([1, 2])
    counted.on_block = lambda: ipu_protocol.send(ring, Message(Op.PING, seq=next(seq)))
    clock = time.perf_counter_ns
    t0 = clock()
    assert wire.next().seq == 1
    assert clock() - t0 >= 2_000_000
    assert counted.polls > 0 and counted.blocked == 1
    polls = counted.polls
    assert wire.next().seq == 2   # the poll was for the first request only
    assert counted.polls == polls and counted.blocked == 2
