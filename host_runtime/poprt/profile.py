"""Model statistics: the FLOPs of an ONNX model's nodes (from its inferred shapes)."""

from __future__ import annotations

import math
from typing import Any

import onnx

__all__ = ["Profiler", "get_model_flops"]

_ELEMENTWISE = {"Add", "Sub", "Mul", "Div", "Relu", "Sigmoid", "Tanh", "Erf", "Exp", "Log",
                "Sqrt", "Pow", "Neg", "Abs", "Max", "Min", "Clip", "LeakyRelu", "Gelu",
                "Softmax", "Where"}


class Profiler:
    """FLOPs per node: ``Profiler().get_profiler(model)`` -> ``{node name: FLOPs}``
    (MatMul/Gemm: 2*M*N*K; Conv: 2 x output elements x input channels per group x kernel
    size; element-wise ops: one per output element; other ops: 0)."""

    def get_profiler(self, model: onnx.ModelProto) -> dict[str, int]:
        inferred = onnx.shape_inference.infer_shapes(model)
        g = inferred.graph
        shapes: dict[str, list[int]] = {}
        for vi in list(g.input) + list(g.output) + list(g.value_info):
            tt = vi.type.tensor_type
            if tt.HasField("shape"):
                shapes[vi.name] = [d.dim_value if d.HasField("dim_value") else 1
                                   for d in tt.shape.dim]
        for t in g.initializer:
            shapes[t.name] = list(t.dims)
        out: dict[str, int] = {}
        for k, n in enumerate(g.node):
            out[n.name or f"{n.op_type}_{k}"] = _flops(n, shapes)
        return out


def _flops(n: onnx.NodeProto, shapes: dict[str, list[int]]) -> int:
    y = shapes.get(n.output[0]) if n.output else None
    if y is None:
        return 0
    size = math.prod(y)
    if n.op_type in ("MatMul", "Gemm"):
        a = shapes.get(n.input[0])
        if not a:
            return 0
        trans_a = any(x.name == "transA" and x.i for x in n.attribute)
        k = a[-2] if (n.op_type == "Gemm" and trans_a) else a[-1]
        return 2 * size * k
    if n.op_type == "Conv":
        w = shapes.get(n.input[1])
        return 2 * size * math.prod(w[1:]) if w else 0
    return size if n.op_type in _ELEMENTWISE else 0


def get_model_flops(model: onnx.ModelProto, verbose: Any = False) -> int:
    """The model's FLOPs (the sum of ``Profiler().get_profiler(model)``); ``verbose``
    prints each node's."""
    per_node = Profiler().get_profiler(model)
    if verbose:
        for name, flops in per_node.items():
            print(f"{name}: {flops}")
    return sum(per_node.values())
