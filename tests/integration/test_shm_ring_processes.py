"""Rings between two real processes (the peer is started with 'spawn')."""

from __future__ import annotations

import os
import random

import pytest

import shm.ring as ring_module
from shm import Ring, naming
from tools.bench import peers as _peers
from shm.cleanup import list_objects
from tests._helpers import SPAWN as _CTX
from tests._helpers import finish as _finish
from tests._helpers import spawn as _run_peer


@pytest.mark.parametrize("seed", range(8))
def test_every_message_arrives_once_in_order_intact(seed: int, monkeypatch) -> None:
    """Random slot sizes, depths, speeds and blocking modes; the child is one end.

    The seeds also cover each pairing of the C core and the pure-Python path.
    """
    if (seed >> 1) & 1:
        monkeypatch.setattr(ring_module, "_ringcore", None)
    if (seed >> 2) & 1:
        monkeypatch.setenv("IPU_EMULATOR_RING_C", "0")
    rng = random.Random(seed)
    slot_size = rng.choice([1, 7, 64, 1000, 4096, 65536])
    num_slots = rng.randint(1, 8)
    count = rng.randint(40, 250) if slot_size < 65536 else 30
    child_produces = seed % 2 == 0
    child_blocking, parent_blocking = rng.random() < 0.6, rng.random() < 0.6
    child_speed, parent_speed = rng.choice([0, 0.05, 0.3]), rng.choice([0, 0.05, 0.3])
    with Ring.create(slot_size, num_slots) as ring:
        if child_produces:
            proc = _run_peer(_peers.produce, ring.name, seed, count, child_blocking,
                             child_speed, os.getpid())
            _peers.consume(ring.name, seed, count, parent_blocking, parent_speed, proc.pid)
        else:
            proc = _run_peer(_peers.consume, ring.name, seed, count, child_blocking,
                             child_speed, os.getpid())
            _peers.produce(ring.name, seed, count, parent_blocking, parent_speed, proc.pid)
        _finish(proc)
        counters = ring.counters()
        assert (counters["published"], counters["acquired"], counters["released"]) == (
            count, count, count)
        assert (counters["sem_full"], counters["sem_free"]) == (0, num_slots)


def test_echo_pair_round_trips_payloads() -> None:
    req, resp = Ring.create(1 << 20, 2, kind="req"), Ring.create(1 << 20, 2, kind="resp")
    try:
        proc = _run_peer(_peers.echo, req.name, resp.name, os.getpid())
        req.set_peer(proc.pid)
        resp.set_peer(proc.pid)
        for k in range(20):
            data = _peers.payload(99, k, (k * 52361) % (1 << 20))
            req.write(data, tag=k, timeout=60)
            assert resp.read(timeout=60) == (data, k)
        req.write(b"", tag=_peers.STOP)
        assert resp.read(timeout=60) == (b"", _peers.STOP)
        _finish(proc)
    finally:
        for ring in (req, resp):
            ring.close()
            ring.unlink()


def test_invalidate_wakes_a_waiter_in_another_process() -> None:
    with Ring.create(32, 2) as ring:
        ready = _CTX.Event()
        proc = _run_peer(_peers.expect_invalidated, ring.name, ready, os.getpid())
        assert ready.wait(60)
        ring.invalidate()
        _finish(proc)
        assert not ring.is_valid()


def test_objects_of_a_process_that_exits_normally_are_unlinked_at_exit() -> None:
    names = _CTX.Queue()
    proc = _run_peer(_peers.create_and_exit, names)
    ring_name, region_name = names.get(timeout=60)
    _finish(proc)
    left = [o.entry for o in list_objects() if o.pid == proc.pid]
    assert left == []
    assert naming.parse_name(ring_name).pid == proc.pid  # type: ignore[union-attr]
    assert naming.parse_name(region_name).kind == "region"  # type: ignore[union-attr]
