"""ONNX conformance of the emulated IPU: the backend test data that ships with onnx,
through ``host_runtime.poprt.backend``, compared with the stored outputs.

    python -m tools.conformance [--suite node|simple|pytorch-converted|pytorch-operator|light ...]
                                [-k PATTERN] [--precision fp32|fp16] [--json] [--verbose]

Every case is first run by onnxruntime in-process on its stored inputs. A case
onnxruntime cannot run (or whose outputs onnxruntime itself does not reproduce)
is skipped with that reason. Every other case must either give the stored outputs
(fp32: the case's tolerance; fp16: fp16 tolerance) or be refused at compile time
with a ``CompileError`` naming the unsupported feature. Anything else fails, and
the command exits 1.

fp16: the fair reference for an fp16-compiled model is onnxruntime running the fp16
graph the compiler produced. The stored outputs are checked first; a case that differs
from them is compared with onnxruntime's in-process run of that graph (fp16 tolerance),
and counts as passed only if it matches it; the summary lists these cases apart
("matched onnxruntime's fp16 run, not the fp32 reference"), with why the fp32
reference differs (fp16 overflow or rounding).

Suites: ``node`` comes from onnx's node test generators (in memory, as onnx's
``BackendTest`` does); ``simple``, ``pytorch-converted`` and ``pytorch-operator``
from the data folders of the onnx package; ``light`` are the small CNNs of
``onnx/backend/test/data/light`` with the inputs onnx's runner generates for them.
"""

from __future__ import annotations

import argparse
import fnmatch
import glob
import importlib
import json
import logging
import os
import re
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

import numpy as np

__all__ = ["Case", "Outcome", "SUITES", "load_cases", "node_cases", "run_case", "run", "main"]

_log = logging.getLogger(__name__)

SUITES = ("node", "simple", "pytorch-converted", "pytorch-operator", "light")
FP16_RTOL, FP16_ATOL = 1e-2, 1e-2


@dataclass
class Case:
    """One model and its data sets (inputs and expected outputs, in graph order)."""

    suite: str
    name: str
    model: Any                               # onnx.ModelProto
    data_sets: list[tuple[list[Any], list[Any]]]
    rtol: float = 1e-3
    atol: float = 1e-7


@dataclass
class Outcome:
    suite: str
    name: str
    status: str                  # "passed", "refused", "skipped", "failed"
    reason: str = ""             # refused/skipped: why (grouping key); failed: first lines
    detail: str = ""
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------- loading

def _data_dir() -> str:
    import onnx
    return os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data")


def _read_value(path: str, vi: Any) -> Any:
    """A stored input/output: a numpy array, a list (sequence), None or a value (optional)."""
    import onnx
    from onnx import numpy_helper

    with open(path, "rb") as f:
        raw = f.read()
    which = vi.type.WhichOneof("value") if vi is not None else "tensor_type"
    if which == "sequence_type":
        seq = onnx.SequenceProto()
        seq.ParseFromString(raw)
        return numpy_helper.to_list(seq)
    if which == "optional_type":
        opt = onnx.OptionalProto()
        opt.ParseFromString(raw)
        return numpy_helper.to_optional(opt)
    if which == "map_type":
        mp = onnx.MapProto()
        mp.ParseFromString(raw)
        return numpy_helper.to_dict(mp)
    t = onnx.TensorProto()
    t.ParseFromString(raw)
    return numpy_helper.to_array(t)


def _graph_inputs(model: Any) -> list[Any]:
    inits = {t.name for t in model.graph.initializer}
    return [vi for vi in model.graph.input if vi.name not in inits]


