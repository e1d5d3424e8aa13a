"""``python -m tools.bench cnn``: a convolutional network's throughput on the emulated IPUs
against onnxruntime in-process with the same number of threads.

The model: a small ResNet-style CNN (a stride-2 stem, ``--blocks`` residual blocks of two
3x3 convolutions with batch-norm folded in, global average pooling and a classifier)
on ``--batch`` images of 3x``--size``x``--size``, float32, built by script.

Three runs, each with ``--in-flight`` requests kept in flight through
``executeAsync`` (inputs and outputs in ``empty_shared`` memory) for ``--requests``
requests, interleaved in ``--blocks-of-runs`` blocks (median of the blocks' figures):

- ``2 replicas``: one IPU per replica (two IPU processes), requests alternating
  between the replicas;
- ``pipelined over 2 IPUs``: the first half of the network on IPU 0, the rest on IPU 1
  (``--num_ipus 2 --enable_pipelining``, batches_per_step 2);
- ``onnxruntime``: one in-process session with ``intra_op_num_threads=2`` (the two IPU
  processes' worth of threads), requests run back to back.

Each IPU process computes with onnxruntime on one thread, so on a 2-core machine the
emulated runs can at best match onnxruntime's two threads; the figure shows what the
emulation (rings, processes, pipeline hand-overs) costs on a real CNN.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import deque
from typing import Any

import numpy as np

from tools.bench._markdown import MarkdownTable

DESCRIPTION = "a CNN: 2 replicas and pipelined over 2 IPUs vs onnxruntime with 2 threads"


def cnn_model(batch: int, size: int, blocks: int, width: int = 32, classes: int = 100
              ) -> tuple[Any, dict[str, int]]:
    """The network and its split over 2 IPUs (node name -> IPU, also the stages)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes: list[Any] = []
    inits: list[Any] = []
    split: dict[str, int] = {}

    def conv(x: str, cin: int, cout: int, name: str, stride: int = 1, relu: bool = True,
             ipu: int = 0) -> str:
        w = (rng.standard_normal((cout, cin, 3, 3)) * np.sqrt(2.0 / (9 * cin))).astype(np.float32)
        inits.extend([numpy_helper.from_array(w, f"{name}_w"),
                      numpy_helper.from_array(np.zeros(cout, np.float32), f"{name}_b")])
        nodes.append(helper.make_node("Conv", [x, f"{name}_w", f"{name}_b"], [name], name=name,
                                      pads=[1, 1, 1, 1], strides=[stride, stride]))
        split[name] = ipu
        if not relu:
            return name
        nodes.append(helper.make_node("Relu", [name], [f"{name}_r"], name=f"{name}_relu"))
        split[f"{name}_relu"] = ipu
        return f"{name}_r"

    x = conv("images", 3, width, "stem", stride=2)
    for k in range(blocks):
        ipu = 0 if k < (blocks + 1) // 2 else 1
        h = conv(x, width, width, f"b{k}a", ipu=ipu)
        h = conv(h, width, width, f"b{k}b", relu=False, ipu=ipu)
        nodes += [helper.make_node("Add", [x, h], [f"b{k}_sum"], name=f"b{k}_add"),
                  helper.make_node("Relu", [f"b{k}_sum"], [f"b{k}_out"], name=f"b{k}_out")]
        split[f"b{k}_add"] = split[f"b{k}_out"] = ipu
        x = f"b{k}_out"
    fc = (rng.standard_normal((width, classes)) / np.sqrt(width)).astype(np.float32)
    inits.append(numpy_helper.from_array(fc, "fc_w"))
    nodes += [helper.make_node("GlobalAveragePool", [x], ["pooled"], name="pool"),
              helper.make_node("Flatten", ["pooled"], ["flat"], name="flatten"),
              helper.make_node("MatMul", ["flat", "fc_w"], ["logits"], name="fc")]
    split.update(pool=1, flatten=1, fc=1)
    g = helper.make_graph(
        nodes, "cnn", [helper.make_tensor_value_info("images", TensorProto.FLOAT,
                                                     [batch, 3, size, size])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, classes])],
        initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m, split


