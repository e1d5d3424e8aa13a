"""``python -m tools.bench ring``: the wire's latency and bandwidth, side by side.

Latency: round trips of a 64-byte message to an echo process and back,
through a pair of :class:`shm.Ring` (``write`` + ``read``: one copy in, one
copy in the echo, one copy out), through ``multiprocessing.Pipe``, and through
a bare ``posix_ipc`` semaphore ping-pong (no data at all: the floor of any
blocking design).

Bandwidth: round trips of 1 MiB and 16 MiB payloads. The host copies the
payload into a request slot, the echo copies the request slot into a response
slot, and the host reads the response slot in place: two copies per round
trip, compared with two plain numpy copies of the same size in one process.
The "3 copies" row also copies the response out of the slot.

The echo processes are started with the ``spawn`` method.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Callable

import numpy as np
import posix_ipc

from shm import Ring, naming
from shm import _peers

_MiB = 1 << 20


def _percentiles(ns: list[int]) -> tuple[float, float]:
    ns = sorted(ns)
    return statistics.median(ns) / 1000, ns[min(len(ns) - 1, int(len(ns) * 0.99))] / 1000


def _spawn(target: Callable[..., None], *args: object) -> mp.process.BaseProcess:
    proc = mp.get_context("spawn").Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


def _stop(proc: mp.process.BaseProcess) -> None:
    proc.join(10)
    if proc.is_alive():
        proc.kill()
        proc.join()


def ring_latency(rounds: int, size: int = 64) -> tuple[float, float]:
    req, resp = Ring.create(size, 4, kind="breq"), Ring.create(size, 4, kind="bresp")
    try:
        proc = _spawn(_peers.echo, req.name, resp.name, os.getpid())
        req.set_peer(proc.pid)
        resp.set_peer(proc.pid)
        msg = bytes(range(size % 256)) * (size // 256) + bytes(size % 256)
        write, read, clock = req.write, resp.read, time.perf_counter_ns
        for _ in range(200):
            write(msg)
            read()
        times = []
        for _ in range(rounds):
            t0 = clock()
            write(msg)
            read()
            times.append(clock() - t0)
        req.write(b"", tag=_peers.STOP)
        resp.read()
        _stop(proc)
    finally:
        for r in (req, resp):
            r.close()
            r.unlink()
    return _percentiles(times)


def pipe_latency(rounds: int, size: int = 64) -> tuple[float, float]:
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_peers.pipe_echo, args=(there,), daemon=True)
    proc.start()
    msg = b"x" * size
    send, recv, clock = here.send_bytes, here.recv_bytes, time.perf_counter_ns
    for _ in range(200):
        send(msg)
        recv()
    times = []
    for _ in range(rounds):
        t0 = clock()
        send(msg)
        recv()
        times.append(clock() - t0)
    send(b"")
    recv()
    _stop(proc)
    return _percentiles(times)


def sem_latency(rounds: int) -> tuple[float, float]:
    ping_name, pong_name = naming.new_name("bping"), naming.new_name("bpong")
    ping = posix_ipc.Semaphore(ping_name, posix_ipc.O_CREX, mode=0o600)
    pong = posix_ipc.Semaphore(pong_name, posix_ipc.O_CREX, mode=0o600)
    try:
        warm = 200
        proc = _spawn(_peers.sem_echo, ping_name, pong_name, rounds + warm)
        post, wait, clock = ping.release, pong.acquire, time.perf_counter_ns
        for _ in range(warm):
            post()
            wait()
        times = []
        for _ in range(rounds):
            t0 = clock()
            post()
            wait()
            times.append(clock() - t0)
        _stop(proc)
    finally:
        for sem in (ping, pong):
            sem.unlink()
            sem.close()
    return _percentiles(times)


def ring_bandwidth(size: int, rounds: int, copy_out: bool) -> float:
    """GB/s of payload through one round trip (2 copies, or 3 with ``copy_out``)."""
    req, resp = Ring.create(size, 2, kind="breq"), Ring.create(size, 2, kind="bresp")
    try:
        proc = _spawn(_peers.echo, req.name, resp.name, os.getpid())
        req.set_peer(proc.pid)
        resp.set_peer(proc.pid)
        src = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
        out = np.empty(size, np.uint8)
        times = []
        for i in range(rounds + 3):
            t0 = time.perf_counter_ns()
            slot = req.acquire_write()
            np.copyto(np.frombuffer(slot, np.uint8), src)
            req.publish(size)
            view, _ = resp.acquire_read()
            if copy_out:
                np.copyto(out, np.frombuffer(view, np.uint8))
            resp.release()
            if i >= 3:
                times.append(time.perf_counter_ns() - t0)
        if copy_out and not np.array_equal(out, src):
            raise AssertionError("echoed payload differs")
        req.write(b"", tag=_peers.STOP)
        resp.read()
        _stop(proc)
    finally:
        for r in (req, resp):
            r.close()
            r.unlink()
    return size / statistics.median(times)  # bytes per ns = GB/s


def numpy_bandwidth(size: int, rounds: int, copies: int) -> float:
    """GB/s of payload when one round trip is ``copies`` plain numpy copies."""
    src = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8)
    bufs = [np.zeros(size, np.uint8) for _ in range(copies)]
    for b in bufs:
        b[:] = 1  # fault the pages in: a warm copy is the fair baseline
    times = []
    for i in range(rounds + 3):
        t0 = time.perf_counter_ns()
        prev = src
        for b in bufs:
            np.copyto(b, prev)
            prev = b
        if i >= 3:
            times.append(time.perf_counter_ns() - t0)
    return size / statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench ring", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20000, help="latency round trips")
    parser.add_argument("--bw-rounds", type=int, default=40, help="bandwidth round trips")
    args = parser.parse_args(argv)

    print(f"latency of a 64-byte round trip ({args.rounds} rounds, {os.cpu_count()} cores)")
    sem = sem_latency(args.rounds)
    ring = ring_latency(args.rounds)
    pipe = pipe_latency(args.rounds)
    print(f"  {'':34s} {'median us':>10s} {'p99 us':>10s} {'x sem':>7s}")
    for label, (med, p99) in (("bare posix_ipc semaphore ping-pong", sem),
                              ("shm.Ring pair (write + read)", ring),
                              ("multiprocessing.Pipe", pipe)):
        print(f"  {label:34s} {med:10.1f} {p99:10.1f} {med / sem[0]:7.2f}")
    print(f"  ring / sem = {ring[0] / sem[0]:.2f} (target <= 1.2); "
          f"ring / Pipe = {ring[0] / pipe[0]:.2f} (target <= 0.5)")

    print(f"\nbandwidth of a round trip, GB/s of payload (median of {args.bw_rounds})")
    print(f"  {'size':>8s} {'2 numpy copies':>15s} {'ring (2 copies)':>16s} {'ratio':>6s}"
          f" {'3 numpy copies':>15s} {'ring (3 copies)':>16s} {'ratio':>6s}")
    for size in (_MiB, 16 * _MiB):
        rounds = args.bw_rounds if size <= _MiB else max(5, args.bw_rounds // 2)
        np2 = numpy_bandwidth(size, rounds, 2)
        r2 = ring_bandwidth(size, rounds, copy_out=False)
        np3 = numpy_bandwidth(size, rounds, 3)
        r3 = ring_bandwidth(size, rounds, copy_out=True)
        print(f"  {size // _MiB:5d} MiB {np2:15.2f} {r2:16.2f} {r2 / np2:6.2f}"
              f" {np3:15.2f} {r3:16.2f} {r3 / np3:6.2f}")
    print("  target: 16 MiB ring (2 copies) >= 0.70 of 2 numpy copies")
    return 0


if __name__ == "__main__":
    sys.exit(main())
