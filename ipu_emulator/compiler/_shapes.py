"""Static shapes of a model's values: the graph outputs the IPU streams, and the
intermediates the memory estimate counts.

Shapes come, in order, from onnx's shape inference (``_prepare``), the shapes the model
declares for outputs onnx leaves unknown, onnxruntime's symbolic shape inference (run
in memory: nothing is written to the working directory, partial results kept), the
shapes of sequences at constant positions, and last from onnxruntime itself: the model
runs at the fixed input shapes on two data sets (zeros, and a non-zero pattern) with its
unresolved intermediates as extra outputs. A shape both runs agree on is the shape; one
that differs between them depends on the input data and is refused by name.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ipu_emulator.compiler._onnx import dtype_of, ort_session
from ipu_emulator.errors import CompileError
from ipu_emulator.executable import numpy_dtype
from shm.errors import echo

_log = logging.getLogger(__name__)

__all__ = ["Value", "dims_of", "value_of", "require_static", "resolve_outputs", "set_dims",
           "static", "symbolic_infer", "measure"]


@dataclass
class Value:
    """A typed, statically shaped tensor of the graph interface."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * numpy_dtype(self.dtype).itemsize


def dims_of(vi: onnx.ValueInfoProto) -> list[int | str | None]:
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


def value_of(vi: onnx.ValueInfoProto, label: str, kind: str) -> Value:
    if vi.type.WhichOneof("value") != "tensor_type":
        raise CompileError(f"model {echo(label, 200)}: {kind} {echo(vi.name)} is not a tensor")
    dtype = dtype_of(vi.type.tensor_type.elem_type, f"model {echo(label, 200)}: {kind} {echo(vi.name)}")
    dims = dims_of(vi)
    return Value(vi.name, dtype, tuple(d if isinstance(d, int) else -1 for d in dims)
                 if dims != [None] else (-2,))


def require_static(values: list[Value], label: str, kind: str) -> None:
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


def resolve_outputs(model: onnx.ModelProto, label: str,
                    declared: dict[str, list[int | str | None]] | None = None) -> list[Value]:
    """The graph outputs with static shapes (written into ``model``'s graph outputs), or a
    CompileError naming the output that has none or whose shape depends on the data."""
    outputs = [value_of(vi, label, "output") for vi in model.graph.output]
    for k, v in enumerate(outputs):
        # Shape inference cannot see through a shape given as an input (Expand(X, shape)):
        # the shapes the model declares for its outputs then say what the stream carries.
        dims = (declared or {}).get(v.name)
        if not static(v.shape) and dims and dims != [None] and \
                all(isinstance(d, int) for d in dims):
            if v.shape != (-2,) and len(v.shape) != len(dims):
                continue
            _log.info("model %s: output %r takes its declared shape %s (not inferable)",
                      label, v.name, dims)
            outputs[k] = Value(v.name, v.dtype, tuple(int(d) for d in dims))  # type: ignore[arg-type]
            set_dims(model.graph.output[k], outputs[k].shape)
    unresolved = [v for v in outputs if not static(v.shape)]
    if not unresolved:
        return outputs
    # onnx could not infer them (sub-graphs of If/Loop/Scan, shapes computed from shapes,
    # ops it does not know): onnxruntime's symbolic shape inference follows most; what it
    # leaves open, onnxruntime measures at the fixed input shapes.
    found = _symbolic_outputs(model, label, unresolved)
    open_ = [v.name for v in unresolved if not _fits(v, found.get(v.name))]
    got = measure(model, label, open_) if open_ else Measured()
    for k, v in enumerate(outputs):
        if v not in unresolved:
            continue
        dims = found.get(v.name)
        if _fits(v, dims):
            how = "symbolic shape inference"
        elif v.name in got.varying:
            runs = " and ".join(str(list(s)) for s in got.varying[v.name])
            _refuse_data_dependent(label, v.name, _shown(dims) + f"onnxruntime gives {runs} "
                                   "on inputs of the same shapes (samples, each branch of "
                                   "an If)")
        elif v.name in got.shapes and (got.runs > 1 or not _symbolic_names(dims)) and \
                (v.shape == (-2,) or len(got.shapes[v.name]) == len(v.shape)):
            culprit = _data_dependent_source(model, v.name)
            if culprit:
                _refuse_data_dependent(label, v.name, _shown(dims) + f"it is computed from "
                                       f"{culprit}, whose output size depends on values")
            dims, how = list(got.shapes[v.name]), "onnxruntime at the fixed input shapes"
        elif _symbolic_names(dims):
            _refuse_data_dependent(label, v.name, _shown(dims).rstrip("; "))
        else:
            raise CompileError(
                f"model {echo(label, 200)}: cannot determine the shape of output {echo(v.name)}: "
                "neither shape inference (onnx's, onnxruntime's symbolic) resolves it nor does "
                f"onnxruntime run the model at the fixed input shapes ({echo(got.error, 300, quote=False)}); "
                "fix the dynamic dims of the inputs with --input_shape NAME=d0,d1,... or "
                "declare the output's shape in the model (graph.output)")
        outputs[k] = Value(v.name, v.dtype, tuple(int(d) for d in dims))  # type: ignore[union-attr, arg-type]
        _log.info("model %s: output %r has shape %s by %s", label, v.name,
                  list(outputs[k].shape), how)
        set_dims(model.graph.output[k], outputs[k].shape)
    _fill_value_info(model, got.shapes)
    require_static(outputs, label, "output")
    return outputs


