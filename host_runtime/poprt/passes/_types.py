"""Passes over input shapes and element types: what PopRT's shape and precision passes
do, over ONNX graphs the emulator runs."""

from __future__ import annotations

import logging
from typing import Any, Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from host_runtime.errors import BadRequestError
from host_runtime.poprt.passes._base import Pass
from host_runtime.poprt._onnx_util import (copy_model, graph_inputs, parse_skip_list, set_dims,
                                          subgraphs, unique)

__all__ = ["ConstBatchSize", "ConstInputShape", "Float2Half", "Int64ToInt32", "DoubleToFloat",
           "RemoveInputCast", "ReplaceCastLike", "ShapeInference", "infer_lenient", "infer_shapes"]

_log = logging.getLogger("poprt.passes")


def infer_lenient(model: onnx.ModelProto) -> onnx.ModelProto:
    """onnx's shape inference, or the model unchanged when it fails."""
    try:
        return onnx.shape_inference.infer_shapes(model, data_prop=True)
    except Exception as exc:  # noqa: BLE001 - the compiler infers again and says why
        _log.info("shape inference failed (%s); shapes are left to the compiler", exc)
        return model


def infer_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """PopRT's ``poprt.passes.shape_inference.infer_shapes``: a copy of ``model`` with
    the types and shapes onnx infers (the model as given when inference fails)."""
    return infer_lenient(copy_model(model))


def _refresh_shapes(model: onnx.ModelProto) -> onnx.ModelProto:
    """Drop the intermediate and output shapes that new input shapes made stale, and infer
    them afresh."""
    del model.graph.value_info[:]
    for vi in model.graph.output:
        if vi.type.WhichOneof("value") == "tensor_type" and vi.type.tensor_type.HasField("shape"):
            vi.type.tensor_type.ClearField("shape")
    return infer_lenient(model)


class ConstInputShape(Pass):
    """Fix the shapes of the inputs named in ``const_input_shape`` (name -> dims); with
    ``batch_size`` and ``batch_axis``, also set that axis of every input to
    ``batch_size``. Changes the model: its inputs (and what follows) get static shapes."""

    def __init__(self, const_input_shape: dict[str, Any] | None = None,
                 batch_size: int | None = None, batch_axis: int | None = None) -> None:
        super().__init__()
        self.shapes = {str(k): [int(d) for d in v] for k, v in (const_input_shape or {}).items()}
        if (batch_size is None) != (batch_axis is None):
            raise BadRequestError("batch_size and batch_axis go together; got batch_size="
                                  f"{batch_size!r}, batch_axis={batch_axis!r}")
        if batch_size is not None and int(batch_size) < 1:
            raise BadRequestError(f"batch_size must be a positive integer, got {batch_size!r}")
        self.batch_size = None if batch_size is None else int(batch_size)
        self.batch_axis = None if batch_axis is None else int(batch_axis)

    def run(self, onnx_model: onnx.ModelProto) -> onnx.ModelProto:
        from ipu_emulator.compiler import fix_input_shapes

        model = copy_model(onnx_model)
        # the compiler's own --input_shape (same checks and messages)
        fix_input_shapes(model, model.graph.name or "<model>", self.shapes,
                         {t.name for t in model.graph.initializer})
        inputs = {vi.name: vi for vi in graph_inputs(model.graph)}
        for name, vi in inputs.items():
            dims = None
            if name not in self.shapes and self.batch_size is not None \
                    and self.batch_axis is not None:
                tt = vi.type.tensor_type
                rank = len(tt.shape.dim)
                axis = self.batch_axis + rank if self.batch_axis < 0 else self.batch_axis
                if vi.type.WhichOneof("value") != "tensor_type" or not 0 <= axis < rank:
                    continue
                dims = [int(d.dim_value) if d.HasField("dim_value") else -1 for d in tt.shape.dim]
                dims[axis] = self.batch_size
                if any(d < 0 for d in dims):
                    tt.shape.dim[axis].Clear()
                    tt.shape.dim[axis].dim_value = self.batch_size
                    continue
            if dims is not None:
                set_dims(vi, dims)
        return _refresh_shapes(model)