def _dir_case(suite: str, case_dir: str, rtol: float, atol: float) -> Case:
    import onnx

    model = onnx.load(os.path.join(case_dir, "model.onnx"))
    ins = _graph_inputs(model)
    sets = []
    for ds in sorted(glob.glob(os.path.join(case_dir, "test_data_set_*"))):
        n_in = len(glob.glob(os.path.join(ds, "input_*.pb")))
        n_out = len(glob.glob(os.path.join(ds, "output_*.pb")))
        inputs = [_read_value(os.path.join(ds, f"input_{i}.pb"), ins[i] if i < len(ins) else None)
                  for i in range(n_in)]
        outs = [_read_value(os.path.join(ds, f"output_{i}.pb"),
                            model.graph.output[i] if i < len(model.graph.output) else None)
                for i in range(n_out)]
        sets.append((inputs, outs))
    return Case(suite, os.path.basename(case_dir), model, sets, rtol, atol)


def _light_cases(data_dir: str) -> list[Case]:
    import onnx
    from onnx.backend.test.runner import Runner

    out = []
    for path in sorted(glob.glob(os.path.join(data_dir, "light", "light_*.onnx"))):
        name = os.path.basename(path)[len("light_"):-len(".onnx")]
        model = onnx.load(path)
        inputs = [Runner.generate_dummy_data(vi, seed=0, name=name, random=False)
                  for vi in _graph_inputs(model)]
        outs = []
        for i in range(len(model.graph.output)):
            p = os.path.join(data_dir, "light", f"light_{name}_output_{i}.pb")
            outs.append(_read_value(p, model.graph.output[i]))
        # onnx's runner compares real models with rtol 1e-3, atol 1e-7
        out.append(Case("light", f"test_{name}", model, [(inputs, outs)], 1e-3, 1e-7))
    return out


_NODE_BY_MODULE: dict[str, list[Any]] = {}


def node_cases(modules: Optional[Sequence[str]] = None) -> list[Case]:
    """onnx's node test cases, generated in memory: all of them, or those of some
    modules of ``onnx.backend.test.case.node`` (``["add", "relu"]``, much faster)."""
    from onnx.backend.test.case import node as node_pkg

    if modules is None:
        from onnx.backend.test.loader import load_node_model_tests
        found = list(load_node_model_tests())
    else:
        found = []
        for mod in modules:
            if mod not in _NODE_BY_MODULE:
                before = len(node_pkg._NodeTestCases)
                name = f"onnx.backend.test.case.node.{mod}"
                if name in sys.modules:
                    raise ValueError(f"node module {mod!r} was already imported; its cases are "
                                     "among all the node cases (modules=None)")
                importlib.import_module(name)
                _NODE_BY_MODULE[mod] = list(node_pkg._NodeTestCases[before:])
            found.extend(_NODE_BY_MODULE[mod])
    return [Case("node", tc.name, tc.model,
                 [([_normalize(v) for v in i], [_normalize(v) for v in o]) for i, o in (tc.data_sets or [])],
                 tc.rtol, tc.atol) for tc in found]


def _normalize(value: Any) -> Any:
    """The generators' values as the stored files hold them: numpy arrays (0-d for numpy
    scalars), lists for sequences, None for an empty optional."""
    import onnx
    from onnx import numpy_helper

    if isinstance(value, onnx.TensorProto):
        return numpy_helper.to_array(value)
    if isinstance(value, np.generic):
        return np.asarray(value)
    if isinstance(value, (list, tuple)):
        return [_normalize(v) for v in value]
    return value


def load_cases(suites: Iterable[str], pattern: Optional[str] = None) -> list[Case]:
    data_dir = _data_dir()
    out: list[Case] = []
    for suite in suites:
        if suite not in SUITES:
            raise ValueError(f"unknown suite {suite!r}; expected some of {', '.join(SUITES)}")
        if suite == "node":
            cases = node_cases()
            if pattern:
                cases = [c for c in cases if _match(c.name, pattern)]
            out.extend(cases)
            continue
        if suite == "light":
            cases = _light_cases(data_dir)
            out.extend(c for c in cases if not pattern or _match(c.name, pattern))
            continue
        root = os.path.join(data_dir, suite)
        for case_dir in sorted(glob.glob(os.path.join(root, "test_*"))):
            if not os.path.isfile(os.path.join(case_dir, "model.onnx")):
                continue
            if pattern and not _match(os.path.basename(case_dir), pattern):
                continue
            rtol, atol = 1e-3, 1e-7
            meta = os.path.join(case_dir, "data.json")
            if os.path.exists(meta):
                with open(meta) as f:
                    data = json.load(f)
                rtol, atol = data.get("rtol", rtol), data.get("atol", atol)
            out.append(_dir_case(suite, case_dir, rtol, atol))
    return out