def _fits(v: Value, dims: list[int | str | None] | None) -> bool:
    return dims is not None and dims != [None] and all(isinstance(d, int) for d in dims) and \
        (v.shape == (-2,) or len(dims) == len(v.shape))


def _symbolic_names(dims: list[int | str | None] | None) -> list[str]:
    return [d for d in dims or [] if isinstance(d, str)]


def _shown(dims: list[int | str | None] | None) -> str:
    """``[2, '?'], ['NonZero_o0__d1'] computed from values, not shapes; `` (or "")."""
    names = _symbolic_names(dims)
    if not names:
        return ""
    assert dims is not None
    shown = ["?" if not isinstance(d, int) else d for d in dims]
    return f"{shown}, {echo(names, 120, quote=False)} computed from values, not shapes; "


def _refuse_data_dependent(label: str, name: str, shown: str) -> None:
    raise CompileError(
        f"model {echo(label, 200)}: output {echo(name)} has a shape that depends on "
        f"the input data ({shown}); the IPU needs static shapes: --input_shape "
        "fixes only shapes that follow from the inputs' shapes, so declare the "
        "output's static shape in the model (graph.output) if the data always gives "
        "it (unsupported: output shapes that depend on input data)")


# ops whose output size depends on the values of their inputs, not only on their shapes
_DATA_DEPENDENT_OPS = {"NonZero", "Unique", "Compress", "NonMaxSuppression", "StringSplit",
                       "RegexFullMatch"}


def _data_dependent_source(model: onnx.ModelProto, name: str) -> str:
    """The first node of ``_DATA_DEPENDENT_OPS`` that ``name`` is computed from, as
    "NonZero 'node name'" ("" if none): two sample runs may agree by chance."""
    producer = {o: node for node in model.graph.node for o in node.output if o}
    seen: set[str] = set()
    stack = [name]
    while stack:
        value = stack.pop()
        node = producer.get(value)
        if node is None or value in seen:
            continue
        seen.add(value)
        if node.op_type in _DATA_DEPENDENT_OPS:
            return f"{node.op_type} {echo(node.name or node.output[0])}"
        stack.extend(i for i in node.input if i)
    return ""


