"""``--precision fp16``: convert a model's float tensors to half precision.

Converted: initializers, graph inputs/outputs and value_info, ``Cast``/
``CastLike`` targets, ``Constant``/``ConstantOfShape`` values and the ``dtype``
of random, ``EyeLike`` and ``SequenceEmpty`` ops, in sub-graphs too. Inputs that the ONNX
standard requires to stay float32 (``Resize`` roi/scales, ``Upsample``
scales) are kept float32: initializers feeding them are left alone, computed
values get a ``Cast`` to float32.

The host CPU lacks half-precision kernels for some ops (onnxruntime's CPU
provider has no fp16 ``Conv``, for one). The IPU computes those in fp16; the
emulator computes them in fp32 between casts (``wrap_in_fp32``), which keeps
the fp16 interface and fp16 rounding of every intermediate tensor.

Some ops have no faithful fp16 form at all (``_KEEP_FP32_OPS``: ``BitCast`` of
float32 bits, onnx's float32-only function body of ``MeanVarianceNormalization``,
``MelWeightMatrix``'s float32 table, ``TreeEnsemble``'s float32 thresholds,
``EyeLike`` without an fp16 kernel): like PopRT, which keeps the ops it cannot
convert in fp32, they keep their float32 attributes and run in fp32 between casts.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = ["convert_to_fp16", "wrap_in_fp32", "wrap_nodes_in_fp32", "fp32_only_ops",
           "fp32_only_inputs", "schema_types",
           "FP16_MAX", "Fp16RangeWarning"]

FP16_MAX = 65504.0
"""The largest finite fp16 value."""


class Fp16RangeWarning(UserWarning):
    """``--precision fp16`` kept values beyond fp16's range in fp32 or clamped them."""

_F32, _F16 = TensorProto.FLOAT, TensorProto.FLOAT16
_KEEP_FP32_INPUTS = {"Resize": (1, 2), "Upsample": (1,)}
_DTYPE_ATTR_OPS = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
                   "EyeLike", "Multinomial", "Bernoulli", "SequenceEmpty"}
# float output by default (attribute output_datatype)
_OUTPUT_DATATYPE_OPS = {"BlackmanWindow", "HammingWindow", "HannWindow"}
_NO_FP16_REDUCTION = {"ScatterND", "ScatterElements"}
_FLOAT_BY_DEFAULT = {"RandomNormal", "RandomUniform", "SequenceEmpty"}   # dtype attr absent
# Kept in fp32 inside an fp16 model (between casts), as PopRT keeps ops it cannot convert:
_KEEP_FP32_OPS = {
    # reinterprets the bits of a float32 (or makes float32 bits): fp16 has other bits
    "BitCast": "BitCast reinterprets float32 bits, which have no fp16 equivalent",
    # onnx's function body adds a float32 Constant: an fp16 input fails its type check
    "MeanVarianceNormalization": "onnx's function body for it is float32-only",
    # its output_datatype is a float32 table of filter weights; onnx infers float32
    "MelWeightMatrix": "its filter table is computed in float32 (output_datatype)",
    # the tree thresholds/leaf values are float32 attributes that must match the input
    "TreeEnsemble": "ai.onnx.ml TreeEnsemble's float32 thresholds must match its input "
                    "type (onnxruntime has no fp16 kernel)",
    # onnxruntime's CPU provider has no fp16 EyeLike
    "EyeLike": "onnxruntime has no fp16 EyeLike kernel",
}


def convert_to_fp16(model: onnx.ModelProto, keep_nodes: frozenset[str] = frozenset(),
                    keep_values: frozenset[str] = frozenset()) -> list[str]:
    """Convert ``model`` (in place) to fp16; see the module docstring. The main graph's
    ``_KEEP_FP32_OPS`` nodes and the nodes named in ``keep_nodes`` keep their float32
    attributes (``wrap_in_fp32`` / ``wrap_nodes_in_fp32`` then cast around them); the
    main graph's initializers and values named in ``keep_values`` stay float32.

    Other float32 constants beyond fp16's range are clamped to +-65504 (never inf);
    returns their names."""
    clamped: list[str] = []
    _convert_graph(model.graph, clamped, main=True, keep_nodes=keep_nodes,
                   keep_values=keep_values)
    _ensure_default_opset(model)
    return clamped


