"""ONNX conformance through ``host_runtime.poprt.backend``: a representative subset of onnx's
backend test data (every suite, a light CNN, the Expand-with-shape-input models, refusals
with their reasons), the backend's contract, and the IPU process kept between models.

The whole run is ``python -m tools.conformance``; ``IPU_EMULATOR_CONFORMANCE=1 pytest -m
conformance`` runs it (and onnx's own ``BackendTest`` over the node cases) as tests.
"""

from __future__ import annotations

import os
from typing import Iterator

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper

from host_runtime.errors import BadRequestError
from host_runtime.poprt import backend
from ipu_emulator.errors import CompileError
from tools import conformance

pytestmark = pytest.mark.usefixtures("private_machine")

_FULL = bool(os.environ.get("IPU_EMULATOR_CONFORMANCE"))


@pytest.fixture(scope="module", autouse=True)
def shared_ipu(private_machine: None) -> Iterator[None]:
    """Attach the backend's IPU before the tests' /dev/shm probes look, release it after."""
    backend._shared.get()
    yield
    backend.release_device()


# name pattern -> expected status (and, for refusals, the reason)
_SUBSET: dict[str, dict[str, tuple[str, ...]]] = {
    "simple": {
        "test_expand_shape_model1": ("passed",), "test_expand_shape_model2": ("passed",),
        "test_expand_shape_model3": ("passed",), "test_expand_shape_model4": ("passed",),
        "test_single_relu_model": ("passed",), "test_shrink": ("passed",),
        "test_sign_model": ("passed",),
        "test_strnorm_model_nostopwords_nochangecase": ("refused", "string tensors"),
        "test_gradient_of_add": ("skipped", "onnxruntime cannot run it"),
    },
    "pytorch-converted": {
        "test_Conv2d": ("passed",), "test_MaxPool2d": ("passed",), "test_Softmax": ("passed",),
        "test_Embedding": ("passed",), "test_ReLU": ("passed",), "test_Tanh": ("passed",),
        "test_PReLU_1d": ("skipped", "onnxruntime cannot run it"),
    },
    "pytorch-operator": {
        "test_operator_chunk": ("passed",), "test_operator_concat2": ("passed",),
        "test_operator_maxpool": ("passed",), "test_operator_view": ("passed",),
        "test_operator_reduced_sum": ("passed",), "test_operator_index": ("passed",),
    },
    "light": {"test_squeezenet": ("passed",), "test_resnet50": ("passed",)},
}

# node: cases of a few op modules (generated in memory, as onnx's BackendTest does)
_NODE_MODULES = ["add", "cast", "expand", "trilu", "unique", "identity", "reduce_log_sum",
                 "meanvariancenormalization", "cumsum", "split", "where", "slice", "equal"]
_NODE_EXPECT = {
    "test_add": ("passed",), "test_add_uint8": ("passed",), "test_add_bcast": ("passed",),
    "test_cast_FLOAT_to_FLOAT16": ("passed",), "test_cast_FLOAT16_to_DOUBLE": ("passed",),
    "test_equal_string": ("refused", "string tensors"),
    "test_expand_dim_changed": ("passed",),
    "test_triu_neg": ("passed",),                          # a 0-d (scalar) input k
    "test_unique_sorted_with_axis": ("refused", "output shapes that depend on input data"),
    "test_identity_sequence": ("refused", "sequence inputs"),
    "test_identity_opt": ("refused", "optional inputs"),
    "test_reduce_log_sum_empty_set": ("passed",),          # a zero-size input
    "test_mvn": ("passed",),                               # strict inference falls back
    "test_cumsum_1d": ("passed",), "test_split_equal_parts_1d_opset18": ("passed",),
    "test_where_example": ("passed",), "test_slice_start_out_of_bounds": ("passed",),
}


