"""A chain of MatMul/Relu nodes with named nodes: the model that sharding is shown with.

``chain_model(layers, width, batch)`` -> ``onnx.ModelProto``: input ``x``
``[batch, width]`` F32, then per layer ``k`` a MatMul node ``mm<k>`` with weight
``w<k>`` ``[width, width]`` and a Relu node ``relu<k>`` (output ``y`` for the
last). ``shard_config(layers, ipus, pipelined)`` gives the ``sharding_info`` /
``pipelining_info`` maps that cut it into equal consecutive parts.
Used by the demo, the pipelining benchmark, the stress scenario and the tests.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np

__all__ = ["chain_model", "shard_config", "write_shard_yaml", "reference"]


def chain_model(layers: int = 4, width: int = 16, batch: int = 2, seed: int = 0,
                initializer: Callable[[str, np.ndarray], Any] | None = None) -> Any:
    """``initializer(name, weights)`` makes each weight's TensorProto (default: inline
    data, and the model is checked); e.g. one whose data is external."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes = []
    inits = []
    x = "x"
    scale = np.float32(1.0 / np.sqrt(width))
    for k in range(layers):
        w = (rng.standard_normal((width, width)).astype(np.float32) * scale * 1.5)
        inits.append(numpy_helper.from_array(w, f"w{k}") if initializer is None
                     else initializer(f"w{k}", w))
        out = "y" if k == layers - 1 else f"r{k}"
        nodes.append(helper.make_node("MatMul", [x, f"w{k}"], [f"m{k}"], name=f"mm{k}"))
        nodes.append(helper.make_node("Relu", [f"m{k}"], [out], name=f"relu{k}"))
        x = out
    graph = helper.make_graph(
        nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, width])],
        initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    if initializer is None:
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