def _tensor_to_fp16(t: TensorProto, clamped: list[str]) -> None:
    if t.data_type != _F32:
        return
    arr = numpy_helper.to_array(t)
    finite = np.isfinite(arr)
    if np.any(np.abs(arr[finite]) > FP16_MAX):
        clamped.append(t.name or "<constant>")
        arr = np.where(finite, np.clip(arr, -FP16_MAX, FP16_MAX), arr)
    new = numpy_helper.from_array(arr.astype(np.float16), t.name)
    t.CopyFrom(new)


def _convert_type(tp: onnx.TypeProto) -> None:
    which = tp.WhichOneof("value")
    if which == "tensor_type" and tp.tensor_type.elem_type == _F32:
        tp.tensor_type.elem_type = _F16
    elif which == "sequence_type":
        _convert_type(tp.sequence_type.elem_type)
    elif which == "optional_type":
        _convert_type(tp.optional_type.elem_type)


def _convert_graph(graph: onnx.GraphProto, clamped: list[str], main: bool = False,
                   keep_nodes: frozenset[str] = frozenset(),
                   keep_values: frozenset[str] = frozenset()) -> None:
    keep: set[str] = set(keep_values)
    init_names = {t.name for t in graph.initializer}
    new_nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        for idx in _KEEP_FP32_INPUTS.get(node.op_type, ()):
            if idx < len(node.input) and node.input[idx]:
                name = node.input[idx]
                if name in init_names:
                    keep.add(name)
                else:
                    cast_out = f"{name}__fp32_for_{node.name or node.op_type}_{idx}"
                    new_nodes.append(helper.make_node("Cast", [name], [cast_out], to=_F32,
                                                      name=cast_out))
                    node.input[idx] = cast_out
        if main and (node.op_type in _KEEP_FP32_OPS or node.name in keep_nodes):
            _convert_subgraphs(node, clamped)      # its own attributes stay float32
        else:
            _convert_node(node, clamped)
        new_nodes.append(node)
    del graph.node[:]
    graph.node.extend(new_nodes)
    for t in graph.initializer:
        if t.name not in keep:
            _tensor_to_fp16(t, clamped)
    for vi in list(graph.input) + list(graph.output) + list(graph.value_info):
        if vi.name not in keep:
            _convert_type(vi.type)


def _convert_node(node: onnx.NodeProto, clamped: list[str]) -> None:
    if node.op_type in _FLOAT_BY_DEFAULT and not any(a.name == "dtype" for a in node.attribute):
        node.attribute.append(helper.make_attribute("dtype", _F16))
    if node.op_type == "ConstantOfShape" and not any(a.name == "value" for a in node.attribute):
        # its default value is a float32 zero
        node.attribute.append(helper.make_attribute(
            "value", numpy_helper.from_array(np.zeros((1,), np.float16))))
    if node.op_type in _OUTPUT_DATATYPE_OPS and not any(
            a.name == "output_datatype" for a in node.attribute):
        node.attribute.append(helper.make_attribute("output_datatype", _F16))
    for attr in node.attribute:
        if node.op_type in ("Cast",) and attr.name == "to" and attr.i == _F32:
            attr.i = _F16
        elif node.op_type in _DTYPE_ATTR_OPS and attr.name == "dtype" and attr.i == _F32:
            attr.i = _F16
        elif node.op_type in _OUTPUT_DATATYPE_OPS and attr.name == "output_datatype" and \
                attr.i == _F32:
            attr.i = _F16
        if attr.HasField("t"):
            _tensor_to_fp16(attr.t, clamped)
            if node.op_type == "Constant" and clamped and clamped[-1] == "<constant>":
                clamped[-1] = node.output[0]
        for t in attr.tensors:
            _tensor_to_fp16(t, clamped)
        if attr.HasField("g"):
            _convert_graph(attr.g, clamped)
        for g in attr.graphs:
            _convert_graph(g, clamped)
    if node.op_type == "Constant":
        for k, attr in enumerate(node.attribute):
            if attr.name in ("value_float", "value_floats"):
                vals = np.asarray([attr.f] if attr.name == "value_float" else list(attr.floats),
                                  dtype=np.float32)
                if np.any(np.abs(vals[np.isfinite(vals)]) > FP16_MAX):
                    clamped.append(node.output[0])
                    vals = np.where(np.isfinite(vals), np.clip(vals, -FP16_MAX, FP16_MAX), vals)
                arr = vals.astype(np.float16)
                if attr.name == "value_float":
                    arr = arr.reshape(())
                new = helper.make_attribute("value", numpy_helper.from_array(arr))
                node.attribute[k].CopyFrom(new)