_ONNX = tuple(int(x) for x in onnx.__version__.split(".")[:2])
_ALL_CASES_SINCE = (1, 21)
"""The onnx release whose test data holds every case named here (setup.cfg admits older
ones, which lack some: BitCast's cases came with 1.21)."""


def _installed(modules: list[str]) -> list[str]:
    """The node-case modules the installed onnx has (all of them from _ALL_CASES_SINCE)."""
    import importlib.util

    have = [m for m in modules
            if importlib.util.find_spec(f"onnx.backend.test.case.node.{m}") is not None]
    assert have == modules or _ONNX < _ALL_CASES_SINCE, sorted(set(modules) - set(have))
    return have


def _onnxruntime_lacks(case: conformance.Case) -> bool:
    """The installed onnxruntime cannot load or run the case's model itself (an older
    release without the kernel, a locale it needs): the case is then skipped, whatever
    we expect of it with an onnxruntime that can."""
    import onnxruntime as ort

    try:
        sess = ort.InferenceSession(case.model.SerializeToString(),
                                    providers=["CPUExecutionProvider"])
        inputs, _ = case.data_sets[0]
        sess.run(None, {i.name: v for i, v in zip(sess.get_inputs(), inputs)})
    except Exception:
        return True
    return False


_BEFORE_ALL_CASES = {
    # older onnx's shape inference keeps the case's declared output shapes, which hold for
    # its one data set: the model compiles to those shapes and passes
    "test_unique_sorted_with_axis": ("passed",),
}


def _check(case: conformance.Case, o: conformance.Outcome, want: tuple[str, ...]) -> None:
    if _ONNX < _ALL_CASES_SINCE:
        want = _BEFORE_ALL_CASES.get(case.name, want)
    if (o.status == "skipped" and o.reason == "onnxruntime cannot run it"
            and want[0] != "skipped" and _onnxruntime_lacks(case)):
        return
    assert o.status == want[0], (case.name, o.status, o.reason, o.detail[:500])
    if len(want) > 1:
        assert o.reason == want[1], (case.name, o.reason)


def _subset_cases() -> list[conformance.Case]:
    cases: list[conformance.Case] = []
    for suite, names in _SUBSET.items():
        found = [c for c in conformance.load_cases([suite], "test_") if c.name in names]
        assert sorted(c.name for c in found) == sorted(names), suite
        cases.extend(found)
    return cases


@pytest.mark.parametrize("suite", list(_SUBSET))
def test_subset_of_each_suite(suite: str) -> None:
    names = _SUBSET[suite]
    cases = [c for c in conformance.load_cases([suite]) if c.name in names]
    assert sorted(c.name for c in cases) == sorted(names)
    for case in cases:
        _check(case, conformance.run_case(case), names[case.name])


def test_subset_of_node_cases() -> None:
    cases = {c.name: c for c in conformance.node_cases(_installed(_NODE_MODULES))}
    missing = sorted(set(_NODE_EXPECT) - set(cases))
    assert not missing or _ONNX < _ALL_CASES_SINCE, missing
    outcomes = {}
    for name, case in cases.items():
        o = conformance.run_case(case)
        outcomes[name] = o
        want = _NODE_EXPECT.get(name)
        if want is not None:
            _check(case, o, want)
    # the rest of these modules: nothing fails, and every refusal names its reason
    failed = {n: o.reason for n, o in outcomes.items() if o.status == "failed"}
    assert not failed
    for o in outcomes.values():
        if o.status == "refused":
            assert o.detail.startswith("model ") and o.reason


# fp16: formerly failing (range/rounding) and formerly refused cases, and plain ones
_FP16_MODULES = ["softmax", "tan", "bitcast", "eyelike", "nonmaxsuppression"]
_FP16_EXPECT = {
    "test_softmax_example": ("passed", ""),
    "test_softmax_large_number": ("passed", "fp16 rounding"),   # 10001.. round to 10000
    "test_tan": ("passed", "fp16 rounding"),
    "test_bitcast_float32_to_int32": ("passed", ""),           # kept in fp32 between casts
    "test_bitcast_int32_to_float32": ("passed", ""),
    "test_eyelike_populate_off_main_diagonal": ("passed", ""),  # no fp16 EyeLike kernel
    "test_nonmaxsuppression_iou_threshold_boundary": ("skipped", "fp16 rounding changes"),
}


