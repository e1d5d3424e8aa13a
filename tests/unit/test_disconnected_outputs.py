"""A run whose streams were disconnected publishes nothing.

When one IPU of a pipelined device fails, the host invalidates the IPU-Links; an IPU
further down then reads dummy (zero) inputs "until the run returns". What it computes
from them must not reach an output ring that is still open (the host's): it would be an
answer made of nothing, tagged with an older transfer's number.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ipu_emulator.ipu._stream_io import _RingIO
from shm import Ring


@pytest.fixture
def io_and_ring():
    ring = Ring.create(64, 2)
    stream = SimpleNamespace(ring=ring, plan=SimpleNamespace(null=False, out_event=False),
                             seq_mask=-1, index=0, nbytes=4, link=False)
    dev = SimpleNamespace(host_memory=SimpleNamespace(resolved={}, set_writes=lambda _: None),
                          control=None, wait_on=lambda fn: fn(None))
    io = _RingIO(dev, SimpleNamespace(interp=None, by_handle={"y": stream}))
    io._stream = lambda handle: stream          # type: ignore[method-assign]
    try:
        yield io, ring
    finally:
        ring.close()
        ring.unlink()


@pytest.mark.parametrize("disconnected", [False, True])
def test_written_output(io_and_ring, disconnected):
    io, ring = io_and_ring
    io.disconnected = disconnected
    io.write_output("y", memoryview(b"abcd"))
    assert bool(ring.readable()) is (not disconnected)


@pytest.mark.parametrize("disconnected", [False, True])
def test_lent_output(io_and_ring, disconnected):
    io, ring = io_and_ring
    io.disconnected = disconnected
    view = io.acquire_output("y", 4)
    view[:] = b"abcd"
    io.publish_output("y")
    assert bool(ring.readable()) is (not disconnected)
