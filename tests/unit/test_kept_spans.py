"""The address ranges a pool IPU process keeps its builds over (``ipu_emulator.ipu._kept``):
a host's region mapped over a range is what its views read and write; cleared, the
range is anonymous memory again and the region keeps what was written; and the bound
on the kept builds."""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from ipu_emulator.ipu._kept import KEPT, Kept, KeptBuilds, Span
from ipu_emulator.ipu._stream_io import _RequestError
from ipu_emulator.ipu_protocol import ErrorKind
from shm import Region


@pytest.fixture
def regions():
    made = [Region.create(3 * mmap.PAGESIZE) for _ in range(2)]
    try:
        yield made
    finally:
        for r in made:
            r.close()
            r.unlink()


def test_a_region_mapped_over_a_span_is_what_its_views_see(regions):
    one, two = regions
    span = Span(2 * mmap.PAGESIZE + 8, readonly=False)
    try:
        array = np.frombuffer(span.view, np.uint8)   # made once, as an interpreter does
        span.map(one.name, "device memory")
        array[:4] = (1, 2, 3, 4)
        array[-1] = 9
        assert bytes(one.buf[:4]) == b"\x01\x02\x03\x04" and one.buf[len(array) - 1] == 9
        two.buf[:4] = b"abcd"
        span.map(two.name, "device memory")   # another host's, over the same addresses
        assert bytes(array[:4]) == b"abcd"
        span.clear()
        assert not array.any()                 # anonymous memory: nothing of a host
        assert bytes(one.buf[:4]) == b"\x01\x02\x03\x04" and bytes(two.buf[:4]) == b"abcd"
        del array
    finally:
        span.close()


def test_a_read_only_span_reads_the_host_constants(regions):
    one, _ = regions
    one.buf[:8] = b"constant"
    span = Span(8, readonly=True)
    try:
        span.map(one.name, "the constants region")
        assert bytes(span.view) == b"constant" and span.view.readonly
    finally:
        span.close()


def test_a_region_too_short_or_missing_is_named(regions):
    one, _ = regions
    span = Span(4 * mmap.PAGESIZE, readonly=False)
    try:
        with pytest.raises(_RequestError, match=rf"device memory {one.name} of "
                           rf"{one.size} bytes is shorter than the {4 * mmap.PAGESIZE}") as e:
            span.map(one.name, "device memory")
        assert e.value.kind is ErrorKind.PROTOCOL and span.bound is None
        with pytest.raises(_RequestError, match="cannot open device memory /ipuemu_none"):
            span.map("/ipuemu_none_0_0_mem", "device memory")
    finally:
        span.close()


class _Interp:
    """What the kept builds ask of an interpreter."""

    def __init__(self) -> None:
        self.closed = False
        self.held: list[str] = []

    def holds_transfers(self) -> bool:
        return bool(self.held)

    def close(self) -> None:
        self.closed = True


def _kept(key: str) -> Kept:
    kept = Kept(key, Span(64, readonly=False), None)
    kept.interp = _Interp()
    return kept


def test_the_least_recently_used_beyond_the_bound_is_closed():
    builds = KeptBuilds()
    made = [_kept(f"k{i}") for i in range(KEPT + 1)]
    for kept in made:
        builds.give_back(kept)
    assert len(builds) == KEPT and made[0].interp is None      # closed
    assert builds.take("k0") is None
    again = builds.take(f"k{KEPT}")
    assert again is made[KEPT] and again.interp is not None and not again.interp.closed
    builds.close()
    again.close()
    assert all(k.interp is None for k in made)


def test_a_build_cut_short_mid_run_is_not_kept():
    builds = KeptBuilds()
    kept = _kept("k")
    kept.interp.held.append("in")   # a transfer its run still held
    interp = kept.interp
    builds.give_back(kept)
    assert len(builds) == 0 and interp.closed and kept.interp is None