def test_fp16_subset_of_node_cases() -> None:
    cases = {c.name: c for c in conformance.node_cases(_installed(_FP16_MODULES))}
    assert not sorted(set(_FP16_EXPECT) - set(cases)) or _ONNX < _ALL_CASES_SINCE
    outcomes = {name: conformance.run_case(case, "fp16") for name, case in cases.items()}
    for name, (status, why) in _FP16_EXPECT.items():
        if name not in cases:
            continue
        o = outcomes[name]
        if (o.status == "skipped" and o.reason == "onnxruntime cannot run it"
                and status != "skipped" and _onnxruntime_lacks(cases[name])):
            continue
        assert o.status == status, (name, o.status, o.reason, o.detail[:500])
        ref = o.extra.get("fp16_reference", "")
        if status == "passed":
            # held to onnxruntime's fp16 run only where the stored outputs differ
            assert ref.startswith(why) if why else not ref, (name, ref, o.detail[:300])
        else:
            assert o.reason.startswith(why), (name, o.reason)
    failed = {n: o.detail[:300] for n, o in outcomes.items() if o.status == "failed"}
    assert not failed
    s = conformance.summary(list(outcomes.values()), 1.0)
    held = s["matched_ort_fp16_by_reason"]
    assert s["matched_ort_fp16_not_fp32_reference"] == sum(g["count"] for g in held.values())
    assert "node/test_tan" in [c for g in held.values() for c in g["cases"]]


def test_fp16_reference_does_not_hide_a_real_difference() -> None:
    # ours differ from the stored outputs and from onnxruntime's fp16 run: still a failure
    case = conformance.node_cases(["tan"])[0]
    inputs, expected = case.data_sets[0]
    with pytest.raises(AssertionError, match="and from onnxruntime's fp16 run"):
        conformance._fp16_reference(case, {}, [(inputs, expected)],
                                    [[e + 1.0 for e in expected]], AssertionError("stored"))
    # and the same outputs as onnxruntime's fp16 run pass, with why
    model, _ = conformance._fp16_model(case, {})
    ours = [[r.astype(np.float32) for r in conformance._ort_fp16_outputs(model, inputs)]]
    assert conformance._fp16_reference(case, {}, [(inputs, expected)], ours,
                                       AssertionError("stored")).startswith("fp16 rounding")


def test_summary_groups_refusals_and_counts() -> None:
    outcomes = [conformance.Outcome("node", "a", "passed"),
                conformance.Outcome("node", "b", "refused", "string tensors"),
                conformance.Outcome("node", "c", "refused", "string tensors"),
                conformance.Outcome("simple", "d", "skipped", "onnxruntime cannot run it"),
                conformance.Outcome("simple", "e", "failed", "AssertionError: x", "AssertionError: x")]
    s = conformance.summary(outcomes, 2.0)
    assert (s["passed"], s["refused"], s["skipped"], s["failed"]) == (1, 2, 1, 1)
    assert s["refused_by_reason"] == {"string tensors": {"count": 2,
                                                         "cases": ["node/b", "node/c"]}}
    assert s["failures"] == [{"case": "simple/e", "error": "AssertionError: x",
                              "detail": "AssertionError: x"}]
    assert conformance.refusal_reason(
        "model 'm': output 'y' has an unresolved shape (['?', 3]) after shape inference") == \
        "output … has an unresolved shape (N) after shape inference"


