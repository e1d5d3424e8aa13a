"""Graph outputs take what their nodes compute, not what the model declares.

Models built by hand declare outputs that disagree with their nodes: a ``ReduceMean``
declared ``[256, 256]`` that computes ``[1, 1, 256, 256]``, a ``Mul`` of floats declared
FLOAT16. onnxruntime runs them (it warns and returns what the nodes compute) while onnx's
shape inference refuses them. Here the declared output shapes are cleared before shape
inference (what the nodes compute wins; the declared shape stays the fallback when
nothing else resolves one), and an output whose declared element type differs from the
computed one is computed under another name and cast to the declared type: the stream
carries what the model's author declared.
"""

from __future__ import annotations

import logging

import onnx
from onnx import helper

from ipu_emulator.compiler._onnx import ONNX_TO_DTYPE

__all__ = ["follow_computed"]

_log = logging.getLogger(__name__)


def follow_computed(model: onnx.ModelProto, label: str) -> None:
    """Clear the declared shapes of ``model``'s tensor outputs and cast outputs whose
    declared element type differs from the computed one (in place)."""
    g = model.graph
    outs = [vi for vi in g.output if vi.type.WhichOneof("value") == "tensor_type"]
    for vi in outs:
        vi.type.tensor_type.ClearField("shape")
    producers = {o for node in g.node for o in node.output if o}
    declared = {vi.name: vi.type.tensor_type.elem_type for vi in outs
                if vi.name in producers and vi.type.tensor_type.elem_type in ONNX_TO_DTYPE}
    if not declared:
        return
    computed = _computed_types(model, set(declared))
    for name, want in declared.items():
        have = computed.get(name, 0)
        if not have or have == want or have not in ONNX_TO_DTYPE:
            continue
        inner = f"{name}__computed"
        _rename(g, name, inner)
        g.node.append(helper.make_node("Cast", [inner], [name], to=want,
                                       name=f"{name}__to_declared_type"))
        _log.info("model %s: output %r is declared %s but its nodes compute %s: cast to the "
                  "declared type", label, name, ONNX_TO_DTYPE[want], ONNX_TO_DTYPE[have])


def _computed_types(model: onnx.ModelProto, names: set[str]) -> dict[str, int]:
    """Element types onnx infers for the outputs ``names`` with their declared types
    cleared (initializers given as typed inputs: types need no values)."""
    probe = onnx.ModelProto()
    probe.ir_version = model.ir_version
    probe.opset_import.extend(model.opset_import)
    probe.functions.extend(model.functions)
    pg = probe.graph
    pg.node.extend(model.graph.node)
    inputs = {vi.name for vi in model.graph.input}
    pg.input.extend(model.graph.input)
    pg.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                    for t in model.graph.initializer if t.name not in inputs)
    pg.output.extend(model.graph.output)
    for vi in pg.output:
        if vi.name in names:
            vi.type.tensor_type.elem_type = 0
    try:
        inferred = onnx.shape_inference.infer_shapes(probe, strict_mode=False)
    except Exception:
        return {}
    return {vi.name: vi.type.tensor_type.elem_type for vi in inferred.graph.output
            if vi.name in names and vi.type.WhichOneof("value") == "tensor_type"}


def _rename(graph: onnx.GraphProto, old: str, new: str) -> None:
    """Every use of value ``old`` (node inputs and outputs, in sub-graphs too) -> ``new``."""
    for node in graph.node:
        node.input[:] = [new if i == old else i for i in node.input]
        node.output[:] = [new if o == old else o for o in node.output]
        for attr in node.attribute:
            if attr.HasField("g"):
                _rename_reads(attr.g, old, new)
            for sub in attr.graphs:
                _rename_reads(sub, old, new)


def _rename_reads(graph: onnx.GraphProto, old: str, new: str) -> None:
    """Outer-scope reads of ``old`` in a sub-graph (unless the sub-graph defines it)."""
    local = {o for node in graph.node for o in node.output} | {vi.name for vi in graph.input}
    if old in local:
        return
    for node in graph.node:
        node.input[:] = [new if i == old else i for i in node.input]
        for attr in node.attribute:
            if attr.HasField("g"):
                _rename_reads(attr.g, old, new)
            for sub in attr.graphs:
                _rename_reads(sub, old, new)
