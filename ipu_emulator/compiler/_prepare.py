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
from ipu_emulator.compiler._fp16_range import Fp16Plan, clip_outputs, plan_fp16, relative_error
from ipu_emulator.compiler._precision import (
    Fp16RangeWarning, convert_to_fp16, fp32_only_ops, wrap_in_fp32, wrap_nodes_in_fp32)
from ipu_emulator.errors import CompileError
from ipu_emulator.executable import numpy_dtype
from shm.errors import echo

_log = logging.getLogger(__name__)

_FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE)
PRECISIONS = ("fp32", "fp16")


@dataclass
class Value:
    """A typed, statically shaped tensor of the graph interface."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * numpy_dtype(self.dtype).itemsize


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


def prepare(model: onnx.ModelProto, label: str, input_shapes: dict[str, list[int]],
            precision: str, weights_as_tensor_data: bool) -> Prepared:
    if precision not in PRECISIONS:
        raise CompileError(f"precision {echo(precision)} is not supported; expected one of "
                           f"{', '.join(PRECISIONS)}")
    model.ir_version = min(model.ir_version or 8, ort_max_ir_version())
    _drop_unused_initializers(model, label)
    _refuse_non_tensors(model, label)
    init_names = {t.name for t in model.graph.initializer}
    declared = {vi.name: _dims(vi) for vi in model.graph.output}
    _fix_input_shapes(model, label, input_shapes, init_names)
    plan = to_fp16(model, label) if precision == "fp16" else None
    model = _infer(model, label)
    model = _make_loadable(model, label, precision)
    fp16_error = relative_error(model, plan) if plan is not None else {}
    inputs = [_value(vi, label, "input") for vi in model.graph.input if vi.name not in init_names]
    _require_static(inputs, label, "input")
    outputs = _outputs(model, label, inputs, declared)
    in_names = {v.name for v in inputs}
    for v in outputs:
        if v.name in in_names:
            raise CompileError(f"model {echo(label, 200)}: output {echo(v.name)} is also a graph input; add an "
                               "Identity node so the output has its own name")
    sizes = _sizes(model)
    prepared = Prepared(label, model, model, inputs, outputs, sizes=sizes, fp16_error=fp16_error)
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


def to_fp16(model: onnx.ModelProto, label: str,
            keep_op_types: frozenset[str] = frozenset()) -> "Fp16Plan":
    """Convert ``model`` (in place, its input shapes fixed) to fp16 as ``--precision fp16``
    does; the main graph's ops of ``keep_op_types`` stay fp32 between casts (PopRT's
    ``fp16_skip_op_types``). Returns the plan (``relative_error`` compares with it)."""
    # Types before conversion tell which values become fp16; ops whose schema
    # has no fp16 are computed in fp32 between casts, and so are the values beyond
    # fp16's range on a sample run (``_fp16_range``).
    before = _types(_infer(model, label))
    fp32_ops = fp32_only_ops(model)
    plan = plan_fp16(model, label, before)
    skipped = frozenset(n.name for n in model.graph.node
                        if n.op_type in keep_op_types and n.name)
    clamped = convert_to_fp16(model, plan.keep_nodes | skipped, plan.keep_values)
    after = {k: (TensorProto.FLOAT16 if v == TensorProto.FLOAT and k not in plan.keep_values
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
    warnings.warn(Fp16RangeWarning(text), stacklevel=4)


def _names(names: list[str]) -> str:
    return ", ".join(repr(n) for n in names[:12]) + (f", ... ({len(names)} in all)"
                                                     if len(names) > 12 else "")


def _dims(vi: onnx.ValueInfoProto) -> list[int | str | None]:
    tt = vi.type.tensor_type
    if not tt.HasField("shape"):
        return [None]
    out: list[int | str | None] = []
    for d in tt.shape.dim:
        if d.HasField("dim_value") and d.dim_value >= 0:
            out.append(int(d.dim_value))
        elif d.HasField("dim_param"):
            out.append(d.dim_param)
        else:
            out.append(None)
    return out


def _value(vi: onnx.ValueInfoProto, label: str, kind: str) -> Value:
    if vi.type.WhichOneof("value") != "tensor_type":
        raise CompileError(f"model {echo(label, 200)}: {kind} {echo(vi.name)} is not a tensor")
    dtype = dtype_of(vi.type.tensor_type.elem_type, f"model {echo(label, 200)}: {kind} {echo(vi.name)}")
    dims = _dims(vi)
    return Value(vi.name, dtype, tuple(d if isinstance(d, int) else -1 for d in dims)
                 if dims != [None] else (-2,))


def _require_static(values: list[Value], label: str, kind: str) -> None:
    for v in values:
        if v.shape == (-2,) or any(d < 0 for d in v.shape):
            shown = "unknown rank" if v.shape == (-2,) else str(
                ["?" if d < 0 else d for d in v.shape])
            raise CompileError(
                f"model {echo(label, 200)}: {kind} {echo(v.name)} has an unresolved dynamic shape ({shown}); "
                f"fix it with --input_shape NAME=d0,d1,... (for example --input_shape "
                f"{v.name}=1,...)" if kind == "input" else
                f"model {echo(label, 200)}: {kind} {echo(v.name)} has an unresolved shape ({shown}) after "
                "shape inference; fix the inputs' dynamic dims with --input_shape")


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
        old = _dims(vi)
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


def _outputs(model: onnx.ModelProto, label: str, inputs: list[Value],
             declared: dict[str, list[int | str | None]] | None = None) -> list[Value]:
    outputs = [_value(vi, label, "output") for vi in model.graph.output]
    for k, v in enumerate(outputs):
        # Shape inference cannot see through a shape given as an input (Expand(X, shape)):
        # the shapes the model declares for its outputs then say what the stream carries.
        dims = (declared or {}).get(v.name)
        if not _static(v.shape) and dims and dims != [None] and \
                all(isinstance(d, int) for d in dims):
            if v.shape != (-2,) and len(v.shape) != len(dims):
                continue
            _log.info("model %s: output %r takes its declared shape %s (not inferable)",
                      label, v.name, dims)
            outputs[k] = Value(v.name, v.dtype, tuple(int(d) for d in dims))  # type: ignore[arg-type]
            _set_dims(model.graph.output[k], outputs[k].shape)
    unresolved = [v for v in outputs if not _static(v.shape)]
    if unresolved:
        # onnx could not infer them (sub-graphs of If/Loop/Scan, shapes computed from
        # shapes): onnxruntime's symbolic shape inference follows both. With every input
        # static, a dim it leaves symbolic is decided by the input data.
        found = _symbolic_outputs(model, label, unresolved)
        for k, v in enumerate(outputs):
            if v not in unresolved:
                continue
            dims = found.get(v.name)
            if dims is None or dims == [None] or (v.shape != (-2,) and len(dims) != len(v.shape)):
                raise CompileError(
                    f"model {echo(label, 200)}: cannot determine the shape of output {echo(v.name)}: "
                    "neither onnx's nor onnxruntime's symbolic shape inference resolves it; "
                    "fix the dynamic dims of the inputs with --input_shape NAME=d0,d1,... or "
                    "declare the output's shape in the model (graph.output)")
            if not all(isinstance(d, int) for d in dims):
                shown = ["?" if not isinstance(d, int) else d for d in dims]
                raise CompileError(
                    f"model {echo(label, 200)}: output {echo(v.name)} has a shape that depends on "
                    f"the input data ({shown}, {echo([d for d in dims if not isinstance(d, int)], 120, quote=False)} "
                    "computed from values, not shapes); the IPU needs static shapes: --input_shape "
                    "fixes only shapes that follow from the inputs' shapes, so declare the "
                    "output's static shape in the model (graph.output) if the data always gives "
                    "it (unsupported: output shapes that depend on input data)")
            outputs[k] = Value(v.name, v.dtype, tuple(int(d) for d in dims))  # type: ignore[arg-type]
            _log.info("model %s: output %r has shape %s by symbolic shape inference",
                      label, v.name, list(outputs[k].shape))
            _set_dims(model.graph.output[k], outputs[k].shape)
    _require_static(outputs, label, "output")
    return outputs


def _symbolic_outputs(model: onnx.ModelProto, label: str, wanted: list[Value]
                      ) -> dict[str, list[int | str | None]]:
    """The graph outputs' dims by onnxruntime's SymbolicShapeInference (``{}`` if it fails)."""
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    m = onnx.ModelProto()
    m.CopyFrom(model)
    _give_loops_a_condition(m.graph, m.graph)
    sym_log = logging.getLogger("onnxruntime.tools.symbolic_shape_infer")
    level = sym_log.level
    sym_log.setLevel(logging.CRITICAL)   # it logs what it cannot infer: we say it ourselves
    try:
        inferred = SymbolicShapeInference.infer_shapes(m, auto_merge=True)
    except Exception as exc:
        _log.info("model %s: symbolic shape inference failed for %s: %s", label,
                  ", ".join(v.name for v in wanted), str(exc).splitlines()[0][:200] if str(exc) else
                  type(exc).__name__)
        return {}
    finally:
        sym_log.setLevel(level)
    if inferred is None:
        return {}
    found = {vi.name: _dims(vi) for vi in inferred.graph.output}
    if any(not all(isinstance(d, int) for d in dims) for dims in found.values()):
        found.update(_sequence_shapes(inferred))
    return found


def _sequence_shapes(model: onnx.ModelProto) -> dict[str, list[int | str | None]]:
    """Static shapes SymbolicShapeInference leaves symbolic though they follow from shapes
    and constants: sequences of known tensors at constant positions (SequenceAt,
    ConcatFromSequence), and ``Unique`` of a single element."""
    g = model.graph
    shapes: dict[str, tuple[int, ...]] = {}
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        dims = _dims(vi)
        if vi.type.WhichOneof("value") == "tensor_type" and dims != [None] and \
                all(isinstance(d, int) for d in dims):
            shapes[vi.name] = tuple(int(d) for d in dims)  # type: ignore[arg-type]
    consts = {t.name: numpy_helper.to_array(t) for t in g.initializer}
    shapes.update({k: tuple(v.shape) for k, v in consts.items()})
    seqs: dict[str, list[tuple[int, ...]]] = {}

    def const_int(name: str) -> int | None:
        v = consts.get(name)
        return int(v.reshape(-1)[0]) if v is not None and v.size == 1 and \
            np.issubdtype(v.dtype, np.integer) else None

    def attr(node: onnx.NodeProto, key: str, default: int) -> int:
        return next((int(a.i) for a in node.attribute if a.name == key), default)

    for node in g.node:
        ins, outs, op = list(node.input), list(node.output), node.op_type
        try:
            if op == "SequenceEmpty":
                seqs[outs[0]] = []
            elif op == "SequenceConstruct":
                seqs[outs[0]] = [shapes[i] for i in ins]
            elif op == "SequenceInsert":
                new = list(seqs[ins[0]])
                pos = const_int(ins[2]) if len(ins) > 2 and ins[2] else len(new)
                if pos is None:
                    continue
                new.insert(pos if pos >= 0 else pos + len(new), shapes[ins[1]])
                seqs[outs[0]] = new
            elif op == "SequenceErase":
                new = list(seqs[ins[0]])
                pos = const_int(ins[1]) if len(ins) > 1 and ins[1] else -1
                if pos is None:
                    continue
                del new[pos]
                seqs[outs[0]] = new
            elif op == "SequenceAt":
                pos = const_int(ins[1])
                if pos is not None:
                    shapes[outs[0]] = seqs[ins[0]][pos]
            elif op == "ConcatFromSequence":
                items = seqs[ins[0]]
                axis, new_axis = attr(node, "axis", 0), attr(node, "new_axis", 0)
                if not items or any(len(x) != len(items[0]) for x in items):
                    continue
                rank = len(items[0]) + (1 if new_axis else 0)
                ax = axis + rank if axis < 0 else axis
                if new_axis:
                    shapes[outs[0]] = items[0][:ax] + (len(items),) + items[0][ax:]
                else:
                    shapes[outs[0]] = items[0][:ax] + (sum(x[ax] for x in items),) + \
                        items[0][ax + 1:]
            elif op == "Unique":
                x = shapes[ins[0]]
                u_axis = next((int(a.i) for a in node.attribute if a.name == "axis"), None)
                if u_axis is None and int(np.prod(x)) == 1:
                    got: list[tuple[int, ...]] = [(1,)] * 4
                elif u_axis is not None and x[u_axis if u_axis >= 0 else u_axis + len(x)] == 1:
                    got = [x, (1,), (1,), (1,)]
                else:
                    continue
                for name, shape in zip(outs, got):
                    if name:
                        shapes[name] = shape
            elif op == "Identity" and ins[0] in seqs:
                seqs[outs[0]] = seqs[ins[0]]
        except (KeyError, IndexError):
            continue
    return {vi.name: list(shapes[vi.name]) for vi in g.output if vi.name in shapes}


def _give_loops_a_condition(graph: onnx.GraphProto, main: onnx.GraphProto) -> None:
    """SymbolicShapeInference needs every Loop's optional condition input: give the ones
    without it a constant true (what an absent condition means)."""
    for node in graph.node:
        if node.op_type == "Loop" and len(node.input) > 1 and not node.input[1]:
            name = "__symbolic_shapes_true"
            if not any(t.name == name for t in main.initializer):
                main.initializer.append(numpy_helper.from_array(np.array(True), name))
            node.input[1] = name
        for attr in node.attribute:
            if attr.HasField("g"):
                _give_loops_a_condition(attr.g, main)
            for g in attr.graphs:
                _give_loops_a_condition(g, main)


def _static(shape: tuple[int, ...]) -> bool:
    return shape != (-2,) and all(d >= 0 for d in shape)


def _set_dims(vi: onnx.ValueInfoProto, shape: tuple[int, ...]) -> None:
    vi.type.tensor_type.ClearField("shape")
    tshape = vi.type.tensor_type.shape      # present even for a scalar (no dims)
    tshape.SetInParent()
    for d in shape:
        tshape.dim.add().dim_value = int(d)


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
        dims = _dims(vi)
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
