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
against a host ring transfer of the same size, both measured as differences of
median ``execute`` latencies (one request at a time) of tiny Relu models:
``hop = lat(Relu->Relu on 2 IPUs) - lat(Relu->Relu on 1 IPU)`` and
``host = lat(Relu->Relu on 1 IPU, the middle tensor also an output) -
lat(Relu->Relu on 1 IPU)``. Target: hop <= 1.5x host.
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


def _hop_model(extra_output: bool) -> Any:
    from onnx import TensorProto, helper

    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [ROWS, WIDTH])]
    if extra_output:
        outs.append(helper.make_tensor_value_info("a", TensorProto.FLOAT, [ROWS, WIDTH]))
    g = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["a"], name="first"),
         helper.make_node("Relu", ["a"], ["y"], name="second")], "hop",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [ROWS, WIDTH])], outs)
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
    parser.add_argument("--hop-rounds", type=int, default=300)
    args = parser.parse_args(argv)
    # runners side by side: 1 + S IPUs, and 1 + 2 + 2 + 1 for the hop (aligned groups)
    os.environ.setdefault("IPU_EMULATOR_NUM_IPUS", str(max(8, 2 * max(args.stages))))
    from host_runtime import ModelRunner

    with tempfile.TemporaryDirectory(prefix="bench_pipeline_") as tmp:
        print(f"throughput, requests/s: stages of {args.matmuls} x [64,1024]x[1024,1024] F32 "
              f"MatMul, {args.in_flight} in flight, empty_shared I/O, {os.cpu_count()} cores "
              f"(median of {args.blocks} interleaved blocks of {args.requests})")
        print(f"  {'stages':>6s} {'1 IPU':>10s} {'pipelined':>10s} {'ratio':>7s}")
        for stages in args.stages:
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

        print(f"\none inter-IPU hop of a 256 KiB activation vs a host ring transfer "
              f"(execute latency, us, {args.hop_rounds} requests in interleaved blocks)")
        base = _compile(_hop_model(False), tmp, "hop_base")
        sharded = _compile(_hop_model(False), tmp, "hop_sharded", 2, {"first": 0, "second": 1})
        piped = _compile(_hop_model(False), tmp, "hop_piped", 2, {"first": 0, "second": 1},
                         pipelined=True)
        extra = _compile(_hop_model(True), tmp, "hop_host")
        keys = ("base", "sharded", "piped", "extra")
        lat: dict[str, list[float]] = {k: [] for k in keys}
        blocks = max(3, args.blocks)
        with ModelRunner(base) as rb, ModelRunner(sharded) as rs, ModelRunner(piped) as rp, \
                ModelRunner(extra) as re_:
            for _ in range(blocks):
                for key, r in zip(keys, (rb, rs, rp, re_)):
                    lat[key].append(_latency(r, max(10, args.hop_rounds // blocks)))
        for label, pick in (("median of block medians", statistics.median), ("best block", min)):
            lb, ls, lp, le = (pick(lat[k]) for k in keys)
            host = le - lb
            print(f"  {label}:")
            print(f"    Relu->Relu, 1 IPU                     {lb:8.1f}")
            print(f"    1 IPU + the 256 KiB as output         {le:8.1f}   host = {host:7.1f}")
            for name, value in (("sharded", ls), ("pipelined", lp)):
                hop = value - lb
                ratio = hop / host if host > 0 else float("inf")
                print(f"    Relu->Relu, 2 IPUs {name:10s} (hop) {value:8.1f}   hop  = {hop:7.1f}"
                      f"   hop / host = {ratio:.2f} (target <= 1.5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