class ConstBatchSize(Pass):
    """Set the first dim of every input whose first dim is not a number to
    ``const_batch_size``. Changes the model (static shapes)."""

    def __init__(self, const_batch_size: int = 1) -> None:
        super().__init__()
        if int(const_batch_size) < 1:
            raise BadRequestError(f"const_batch_size must be positive, got {const_batch_size!r}")
        self.const_batch_size = int(const_batch_size)

    def run(self, onnx_model: onnx.ModelProto) -> onnx.ModelProto:
        model = copy_model(onnx_model)
        for vi in graph_inputs(model.graph):
            tt = vi.type.tensor_type
            if vi.type.WhichOneof("value") == "tensor_type" and len(tt.shape.dim) > 0 \
                    and not tt.shape.dim[0].HasField("dim_value"):
                tt.shape.dim[0].Clear()
                tt.shape.dim[0].dim_value = self.const_batch_size
        return _refresh_shapes(model)


class ShapeInference(Pass):
    """Run onnx's shape inference (the model's value_info is filled in)."""

    def run(self, onnx_model: onnx.ModelProto) -> onnx.ModelProto:
        return infer_lenient(copy_model(onnx_model))


class Float2Half(Pass):
    """Convert the model to fp16 with the compiler's own conversion
    (``ipu_emulator.compiler.to_fp16``): float tensors become fp16; ops in
    ``skip_op_types``, ops without fp16 in their schema and values beyond fp16's range
    stay fp32 between casts. ``enable_avoid_overflow_patterns`` is accepted: values that
    would overflow fp16 on a sample run are always kept fp32 here."""

    def __init__(self, skip_op_types: Any = None,
                 enable_avoid_overflow_patterns: bool = False) -> None:
        super().__init__()
        self.skip_op_types = parse_skip_list(skip_op_types, "skip_op_types")
        self.enable_avoid_overflow_patterns = bool(enable_avoid_overflow_patterns)

    def run(self, onnx_model: onnx.ModelProto) -> onnx.ModelProto:
        from ipu_emulator.compiler import to_fp16

        model = copy_model(onnx_model)
        # the plan (the fp32 sample and which values stayed fp32) is kept for the
        # poprt command's fp16-vs-fp32 report
        self.plan = to_fp16(model, model.graph.name or "model", frozenset(self.skip_op_types))
        return _declared_shapes_kept(onnx_model, infer_lenient(model))


def _declared_shapes_kept(given: onnx.ModelProto, model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with the output shapes ``given`` declared where inference found none
    (e.g. after an op onnx has no shape function for, such as com.microsoft's Gelu)."""
    declared = {vi.name: vi.type.tensor_type.shape for vi in given.graph.output
                if vi.type.WhichOneof("value") == "tensor_type"
                and vi.type.tensor_type.HasField("shape")}
    for vi in model.graph.output:
        tt = vi.type.tensor_type
        if vi.name in declared and vi.type.WhichOneof("value") == "tensor_type" \
                and not tt.HasField("shape"):
            tt.shape.CopyFrom(declared[vi.name])
    return model


def _retype(model: onnx.ModelProto, old: int, new: int, np_new: Any) -> None:
    """Every tensor of element type ``old`` becomes ``new`` (values, initializers, Cast
    targets, Constant values), in sub-graphs too."""
    def graph(g: onnx.GraphProto) -> None:
        for vi in list(g.input) + list(g.output) + list(g.value_info):
            if vi.type.WhichOneof("value") == "tensor_type" and vi.type.tensor_type.elem_type == old:
                vi.type.tensor_type.elem_type = new
        for k, t in enumerate(g.initializer):
            if t.data_type == old:
                g.initializer[k].CopyFrom(numpy_helper.from_array(
                    numpy_helper.to_array(t).astype(np_new), t.name))
        for n in g.node:
            for a in n.attribute:
                if a.name == "to" and n.op_type == "Cast" and a.i == old:
                    a.i = new
                elif a.type == onnx.AttributeProto.TENSOR and a.t.data_type == old:
                    a.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(a.t).astype(np_new),
                                                         a.t.name))
            for sg in subgraphs(n):
                graph(sg)
    graph(model.graph)


class DoubleToFloat(Pass):
    """Convert float64 to float32: initializers, Constant values, Cast targets and the
    graph's inputs and outputs (the IPU has no float64). Changes the model."""

    def run(self, onnx_model: onnx.ModelProto) -> onnx.ModelProto:
        model = copy_model(onnx_model)
        _retype(model, TensorProto.DOUBLE, TensorProto.FLOAT, np.float32)
        return model


