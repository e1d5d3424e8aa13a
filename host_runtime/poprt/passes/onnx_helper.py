"""Helpers over ONNX graphs that PopRT's pass authors use."""

from __future__ import annotations

import numpy as np
import onnx

from host_runtime.poprt.passes._graph import topological_sort as _sorted_graph
from host_runtime.poprt._onnx_util import constant_value

__all__ = ["topological_sort", "get_constant"]


def get_constant(graph: onnx.GraphProto, name: str) -> np.ndarray | None:
    """The value of ``name`` when an initializer or a Constant node of ``graph`` gives it."""
    return constant_value(graph, name)


def topological_sort(graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """The nodes of ``graph`` in an order where each follows the producers of its inputs,
    as PopRT's helper gives them: a list to put back into ``graph.node``."""
    return list(_sorted_graph(graph).node)
