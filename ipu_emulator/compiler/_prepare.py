"""Turning one ONNX model into a static, typed, device-runnable graph.

Steps: fix input shapes (``--input_shape``), convert precision (fp16: values
beyond its range stay fp32, ``_fp16_range``), infer shapes (onnx; for outputs it
leaves unknown, the shapes the model declares, then onnxruntime's symbolic shape
inference, then the shapes of sequences at constant positions), refuse what is
still dynamic (naming the tensor and the option), check onnxruntime can load it
(wrapping ops that lack fp16 CPU kernels), and split float initializers out as
weights when they are exported as tensor data.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from ipu_emulator.compiler._onnx import (
    dtype_of, missing_kernel, ort_max_ir_version, ort_session)
from ipu_emulator.compiler._declared import follow_computed
from ipu_emulator.compiler._fp16_range import Fp16Plan, clip_outputs, plan_fp16, relative_error
from ipu_emulator.compiler._precision import (
    Fp16RangeWarning, convert_to_fp16, fp32_only_ops, fp32_only_inputs, schema_types,
    wrap_in_fp32, wrap_nodes_in_fp32)
from ipu_emulator.compiler._tail import finish_tail, split_tail
from ipu_emulator.compiler._widen import widen_small_ints
from ipu_emulator.compiler._shapes import (
    Value, dims_of, require_static, resolve_outputs, set_dims, value_of)
from ipu_emulator.errors import CompileError
from ipu_emulator.executable import numpy_dtype
from shm.errors import echo

_log = logging.getLogger(__name__)

_FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE)
PRECISIONS = ("fp32", "fp16")


@dataclass
class Prepared:
    """One model ready for the back end."""

    label: str
    model: onnx.ModelProto                 # transformed model, weights still initializers
    device_model: onnx.ModelProto          # what the device runs (weights may be inputs)
    inputs: list[Value]                    # stream inputs
    outputs: list[Value]
    weights: list[tuple[Value, bytes]] = field(default_factory=list)   # tensor-data weights
    constant_bytes: int = 0                # initializer bytes compiled into the graph
    peak_activation_bytes: int = 0
    sizes: dict[str, tuple[str, tuple[int, ...], int]] = field(default_factory=dict)
    # fp16: output -> (max, mean) relative error to fp32 on a sample (``_fp16_range``)
    fp16_error: dict[str, tuple[float, float]] = field(default_factory=dict)
    host_tail: onnx.ModelProto | None = None   # non-tensor tail run on the host (``_tail``)


def prepare(model: onnx.ModelProto, label: str, input_shapes: dict[str, list[int]],
            precision: str, weights_as_tensor_data: bool) -> Prepared:
    if precision not in PRECISIONS:
        raise CompileError(f"precision {echo(precision)} is not supported; expected one of "
                           f"{', '.join(PRECISIONS)}")
    model.ir_version = min(model.ir_version or 8, ort_max_ir_version())
    tail = split_tail(model, label)
    _drop_unused_initializers(model, label)
    _refuse_non_tensors(model, label)
    init_names = {t.name for t in model.graph.initializer}
    declared = {vi.name: dims_of(vi) for vi in model.graph.output}
    _fix_input_shapes(model, label, input_shapes, init_names)
    _settle(model, label)
    plan = to_fp16(model, label) if precision == "fp16" else None
    model = _infer(model, label)
    model = _make_loadable(model, label, precision)
    fp16_error = relative_error(model, plan) if plan is not None else {}
    inputs = [value_of(vi, label, "input") for vi in model.graph.input if vi.name not in init_names]
    require_static(inputs, label, "input")
    outputs = resolve_outputs(model, label, declared)
    in_names = {v.name for v in inputs}
    for v in outputs:
        if v.name in in_names:
            raise CompileError(f"model {echo(label, 200)}: output {echo(v.name)} is also a graph input; add an "
                               "Identity node so the output has its own name")
    sizes = _sizes(model)
    prepared = Prepared(label, model, model, inputs, outputs, sizes=sizes, fp16_error=fp16_error)
    if tail is not None:
        prepared.host_tail = finish_tail(tail, {v.name: v.dtype for v in outputs})
    prepared.peak_activation_bytes = _peak_activations(model, sizes)
    device = onnx.ModelProto()
    device.CopyFrom(model)
    if weights_as_tensor_data:
        kept = []
        for t in device.graph.initializer:
            if t.data_type in _FLOATS:
                arr = numpy_helper.to_array(t)
                v = Value(t.name, dtype_of(t.data_type, f"initializer {echo(t.name)}"), tuple(arr.shape))
                prepared.weights.append((v, np.ascontiguousarray(arr).tobytes()))
                device.graph.input.append(onnx.helper.make_tensor_value_info(
                    t.name, t.data_type, list(arr.shape)))
            else:
                kept.append(t)
        del device.graph.initializer[:]
        device.graph.initializer.extend(kept)
        # Old-style models list initializers among the inputs too: keep one entry each.
        seen: set[str] = {t.name for t in kept}
        uniq = []
        for vi in device.graph.input:
            if vi.name not in seen:
                seen.add(vi.name)
                uniq.append(vi)
        del device.graph.input[:]
        device.graph.input.extend(uniq)
    else:
        # Drop initializers from the input list so every graph input is a stream.
        keep = [vi for vi in device.graph.input if vi.name not in init_names]
        del device.graph.input[:]
        device.graph.input.extend(keep)
    prepared.device_model = device
    prepared.constant_bytes = sum(sizes[t.name][2] for t in device.graph.initializer
                                  if t.name in sizes)
    return prepared


def _settle(model: onnx.ModelProto, label: str) -> None:
    """What the model's nodes compute decides (in place): outputs declared otherwise are
    cast to their declared types and lose their declared shapes; small-integer ops the
    opset does not allow are computed wider. Settling a settled model changes nothing."""
    follow_computed(model, label)
    widen_small_ints(model, label)


def to_fp16(model: onnx.ModelProto, label: str,
            keep_op_types: frozenset[str] = frozenset()) -> "Fp16Plan":
    """Convert ``model`` (in place, its input shapes fixed) to fp16 as ``--precision fp16``
    does; the main graph's ops of ``keep_op_types`` stay fp32 between casts (PopRT's
    ``fp16_skip_op_types``). Returns the plan (``relative_error`` compares with it)."""
    # The model is settled first (the Converter converts models prepare() has not
    # seen). Types before conversion tell which values become fp16; ops whose schema
    # has no fp16 are computed in fp32 between casts, and so are the values beyond
    # fp16's range on a sample run (``_fp16_range``).
    _settle(model, label)
    before = _known_types(model, label)
    fp32_ops = fp32_only_ops(model)
    plan = plan_fp16(model, label, before)
    stay = plan.keep_values | fp32_only_inputs(model, fp32_ops)
    skipped = frozenset(n.name for n in model.graph.node
                        if n.op_type in keep_op_types and n.name)
    clamped = convert_to_fp16(model, plan.keep_nodes | skipped, stay)
    after = {k: (TensorProto.FLOAT16 if v == TensorProto.FLOAT and k not in stay
                 else v) for k, v in before.items()}
    for op in sorted(fp32_ops | set(keep_op_types)):
        n = wrap_in_fp32(model, op, after)
        _log.info("model %s: %d %s node(s) computed in fp32 (no fp16 in its schema, or "
                  "kept fp32 on request)", label, n, op)
    wrap_nodes_in_fp32(model, plan.keep_nodes | plan.readers, after)
    clip_outputs(model, plan.outputs)
    _warn_range(label, plan, clamped)
    return plan


def _warn_range(label: str, plan: "Fp16Plan", clamped: list[str]) -> None:
    """One warning naming the values kept in fp32 and the constants clamped."""
    if not plan.keep_values and not clamped:
        return
    parts = []
    if plan.keep_values:
        names = sorted(plan.keep_values)
        parts.append(f"kept in fp32 (beyond fp16's range of +-65504 on a sample run or as "
                     f"initializers): {_names(names)}")
    if plan.outputs:
        parts.append(f"outputs clipped to +-65504 for their fp16 stream: {_names(sorted(plan.outputs))}")
    if clamped:
        parts.append(f"constants clamped to +-65504: {_names(sorted(set(clamped)))}")
    text = f"model {label}: --precision fp16: " + "; ".join(parts)
    _log.info("%s", text)
    warnings.warn(Fp16RangeWarning(text), stacklevel=5)


def _names(names: list[str]) -> str:
    return ", ".join(repr(n) for n in names[:12]) + (f", ... ({len(names)} in all)"
                                                     if len(names) > 12 else "")


def _fix_input_shapes(model: onnx.ModelProto, label: str, shapes: dict[str, list[int]],
                      init_names: set[str]) -> None:
    by_name = {vi.name: vi for vi in model.graph.input if vi.name not in init_names}
    for name, dims in shapes.items():
        vi = by_name.get(name)
        if vi is None:
            raise CompileError(f"model {echo(label, 200)}: --input_shape names {echo(name)}, which is not an "
                               f"input; the inputs are {echo(sorted(by_name), 200)}")
        if any(not isinstance(d, (int, np.integer)) or d < 0 for d in dims):
            raise CompileError(f"model {echo(label, 200)}: --input_shape {echo(name, quote=False)}={echo(dims)} must be "
                               "non-negative integers")
        old = dims_of(vi)
        if old != [None] and len(old) != len(dims):
            raise CompileError(f"model {echo(label, 200)}: --input_shape {echo(name, quote=False)} has {len(dims)} dims "
                               f"{list(dims)} but the input has rank {len(old)} {old}")
        shape = vi.type.tensor_type.shape
        del shape.dim[:]
        for d in dims:
            shape.dim.add().dim_value = int(d)
    if shapes:
        # Stale intermediate shapes would conflict with the new ones: infer afresh.
        del model.graph.value_info[:]
        for vi in model.graph.output:
            if vi.type.tensor_type.HasField("shape"):
                vi.type.tensor_type.ClearField("shape")


def _infer(model: onnx.ModelProto, label: str) -> onnx.ModelProto:
    try:
        return onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True,
                                                 data_prop=True)
    except Exception as exc:
        strict_error = exc
    # onnx's strict mode also fails on its own function bodies (MeanVarianceNormalization
    # expands to a Constant it then calls malformed): if onnxruntime loads the model, the
    # lenient result is used; what stays unknown is resolved from the outputs or refused.
    try:
        inferred = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=False,
                                                     data_prop=True)
        ort_session(inferred)
    except Exception:
        raise CompileError(f"model {echo(label, 200)}: shape inference failed: {echo(str(strict_error), 300, quote=False)}") from None
    _log.info("model %s: strict shape inference failed (%s); using the lenient result",
              label, str(strict_error).splitlines()[0][:200])
    return inferred


def _types(model: onnx.ModelProto) -> dict[str, int]:
    g = model.graph
    out = {vi.name: vi.type.tensor_type.elem_type
           for vi in list(g.input) + list(g.output) + list(g.value_info)
           if vi.type.WhichOneof("value") == "tensor_type"}
    out.update({t.name: t.data_type for t in g.initializer})
    return out


def _known_types(model: onnx.ModelProto, label: str) -> dict[str, int]:
    """Element types of the values (onnx's inference, completed from the op schemas for
    what it does not know: the outputs of com.microsoft ops such as DynamicQuantizeLSTM)."""
    return schema_types(model, _types(_infer(model, label)))


def _make_loadable(model: onnx.ModelProto, label: str, precision: str) -> onnx.ModelProto:
    wrapped: set[str] = set()
    while True:
        try:
            ort_session(model)
            return model
        except Exception as exc:
            op = missing_kernel(exc)
            # a missing fp16 kernel: fp16 requested here, or a model converted to fp16
            # before (poprt.Converter); wrap_in_fp32 wraps only fp16 values
            if op is None or op in wrapped:
                raise CompileError(f"model {echo(label, 200)} cannot run on the IPU emulator "
                                   f"(onnxruntime refused it): {echo(str(exc), 300, quote=False)}") from None
            wrapped.add(op)
            n = wrap_in_fp32(model, op, _types(model))
            _log.info("model %s: %d %s node(s) computed in fp32 between fp16 casts", label, n, op)
            model = _infer(model, label)


def _used_names(graph: onnx.GraphProto, out: set[str]) -> None:
    """Every value name read by a node of ``graph`` or of its sub-graphs (outer scope)."""
    for node in graph.node:
        out.update(n for n in node.input if n)
        for attr in node.attribute:
            if attr.HasField("g"):
                _used_names(attr.g, out)
            for g in attr.graphs:
                _used_names(g, out)
    out.update(vi.name for vi in graph.output)


def _drop_unused_initializers(model: onnx.ModelProto, label: str) -> None:
    """Remove initializers no node reads and no output returns (onnxruntime drops them
    with a warning in-process, but refuses a graph whose inputs were rewritten around
    them: "Graph ctor should have created NodeArg for initializer")."""
    g = model.graph
    used: set[str] = set()
    _used_names(g, used)
    unused = [t.name for t in g.initializer if t.name not in used]
    if not unused:
        return
    gone = set(unused)
    kept = [t for t in g.initializer if t.name not in gone]
    del g.initializer[:]
    g.initializer.extend(kept)
    inputs = [vi for vi in g.input if vi.name not in gone]
    del g.input[:]
    g.input.extend(inputs)
    _log.info("model %s: dropped %d initializer(s) that no node uses: %s", label, len(unused),
              ", ".join(unused[:5]) + (" ..." if len(unused) > 5 else ""))


def check_interface(model: onnx.ModelProto, label: str) -> None:
    """Refuse (CompileError) a model whose inputs or outputs the IPU cannot stream:
    sequences, maps, optionals, sparse or string tensors, element types it lacks."""
    _refuse_non_tensors(model, label)
    inits = {t.name for t in model.graph.initializer}
    for kind, values in (("input", [vi for vi in model.graph.input if vi.name not in inits]),
                         ("output", list(model.graph.output))):
        for vi in values:
            dtype_of(vi.type.tensor_type.elem_type, f"model {echo(label, 200)}: {kind} {echo(vi.name)}")


def _refuse_non_tensors(model: onnx.ModelProto, label: str) -> None:
    """Name the unsupported feature for graph inputs/outputs that are not plain tensors."""
    kinds = {"sequence_type": "a sequence", "map_type": "a map", "optional_type": "an optional",
             "sparse_tensor_type": "a sparse tensor"}
    g = model.graph
    for kind, values in (("input", g.input), ("output", g.output)):
        for vi in values:
            which = vi.type.WhichOneof("value")
            if which in kinds:
                raise CompileError(
                    f"model {echo(label, 200)}: {kind} {echo(vi.name)} is {kinds[which]}; the IPU streams "
                    f"only dense tensors (unsupported: {kinds[which].split(' ', 1)[1]} "
                    f"{kind}s)")
            if which == "tensor_type" and vi.type.tensor_type.elem_type == TensorProto.STRING:
                raise CompileError(
                    f"model {echo(label, 200)}: {kind} {echo(vi.name)} is a string tensor; the IPU has no "
                    "string type (unsupported: string tensors)")
    if g.sparse_initializer:
        raise CompileError(f"model {echo(label, 200)}: sparse initializers are not supported "
                           f"({echo(g.sparse_initializer[0].values.name)}); store them dense")


def _sizes(model: onnx.ModelProto) -> dict[str, tuple[str, tuple[int, ...], int]]:
    """name -> (dtype, shape, bytes) for every statically known tensor."""
    out: dict[str, tuple[str, tuple[int, ...], int]] = {}
    g = model.graph
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        if vi.type.WhichOneof("value") != "tensor_type":
            continue
        dtype = _maybe_dtype(vi.type.tensor_type.elem_type)
        dims = dims_of(vi)
        if dtype is None or dims == [None] or not all(isinstance(d, int) for d in dims):
            continue
        shape = tuple(int(d) for d in dims)  # type: ignore[arg-type]
        out[vi.name] = (dtype, shape, int(np.prod(shape, dtype=np.int64)) *
                        numpy_dtype(dtype).itemsize)
    for t in g.initializer:
        dtype = _maybe_dtype(t.data_type)
        if dtype is not None:
            shape = tuple(int(d) for d in t.dims)
            out[t.name] = (dtype, shape, int(np.prod(shape, dtype=np.int64)) *
                           numpy_dtype(dtype).itemsize)
    return out


def _maybe_dtype(elem: int) -> str | None:
    from ipu_emulator.compiler._onnx import ONNX_TO_DTYPE
    return ONNX_TO_DTYPE.get(elem)


def _peak_activations(model: onnx.ModelProto, sizes: dict[str, tuple[str, tuple[int, ...], int]]
                      ) -> int:
    """Peak bytes of live intermediate tensors, walking the nodes in order."""
    g = model.graph
    external = {vi.name for vi in g.input} | {vi.name for vi in g.output} | \
        {t.name for t in g.initializer}
    last_use: dict[str, int] = {}
    for k, node in enumerate(g.node):
        for name in node.input:
            last_use[name] = k
    live = peak = 0
    for k, node in enumerate(g.node):
        for name in node.output:
            if name and name not in external and name in sizes:
                live += sizes[name][2]
        peak = max(peak, live)
        for name in set(node.input):
            if name and name not in external and last_use.get(name) == k and name in sizes:
                live -= sizes[name][2]
        for name in node.output:   # produced but never used
            if name and name not in external and name not in last_use and name in sizes:
                live -= sizes[name][2]
    return peak
