"""Peer processes for the benchmarks and tests of :mod:`shm` (not part of ``shm``).

Each function is the target of a ``multiprocessing`` *spawn* process (never
fork: the parent may have threads). They attach to rings by name, watch the
parent's liveness, and exit non-zero with a traceback on any failure.
"""

from __future__ import annotations

import random
import time
from typing import Any

import numpy as np
import posix_ipc

from shm import Region, Ring, RingInvalidatedError, WouldBlock

STOP = -1
"""Tag that tells an echo peer to exit."""


def payload(seed: int, k: int, size: int) -> bytes:
    """The deterministic content of message ``k`` of a run with ``seed``."""
    return np.random.default_rng([seed, k]).integers(0, 256, size, dtype=np.uint8).tobytes()


def message_size(seed: int, k: int, slot_size: int) -> int:
    return random.Random(seed * 1_000_003 + k).randint(0, slot_size)


def _pause(rng: random.Random, speed: float) -> None:
    """Vary a peer's pace: ``speed`` 0 never pauses, 1 often does."""
    if speed and rng.random() < speed:
        time.sleep(rng.choice((0, 0, 0.0005, 0.002)))


def produce(name: str, seed: int, count: int, blocking: bool, speed: float,
            parent: int) -> None:
    """Write ``count`` messages of :func:`payload` (tag = k) into ring ``name``."""
    rng = random.Random(seed)
    with Ring.attach(name) as ring:
        ring.set_peer(parent)
        for k in range(count):
            data = payload(seed, k, message_size(seed, k, ring.slot_size))
            if blocking:
                ring.write(data, tag=k, timeout=60)
            else:
                while True:
                    try:
                        slot = ring.try_acquire_write()
                        break
                    except WouldBlock:  # yield the core to the consumer
                        time.sleep(0.0002)
                slot[:len(data)] = data
                ring.publish(len(data), tag=k)
            _pause(rng, speed)


def consume(name: str, seed: int, count: int, blocking: bool, speed: float,
            parent: int) -> None:
    """Read ``count`` messages from ring ``name`` and check each one exactly."""
    rng = random.Random(seed + 1)
    with Ring.attach(name) as ring:
        ring.set_peer(parent)
        for k in range(count):
            if blocking:
                view, tag = ring.acquire_read(timeout=60)
            else:
                while True:
                    try:
                        view, tag = ring.try_acquire_read()
                        break
                    except WouldBlock:
                        time.sleep(0.0002)
            expected = payload(seed, k, message_size(seed, k, ring.slot_size))
            if tag != k or bytes(view) != expected:
                raise AssertionError(f"message {k}: got tag {tag} and {len(view)} bytes "
                                     f"(crc mismatch); expected tag {k} and {len(expected)}")
            ring.release()
            _pause(rng, speed)


def write_then_hang(name: str, good: int, ready: Any, parent: int) -> None:
    """Publish ``good`` messages, then fill half of the next slot and wait to be killed."""
    with Ring.attach(name) as ring:
        ring.set_peer(parent)
        for k in range(good):
            ring.write(payload(0, k, ring.slot_size), tag=k)
        slot = ring.acquire_write()
        half = ring.slot_size // 2
        slot[:half] = b"\xee" * half
        ready.set()
        time.sleep(600)


def read_then_hang(name: str, ready: Any, parent: int) -> None:
    """Acquire one message for reading, never release it, and wait to be killed."""
    with Ring.attach(name) as ring:
        ring.set_peer(parent)
        ring.acquire_read(timeout=60)
        ready.set()
        time.sleep(600)


def create_then_hang(slot_size: int, num_slots: int, names: Any, ready: Any) -> None:
    """Create a ring, report its name, wait to be killed (leaves it behind)."""
    ring = Ring.create(slot_size, num_slots)
    names.put(ring.name)
    ready.set()
    time.sleep(600)


def echo(request: str, response: str, parent: int) -> None:
    """Copy every request slot into a response slot (one copy) until tag STOP."""
    req = Ring.attach(request)
    resp = Ring.attach(response)
    req.set_peer(parent)
    resp.set_peer(parent)
    acquire_read, release, write = req.acquire_read, req.release, resp.write
    try:
        while True:
            view, tag = acquire_read()
            write(view, tag)
            release()
            if tag == STOP:
                return
    finally:
        req.close()
        resp.close()


def sem_echo(ping: str, pong: str, rounds: int) -> None:
    """The floor of a blocking design: bare semaphore ping-pong (rounds < 0: until killed)."""
    a = posix_ipc.Semaphore(ping)
    b = posix_ipc.Semaphore(pong)
    acquire, release = a.acquire, b.release
    if rounds < 0:
        while True:
            acquire()
            release()
    for _ in range(rounds):
        acquire()
        release()
    a.close()
    b.close()


def pipe_echo(conn: Any) -> None:
    """multiprocessing.Pipe echo until an empty message."""
    recv, send = conn.recv_bytes, conn.send_bytes
    while True:
        data = recv()
        send(data)
        if not data:
            return


def expect_invalidated(name: str, ready: Any, parent: int) -> None:
    """Block on an empty ring until it is invalidated; fail on anything else."""
    with Ring.attach(name) as ring:
        ring.set_peer(parent)
        ready.set()
        try:
            ring.acquire_read(timeout=60)
        except RingInvalidatedError:
            return
        raise AssertionError("acquire_read returned on a ring that was only invalidated")


def create_and_exit(names: Any) -> None:
    """Create a ring and a region, report their names, exit without unlinking."""
    ring = Ring.create(64, 2)
    region = Region.create(4096)
    names.put([ring.name, region.name])