def _convert_subgraphs(node: onnx.NodeProto, clamped: list[str]) -> None:
    for attr in node.attribute:
        if attr.HasField("g"):
            _convert_graph(attr.g, clamped)
        for g in attr.graphs:
            _convert_graph(g, clamped)


def fp32_only_ops(model: onnx.ModelProto) -> set[str]:
    """Op types of the main graph whose ONNX schema allows float32 but not float16 (and
    ScatterND/ScatterElements with a reduction, which onnxruntime computes only in fp32,
    and the ``_KEEP_FP32_OPS`` that have no faithful fp16 form)."""
    opsets = {("" if o.domain == "ai.onnx" else o.domain): o.version for o in model.opset_import}
    out: set[str] = set()
    for node in model.graph.node:
        if node.op_type in _KEEP_FP32_OPS:
            out.add(node.op_type)
            continue
        if node.op_type in _NO_FP16_REDUCTION and any(
                a.name == "reduction" and a.s not in (b"", b"none") for a in node.attribute):
            out.add(node.op_type)   # onnxruntime's CPU kernels refuse fp16 with a reduction
            continue
        domain = "" if node.domain == "ai.onnx" else node.domain
        if node.op_type in out or domain not in opsets:
            continue
        schema: Any
        try:
            schema = onnx.defs.get_schema(node.op_type, opsets[domain], domain)
        except Exception:   # not an onnx op: onnxruntime's own (com.microsoft) schemas
            schema = _ort_schemas().get((domain, node.op_type))
            if schema is None:   # unknown op: onnxruntime will say
                continue
        allowed = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
        for formal in list(schema.inputs) + list(schema.outputs):
            tstr = str(getattr(formal, "type_str", None) or getattr(formal, "typeStr", ""))
            types = allowed.get(tstr, {tstr})
            if "tensor(float)" in types and "tensor(float16)" not in types:
                out.add(node.op_type)
                break
    return out


@functools.lru_cache(maxsize=1)
def _ort_schemas() -> dict[tuple[str, str], Any]:
    """onnxruntime's operator schemas of the domains onnx does not know (com.microsoft's
    DynamicQuantizeLSTM, MatMulIntegerToFloat...), the newest version of each."""
    try:
        from onnxruntime.capi import onnxruntime_pybind11_state as ort_c
        schemas = ort_c.get_all_operator_schema()
    except Exception:   # a build without schemas: onnxruntime's load error says instead
        return {}
    out: dict[tuple[str, str], Any] = {}
    for sc in schemas:
        if sc.domain in ("", "ai.onnx", "ai.onnx.ml"):
            continue
        key = (sc.domain, sc.name)
        if key not in out or sc.since_version > out[key].since_version:
            out[key] = sc
    return out


_TYPE_NAMES = {f"tensor({n})": v for n, v in (
    ("float", TensorProto.FLOAT), ("float16", TensorProto.FLOAT16), ("double", TensorProto.DOUBLE),
    ("int8", TensorProto.INT8), ("uint8", TensorProto.UINT8), ("int16", TensorProto.INT16),
    ("uint16", TensorProto.UINT16), ("int32", TensorProto.INT32), ("uint32", TensorProto.UINT32),
    ("int64", TensorProto.INT64), ("uint64", TensorProto.UINT64), ("bool", TensorProto.BOOL))}