def _emulated(runner: Any, shape: tuple[int, ...], out_shape: tuple[int, ...], requests: int,
              in_flight: int, replicas: int) -> float:
    from host_runtime import empty_shared

    xs = [empty_shared(shape, np.float32) for _ in range(in_flight)]
    ys = [empty_shared(out_shape, np.float32) for _ in range(in_flight)]
    rng = np.random.default_rng(1)
    for x in xs:
        x[...] = rng.random(shape, dtype=np.float32)
    pending: deque[Any] = deque()
    t0 = time.perf_counter()
    for i in range(requests):
        if len(pending) == in_flight:
            pending.popleft().wait()
        slot = i % in_flight
        pending.append(runner.executeAsync({"images": xs[slot]}, {"logits": ys[slot]},
                                           i % replicas))
    while pending:
        pending.popleft().wait()
    return requests / (time.perf_counter() - t0)


def _ort(session: Any, shape: tuple[int, ...], requests: int) -> float:
    x = np.random.default_rng(1).random(shape, dtype=np.float32)
    t0 = time.perf_counter()
    for _ in range(requests):
        session.run(None, {"images": x})
    return requests / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench cnn", description=DESCRIPTION)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--blocks", type=int, default=4, help="residual blocks (default 4)")
    p.add_argument("--requests", type=int, default=60, help="requests per run of a block")
    p.add_argument("--in-flight", type=int, default=8)
    p.add_argument("--blocks-of-runs", type=int, default=3)
    p.add_argument("--markdown", action="store_true", help="print rows for docs/benchmarks.md")
    args = p.parse_args(argv)
    table = MarkdownTable(args.markdown)

    import onnxruntime as ort

    from host_runtime.poprt.compiler import compile as poprt_compile
    from host_runtime.runner import ModelRunner
    from host_runtime.runner.config import ModelRunnerConfig

    model, split = cnn_model(args.batch, args.size, args.blocks)
    shape = (args.batch, 3, args.size, args.size)
    out_shape = (args.batch, 100)
    with tempfile.TemporaryDirectory(prefix="bench-cnn-") as d:
        one = poprt_compile(model, d, popef_name="cnn.popef")
        two = poprt_compile(model, d, popef_name="cnn_pipelined.popef", num_ipus=2,
                            sharding_info=split, pipelining_info=split, enable_pipelining=True,
                            batches_per_step=2)
        cfg = ModelRunnerConfig()
        cfg.replication_factor = 2
        so = ort.SessionOptions()
        so.intra_op_num_threads = 2
        so.inter_op_num_threads = 1
        session = ort.InferenceSession(model.SerializeToString(), so,
                                       providers=["CPUExecutionProvider"])
        figures: dict[str, list[float]] = {"replicas": [], "pipelined": [], "ort": []}
        with ModelRunner(str(one.popef_path), cfg) as rep, \
                ModelRunner(str(two.popef_path)) as pipe:
            # check once that each answers as onnxruntime does, and warm up
            x = np.random.default_rng(2).random(shape, dtype=np.float32)
            want = session.run(None, {"images": x})[0]
            for r, rid in ((rep, 0), (rep, 1), (pipe, 0)):
                np.testing.assert_allclose(r.execute({"images": x}, rid)["logits"], want,
                                           rtol=1e-4, atol=1e-4)
            _ort(session, shape, 5)
            for _ in range(args.blocks_of_runs):
                figures["replicas"].append(_emulated(rep, shape, out_shape, args.requests,
                                                     args.in_flight, 2))
                figures["pipelined"].append(_emulated(pipe, shape, out_shape, args.requests,
                                                      args.in_flight, 1))
                figures["ort"].append(_ort(session, shape, args.requests))
    med = {k: statistics.median(v) for k, v in figures.items()}
    img = args.batch
    print(f"cnn: {args.blocks} residual blocks, batch {args.batch} of 3x{args.size}x{args.size} "
          f"float32, {args.in_flight} requests in flight, median of {args.blocks_of_runs} blocks")
    for key, label in (("replicas", "2 replicas (executeAsync)"),
                       ("pipelined", "pipelined over 2 IPUs (executeAsync)"),
                       ("ort", "onnxruntime in-process, 2 threads")):
        ratio = med[key] / med["ort"]
        print(f"  {label:40s} {med[key]:8.1f} requests/s  {med[key] * img:8.1f} images/s  "
              f"{ratio:.2f}x onnxruntime")
        if key != "ort":
            table.add(f"CNN {label}", f"{med[key] * img:.0f} images/s",
                      f"{med['ort'] * img:.0f} images/s (onnxruntime, 2 threads)", ratio)
    table.emit()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
