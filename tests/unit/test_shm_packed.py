"""Rings packed in one segment (``Ring.create_packed``, ``shm/_packed.py``): one
/dev/shm object for all of them, mapped once by a peer that attaches them together, each
ring as usable as one of its own; sparse ones backed as they would be alone; the
segment given back with the last of them. The rings' own behaviour runs on a packed
ring too: the ``packed`` leg of tests/unit/test_shm_ring.py's ``pair``."""

from __future__ import annotations

import gc
import mmap
import os

import pytest

from shm import Region, Ring, ShmError, cleanup
from shm import ring as ring_module
from shm._packed import segment_of

PAGE = mmap.PAGESIZE


def _objects() -> set[str]:
    return {o.name for o in cleanup.list_objects() if o.pid == os.getpid()}


def _allocated(name: str) -> int:
    return os.stat(os.path.join("/dev/shm", segment_of(name)[0].lstrip("/"))).st_blocks * 512


def test_packed_rings_are_one_object_named_by_offset_and_each_carries_its_own() -> None:
    before = _objects()
    rings = Ring.create_packed([(16, 8, False), (100, 3, False), (3 * PAGE, 2, False)])
    try:
        made = _objects() - before
        assert len(made) == 1
        (segment,) = made
        assert [r.name for r in rings] == [f"{segment}@0", f"{segment}@{PAGE}",
                                          f"{segment}@{2 * PAGE}"]
        assert [(r.slot_size, r.num_slots) for r in rings] == [(16, 8), (100, 3),
                                                              (3 * PAGE, 2)]
        segments: dict = {}
        peers = [Ring.attach(r.name, segments=segments) for r in rings]
        assert len(segments) == 1   # mapped once for the three
        for k, (ring, peer) in enumerate(zip(rings, peers)):
            ring.write(bytes([k + 1]) * ring.slot_size, k)
        for k, peer in enumerate(peers):
            assert peer.read(1) == (bytes([k + 1]) * peer.slot_size, k)
        for peer in peers:
            peer.close()
    finally:
        for r in rings:
            r.close()
            r.unlink()
    assert _objects() == before


def test_a_sparse_packed_ring_is_backed_as_one_of_its_own_would_be() -> None:
    rings = Ring.create_packed([(16, 4, False), (16 * PAGE, 4, True), (16, 4, False)])
    try:
        # the two small rings whole (a page each), the sparse one's header page only
        assert _allocated(rings[0].name) == 3 * PAGE
        rings[1].back()
        assert _allocated(rings[0].name) >= 3 * PAGE + 64 * PAGE
        rings[1].write(b"x" * 16 * PAGE, 1)
        with Ring.attach(rings[1].name) as peer:
            assert peer.read(1) == (b"x" * 16 * PAGE, 1)
    finally:
        for r in rings:
            r.close()
            r.unlink()


def test_one_closed_ring_leaves_the_others_of_its_segment_usable() -> None:
    a, b = Ring.create_packed([(16, 2, False), (16, 2, False)])
    try:
        peer_b = Ring.attach(b.name)
        a.close()
        a.unlink()   # the segment's name goes; mappings stay
        assert not os.path.exists("/dev/shm/" + segment_of(b.name)[0].lstrip("/"))
        b.write(b"still", 5)
        assert peer_b.read(1) == (b"still", 5)
        peer_b.close()
    finally:
        b.close()
        b.unlink()


def test_packed_rings_dropped_without_close_give_their_segment_back() -> None:
    before = _objects()
    enabled = gc.isenabled()
    gc.disable()   # reference counting alone
    try:
        rings = Ring.create_packed([(16, 2, False), (16, 2, True)])
        assert len(_objects() - before) == 1
        del rings
        assert _objects() == before
    finally:
        if enabled:
            gc.enable()


@pytest.mark.parametrize("suffix, message", [
    ("@12", "no ring starts at offset 12"),
    ("@1048576", "no ring starts at offset 1048576"),
    ("@twelve", "'twelve' after '@' is not a byte offset"),
])
def test_a_bad_packed_ring_name_is_a_named_error(suffix, message) -> None:
    a, b = Ring.create_packed([(16, 2, False), (16, 2, False)])
    try:
        segment = a.name.rpartition("@")[0]
        with pytest.raises(ShmError, match=message):
            Ring.attach(segment + suffix)
    finally:
        for r in (a, b):
            r.close()
            r.unlink()


def test_a_packed_ring_name_is_unlinked_by_its_segment() -> None:
    before = _objects()
    a, b = Ring.create_packed([(16, 2, False), (16, 2, False)])
    try:
        assert cleanup.unlink_named(b.name) == 1   # a dead host's names (the IPU side)
        assert _objects() == before
    finally:
        for r in (a, b):
            r.close()
            r.unlink()


def test_create_packed_checks_each_shape() -> None:
    with pytest.raises(ValueError, match="num_slots must be an int in 1.."):
        Ring.create_packed([(16, 2, False), (16, 0, False)])
    with pytest.raises(ValueError, match="at least one ring shape"):
        Ring.create_packed([])


def test_a_region_made_with_ranges_prefaults_only_those(monkeypatch) -> None:
    """Pre-faulting a packed segment touches the backed ranges only: a sparse ring's
    pages stay unallocated (a fault there would allocate them)."""
    calls = []
    real = ring_module.Region.create

    def spy(size, kind="region", prefault=True, backed=None):
        calls.append((prefault, backed))
        return real(size, kind=kind, prefault=prefault, backed=backed)
    monkeypatch.setattr(ring_module.Region, "create", staticmethod(spy))
    rings = Ring.create_packed([(16, 2, False), (8 * PAGE, 2, True)])
    try:
        assert calls == [(True, [(0, ring_module.Ring.region_size(16, 2)),
                                 (PAGE, ring_module.HEADER_SIZE)])]
        assert _allocated(rings[0].name) == 2 * PAGE
    finally:
        for r in rings:
            r.close()
            r.unlink()
    with Region.create(4 * PAGE, backed=[(PAGE, 10)]) as r:
        assert _allocated(r.name) == PAGE