def _match(name: str, pattern: str) -> bool:
    """``-k``: a substring, or a glob when it has wildcards."""
    if any(c in pattern for c in "*?["):
        return fnmatch.fnmatch(name, pattern)
    return pattern in name


# ----------------------------------------------------------------------------- running

def _ort_outputs(case: Case, inputs: list[Any]) -> list[Any]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 4
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(case.model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])
    names = [i.name for i in sess.get_inputs()]
    return list(sess.run(None, dict(zip(names, inputs))))


def _compare(expected: Any, got: Any, rtol: float, atol: float, what: str) -> None:
    if isinstance(expected, list):
        if not isinstance(got, list) or len(got) != len(expected):
            raise AssertionError(f"{what}: expected a sequence of {len(expected)}")
        for k, (e, g) in enumerate(zip(expected, got)):
            _compare(e, g, rtol, atol, f"{what}[{k}]")
        return
    if expected is None:
        if got is not None:
            raise AssertionError(f"{what}: expected an empty optional")
        return
    e = np.asarray(expected)
    g = np.asarray(got)
    if e.dtype != g.dtype:
        raise AssertionError(f"{what}: dtype {g.dtype}, expected {e.dtype}")
    if e.shape != g.shape:
        raise AssertionError(f"{what}: shape {list(g.shape)}, expected {list(e.shape)}")
    if e.dtype == object or e.dtype.kind in "SU":
        np.testing.assert_array_equal(g, e, err_msg=what)
    elif e.dtype.kind in "fc":
        np.testing.assert_allclose(g.astype(np.float64) if e.dtype == np.float16 else g,
                                   e.astype(np.float64) if e.dtype == np.float16 else e,
                                   rtol=rtol, atol=atol, err_msg=what)
    else:
        np.testing.assert_array_equal(g, e, err_msg=what)


_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")
_NUMBERS = re.compile(r"\[[^\[\]]*\]|\b\d+\b")


def refusal_reason(message: str) -> str:
    """The grouping key of a CompileError: its ``(unsupported: ...)`` part, else the
    message without the model's and tensors' names and numbers."""
    found = re.search(r"\(unsupported: ([^)]*)\)", message)
    if found:
        return found.group(1)
    text = re.sub(r"^model '[^']*'(: )?", "", message.strip().splitlines()[0])
    text = _QUOTED.sub("…", text)
    text = _NUMBERS.sub("N", text)
    return text[:160]