def test_command_exit_status_and_summary(capsys: pytest.CaptureFixture[str]) -> None:
    rc = conformance.main(["--suite", "simple", "-k", "expand_shape", "--json"])
    out = capsys.readouterr().out
    import json
    s = json.loads(out)
    assert rc == 0 and (s["total"], s["passed"], s["failed"]) == (4, 4, 0)
    assert backend.holds_device()      # main() keeps an IPU it did not attach


# ----------------------------------------------------------------------------- the backend

def _add_model(shape: list[int | str]) -> onnx.ModelProto:
    g = helper.make_graph([helper.make_node("Add", ["a", "b"], ["sum"]),
                           helper.make_node("Mul", ["a", "b"], ["prod"])], "addmul",
                          [helper.make_tensor_value_info("a", T.FLOAT, shape),
                           helper.make_tensor_value_info("b", T.FLOAT, shape)],
                          [helper.make_tensor_value_info("sum", T.FLOAT, shape),
                           helper.make_tensor_value_info("prod", T.FLOAT, shape)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])


def test_backend_runs_and_orders_outputs_like_the_graph() -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.full((2, 3), 2, np.float32)
    assert backend.supports_device("IPU") and not backend.supports_device("CUDA")
    with backend.prepare(_add_model([2, 3]), "IPU") as rep:
        out = rep.run([a, b])
        assert len(out) == 2
        np.testing.assert_array_equal(out[0], a + b)
        np.testing.assert_array_equal(out.prod, a * b)
        out2 = rep.run({"b": b, "a": a})
        np.testing.assert_array_equal(out2[1], a * b)
        with pytest.raises(BadRequestError, match="do not match the model's inputs"):
            rep.run({"a": a})
    got = backend.run_model(_add_model([2, 3]), [a, b])
    np.testing.assert_array_equal(got[0], a + b)


def test_backend_dynamic_dims_compile_per_shape_and_fp16() -> None:
    with backend.prepare(_add_model(["n", 3])) as rep:
        for n in (1, 4, 1):
            a = np.ones((n, 3), np.float32)
            np.testing.assert_array_equal(rep.run([a, a])[0], a + a)
        assert len(rep._compiled) == 2
    a = np.linspace(0, 1, 6, dtype=np.float32).reshape(2, 3)
    with backend.prepare(_add_model([2, 3]), precision="fp16") as rep:
        out = rep.run([a, a])
        assert out[0].dtype == np.float32      # the model's own dtype at the boundary
        np.testing.assert_allclose(out[0], a + a, rtol=1e-3, atol=1e-3)


