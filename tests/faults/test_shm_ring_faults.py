"""SIGKILL one end of a ring; the survivor must fail fast and clean, never read junk."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal

import pytest

from shm import PeerDiedError, Ring, remove_dead
from tools.bench import peers as _peers
from shm.cleanup import list_objects
from tests._helpers import SPAWN as _CTX
from tests._helpers import spawn as _start


def _kill(proc: mp.process.BaseProcess) -> None:
    os.kill(proc.pid, signal.SIGKILL)  # not joined yet: a zombie must count as dead


def test_producer_killed_mid_write_consumer_gets_peer_died_not_the_half_slot() -> None:
    with Ring.create(4096, 4) as ring:
        ready = _CTX.Event()
        proc = _start(_peers.write_then_hang, ring.name, 2, ready, os.getpid())
        try:
            assert ready.wait(60), "producer never reached the middle of its write"
            ring.set_peer(proc.pid)
            _kill(proc)
            for k in range(2):  # what was published before the death is intact
                assert ring.read(timeout=60) == (_peers.payload(0, k, 4096), k)
            with pytest.raises(PeerDiedError, match=rf"peer process {proc.pid} exited") as info:
                ring.acquire_read(timeout=60)  # bounded: must not be a RingTimeoutError
            assert info.value.pid == proc.pid
            counters = ring.counters()
            assert (counters["held"], counters["published"], counters["acquired"]) == (1, 2, 2)
        finally:
            proc.join(60)
        assert proc.exitcode == -signal.SIGKILL


def test_consumer_killed_mid_read_producer_gets_peer_died() -> None:
    with Ring.create(1024, 3) as ring:
        ready = _CTX.Event()
        proc = _start(_peers.read_then_hang, ring.name, ready, os.getpid())
        try:
            ring.set_peer(proc.pid)
            ring.write(b"first", tag=1)
            assert ready.wait(60), "consumer never acquired its slot"
            ring.write(b"second")
            ring.write(b"third")
            _kill(proc)
            with pytest.raises(PeerDiedError, match=rf"peer process {proc.pid} exited.* while "
                                                    r"this process waited for free slot"):
                ring.acquire_write(timeout=60)
            state = ring.state()
            assert "acquired 1, released 0" in state and "published 3" in state
        finally:
            proc.join(60)


@pytest.mark.allow_shm_leak  # checks /dev/shm itself
def test_owner_killed_survivor_and_cleanup_leave_nothing() -> None:
    before = {o.entry for o in list_objects()}
    ready, names = _CTX.Event(), _CTX.Queue()
    proc = _start(_peers.create_then_hang, 256, 2, names, ready)
    try:
        assert ready.wait(60)
        ring = Ring.attach(names.get(timeout=60))
        ring.set_peer(proc.pid)
        theirs = {o.entry for o in list_objects() if o.pid == proc.pid}
        assert len(theirs) == 1  # the segment (its semaphores are inside)
        _kill(proc)
        with pytest.raises(PeerDiedError):
            ring.acquire_read()  # no timeout at all: liveness alone ends the wait
        ring.close()
        assert sorted(remove_dead()) == sorted(theirs)
    finally:
        proc.join(60)
        remove_dead()
    assert {o.entry for o in list_objects()} == before