def run_case(case: Case, precision: str = "fp32") -> Outcome:
    """Run one case through onnxruntime (to decide whether it counts) and the backend."""
    from host_runtime.poprt import backend
    from host_runtime.errors import DeviceExecutionError
    from ipu_emulator.errors import CompileError

    t0 = time.perf_counter()
    ipu_seconds = [0.0]      # compiling, loading and running on the IPU

    def done(status: str, reason: str = "", detail: str = "",
             fp16_reference: str = "") -> Outcome:
        extra: dict[str, Any] = {"ipu_seconds": ipu_seconds[0]}
        if fp16_reference:
            extra["fp16_reference"] = fp16_reference
        return Outcome(case.suite, case.name, status, reason, detail,
                       time.perf_counter() - t0, extra)

    # 1. does onnxruntime itself run it (and agree with the stored outputs)? Where it
    # disagrees, ours are held to onnxruntime's outputs instead, and the case is skipped.
    ort_differs = ""
    data_sets = []
    for inputs, expected in case.data_sets:
        try:
            ref = _ort_outputs(case, inputs)
        except Exception as exc:  # noqa: BLE001 - any refusal of onnxruntime's
            text = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
            reason = "onnxruntime cannot run it"
            if "can't be converted to MLDataType" in text or "No corresponding Numpy type" in text:
                reason += " (its Python API takes no bfloat16/float8/int4 arrays)"
            return done("skipped", reason, text)
        try:
            for k, (e, g) in enumerate(zip(expected, ref)):
                _compare(e, g, case.rtol, case.atol, f"output {k}")
        except AssertionError as exc:
            ort_differs = str(exc).strip().splitlines()[0][:300]
            expected = ref
        data_sets.append((inputs, expected))
    # 2. ours
    rep = None
    t_ipu = time.perf_counter()
    try:
        rtol, atol = (case.rtol, case.atol) if precision == "fp32" else (FP16_RTOL, FP16_ATOL)
        shapes = _dynamic_input_shapes(case)
        try:
            rep = backend.prepare(case.model, "IPU", precision=precision, input_shapes=shapes)
            results = [list(rep.run(inputs)) for inputs, _ in data_sets]
        except CompileError as exc:
            return done("refused", refusal_reason(str(exc)), str(exc))
        except DeviceExecutionError as exc:
            if precision == "fp16":
                _check_declared_shapes(case, shapes, data_sets, exc)
            raise
        finally:
            ipu_seconds[0] = time.perf_counter() - t_ipu
        try:
            _compare_sets(case, data_sets, results, rtol, atol)
        except AssertionError as exc:
            if precision != "fp16":
                raise
            # fp16: held to onnxruntime running the fp16 graph the compiler produced
            why = _fp16_reference(case, shapes, data_sets, results, exc)
            if not ort_differs:
                return done("passed", detail=str(exc).strip().splitlines()[0][:300],
                            fp16_reference=why)
    except Exception as exc:  # noqa: BLE001 - reported as the case's failure
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        if isinstance(exc, _DeclaredShapeBroken):
            return done("skipped", "fp16 rounding changes an output's shape from the static "
                        "shape the model declares (onnxruntime's fp16 run returns another "
                        "shape; the IPU stream has the declared one and the run fails)",
                        text)
        if ort_differs:
            text = f"{text}\n(onnxruntime's own outputs differ from the stored ones too: " \
                   f"{ort_differs}; ours were compared with onnxruntime's)"
        return done("failed", text.splitlines()[0][:300], text)
    finally:
        if rep is not None:
            rep.close()
    if ort_differs:
        return done("skipped", "onnxruntime's own outputs differ from the stored outputs "
                    "(ours equal onnxruntime's)", ort_differs)
    return done("passed")


def _compare_sets(case: Case, data_sets: list[tuple[list[Any], list[Any]]],
                  results: list[list[Any]], rtol: float, atol: float) -> None:
    for (inputs, expected), got in zip(data_sets, results):
        if len(got) != len(expected):
            raise AssertionError(f"{len(got)} outputs, expected {len(expected)}")
        for k, (e, g) in enumerate(zip(expected, got)):
            _compare(e, g, rtol, atol, f"output {k} ({case.model.graph.output[k].name})")


class _DeclaredShapeBroken(AssertionError):
    """onnxruntime's fp16 run gives an output a shape other than the model declares."""


def _fp16_model(case: Case, shapes: dict[str, list[int]]) -> tuple[Any, list[Any]]:
    """The fp16 graph the compiler makes of the case (``ipu_emulator.compiler``'s
    conversion, weights as initializers) and its outputs' static shapes."""
    import onnx
    from ipu_emulator.compiler import prepare

    model = onnx.ModelProto()
    model.CopyFrom(case.model)
    prepared = prepare(model, case.name, dict(shapes), "fp16", False)
    return prepared.model, [tuple(v.shape) for v in prepared.outputs]


