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
from tools.bench import peers as _peers
from tools.bench._markdown import MarkdownTable

DESCRIPTION = "shm ring latency and bandwidth vs Pipe, semaphores, numpy"

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


class _RingPingPong:
    """Round trips through a request ring and a response ring to an echo process."""

    label = "shm.Ring pair (write + read)"

    def __init__(self, size: int = 64) -> None:
        self.req = Ring.create(size, 4, kind="breq")
        self.resp = Ring.create(size, 4, kind="bresp")
        self.proc = _spawn(_peers.echo, self.req.name, self.resp.name, os.getpid())
        self.req.set_peer(self.proc.pid)
        self.resp.set_peer(self.proc.pid)
        self.msg = bytes(i % 256 for i in range(size))

    def run(self, rounds: int) -> list[int]:
        write, read, clock, msg = self.req.write, self.resp.read, time.perf_counter_ns, self.msg
        times = []
        for _ in range(rounds):
            t0 = clock()
            write(msg)
            read()
            times.append(clock() - t0)
        return times

    def close(self) -> None:
        self.req.write(b"", tag=_peers.STOP)
        self.resp.read()
        _stop(self.proc)
        for ring in (self.req, self.resp):
            ring.close()
            ring.unlink()


class _PipePingPong:
    label = "multiprocessing.Pipe"

    def __init__(self, size: int = 64) -> None:
        ctx = mp.get_context("spawn")
        self.conn, there = ctx.Pipe()
        self.proc = ctx.Process(target=_peers.pipe_echo, args=(there,), daemon=True)
        self.proc.start()
        self.msg = b"x" * size

    def run(self, rounds: int) -> list[int]:
        send, recv, clock, msg = (self.conn.send_bytes, self.conn.recv_bytes,
                                  time.perf_counter_ns, self.msg)
        times = []
        for _ in range(rounds):
            t0 = clock()
            send(msg)
            recv()
            times.append(clock() - t0)
        return times

    def close(self) -> None:
        self.conn.send_bytes(b"")
        self.conn.recv_bytes()
        _stop(self.proc)


class _SemPingPong:
    label = "bare posix_ipc semaphore ping-pong"

    def __init__(self) -> None:
        self.names = naming.new_name("bping"), naming.new_name("bpong")
        self.ping = posix_ipc.Semaphore(self.names[0], posix_ipc.O_CREX, mode=0o600)
        self.pong = posix_ipc.Semaphore(self.names[1], posix_ipc.O_CREX, mode=0o600)
        self.proc = _spawn(_peers.sem_echo, *self.names, -1)

    def run(self, rounds: int) -> list[int]:
        post, wait, clock = self.ping.release, self.pong.acquire, time.perf_counter_ns
        times = []
        for _ in range(rounds):
            t0 = clock()
            post()
            wait()
            times.append(clock() - t0)
        return times

    def close(self) -> None:
        self.proc.kill()
        _stop(self.proc)
        for sem in (self.ping, self.pong):
            sem.unlink()
            sem.close()


def latencies(rounds: int, blocks: int = 10) -> dict[str, tuple[float, float, float, float]]:
    """label -> (median of block medians, p99, min and max of block medians), in us.

    The three ping-pongs run interleaved in ``blocks`` blocks, so that a noisy
    neighbour or a change of CPU placement hits all of them alike.
    """
    pongs: list[_SemPingPong | _RingPingPong | _PipePingPong] = []
    try:
        pongs = [_SemPingPong(), _RingPingPong(), _PipePingPong()]
        for p in pongs:
            p.run(300)  # warm up (and wait for the spawned peers to be ready)
        per_block: dict[str, list[float]] = {p.label: [] for p in pongs}
        every: dict[str, list[int]] = {p.label: [] for p in pongs}
        for _ in range(blocks):
            for p in pongs:
                times = p.run(max(1, rounds // blocks))
                per_block[p.label].append(statistics.median(times) / 1000)
                every[p.label].extend(times)
    finally:
        for p in pongs:
            p.close()
    out = {}
    for label, meds in per_block.items():
        _, p99 = _percentiles(every[label])
        out[label] = (statistics.median(meds), p99, min(meds), max(meds))
    return out


def ring_bandwidth(size: int, rounds: int, copy_out: bool, num_slots: int = 1) -> float:
    """GB/s of payload through one round trip (2 copies, or 3 with ``copy_out``).

    One slot per ring by default: a ping-pong has one message in flight, and
    deeper rings only grow the working set (at 16 MiB, 2 slots per ring make
    it 80 MiB instead of 48, which no longer fits this machine's cache: plain
    numpy copies cycling through as many buffers slow down just as much).
    """
    req = Ring.create(size, num_slots, kind="breq")
    resp = Ring.create(size, num_slots, kind="bresp")
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
    parser.add_argument("--blocks", type=int, default=10, help="interleaved latency blocks")
    parser.add_argument("--bw-rounds", type=int, default=40, help="bandwidth round trips")
    parser.add_argument("--markdown", action="store_true",
                        help="print the figures as rows of docs/benchmarks.md (report to stderr)")
    args = parser.parse_args(argv)
    table = MarkdownTable(args.markdown)

    print(f"latency of a 64-byte round trip ({args.rounds} rounds in {args.blocks} interleaved "
          f"blocks, {os.cpu_count()} cores)")
    lat = latencies(args.rounds, args.blocks)
    sem, ring, pipe = (lat[c.label][0] for c in (_SemPingPong, _RingPingPong, _PipePingPong))
    print(f"  {'':34s} {'median us':>10s} {'p99 us':>10s} {'blocks min..max':>16s} {'x sem':>7s}")
    for label, (med, p99, lo, hi) in lat.items():
        print(f"  {label:34s} {med:10.1f} {p99:10.1f} {lo:7.1f}..{hi:<8.1f} {med / sem:7.2f}")
    print(f"  ring / sem = {ring / sem:.2f} (target <= 1.2); "
          f"ring / Pipe = {ring / pipe:.2f} (target <= 0.5)")
    best = {label: v[2] for label, v in lat.items()}
    sem_b, ring_b, pipe_b = (best[c.label] for c in (_SemPingPong, _RingPingPong, _PipePingPong))
    print(f"  best blocks: ring / sem = {ring_b / sem_b:.2f}; ring / Pipe = {ring_b / pipe_b:.2f}")
    table.add("64-byte round trip, `shm.Ring` pair", f"{ring:.1f} µs",
              f"bare semaphore ping-pong {sem:.1f} µs", ring / sem, "≤ 1.2")
    table.add("same", "", f"`multiprocessing.Pipe` {pipe:.1f} µs", ring / pipe, "≤ 0.5")
    print("  (median: of the block medians; a block whose processes share one vCPU and one\n"
          "   whose processes sit on two can differ 10x on this VM: see min..max)")

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
        table.add(f"{size // _MiB} MiB ring round trip (2 copies)", f"{r2:.2f} GB/s",
                  f"two numpy copies {np2:.2f} GB/s", r2 / np2,
                  "≥ 0.7" if size > _MiB else "")
    print("  target: 16 MiB ring (2 copies) >= 0.70 of 2 numpy copies")
    table.emit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