def schema_types(model: onnx.ModelProto, types: dict[str, int]) -> dict[str, int]:
    """``types`` completed from the operators' schemas (onnx's, then onnxruntime's for
    com.microsoft ops that onnx's inference does not know): an output whose type variable
    allows one type, or is bound by a typed input, gets that type."""
    out = dict(types)
    opsets = {("" if o.domain == "ai.onnx" else o.domain): o.version for o in model.opset_import}
    for node in model.graph.node:
        if all(o in out for o in node.output if o):
            continue
        domain = "" if node.domain == "ai.onnx" else node.domain
        schema: Any
        try:
            schema = onnx.defs.get_schema(node.op_type, opsets.get(domain, 1), domain)
        except Exception:
            schema = _ort_schemas().get((domain, node.op_type))
            if schema is None:
                continue
        allowed = {c.type_param_str: list(c.allowed_type_strs) for c in schema.type_constraints}
        bound: dict[str, int] = {}
        for formal, name in zip(schema.inputs, node.input):
            tstr = str(getattr(formal, "type_str", None) or getattr(formal, "typeStr", ""))
            if name in out:
                bound.setdefault(tstr, out[name])
        for formal, name in zip(schema.outputs, node.output):
            if not name or name in out:
                continue
            tstr = str(getattr(formal, "type_str", None) or getattr(formal, "typeStr", ""))
            options = allowed.get(tstr, [tstr])
            if tstr in bound:
                out[name] = bound[tstr]
            elif len(options) == 1 and options[0] in _TYPE_NAMES:
                out[name] = _TYPE_NAMES[options[0]]
    return out


def fp32_only_inputs(model: onnx.ModelProto, op_types: set[str]) -> frozenset[str]:
    """Float32 initializers of the main graph read only by nodes of ``op_types`` (computed
    in fp32 between casts): they stay float32 rather than round through fp16 (the scales of
    dynamically quantized ops, for one)."""
    g = model.graph
    readers: dict[str, set[str]] = {}
    for node in g.node:
        for name in node.input:
            readers.setdefault(name, set()).add(node.op_type)
        for attr in node.attribute:   # read from inside a sub-graph: converted with it
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                for inner in sub.node:
                    for name in inner.input:
                        readers.setdefault(name, set()).add("")
    outputs = {vi.name for vi in g.output}
    return frozenset(t.name for t in g.initializer
                     if t.data_type == _F32 and t.name not in outputs and
                     readers.get(t.name) and readers[t.name] <= op_types)


def wrap_in_fp32(model: onnx.ModelProto, op_type: str, types: dict[str, int]) -> int:
    """Compute every ``op_type`` node of the main graph in fp32 between casts.

    ``types`` maps value names to ONNX element types (from shape inference).
    Returns the number of nodes wrapped.
    """
    return _wrap(model, lambda node: node.op_type == op_type, types)


def wrap_nodes_in_fp32(model: onnx.ModelProto, names: set[str] | frozenset[str],
                       types: dict[str, int]) -> int:
    """Compute the main graph's nodes named in ``names`` in fp32: their fp16 inputs are
    cast to fp32, their outputs typed fp16 in ``types`` cast back (outputs typed fp32
    stay fp32, for fp32 consumers)."""
    return _wrap(model, lambda node: node.name in names, types)


def _wrap(model: onnx.ModelProto, match: "Callable[[onnx.NodeProto], bool]",
          types: dict[str, int]) -> int:
    graph = model.graph
    out: list[onnx.NodeProto] = []
    count = 0
    for n, node in enumerate(graph.node):
        if not match(node):
            out.append(node)
            continue
        tag = node.name or f"{node.op_type}_{n}"
        after: list[onnx.NodeProto] = []
        wrapped = False
        for k, name in enumerate(node.input):
            if name and types.get(name) == _F16:
                cast = f"{tag}__in{k}_fp32"
                out.append(helper.make_node("Cast", [name], [cast], to=_F32, name=cast))
                node.input[k] = cast
                wrapped = True
        for k, name in enumerate(node.output):
            if name and types.get(name) == _F16:
                inner = f"{tag}__out{k}_fp32"
                node.output[k] = inner
                after.append(helper.make_node("Cast", [inner], [name], to=_F16,
                                              name=f"{tag}__out{k}_fp16"))
                wrapped = True
        out.append(node)
        out.extend(after)
        count += wrapped
    del graph.node[:]
    graph.node.extend(out)
    if count:
        _ensure_default_opset(model)
    return count


def _ensure_default_opset(model: onnx.ModelProto) -> None:
    """The Casts added need the default domain (an ai.onnx.ml-only model lacks it)."""
    if not any(o.domain in ("", "ai.onnx") for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("", 13))
