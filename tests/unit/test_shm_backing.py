"""Shared memory is allocated in /dev/shm when it is made (``shm.region``): a new region's
pages are all there at once (a full /dev/shm then is a named error at creation, never
SIGBUS at a later first touch: tests/faults/test_shm_full.py); one made with ``backed``
has only those bytes until ``back`` allocates the ranges asked."""

from __future__ import annotations

import mmap
import os

from ipu_emulator.ipu._constants import _ranges
from shm import Region, Ring

PAGE = mmap.PAGESIZE


def _allocated(obj: Region | Ring) -> int:
    return os.stat(os.path.join("/dev/shm", obj.name.lstrip("/"))).st_blocks * 512


def test_a_new_region_is_allocated_whole_prefaulted_or_not() -> None:
    for prefault in (True, False):
        with Region.create(64 * PAGE, prefault=prefault) as r:
            assert _allocated(r) >= 64 * PAGE, prefault


def test_a_region_made_with_backed_holds_only_those_bytes_until_backed() -> None:
    with Region.create(64 * PAGE, prefault=False, backed=0) as r:
        assert _allocated(r) == 0
        r.back([(3 * PAGE, 2 * PAGE), (10 * PAGE + 1, 1)])
        assert _allocated(r) == 3 * PAGE      # pages 3, 4 and 10 (its byte 1)
        r.back()
        assert _allocated(r) >= 64 * PAGE


def test_a_sparse_ring_backs_its_header_only_until_back() -> None:
    ring = Ring.create(16 * PAGE, 4, sparse=True)
    try:
        assert _allocated(ring) == PAGE
        ring.back()
        assert _allocated(ring) >= 64 * PAGE
    finally:
        ring.close()
        ring.unlink()


def test_device_memory_ranges_merge_where_they_touch() -> None:
    assert _ranges([(64, 16), (0, 64), (100, 4), (102, 10), (200, 0)]) == [
        (0, 80), (100, 12), (200, 0)]
