"""fp16 without invented inf/NaN: which values to keep in fp32, and the distance to fp32.

``plan_fp16`` runs the fp32 model once on a sample of inputs (normal floats, zero
integers, false booleans) with every float value of the main graph exposed, and
finds the values whose magnitude exceeds fp16's largest finite value (65504) and
the float32 initializers beyond it. Those values stay fp32: the nodes producing them
run in fp32 and keep fp32 outputs, the nodes reading them run in fp32 and cast their
outputs back to fp16 (``wrap_nodes_in_fp32``); a graph output among them is clipped
to +-65504 before its fp16 cast. Constants elsewhere (sub-graphs, or when the sample
run fails, and what If/Loop/Scan nodes compute) are clamped to +-65504
(``convert_to_fp16``).

``relative_error`` compares the converted model's outputs on the same sample with the
fp32 ones: ``|fp16 - fp32| / max(|fp32|, 1e-3 * max|fp32|)`` per element, its maximum
and mean over every float output (what ``poprt`` prints).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ipu_emulator.compiler._onnx import ort_session
from ipu_emulator.compiler._precision import FP16_MAX
from ipu_emulator.executable import numpy_dtype

_log = logging.getLogger(__name__)

__all__ = ["Fp16Plan", "plan_fp16", "clip_outputs", "relative_error"]

_F32, _F16 = TensorProto.FLOAT, TensorProto.FLOAT16


@dataclass
class Fp16Plan:
    feeds: dict[str, np.ndarray] = field(default_factory=dict)   # the sample (fp32 inputs)
    reference: dict[str, np.ndarray] = field(default_factory=dict)   # fp32 outputs on it
    keep_nodes: frozenset[str] = frozenset()      # run in fp32, fp32 outputs
    readers: frozenset[str] = frozenset()         # run in fp32, outputs cast to fp16
    keep_values: frozenset[str] = frozenset()     # values (and initializers) kept fp32
    outputs: frozenset[str] = frozenset()         # graph outputs to clip before the cast
    sampled: bool = False                          # the sample run succeeded


def sample_feeds(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    """Normal floats, zero integers, false booleans for the (static) graph inputs."""
    from ipu_emulator.compiler._onnx import dtype_of

    inits = {t.name for t in model.graph.initializer}
    rng = np.random.default_rng(0)
    feeds = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        shape = tuple(int(d.dim_value) for d in tt.shape.dim)
        dt = numpy_dtype(dtype_of(tt.elem_type, vi.name))
        if np.issubdtype(dt, np.floating):
            feeds[vi.name] = rng.standard_normal(shape).astype(dt)
        else:
            feeds[vi.name] = np.zeros(shape, dt)
    return feeds


def plan_fp16(model: onnx.ModelProto, label: str, types: dict[str, int]) -> Fp16Plan:
    """What stays fp32 in ``model`` (fp32, inputs static, ``types`` from shape inference).
    Names the main graph's unnamed nodes (the plan refers to nodes by name)."""
    g = model.graph
    for k, node in enumerate(g.node):
        if not node.name:
            node.name = f"{node.op_type}_{k}__fp16"
    plan = Fp16Plan()
    outer: set[str] = set()
    for node in g.node:
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                _outer_names(sub, outer)
    big_inits = {t.name for t in g.initializer if t.data_type == _F32 and
                 _beyond(numpy_helper.to_array(t))} - outer
    over: set[str] = set(big_inits)
    try:
        plan.feeds = sample_feeds(model)
        probe = onnx.ModelProto()
        probe.CopyFrom(model)
        declared = {vi.name for vi in probe.graph.output}
        for node in probe.graph.node:
            for name in node.output:
                if name and name not in declared and types.get(name) == _F32:
                    probe.graph.output.append(helper.make_tensor_value_info(name, _F32, None))
                    declared.add(name)
        sess = ort_session(probe)
        names = [o.name for o in sess.get_outputs()]   # type: ignore[attr-defined]
        values = dict(zip(names, sess.run(names, plan.feeds)))   # type: ignore[attr-defined]
        plan.reference = {vi.name: values[vi.name] for vi in g.output}
        plan.sampled = True
        over |= {n for n, v in values.items()
                 if isinstance(v, np.ndarray) and v.dtype == np.float32 and _beyond(v)} - outer
    except Exception as exc:
        _log.info("model %s: fp16 range check: the fp32 sample run failed (%s); constants "
                  "beyond fp16's range are kept fp32, activations are not checked", label,
                  str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)
    producers = {name: node.name for node in g.node for name in node.output if name}
    # a node with sub-graphs computes in fp16 inside them (their constants are clamped):
    # what it produces cannot stay fp32
    with_graphs = {node.name for node in g.node
                   if any(a.HasField("g") or len(a.graphs) for a in node.attribute)}
    over = {n for n in over if producers.get(n) not in with_graphs}
    plan.keep_nodes = frozenset(producers[n] for n in over if n in producers)
    plan.readers = frozenset(node.name for node in g.node
                             if node.name not in plan.keep_nodes and
                             any(i in over for i in node.input))
    plan.outputs = frozenset(vi.name for vi in g.output if vi.name in over)
    plan.keep_values = frozenset(over)
    return plan