def _ort_fp16_outputs(model: Any, inputs: list[Any]) -> list[Any]:
    """onnxruntime in-process on the fp16 graph, fed as the backend feeds the IPU
    (float32 inputs rounded to the fp16 the graph takes)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 4
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    feeds = {}
    for meta, value in zip(sess.get_inputs(), inputs):
        if meta.type == "tensor(float16)" and isinstance(value, np.ndarray) and \
                value.dtype == np.float32:
            value = value.astype(np.float16)
        feeds[meta.name] = value
    return list(sess.run(None, feeds))


def _as_stored(ref: Any, expected: Any) -> Any:
    """An fp16 reference output in the stored output's dtype (as the backend returns it)."""
    if isinstance(ref, np.ndarray) and isinstance(expected, np.ndarray) and \
            ref.dtype == np.float16 and expected.dtype != np.float16:
        return ref.astype(expected.dtype)
    return ref


def _check_declared_shapes(case: Case, shapes: dict[str, list[int]],
                           data_sets: list[tuple[list[Any], list[Any]]], exc: Exception) -> None:
    """Raise ``_DeclaredShapeBroken`` if onnxruntime's fp16 run of the compiled graph
    gives an output a shape other than the static one the IPU streams."""
    try:
        model, out_shapes = _fp16_model(case, shapes)
        refs = [_ort_fp16_outputs(model, inputs) for inputs, _ in data_sets]
    except Exception:  # noqa: BLE001 - then ours is a plain failure
        return
    for ref in refs:
        for k, (r, want) in enumerate(zip(ref, out_shapes)):
            if np.shape(r) != want:
                raise _DeclaredShapeBroken(
                    f"output {k}: onnxruntime's fp16 run gives shape {list(np.shape(r))}, the "
                    f"model declares {list(want)}; ours: {str(exc).splitlines()[0][:200]}")


def _fp16_reference(case: Case, shapes: dict[str, list[int]],
                    data_sets: list[tuple[list[Any], list[Any]]], results: list[list[Any]],
                    stored_error: AssertionError) -> str:
    """Ours differ from the stored (fp32) outputs in fp16: compare them with onnxruntime
    running the fp16 graph the compiler produced, with fp16 tolerance. Returns why the
    fp32 reference differs (fp16 overflow or rounding); raises AssertionError if ours
    differ from onnxruntime's fp16 run too."""
    try:
        model, _ = _fp16_model(case, shapes)
        refs = [_ort_fp16_outputs(model, inputs) for inputs, _ in data_sets]
    except Exception as exc:  # noqa: BLE001
        raise AssertionError(f"{str(stored_error).strip().splitlines()[0][:200]} (onnxruntime "
                             f"cannot run the fp16 graph: {str(exc).splitlines()[0][:200]})"
                             ) from None
    ref_sets = [(inputs, [_as_stored(r, e) for r, e in zip(ref, expected)])
                for (inputs, expected), ref in zip(data_sets, refs)]
    try:
        _compare_sets(case, ref_sets, results, FP16_RTOL, FP16_ATOL)
    except AssertionError as exc:
        raise AssertionError(f"differs from the stored outputs "
                             f"({str(stored_error).strip().splitlines()[0][:150]}) and from "
                             f"onnxruntime's fp16 run ({str(exc).strip().splitlines()[0][:150]})"
                             ) from None
    overflow = False
    for (_, expected), (_, ref) in zip(data_sets, ref_sets):
        for e, r in zip(expected, ref):
            if isinstance(e, np.ndarray) and isinstance(r, np.ndarray) and \
                    e.dtype.kind == "f" and r.shape == e.shape:
                if np.any(~np.isfinite(r.astype(np.float64)) & np.isfinite(e)) or \
                        np.any(np.abs(e[np.isfinite(e)]) > 65504):
                    overflow = True
            if isinstance(e, np.ndarray) and e.dtype.kind == "f" and np.isfinite(e).all() and \
                    e.size and np.abs(e).max() > 65504:
                overflow = True
    if overflow:
        return "fp16 overflow (values beyond fp16's range, 65504, become inf/nan)"
    return "fp16 rounding (inputs and intermediates rounded to fp16 change the result " \
           "beyond fp16 tolerance)"


