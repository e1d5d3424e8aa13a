"""Small integer types an op's schema does not take at the model's opset, computed wider.

PopRT's model fusion example builds an ``INT8`` ``Sub`` and ``Add`` at opset 11, whose
schemas take int8 only from opset 14; PopRT compiles it, onnx's checks and onnxruntime
refuse it. Such a node runs on the wider integer type its schema takes (int8, int16,
uint8, uint16 -> int32; uint32 -> int64) between casts: its inputs are cast up, its
outputs cast back to the type the model gives them (the cast wraps as the narrow type's
arithmetic does).
"""

from __future__ import annotations

import logging
from typing import Any

import onnx
from onnx import TensorProto, helper

__all__ = ["widen_small_ints"]

_log = logging.getLogger(__name__)

_T = TensorProto
_WIDER: dict[int, int] = {_T.INT8: _T.INT32, _T.UINT8: _T.INT32, _T.INT16: _T.INT32,
                          _T.UINT16: _T.INT32, _T.UINT32: _T.INT64}
_NAMES: dict[int, str] = {_T.INT8: "int8", _T.UINT8: "uint8", _T.INT16: "int16",
                          _T.UINT16: "uint16", _T.UINT32: "uint32", _T.INT32: "int32",
                          _T.INT64: "int64"}


def _tstr(elem: int) -> str:
    return f"tensor({_NAMES.get(elem, '?')})"


def widen_small_ints(model: onnx.ModelProto, label: str) -> int:
    """Wrap the main graph's nodes whose small integer inputs their schema refuses (in
    place); returns how many."""
    g = model.graph
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if not opset:
        return 0
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:
        return 0
    ig = inferred.graph
    types = {vi.name: vi.type.tensor_type.elem_type
             for vi in list(ig.input) + list(ig.value_info) + list(ig.output)
             if vi.type.WhichOneof("value") == "tensor_type"}
    types.update({t.name: t.data_type for t in g.initializer})
    out: list[onnx.NodeProto] = []
    count = 0
    for k, node in enumerate(g.node):
        plan = _plan(node, opset, types)
        if not plan:
            out.append(node)
            continue
        count += 1
        tag = node.name or f"{node.op_type}_{k}"
        after = []
        for i, (name, param) in enumerate(_formals(node.input, _schema(node, opset).inputs)):
            if name and param in plan:
                wide = f"{tag}__in{i}_wide"
                out.append(helper.make_node("Cast", [name], [wide], to=plan[param][1], name=wide))
                node.input[i] = wide
        for i, (name, param) in enumerate(_formals(node.output, _schema(node, opset).outputs)):
            if name and param in plan:
                wide = f"{tag}__out{i}_wide"
                node.output[i] = wide
                after.append(helper.make_node("Cast", [wide], [name], to=plan[param][0],
                                              name=f"{tag}__out{i}_narrow"))
        out.append(node)
        out.extend(after)
        _log.info("model %s: %s %r computed in %s (its schema at opset %d takes no %s)",
                  label, node.op_type, tag, ", ".join(_tstr(w) for _, w in plan.values()),
                  opset, ", ".join(_tstr(n) for n, _ in plan.values()))
    if count:
        del g.node[:]
        g.node.extend(out)
    return count


def _schema(node: onnx.NodeProto, opset: int) -> Any:
    return onnx.defs.get_schema(node.op_type, opset, "")


def _formals(names: Any, formals: Any) -> list[tuple[str, str]]:
    """(value name, type parameter) for each input or output, variadic formals repeated."""
    out = []
    for k, name in enumerate(names):
        if not formals:
            break
        formal = formals[min(k, len(formals) - 1)]
        if k >= len(formals) and formal.option != onnx.defs.OpSchema.FormalParameterOption.Variadic:
            break
        out.append((name, formal.type_str))
    return out


def _plan(node: onnx.NodeProto, opset: int, types: dict[str, int]) -> dict[str, tuple[int, int]]:
    """Type parameter -> (narrow, wide) for the parameters to widen ({}: none)."""
    if node.domain not in ("", "ai.onnx") or node.op_type == "Cast":
        return {}
    try:
        schema = _schema(node, opset)
    except Exception:
        return {}
    allowed = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
    plan: dict[str, tuple[int, int]] = {}
    for name, param in _formals(node.input, schema.inputs):
        elem = types.get(name)
        if not name or elem is None or param not in allowed or _tstr(elem) in allowed[param]:
            continue
        wide = _WIDER.get(elem)
        if wide is None or _tstr(wide) not in allowed[param]:
            return {}
        plan[param] = (elem, wide)
    return plan