def _boundary_casts(model: onnx.ModelProto, old: int, new: int) -> int:
    """Graph inputs and outputs of type ``old`` become ``new``, cast to ``old`` inside."""
    g = model.graph
    count = 0
    added: list[onnx.NodeProto] = []
    for vi in graph_inputs(g):
        if vi.type.WhichOneof("value") == "tensor_type" and vi.type.tensor_type.elem_type == old:
            inner = unique(g, f"{vi.name}__as_{TensorProto.DataType.Name(old).lower()}")
            _rename_uses(g, vi.name, inner)
            added.append(helper.make_node("Cast", [vi.name], [inner], to=old, name=inner))
            vi.type.tensor_type.elem_type = new
            count += 1
    for vi in g.output:
        if vi.type.WhichOneof("value") == "tensor_type" and vi.type.tensor_type.elem_type == old:
            inner = unique(g, f"{vi.name}__{TensorProto.DataType.Name(old).lower()}")
            for n in g.node:
                n.output[:] = [inner if o == vi.name else o for o in n.output]
            _rename_uses(g, vi.name, inner)
            g.node.append(helper.make_node("Cast", [inner], [vi.name], to=new, name=vi.name + "__cast"))
            vi.type.tensor_type.elem_type = new
            count += 1
    for n in reversed(added):
        g.node.insert(0, n)
    return count


def _rename_uses(g: onnx.GraphProto, old: str, new: str) -> None:
    def rename(graph: onnx.GraphProto) -> None:
        for n in graph.node:
            n.input[:] = [new if i == old else i for i in n.input]
            for sg in subgraphs(n):
                rename(sg)
    rename(g)


class Int64ToInt32(Pass):
    """The graph's int64 inputs and outputs become int32 (the IPU has no int64): inputs
    are cast to int64 where ONNX ops need it, outputs are cast to int32 (values beyond
    int32 wrap, as on the IPU). Changes the model's interface."""

    def run(self, onnx_model: onnx.ModelProto) -> onnx.ModelProto:
        model = copy_model(onnx_model)
        _boundary_casts(model, TensorProto.INT64, TensorProto.INT32)
        return model


class RemoveInputCast(Pass):
    """``input -> Cast(to=T) -> ...`` where the Cast is the input's only reader becomes an
    input of type ``T`` read directly. Changes the model's interface."""

    def run(self, onnx_model: onnx.ModelProto) -> onnx.ModelProto:
        model = copy_model(onnx_model)
        g = model.graph
        outputs = {o.name for o in g.output}
        for vi in graph_inputs(g):
            readers = [n for n in g.node if vi.name in n.input]
            if len(readers) != 1 or readers[0].op_type != "Cast" or vi.name in outputs:
                continue
            cast = readers[0]
            to = next(a.i for a in cast.attribute if a.name == "to")
            if cast.output[0] in outputs:
                continue
            vi.type.tensor_type.elem_type = to
            _rename_uses(g, cast.output[0], vi.name)
            g.node.remove(cast)
        return _refresh_shapes(model) if g.value_info else model


class ReplaceCastLike(Pass):
    """``CastLike(x, like)`` becomes ``Cast(x, to=<type of like>)``. Same values."""

    def run(self, onnx_model: onnx.ModelProto) -> onnx.ModelProto:
        model = copy_model(onnx_model)
        inferred = infer_lenient(model)
        g = inferred.graph
        types = {vi.name: vi.type.tensor_type.elem_type
                 for vi in list(g.input) + list(g.output) + list(g.value_info)}
        types.update({t.name: t.data_type for t in g.initializer})

        def transform(graph: onnx.GraphProto, main: bool) -> onnx.GraphProto:
            for k, n in enumerate(graph.node):
                if n.op_type == "CastLike" and types.get(n.input[1]):
                    graph.node[k].CopyFrom(helper.make_node(
                        "Cast", [n.input[0]], list(n.output), name=n.name,
                        to=types[n.input[1]]))
            return graph

        model.graph.CopyFrom(self.traverse_graph(model.graph, transform))
        return model


Transform = Callable[[onnx.GraphProto, bool], onnx.GraphProto]
