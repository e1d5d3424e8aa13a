"""``--precision fp16`` never invents inf or NaN (compiler only, checked with onnxruntime
running the converted graph the IPU runs)."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from ipu_emulator.compiler import CompileOptions, Fp16RangeWarning, ModelSpec, compile_onnx
from tests.models import run_reference

F = TensorProto.FLOAT


def _model(nodes, inits, out_shape=(4,)):
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [4])],
                          [helper.make_tensor_value_info("y", F, list(out_shape))],
                          initializer=inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    return m


def _compile(model):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = compile_onnx(ModelSpec(model, {}, "fp16"), CompileOptions())
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)]
    return result, [str(w.message) for w in caught if issubclass(w.category, Fp16RangeWarning)]


def test_an_output_beyond_the_range_is_clipped_not_inf():
    m = _model([helper.make_node("Mul", ["x", "k"], ["y"])],
               [numpy_helper.from_array(np.array(1e6, np.float32), "k")])
    result, warned = _compile(m)
    assert len(warned) == 1 and "outputs clipped to +-65504 for their fp16 stream: 'y'" in warned[0]
    x = np.array([-2, -0.1, 0.1, 2], np.float16)       # 1e6 x: all beyond fp16
    y = run_reference(result.output_model, {"x": x})["y"]
    assert y.dtype == np.float16
    np.testing.assert_array_equal(y, np.array([-65504, -65504, 65504, 65504], np.float16))


def test_a_constant_in_a_subgraph_is_clamped_and_named():
    then = helper.make_graph([helper.make_node("Constant", [], ["big"], value=numpy_helper.from_array(
        np.full(4, 1e6, np.float32)))], "then", [], [helper.make_tensor_value_info("big", F, [4])])
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["same"])], "else", [],
                              [helper.make_tensor_value_info("same", F, [4])])
    m = _model([helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
                helper.make_node("Greater", ["s", "zero"], ["c"]),   # sum > 0: the 1e6 branch
                helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)],
               [numpy_helper.from_array(np.array(0, np.float32), "zero")])
    result, warned = _compile(m)
    assert len(warned) == 1 and "constants clamped to +-65504: 'big'" in warned[0], warned
    for x, want in ((np.ones(4), np.full(4, 65504)), (-np.ones(4), -np.ones(4))):
        got = run_reference(result.output_model, {"x": x.astype(np.float16)})["y"]
        np.testing.assert_array_equal(got, want.astype(np.float16))


def test_a_model_within_range_gives_no_warning_and_reports_its_error():
    m = _model([helper.make_node("Mul", ["x", "k"], ["y"])],
               [numpy_helper.from_array(np.array(0.1, np.float32), "k")])
    result, warned = _compile(m)
    assert warned == []
    worst, mean = result.fp16_error["y"]
    assert 0 <= mean <= worst < 2e-3