def _dynamic_input_shapes(case: Case) -> dict[str, list[int]]:
    """The stored inputs' shapes for inputs whose declared shape is not static (as a user
    gives them with --input_shape); every data set of a case must agree."""
    shapes: dict[str, list[int]] = {}
    ins = _graph_inputs(case.model)
    for inputs, _ in case.data_sets[:1]:
        for vi, value in zip(ins, inputs):
            if vi.type.WhichOneof("value") != "tensor_type" or not isinstance(value, np.ndarray):
                continue
            tt = vi.type.tensor_type
            static = tt.HasField("shape") and all(d.HasField("dim_value") for d in tt.shape.dim)
            if not static:
                shapes[vi.name] = list(value.shape)
    return shapes


def run(cases: Sequence[Case], precision: str = "fp32",
        progress: Optional[Any] = None) -> list[Outcome]:
    outcomes = []
    for k, case in enumerate(cases):
        o = run_case(case, precision)
        outcomes.append(o)
        if progress is not None:
            progress(k, len(cases), o)
    return outcomes


# ----------------------------------------------------------------------------- report

def summary(outcomes: Sequence[Outcome], seconds: float) -> dict[str, Any]:
    by: dict[str, list[Outcome]] = {"passed": [], "refused": [], "skipped": [], "failed": []}
    for o in outcomes:
        by[o.status].append(o)
    groups: dict[str, dict[str, Any]] = {}
    for status in ("refused", "skipped"):
        g: dict[str, list[str]] = {}
        for o in by[status]:
            g.setdefault(o.reason, []).append(f"{o.suite}/{o.name}")
        groups[status] = {r: {"count": len(v), "cases": sorted(v)}
                          for r, v in sorted(g.items(), key=lambda kv: -len(kv[1]))}
    fp16_ref: dict[str, list[str]] = {}
    for o in by["passed"]:
        if o.extra.get("fp16_reference"):
            fp16_ref.setdefault(o.extra["fp16_reference"], []).append(f"{o.suite}/{o.name}")
    ran = [o for o in outcomes if o.extra.get("ipu_seconds")]
    n_ipu, ipu = len(ran), sum(o.extra["ipu_seconds"] for o in ran)
    suites: dict[str, dict[str, int]] = {}
    for o in outcomes:
        s = suites.setdefault(o.suite, {"passed": 0, "refused": 0, "skipped": 0, "failed": 0})
        s[o.status] += 1
    return {
        "total": len(outcomes),
        "passed": len(by["passed"]), "refused": len(by["refused"]),
        "skipped": len(by["skipped"]), "failed": len(by["failed"]),
        "suites": suites,
        # passed against onnxruntime running the compiled fp16 graph, not the stored outputs
        "matched_ort_fp16_not_fp32_reference": sum(len(v) for v in fp16_ref.values()),
        "matched_ort_fp16_by_reason": {r: {"count": len(v), "cases": sorted(v)}
                                       for r, v in sorted(fp16_ref.items(),
                                                          key=lambda kv: -len(kv[1]))},
        "refused_by_reason": groups["refused"],
        "skipped_by_reason": groups["skipped"],
        "failures": [{"case": f"{o.suite}/{o.name}", "error": o.reason,
                      "detail": "\n".join(o.detail.splitlines()[:5])} for o in by["failed"]],
        "seconds": round(seconds, 1),
        "models_per_second": round(len(outcomes) / seconds, 1) if seconds > 0 else None,
        # compile + load + run through the emulated IPU only (not onnxruntime's reference)
        "ipu_models": n_ipu,
        "ipu_seconds": round(ipu, 1),
        "ipu_models_per_second": round(n_ipu / ipu, 1) if ipu > 0 else None,
    }


