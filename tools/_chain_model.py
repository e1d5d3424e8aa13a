"""A chain of MatMul/Relu nodes with named nodes: the model that sharding is shown with.

``chain_model(layers, width, batch)`` -> ``onnx.ModelProto``: input ``x``
``[batch, width]`` F32, then per layer ``k`` a MatMul node ``mm<k>`` with weight
``w<k>`` ``[width, width]`` and a Relu node ``relu<k>`` (output ``y`` for the
last). ``shard_config(layers, ipus, pipelined)`` gives the ``sharding_info`` /
``pipelining_info`` maps that cut it into equal consecutive parts.
``conv_chain(blocks)``: a small CNN of named nodes (``conv<k>``/``relu<k>`` per block, then
``pool``, ``flatten``, ``fc``; input ``x`` [batch, 3, size, size], output ``y``), the shape of
the ResNet that PopRT's manual sharding example cuts.
Used by the demo, the pipelining benchmark, the stress scenario and the tests.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np

__all__ = ["chain_model", "conv_chain", "shard_config", "write_shard_yaml", "reference"]


def chain_model(layers: int = 4, width: int = 16, batch: int = 2, seed: int = 0,
                initializer: Callable[[str, np.ndarray], Any] | None = None,
                fanout: bool = False) -> Any:
    """``initializer(name, weights)`` makes each weight's TensorProto (default: inline
    data, and the model is checked); e.g. one whose data is external. ``fanout``: the
    second half of the layers reuses the first half's weights (``mm<k>`` reads
    ``w<k - layers // 2>``), and the tensor between the halves (``r<layers // 2 - 1>``) is
    a second output: cut there, one IPU forwards weights to the other in its Load
    program and streams that tensor both to the next IPU and to the host."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes = []
    inits = []
    x = "x"
    scale = np.float32(1.0 / np.sqrt(width))
    half = layers // 2
    for k in range(layers):
        w = (rng.standard_normal((width, width)).astype(np.float32) * scale * 1.5)
        tied = fanout and k >= half
        if not tied:
            inits.append(numpy_helper.from_array(w, f"w{k}") if initializer is None
                         else initializer(f"w{k}", w))
        out = "y" if k == layers - 1 else f"r{k}"
        weight = f"w{k - half}" if tied else f"w{k}"
        nodes.append(helper.make_node("MatMul", [x, weight], [f"m{k}"], name=f"mm{k}"))
        nodes.append(helper.make_node("Relu", [f"m{k}"], [out], name=f"relu{k}"))
        x = out
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, width])]
    if fanout and 0 < half < layers:
        outputs.append(helper.make_tensor_value_info(f"r{half - 1}", TensorProto.FLOAT,
                                                     [batch, width]))
    graph = helper.make_graph(
        nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, width])],
        outputs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    if initializer is None:
        onnx.checker.check_model(model)
    return model


def conv_chain(blocks: int = 6, channels: int = 4, size: int = 8, classes: int = 5,
               batch: int = 1, seed: int = 0) -> Any:
    """x -> (Conv 3x3 + bias ``conv<k>``, Relu ``relu<k>``) x blocks -> GlobalAveragePool
    ``pool`` -> Flatten ``flatten`` -> Gemm ``fc`` -> y [batch, classes]."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    x, cin = "x", 3
    for k in range(blocks):
        w = rng.standard_normal((channels, cin, 3, 3)) * np.sqrt(2.0 / (cin * 9))
        inits += [numpy_helper.from_array(w.astype(np.float32), f"w{k}"),
                  numpy_helper.from_array((rng.standard_normal(channels) * 0.1)
                                          .astype(np.float32), f"b{k}")]
        nodes += [helper.make_node("Conv", [x, f"w{k}", f"b{k}"], [f"c{k}"], name=f"conv{k}",
                                   kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
                  helper.make_node("Relu", [f"c{k}"], [f"r{k}"], name=f"relu{k}")]
        x, cin = f"r{k}", channels
    inits += [numpy_helper.from_array(rng.standard_normal((classes, channels))
                                      .astype(np.float32), "fc_w"),
              numpy_helper.from_array(rng.standard_normal(classes).astype(np.float32), "fc_b")]
    nodes += [helper.make_node("GlobalAveragePool", [x], ["p"], name="pool"),
              helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
              helper.make_node("Gemm", ["f", "fc_w", "fc_b"], ["y"], name="fc", transB=1)]
    graph = helper.make_graph(
        nodes, "conv_chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, classes])],
        initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def shard_config(layers: int, ipus: int, pipelined: bool = False
                 ) -> tuple[dict[str, int], dict[str, int]]:
    """Points at the last Relu of each of ``ipus`` equal runs of layers (stage = IPU)."""
    per = max(1, layers // ipus)
    sharding: dict[str, int] = {}
    for i in range(ipus):
        last = layers - 1 if i == ipus - 1 else (i + 1) * per - 1
        sharding[f"relu{last}"] = i
    return sharding, (dict(sharding) if pipelined else {})


def write_shard_yaml(path: "str | os.PathLike[str]", layers: int, ipus: int,
                     pipelined: bool = False) -> str:
    import yaml

    sharding, stages = shard_config(layers, ipus, pipelined)
    doc: dict[str, Any] = {"sharding_info": sharding}
    if stages:
        doc["pipelining_info"] = stages
    from ipu_emulator import safe_files   # never through a link at path

    safe_files.write_atomic(path, yaml.safe_dump(doc).encode("utf-8"))
    return os.fspath(path)


def reference(model: Any, x: np.ndarray) -> np.ndarray:
    """The model's output computed by onnxruntime in this process."""
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return np.asarray(sess.run(None, {"x": x})[0])