def clip_outputs(model: onnx.ModelProto, names: frozenset[str]) -> None:
    """Graph outputs ``names`` (fp32 values of an fp16 model): computed as
    ``<name>__fp32``, clipped to +-65504 and cast to fp16 under their own name."""
    if not names:
        return
    g = model.graph
    lo, hi = "__fp16_min", "__fp16_max"
    g.initializer.extend([numpy_helper.from_array(np.array(-FP16_MAX, np.float32), lo),
                          numpy_helper.from_array(np.array(FP16_MAX, np.float32), hi)])
    added = []
    for name in sorted(names):
        inner = f"{name}__fp32"
        for node in g.node:
            node.input[:] = [inner if i == name else i for i in node.input]
            node.output[:] = [inner if o == name else o for o in node.output]
        added += [helper.make_node("Clip", [inner, lo, hi], [f"{name}__clipped"],
                                   name=f"{name}__clip"),
                  helper.make_node("Cast", [f"{name}__clipped"], [name], to=_F16,
                                   name=f"{name}__fp16")]
    g.node.extend(added)
    for vi in g.output:
        if vi.name in names:
            vi.type.tensor_type.elem_type = _F16


def relative_error(model: onnx.ModelProto, plan: Fp16Plan) -> dict[str, tuple[float, float]]:
    """Per float output: (max, mean) relative error of ``model`` (converted) to the fp32
    outputs on the plan's sample; ``{}`` when there is no sample."""
    if not plan.sampled:
        return {}
    in_types = {vi.name: vi.type.tensor_type.elem_type for vi in model.graph.input}
    feeds = {k: (v.astype(np.float16) if in_types.get(k) == _F16 else v)
             for k, v in plan.feeds.items()}
    try:
        sess = ort_session(model)
        names = [o.name for o in sess.get_outputs()]   # type: ignore[attr-defined]
        got = dict(zip(names, sess.run(names, feeds)))   # type: ignore[attr-defined]
    except Exception as exc:
        _log.info("fp16 error report: the converted model's sample run failed: %s", exc)
        return {}
    out = {}
    for name, ref in plan.reference.items():
        if not isinstance(ref, np.ndarray) or ref.dtype != np.float32 or name not in got:
            continue
        if ref.size == 0:
            continue
        have = np.asarray(got[name], np.float64)
        want = ref.astype(np.float64)
        scale = np.nanmax(np.abs(want[np.isfinite(want)])) if np.isfinite(want).any() else 1.0
        denom = np.maximum(np.abs(want), max(1e-3 * scale, 1e-30))
        with np.errstate(invalid="ignore", over="ignore"):
            rel = np.abs(have - want) / denom
        both = ~(np.isnan(have) & np.isnan(want)) & ~((have == want) & np.isinf(want))
        rel = np.where(both, rel, 0.0)
        rel = np.where(np.isnan(rel), np.inf, rel)
        out[name] = (float(rel.max()), float(rel.mean()))
    return out


def _beyond(arr: np.ndarray) -> bool:
    finite = arr[np.isfinite(arr)]
    return bool(finite.size) and float(np.abs(finite).max()) > FP16_MAX


def _outer_names(graph: onnx.GraphProto, out: set[str]) -> None:
    """Names a sub-graph reads from outer scopes (over-approximated: every input name)."""
    for node in graph.node:
        out.update(i for i in node.input if i)
        for attr in node.attribute:
            for sub in ([attr.g] if attr.HasField("g") else []) + list(attr.graphs):
                _outer_names(sub, out)