def _fill_value_info(model: onnx.ModelProto, shapes: dict[str, tuple[int, ...]]) -> None:
    """Measured shapes of intermediates (for the memory estimate)."""
    if not shapes:
        return
    outs = {vi.name for vi in model.graph.output}
    for vi in model.graph.value_info:
        if vi.name in shapes and vi.name not in outs and \
                vi.type.WhichOneof("value") == "tensor_type":
            set_dims(vi, shapes[vi.name])


@dataclass
class Measured:
    """What onnxruntime's runs at the fixed input shapes showed."""

    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)   # the same every run
    varying: dict[str, list[tuple[int, ...]]] = field(default_factory=dict)
    runs: int = 0
    error: str = "not run"


def _feeds(model: onnx.ModelProto) -> list[dict[str, np.ndarray]]:
    """Zeros, and a pattern of non-zero distinct floats / alternating 1, 0 integers."""
    inits = {t.name for t in model.graph.initializer}
    zeros: dict[str, np.ndarray] = {}
    pattern: dict[str, np.ndarray] = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        dims = dims_of(vi)
        if dims == [None] or not all(isinstance(d, int) for d in dims):
            raise ValueError(f"input {vi.name!r} has no static shape")
        shape = tuple(int(d) for d in dims)  # type: ignore[arg-type]
        dt = numpy_dtype(dtype_of(vi.type.tensor_type.elem_type, f"input {echo(vi.name)}"))
        n = int(np.prod(shape, dtype=np.int64))
        zeros[vi.name] = np.zeros(shape, dt)
        if np.issubdtype(dt, np.floating):
            pattern[vi.name] = np.linspace(0.25, 1.0, n).reshape(shape).astype(dt)
        else:
            pattern[vi.name] = ((np.arange(n) + 1) % 2).reshape(shape).astype(dt)
    return [zeros, pattern]


def measure(model: onnx.ModelProto, label: str, wanted: list[str]) -> Measured:
    """Run ``model`` with onnxruntime at its (static) input shapes on two data sets and
    read the shapes of the outputs ``wanted`` and of every intermediate whose shape is not
    static in ``model.graph.value_info``."""
    got = Measured()
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    g = probe.graph
    names = {vi.name for vi in g.output}
    for vi in g.value_info:
        dims = dims_of(vi)
        if vi.type.WhichOneof("value") == "tensor_type" and vi.type.tensor_type.elem_type and \
                vi.name not in names and (dims == [None] or
                                          not all(isinstance(d, int) for d in dims)):
            g.output.append(helper.make_tensor_value_info(vi.name, vi.type.tensor_type.elem_type,
                                                          None))
            names.add(vi.name)
    try:
        runs = _feeds(probe)
        sess = ort_session(probe)
        outs = [o.name for o in sess.get_outputs()]   # type: ignore[attr-defined]
    except Exception as exc:
        got.error = _first_line(exc)
        return got
    seen: dict[str, list[tuple[int, ...]]] = {}
    for feeds in runs:
        if _run_into(sess, outs, feeds, seen, got):
            got.runs += 1
    # an If on an input's value may take a branch neither sample takes: each branch too
    for forced in _branch_probes(probe):
        try:
            _run_into(ort_session(forced), outs, runs[0], seen, got)
        except Exception as exc:   # a branch that cannot run on zeros: the samples decide
            _log.info("model %s: forcing the If branches: %s", label, _first_line(exc))
    for name, shapes in seen.items():
        if len(set(shapes)) == 1:
            got.shapes[name] = shapes[0]
        else:
            got.varying[name] = list(dict.fromkeys(shapes))
    _log.info("model %s: onnxruntime at the fixed input shapes (%d run(s)) measured %d "
              "shape(s) for %s", label, got.runs, len(got.shapes), ", ".join(wanted))
    return got


