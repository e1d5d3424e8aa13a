"""The fused ONNX model written by ``--output_model`` for model fusion.

Each model becomes a sub-graph whose names carry the prefix ``graph<i>/``;
the fused model also declares the ``index`` input that selects a sub-graph on
the device. (On the device the sub-graphs are separate graphs behind a
``Switch``; this ONNX model computes all of them side by side, which is
what a single ONNX graph without control flow can express.)
"""

from __future__ import annotations

import logging

import onnx
from onnx import compose, helper

__all__ = ["fuse_models"]

_log = logging.getLogger(__name__)


def fuse_models(models: list[onnx.ModelProto], index_name: str, index_elem_type: int,
                index_shape: list[int]) -> onnx.ModelProto:
    opsets: dict[str, int] = {}
    for m in models:
        for op in m.opset_import:
            opsets[op.domain] = max(opsets.get(op.domain, 0), op.version)
    if len({next((o.version for o in m.opset_import if o.domain in ("", "ai.onnx")), 0)
            for m in models}) > 1:
        _log.warning("fused models use different opsets; the fused ONNX model declares %s",
                     opsets)
    graph = helper.make_graph([], "model_fusion", [
        helper.make_tensor_value_info(index_name, index_elem_type, index_shape)], [])
    for i, m in enumerate(models):
        pm = compose.add_prefix(m, f"graph{i}/")
        g = pm.graph
        graph.node.extend(g.node)
        graph.input.extend(g.input)
        graph.output.extend(g.output)
        graph.initializer.extend(g.initializer)
        graph.value_info.extend(g.value_info)
    fused = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v)
                                                    for d, v in sorted(opsets.items())])
    fused.ir_version = min(m.ir_version for m in models)
    return fused
