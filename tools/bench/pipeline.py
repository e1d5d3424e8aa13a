"""``python -m tools.bench pipeline``: a model pipelined over 2 (and 4) IPUs vs one IPU.

Throughput: a chain of compute-heavy stages, each ``--matmuls`` MatMuls of
[64, 1024] x [1024, 1024] float32 (and a Relu), compiled once for one IPU and
once pipelined with one stage per IPU (``poprt --num_ipus S
--manual_sharding_config ... --enable_pipelining``). Inputs and outputs live in
``empty_shared`` memory, ``--in-flight`` requests (8) are kept in flight through
``ModelRunner.executeAsync``; the two runs are interleaved in blocks in one
process and the median of the block throughputs is reported. Target on a
2-core machine: >= 1.5x for 2 stages. With 4 stages there are 4 IPU
processes on 2 cores: the figure is bounded by the cores, not by the stages.

Hop: the cost of one inter-IPU hop of a 256 KiB activation ([64, 1024] F32)
against a host ring transfer of the same size, timed directly as ping-pongs
between two processes (``--hop-rounds`` round trips, each a hop there and a hop
back; a hop is a round trip / 2; medians of interleaved blocks):

- IPU-Link: two ends that run the IPU process's own stream code
  (``DeviceProcess`` + ``_RingIO`` of ipu_emulator.ipu, over two link rings
  made as ``ShardedLoad`` makes them, streams in direct mode, waits as one IPU
  of several waits): each end takes the activation in place from its input
  link (``acquire_input``: poll, then block in slices), writes it into a slot
  of its output link (``acquire_output``; what onnxruntime does with a part's
  output), releases the input and publishes the output: what a pipeline stage
  does per batch, minus the compute.
- host ring: ``shm.Ring`` between two processes, one ``write`` (a copy into
  a slot) and one blocking ``acquire_read`` per hop (``tools.bench.peers.echo``
  on the far side).

Both move 256 KiB once per hop and hand it over once. Each rig is timed with its
two ends pinned to one vCPU, to two vCPUs, and as the scheduler places them (blocks
interleaved): the placement decides the cost of a hand-over (a context switch, or a
wake-up of the other vCPU) more than the code does. Target: hop <= 1.5x host.
The single-request ``execute`` latency of a Relu->Relu model on 1 IPU, sharded
over 2 IPUs and pipelined over 2 IPUs is printed too (end to end: a sharded or
pipelined request pays the hop plus a second IPU process's wake-up).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections import deque
from typing import Any

import numpy as np

from tools.bench._markdown import MarkdownTable

DESCRIPTION = "pipelined model over 2/4 IPU processes vs one IPU; an inter-IPU hop vs a host ring"

ROWS, WIDTH = 64, 1024


def _stages_model(stages: int, matmuls: int) -> Any:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, inits = [], []
    x = "x"
    k = 0
    points: dict[str, int] = {}
    for s in range(stages):
        for _ in range(matmuls):
            w = (rng.standard_normal((WIDTH, WIDTH)) / np.sqrt(WIDTH)).astype(np.float32)
            inits.append(numpy_helper.from_array(w, f"w{k}"))
            nodes.append(helper.make_node("MatMul", [x, f"w{k}"], [f"m{k}"], name=f"mm{k}"))
            x = f"m{k}"
            k += 1
        out = "y" if s == stages - 1 else f"s{s}"
        nodes.append(helper.make_node("Relu", [x], [out], name=f"stage{s}"))
        points[f"stage{s}"] = s
        x = out
    g = helper.make_graph(nodes, "stages",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [ROWS, WIDTH])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [ROWS, WIDTH])],
                          initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m, points


def _hop_model() -> Any:
    from onnx import TensorProto, helper

    g = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["a"], name="first"),
         helper.make_node("Relu", ["a"], ["y"], name="second")], "hop",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [ROWS, WIDTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [ROWS, WIDTH])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    return m


def _compile(model: Any, folder: str, name: str, ipus: int = 1,
             points: dict[str, int] | None = None, pipelined: bool = False) -> str:
    from host_runtime.poprt.compiler import compile as poprt_compile

    out = poprt_compile(model, folder, popef_name=f"{name}.popef", num_ipus=ipus,
                        sharding_info=points, pipelining_info=points if pipelined else None,
                        enable_pipelining=pipelined, batches_per_step=ipus if pipelined else 1)
    assert out.popef_path is not None
    return str(out.popef_path)


def _throughput(runner: Any, requests: int, in_flight: int) -> float:
    from host_runtime import empty_shared

    xs = [empty_shared((ROWS, WIDTH), np.float32) for _ in range(in_flight)]
    ys = [empty_shared((ROWS, WIDTH), np.float32) for _ in range(in_flight)]
    for k, x in enumerate(xs):
        x[...] = np.float32(0.01 * (k + 1))
    pending: deque[Any] = deque()
    t0 = time.perf_counter()
    for i in range(requests):
        if len(pending) == in_flight:
            pending.popleft().wait()
        slot = i % in_flight
        pending.append(runner.executeAsync({"x": xs[slot]}, {"y": ys[slot]}))
    while pending:
        pending.popleft().wait()
    return requests / (time.perf_counter() - t0)


def _latency(runner: Any, n: int) -> float:
    x = np.ones((ROWS, WIDTH), np.float32)
    runner.execute({"x": x})
    ts = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        runner.execute({"x": x})
        ts.append(time.perf_counter_ns() - t0)
    return statistics.median(ts) / 1000.0


# -- the hop, timed directly ----------------------------------------------------------------

HOP_BYTES = ROWS * WIDTH * 4          # 256 KiB
HOP_DEPTH = 4
"""Slots of each ring of the hop rigs: host_runtime.devices._ipu_group.HOP_DEPTH, as a
sharded session makes its links (tests/integration/test_bench_pipeline.py checks it)."""


def _link_peer(control: str, events: str, parent: int, ring_in: str, ring_out: str) -> None:
    """The far IPU of the link ping-pong (a spawned process): relay activations until the
    parent invalidates the input link."""
    from ipu_emulator.ipu.linkbench import LinkEnd

    end = LinkEnd(control, events, parent, ring_in, ring_out, HOP_BYTES)
    try:
        while not end.io.disconnected:
            end.relay()
    finally:
        end.close()


class _HopRig:
    """The two ping-pongs, each with its peer process, run block by block."""

    def __init__(self, rounds: int, blocks: int) -> None:
        self.per_block = max(10, rounds // blocks)
        self.affinity = os.sched_getaffinity(0)
        self.rings: list[Any] = []
        self.procs: list[Any] = []
        self.link: Any = None   # ipu_emulator.ipu.linkbench.LinkEnd
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        import multiprocessing as mp

        from shm import Ring
        from ipu_emulator import ipu_protocol
        from ipu_emulator.ipu.linkbench import LinkEnd
        from tools.bench import peers

        def ring(kind: str, size: int, slots: int) -> Any:
            r = Ring.create(size, slots, kind=kind)
            self.rings.append(r)
            return r

        ctx = mp.get_context("spawn")
        me = os.getpid()
        # IPU-Link: links made as ShardedLoad makes them; each end has the rings of an
        # IPU process (its control and event rings) for its wait_on
        ab, ba = ring("link", HOP_BYTES, HOP_DEPTH), ring("link", HOP_BYTES, HOP_DEPTH)
        ctl = [ring("ctl", ipu_protocol.CONTROL_SLOT_SIZE, ipu_protocol.CONTROL_SLOTS) for _ in range(2)]
        evt = [ring("evt", ipu_protocol.EVENT_SLOT_SIZE, ipu_protocol.EVENT_SLOTS) for _ in range(2)]
        self.ab = ab
        self.link = LinkEnd(ctl[0].name, evt[0].name, me, ba.name, ab.name, HOP_BYTES)
        # host ring: shm.Ring both ways, tools.bench.peers.echo on the far side; as many
        # slots as a link, so that only the code at the ends differs
        self.req = ring("bench", HOP_BYTES, HOP_DEPTH)
        self.resp = ring("bench", HOP_BYTES, HOP_DEPTH)
        for target, args in ((_link_peer, (ctl[1].name, evt[1].name, me, ab.name, ba.name)),
                             (peers.echo, (self.req.name, self.resp.name, me))):
            proc = ctx.Process(target=target, args=args, daemon=True)
            proc.start()
            self.procs.append(proc)
        data = memoryview(bytes([7]) * HOP_BYTES)
        self.link.send(data)       # one activation in flight on each rig, for good
        self.req.write(data, 0)
        self._link_rounds(50)      # warm-up (and every pair of slots seen)
        self._host_rounds(50)

    def _link_rounds(self, n: int) -> list[int]:
        """``n`` round trips of the activation in flight: each a hop to the far end and one
        back (this end relays it on), timed from one relay to the next."""
        assert self.link is not None
        clock, relay = time.perf_counter_ns, self.link.relay
        out = []
        t0 = clock()
        for _ in range(n):
            relay()
            t = clock()
            out.append(t - t0)
            t0 = t
        return out

    def _host_rounds(self, n: int) -> list[int]:
        """The same over shm.Ring: this end takes the message and writes it back."""
        clock, write = time.perf_counter_ns, self.req.write
        acquire_read, release = self.resp.acquire_read, self.resp.release
        out = []
        t0 = clock()
        for k in range(n):
            view, _ = acquire_read()
            write(view, k)
            release()
            t = clock()
            out.append(t - t0)
            t0 = t
        return out

    def block(self, cpus: tuple[int, int] | None) -> tuple[list[int], list[int]]:
        """One block of each: the round trips (ns) over the link and over the host ring;
        with ``cpus``, this process runs on the first and the peers on the second."""
        if cpus is not None:
            os.sched_setaffinity(0, {cpus[0]})
            for p in self.procs:
                os.sched_setaffinity(p.pid, {cpus[1]})
        try:
            return self._link_rounds(self.per_block), self._host_rounds(self.per_block)
        finally:
            if cpus is not None:
                os.sched_setaffinity(0, self.affinity)

    def close(self) -> None:
        from tools.bench import peers

        if len(self.procs) == 2:   # stop the peers: STOP to the echo, an invalid link to the relay
            try:
                self.req.write(b"", peers.STOP, 1.0)
                self.ab.invalidate()
            except Exception:   # pragma: no cover - a peer is gone
                pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
        if self.link is not None:
            self.link.close()
        for r in self.rings:
            r.close()
            r.unlink()


def _hop_report(rounds: int, blocks: int) -> None:
    print(f"\none hop of a 256 KiB activation, IPU-Link vs host ring (ping-pong between two "
          f"processes, us per hop, median of {blocks} blocks of {max(10, rounds // blocks)} "
          f"round trips)")
    cpus = sorted(os.sched_getaffinity(0))
    # Where the two ends run decides the cost of a hand-over more than anything else: on
    # one vCPU a context switch, on two a wake-up of the other vCPU (tens of us on this
    # project's VMs when it is idle). The scheduler's choice flips between runs, so each
    # rig is timed pinned both ways, blocks interleaved, plus as the scheduler places it.
    placements: list[tuple[str, tuple[int, int] | None]] = [("as scheduled", None)]
    if len(cpus) >= 2:
        placements += [("one vCPU", (cpus[0], cpus[0])), ("two vCPUs", (cpus[0], cpus[1]))]
    rig = _HopRig(rounds, blocks)
    link: dict[str, list[float]] = {name: [] for name, _ in placements}
    host: dict[str, list[float]] = {name: [] for name, _ in placements}
    try:
        for _ in range(blocks):
            for name, pin in placements:
                a, b = rig.block(pin)
                link[name].append(statistics.median(a) / 2000.0)
                host[name].append(statistics.median(b) / 2000.0)
    finally:
        rig.close()
    print(f"  {'ends on':14s} {'IPU-Link hop':>12s} {'host ring':>10s} {'hop / host':>11s}"
          "   (IPU process stream code vs shm.Ring; target <= 1.5)")
    for name, _ in placements:
        lh, hh = statistics.median(link[name]), statistics.median(host[name])
        print(f"  {name:14s} {lh:12.1f} {hh:10.1f} {lh / hh:11.2f}   blocks "
              + " ".join(f"{v:.1f}" for v in link[name]) + " / "
              + " ".join(f"{v:.1f}" for v in host[name]))


def _latency_report(tmp: str, rounds: int, blocks: int) -> None:
    from host_runtime import ModelRunner

    print(f"\nexecute latency, one request at a time, Relu->Relu [64,1024] F32 (us, median of "
          f"{blocks} interleaved blocks of {max(10, rounds // blocks)})")
    paths = {"1 IPU": _compile(_hop_model(), tmp, "hop_base"),
             "2 IPUs sharded": _compile(_hop_model(), tmp, "hop_sharded", 2,
                                        {"first": 0, "second": 1}),
             "2 IPUs pipelined": _compile(_hop_model(), tmp, "hop_piped", 2,
                                          {"first": 0, "second": 1}, pipelined=True)}
    lat: dict[str, list[float]] = {k: [] for k in paths}
    runners = {k: ModelRunner(p) for k, p in paths.items()}
    try:
        for _ in range(blocks):
            for key, r in runners.items():
                lat[key].append(_latency(r, max(10, rounds // blocks)))
    finally:
        for r in runners.values():
            r.close()
    base = statistics.median(lat["1 IPU"])
    for key, v in lat.items():
        m = statistics.median(v)
        extra = "" if key == "1 IPU" else f"   +{m - base:7.1f} over 1 IPU"
        print(f"  {key:18s} {m:8.1f}{extra}")


def _config(in_flight: int) -> Any:
    from host_runtime import ModelRunnerConfig

    cfg = ModelRunnerConfig()
    cfg.ring_buffer_size_multiplier = in_flight
    return cfg


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench pipeline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--matmuls", type=int, default=2, help="MatMuls per stage")
    parser.add_argument("--requests", type=int, default=24, help="requests per block")
    parser.add_argument("--blocks", type=int, default=3)
    parser.add_argument("--in-flight", type=int, default=8)
    parser.add_argument("--hop-rounds", type=int, default=600)
    parser.add_argument("--only", choices=("throughput", "hop", "latency"), nargs="+",
                        default=["throughput", "hop", "latency"], help="parts to run")
    parser.add_argument("--markdown", action="store_true",
                        help="print the throughput figures as rows of docs/benchmarks.md "
                             "(report to stderr)")
    args = parser.parse_args(argv)
    # runners side by side: 1 + S IPUs, and 1 + 2 + 2 for the latency (aligned groups);
    # for this run only (a caller's process keeps its machine)
    from host_runtime.settings import HostSettings, override

    num_ipus = HostSettings.read("num_ipus") or max(8, 2 * max(args.stages))
    table = MarkdownTable(args.markdown)
    with override(num_ipus=num_ipus):
        code = _run(args, table)
    table.emit()
    return code


def _run(args: argparse.Namespace, table: MarkdownTable) -> int:
    from host_runtime import ModelRunner

    with tempfile.TemporaryDirectory(prefix="bench_pipeline_") as tmp:
        if "throughput" in args.only:
            print(f"throughput, requests/s: stages of {args.matmuls} x [64,1024]x[1024,1024] F32 "
                  f"MatMul, {args.in_flight} in flight, empty_shared I/O, {os.cpu_count()} "
                  f"cores (median of {args.blocks} interleaved blocks of {args.requests})")
            print(f"  {'stages':>6s} {'1 IPU':>10s} {'pipelined':>10s} {'ratio':>7s}")
        for stages in (args.stages if "throughput" in args.only else []):
            model, points = _stages_model(stages, args.matmuls)
            one = _compile(model, tmp, f"one{stages}")
            pipe = _compile(model, tmp, f"pipe{stages}", stages, points, pipelined=True)
            with ModelRunner(one, config=_config(args.in_flight)) as r1, \
                    ModelRunner(pipe, config=_config(args.in_flight)) as rp:
                _throughput(r1, args.in_flight, args.in_flight)     # warm up
                _throughput(rp, args.in_flight * 2, args.in_flight)
                a, b = [], []
                for _ in range(args.blocks):
                    a.append(_throughput(r1, args.requests, args.in_flight))
                    b.append(_throughput(rp, args.requests, args.in_flight))
            t1, tp = statistics.median(a), statistics.median(b)
            target = "  (target >= 1.5)" if stages == 2 else "  (bounded by the cores)"
            print(f"  {stages:6d} {t1:10.1f} {tp:10.1f} {tp / t1:7.2f}{target}")
            table.add(f"{stages} stages over {stages} IPUs vs 1 IPU", f"{tp:.0f} req/s",
                      f"1 IPU {t1:.0f} req/s", tp / t1, "≥ 1.5" if stages == 2 else "")

        if "hop" in args.only:
            _hop_report(args.hop_rounds, max(3, args.blocks))
        if "latency" in args.only:
            _latency_report(tmp, args.hop_rounds, max(3, args.blocks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