def test_backend_refuses_at_prepare_with_compile_error() -> None:
    g = helper.make_graph([helper.make_node("Identity", ["s"], ["o"])], "str",
                          [helper.make_tensor_value_info("s", T.STRING, [2])],
                          [helper.make_tensor_value_info("o", T.STRING, [2])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    with pytest.raises(CompileError, match=r"string tensor.*\(unsupported: string tensors\)"):
        backend.prepare(m)


def test_backend_run_node() -> None:
    node = helper.make_node("Relu", ["x"], ["y"])
    x = np.array([-1.0, 0.5, 2.0], np.float32)
    (y,) = backend.run_node(node, [x])
    np.testing.assert_array_equal(y, np.maximum(x, 0))


def test_zero_size_tensors_run_through_the_runtime() -> None:
    g = helper.make_graph([helper.make_node("Identity", ["x"], ["y"]),
                           helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0)], "z",
                          [helper.make_tensor_value_info("x", T.FLOAT, [0, 4])],
                          [helper.make_tensor_value_info("y", T.FLOAT, [0, 4]),
                           helper.make_tensor_value_info("s", T.FLOAT, [])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    with backend.prepare(m) as rep:
        for _ in range(2):
            y, s = rep.run([np.zeros((0, 4), np.float32)])
            assert y.shape == (0, 4) and y.dtype == np.float32
            assert s.shape == () and float(s) == 0.0


def test_models_share_one_ipu_process() -> None:
    dev = backend._shared.get()
    pid = dev.link.pid
    a = np.ones((2, 3), np.float32)
    for k in range(3):
        with backend.prepare(_add_model([2, 3])) as rep:
            np.testing.assert_array_equal(rep.run([a, a * k])[0], a + a * k)
        # the ModelRunner closed; the IPU it did not attach stays attached, same process
        assert dev.isAttached()
        assert backend._shared.get() is dev and dev.link.pid == pid


def test_reps_alive_together_take_turns_on_the_ipu() -> None:
    a = np.ones((2, 3), np.float32)
    with backend.prepare(_add_model([2, 3])) as r1, backend.prepare(_add_model(["n", 3])) as r2:
        for k in range(3):
            np.testing.assert_array_equal(r1.run([a, a * k])[0], a + a * k)
            np.testing.assert_array_equal(r2.run([a[:1], a[:1] * k])[1], a[:1] * k)


# ----------------------------------------------------------------------------- full run

@pytest.mark.conformance
@pytest.mark.skipif(not _FULL, reason="the whole conformance run: IPU_EMULATOR_CONFORMANCE=1")
def test_whole_conformance_run() -> None:
    outcomes = conformance.run(conformance.load_cases(conformance.SUITES))
    failed = [(o.suite, o.name, o.reason) for o in outcomes if o.status == "failed"]
    assert not failed


@pytest.mark.conformance
@pytest.mark.skipif(not _FULL, reason="onnx's BackendTest: IPU_EMULATOR_CONFORMANCE=1")
def test_onnx_backend_test_harness_runs_against_the_backend() -> None:
    import unittest

    import onnx.backend.test

    bt = onnx.backend.test.BackendTest(backend, __name__)
    bt.include(r"test_(add|relu|expand_shape_model|squeezenet)")
    suite = unittest.TestSuite()
    for case in bt.test_cases.values():
        suite.addTests(unittest.defaultTestLoader.loadTestsFromTestCase(case))
    result = unittest.TextTestRunner(verbosity=0).run(suite)
    assert result.testsRun > 10 and result.wasSuccessful(), result.failures + result.errors


def test_dynamic_model_with_a_sequence_input_is_refused_at_prepare() -> None:
    # onnx's BackendTest prepares with no shapes: what can never stream is refused at once
    g = helper.make_graph([helper.make_node("SequenceAt", ["s", "i"], ["o"])], "seq",
                          [helper.make_tensor_sequence_value_info("s", T.FLOAT, ["n"]),
                           helper.make_tensor_value_info("i", T.INT64, [])],
                          [helper.make_tensor_value_info("o", T.FLOAT, ["n"])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    with pytest.raises(CompileError, match=r"input 's' is a sequence.*"
                                           r"\(unsupported: sequence inputs\)"):
        backend.prepare(m)


def test_declared_output_shape_is_a_contract_checked_at_run_time() -> None:
    # Expand(x, shape): the stream takes the declared [2, 3, 4]; other shape values fail
    # that request with a named error, and the next request runs
    from host_runtime.errors import DeviceExecutionError

    g = helper.make_graph([helper.make_node("Expand", ["x", "shape"], ["y"])], "e",
                          [helper.make_tensor_value_info("x", T.FLOAT, [1, 3, 1]),
                           helper.make_tensor_value_info("shape", T.INT64, [3])],
                          [helper.make_tensor_value_info("y", T.FLOAT, [2, 3, 4])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    x = np.arange(3, dtype=np.float32).reshape(1, 3, 1)
    with backend.prepare(m) as rep:
        with pytest.raises(DeviceExecutionError, match="Expand"):
            rep.run([x, np.array([3, 1, 4])])
        np.testing.assert_array_equal(rep.run([x, np.array([2, 1, 4])])[0],
                                      np.broadcast_to(x, (2, 3, 4)))
