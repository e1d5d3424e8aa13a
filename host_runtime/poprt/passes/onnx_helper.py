"""Helpers over ONNX graphs that PopRT's pass authors use."""

from __future__ import annotations

from typing import Optional

import numpy as np
import onnx

from host_runtime.poprt._onnx_util import constant_value, copy_model, subgraphs
from host_runtime.poprt.passes._graph import topological_sort as _sorted_graph

__all__ = ["topological_sort", "get_constant", "clean_info", "get_dtype", "get_shape"]


def get_constant(graph: onnx.GraphProto, name: str) -> np.ndarray | None:
    """The value of ``name`` when an initializer or a Constant node of ``graph`` gives it."""
    return constant_value(graph, name)


def topological_sort(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """The nodes of ``graph`` in an order where each follows the producers of its inputs,
    as PopRT's helper gives them: a list to put back into ``graph.node``."""
    return list(_sorted_graph(graph).node)


def clean_info(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` without the inferred types and shapes of its intermediate
    tensors (``value_info`` of the graph and of every sub-graph), so that shape
    inference after a rewrite starts afresh. Inputs and outputs keep theirs."""
    out = copy_model(model)
    todo = [out.graph]
    for _ in range(100_000):            # bounded: one step per (sub-)graph
        if not todo:
            break
        g = todo.pop()
        del g.value_info[:]
        for node in g.node:
            todo.extend(subgraphs(node))
    return out


def _value_info(graph: onnx.GraphProto, name: str) -> onnx.ValueInfoProto | None:
    for vi in (*graph.input, *graph.output, *graph.value_info):
        if vi.name == name and vi.type.WhichOneof("value") == "tensor_type":
            found: onnx.ValueInfoProto = vi
            return found
    return None


def get_dtype(graph: onnx.GraphProto, name: str) -> Optional[int]:
    """The ONNX element type (``onnx.TensorProto.FLOAT``, ...) of tensor ``name`` as the
    graph declares it (inputs, outputs, value_info, initializers); None when unknown."""
    vi = _value_info(graph, name)
    if vi is not None and vi.type.tensor_type.elem_type:
        return int(vi.type.tensor_type.elem_type)
    for init in graph.initializer:
        if init.name == name:
            return int(init.data_type)
    return None


def get_shape(graph: onnx.GraphProto, name: str) -> Optional[list[int]]:
    """The dims of tensor ``name`` as the graph declares them (0 for a dimension without
    a value, as ONNX stores it); None when the graph gives no shape."""
    vi = _value_info(graph, name)
    if vi is not None and vi.type.tensor_type.HasField("shape"):
        return [int(d.dim_value) for d in vi.type.tensor_type.shape.dim]
    for init in graph.initializer:
        if init.name == name:
            return [int(d) for d in init.dims]
    return None