def _print_summary(s: dict[str, Any], out: Any) -> None:
    w = out.write
    w(f"\nconformance: {s['total']} cases in {s['seconds']} s "
      f"({s['models_per_second']} models/s; compiling, loading and running "
      f"{s['ipu_models']} models on the IPU took {s['ipu_seconds']} s, "
      f"{s['ipu_models_per_second']} models/s)\n")
    for suite, c in s["suites"].items():
        w(f"  {suite:18} passed {c['passed']:5}  refused {c['refused']:4}  "
          f"skipped {c['skipped']:4}  failed {c['failed']:4}\n")
    w(f"\npassed: {s['passed']}\n")
    if s["matched_ort_fp16_not_fp32_reference"]:
        w(f"  matched onnxruntime's fp16 run, not the fp32 reference: "
          f"{s['matched_ort_fp16_not_fp32_reference']}\n")
        for reason, g in s["matched_ort_fp16_by_reason"].items():
            w(f"  {g['count']:5}  {reason}  ({', '.join(g['cases'])})\n")
    w(f"refused at compile time: {s['refused']}\n")
    for reason, g in s["refused_by_reason"].items():
        examples = ", ".join(g["cases"][:3]) + (" ..." if g["count"] > 3 else "")
        w(f"  {g['count']:5}  {reason}  ({examples})\n")
    w(f"skipped: {s['skipped']}\n")
    for reason, g in s["skipped_by_reason"].items():
        w(f"  {g['count']:5}  {reason}\n")
    w(f"failed: {s['failed']}\n")
    for f in s["failures"]:
        w(f"  {f['case']}: {f['error']}\n")
    w(f"\n{s['passed']} passed, {s['failed']} failed, {s['refused']} refused, "
      f"{s['skipped']} skipped\n")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.conformance",
        description="Run onnx's backend test data through the emulated IPU and compare the "
                    "outputs with the stored ones.")
    parser.add_argument("--suite", action="append", choices=SUITES,
                        help="suite to run (repeatable; default: all)")
    parser.add_argument("-k", dest="pattern", help="only cases whose name contains PATTERN "
                        "(or matches it as a glob)")
    parser.add_argument("--precision", choices=("fp32", "fp16"), default="fp32")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--verbose", "-v", action="store_true", help="one line per case")
    args = parser.parse_args(argv)
    import warnings

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # the models' own warnings (onnx generators, refused models) are the cases' business
    quiet = [logging.getLogger(n) for n in ("host_runtime", "ipu_emulator")]
    levels = [lg.level for lg in quiet]
    for lg in quiet:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            return _main(args)
    finally:
        for lg, level in zip(quiet, levels):
            lg.setLevel(level)


def _main(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    cases = load_cases(args.suite or SUITES, args.pattern)
    load_s = time.perf_counter() - t0

    def progress(k: int, n: int, o: Outcome) -> None:
        if args.verbose:
            extra = f": {o.reason}" if o.status != "passed" else ""
            sys.stderr.write(f"[{k + 1}/{n}] {o.suite}/{o.name} {o.status}{extra} "
                             f"({o.seconds * 1000:.0f} ms)\n")
        elif not args.json and (k + 1) % 100 == 0:
            sys.stderr.write(f"  {k + 1}/{n}\n")

    from host_runtime.poprt import backend
    t1 = time.perf_counter()
    had_device = backend.holds_device()
    try:
        outcomes = run(cases, args.precision, progress)
    finally:
        if not had_device:      # the IPU this run attached
            backend.release_device()
    s = summary(outcomes, time.perf_counter() - t1)
    s["loading_seconds"] = round(load_s, 1)
    s["precision"] = args.precision
    if args.json:
        json.dump(s, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        _print_summary(s, sys.stdout)
    return 1 if s["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