def _run_into(sess: object, outs: list[str], feeds: dict[str, np.ndarray],
              seen: dict[str, list[tuple[int, ...]]], got: Measured) -> bool:
    """One run: the shapes of its array outputs appended to ``seen`` (False: it failed)."""
    try:
        values = sess.run(outs, feeds)   # type: ignore[attr-defined]
    except Exception as exc:
        got.error = _first_line(exc)
        return False
    for name, value in zip(outs, values):
        if isinstance(value, np.ndarray):
            seen.setdefault(name, []).append(tuple(int(d) for d in value.shape))
    return True


def _branch_probes(probe: onnx.ModelProto) -> Iterator[onnx.ModelProto]:
    """``probe`` (changed in place, no copy of its weights) with its main-graph ``If``
    nodes on computed conditions all taking their then branch, then all their else
    branch; nothing when there are none."""
    g = probe.graph
    consts = {t.name for t in g.initializer} | {o for n in g.node if n.op_type == "Constant"
                                                for o in n.output}
    ifs = [n for n in g.node if n.op_type == "If" and n.input[0] not in consts]
    if not ifs:
        return
    conds = [n.input[0] for n in ifs]
    for value in (True, False):
        name = f"__measure_if_{str(value).lower()}"
        g.initializer.append(numpy_helper.from_array(np.array(value), name))
        for n in ifs:
            n.input[0] = name
        try:
            yield probe
        finally:
            for n, cond in zip(ifs, conds):
                n.input[0] = cond
            del g.initializer[-1]


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def symbolic_infer(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """onnxruntime's SymbolicShapeInference (auto_merge) of ``model``, in memory.

    Its ``infer_shapes`` saves an incomplete result as ``sym_shape_infer_temp.onnx`` (and
    external data) in the working directory and raises; here the same steps run without
    that, and an incomplete result is returned as it is (its unresolved values left open).
    """
    from onnxruntime.tools import symbolic_shape_infer as ssi

    cls = ssi.SymbolicShapeInference
    steps = ("_preprocess", "_infer_impl", "_update_output_from_vi")
    if not all(hasattr(cls, s) for s in steps):   # another onnxruntime: measure instead
        return None
    opset = ssi.get_opset(model)
    if not opset or opset < 7:
        return None
    engine = cls(2**31 - 1, True, False, 0)
    engine._preprocess(model)
    for _ in range(64):   # it reruns after merging symbols; bounded
        if not engine.run_:
            break
        engine._infer_impl()
    engine._update_output_from_vi()
    out: onnx.ModelProto = engine.out_mp_
    return out


def _symbolic_outputs(model: onnx.ModelProto, label: str, wanted: list[Value]
                      ) -> dict[str, list[int | str | None]]:
    """The graph outputs' dims by onnxruntime's SymbolicShapeInference (``{}`` if it fails)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    _give_loops_a_condition(m.graph, m.graph)
    sym_log = logging.getLogger("onnxruntime.tools.symbolic_shape_infer")
    level = sym_log.level
    sym_log.setLevel(logging.CRITICAL)   # it logs what it cannot infer: we say it ourselves
    try:
        inferred = symbolic_infer(m)
    except Exception as exc:
        _log.info("model %s: symbolic shape inference failed for %s: %s", label,
                  ", ".join(v.name for v in wanted), str(exc).splitlines()[0][:200] if str(exc) else
                  type(exc).__name__)
        return {}
    finally:
        sym_log.setLevel(level)
    if inferred is None:
        return {}
    found = {vi.name: dims_of(vi) for vi in inferred.graph.output}
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
        dims = dims_of(vi)
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


def static(shape: tuple[int, ...]) -> bool:
    return shape != (-2,) and all(d >= 0 for d in shape)


def set_dims(vi: onnx.ValueInfoProto, shape: tuple[int, ...]) -> None:
    vi.type.tensor_type.ClearField("shape")
    tshape = vi.type.tensor_type.shape      # present even for a scalar (no dims)
    tshape.SetInParent()
    for d in shape:
        tshape.dim.add().dim_value = int(d)

