"""Small helpers over ONNX graphs that the converter, the compile API and the passes share."""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from host_runtime.errors import BadRequestError

__all__ = ["copy_model", "producers", "consumers", "initializers", "constant_value",
           "unique", "graph_inputs", "set_dims", "main_opset", "subgraphs", "make_const",
           "parse_skip_list", "prune"]


def copy_model(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def producers(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    return {o: n for n in graph.node for o in n.output if o}


def consumers(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    out: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for i in n.input:
            if i:
                out.setdefault(i, []).append(n)
    for n in graph.node:      # names read inside sub-graphs count as uses
        for g in subgraphs(n):
            for name in _outer_reads(g):
                out.setdefault(name, []).append(n)
    return out


def subgraphs(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    for a in node.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            yield a.g
        elif a.type == onnx.AttributeProto.GRAPHS:
            yield from a.graphs


def _outer_reads(graph: onnx.GraphProto) -> set[str]:
    reads: set[str] = set()
    for n in graph.node:
        reads.update(i for i in n.input if i)
        for g in subgraphs(n):
            reads |= _outer_reads(g)
    return reads


def initializers(graph: onnx.GraphProto) -> dict[str, TensorProto]:
    return {t.name: t for t in graph.initializer}


def constant_value(graph: onnx.GraphProto, name: str) -> np.ndarray | None:
    """The value of ``name`` if an initializer or a Constant node gives it."""
    for t in graph.initializer:
        if t.name == name:
            return numpy_helper.to_array(t)
    for n in graph.node:
        if n.op_type == "Constant" and n.output and n.output[0] == name:
            for a in n.attribute:
                if a.name == "value":
                    return numpy_helper.to_array(a.t)
                if a.name == "value_float":
                    return np.array(a.f, np.float32)
                if a.name == "value_floats":
                    return np.array(list(a.floats), np.float32)
                if a.name == "value_int":
                    return np.array(a.i, np.int64)
                if a.name == "value_ints":
                    return np.array(list(a.ints), np.int64)
    return None


def unique(graph: onnx.GraphProto, base: str) -> str:
    """A value name not used in ``graph`` yet."""
    used = {t.name for t in graph.initializer} | {vi.name for vi in graph.input} | \
        {o for n in graph.node for o in n.output} | {n.name for n in graph.node}
    name, k = base, 0
    while name in used:
        k += 1
        name = f"{base}_{k}"
    return name


def graph_inputs(graph: onnx.GraphProto) -> list[onnx.ValueInfoProto]:
    inits = {t.name for t in graph.initializer}
    return [vi for vi in graph.input if vi.name not in inits]


def set_dims(vi: onnx.ValueInfoProto, dims: list[int]) -> None:
    if vi.type.WhichOneof("value") != "tensor_type":
        raise BadRequestError(f"input {vi.name!r} is not a tensor; its shape cannot be set")
    shape = vi.type.tensor_type.shape
    del shape.dim[:]
    for d in dims:
        shape.dim.add().dim_value = int(d)


def main_opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def make_const(graph: onnx.GraphProto, base: str, value: np.ndarray) -> str:
    name = unique(graph, base)
    graph.initializer.append(numpy_helper.from_array(np.asarray(value), name))
    return name


def parse_skip_list(value: Any, what: str) -> list[str]:
    """``"A,B"`` or ``["A", "B"]`` (or None) -> ``["A", "B"]``."""
    if value is None:
        return []
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    if isinstance(value, (list, tuple, set)) and all(isinstance(v, str) for v in value):
        return [v.strip() for v in value if v.strip()]
    raise BadRequestError(f"{what} must be a comma-separated str or a list of str, got "
                          f"{value!r}")


def prune(model: onnx.ModelProto) -> onnx.ModelProto:
    """Drop the main graph's nodes no output depends on, then unused initializers."""
    g = model.graph
    prod = producers(g)
    live: set[str] = set()
    stack = [o.name for o in g.output]
    keep: set[int] = set()
    while stack:
        name = stack.pop()
        if name in live:
            continue
        live.add(name)
        n = prod.get(name)
        if n is None or id(n) in keep:
            continue
        keep.add(id(n))
        stack.extend(i for i in n.input if i)
        for sg in subgraphs(n):
            for inner in sg.node:
                stack.extend(i for i in inner.input if i)
    nodes = [n for n in g.node if id(n) in keep]
    del g.node[:]
    g.node.extend(nodes)
    used = set(consumers(g)) | {o.name for o in g.output}
    inits = [t for t in g.initializer if t.name in used]
    del g.initializer[:]
    g.initializer.extend(inits)
    names = {t.name for t in inits}
    all_init = {vi.name for vi in g.input} - {vi.name for vi in graph_inputs(g)}
    ins = [vi for vi in g.input if vi.name not in all_init or vi.name in names]
    del g.input[:]
    g.input.extend(ins)
    return model
