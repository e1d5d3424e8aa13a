"""Compiler fixes found by the ONNX conformance run: unused initializers, declared output
shapes, interfaces the IPU cannot stream, zero-size and 0-d tensors, strict inference."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from ipu_emulator.compiler import CompileError, CompileOptions, ModelSpec, compile_onnx
from ipu_emulator.executable import Executable
from ipu_emulator.ipu.interpreter import Interpreter
from tests.models.arrayio import ArrayIO

_NP = {"F32": np.float32, "F16": np.float16, "S64": np.int64, "S32": np.int32,
       "BOOL": np.bool_}


def _model(nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto],
           outputs: list[onnx.ValueInfoProto], inits: list[onnx.TensorProto] = (),
           opset: int = 13) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "m", inputs, outputs, list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def _run(result, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    outs = {a.name: (np.dtype(_NP[a.dtype]), a.shape) for a in result.anchors
            if a.direction == "out"}
    given = {k: [v] for k, v in feeds.items()}
    for a in result.anchors:
        if a.kind == "weight":
            given[a.name] = [np.frombuffer(a.data, _NP[a.dtype]).reshape(a.shape)]
    io = ArrayIO(given, outs)
    interp = Interpreter(Executable.from_bytes(result.executable.to_bytes()))
    interp.run_program(0, io)
    interp.run_program(1, io)
    return {k: v[0] for k, v in io.outputs.items()}


def test_unused_initializers_are_dropped() -> None:
    # As in light_resnet50: an initializer no node reads, also listed among the inputs
    # (old style); onnxruntime refused the device graph once the inputs were rewritten.
    w = numpy_helper.from_array(np.full((2,), 3, np.float32), "w")
    unused = numpy_helper.from_array(np.zeros((5,), np.float32), "queue_0")
    m = _model([helper.make_node("Mul", ["x", "w"], ["y"])],
               [helper.make_tensor_value_info("x", T.FLOAT, [2]),
                helper.make_tensor_value_info("w", T.FLOAT, [2]),
                helper.make_tensor_value_info("queue_0", T.FLOAT, [5])],
               [helper.make_tensor_value_info("y", T.FLOAT, [2])], [w, unused])
    for as_data in (False, True):
        result = compile_onnx(ModelSpec(m), CompileOptions(weights_as_tensor_data=as_data))
        names = {t.name for t in result.output_model.graph.initializer}
        assert "queue_0" not in names
        assert "queue_0" not in {a.name for a in result.anchors}
        assert [a.name for a in result.anchors if a.kind == "input"] == ["x"]
        out = _run(result, {"x": np.array([1, 2], np.float32)})
        np.testing.assert_array_equal(out["y"], [3, 6])


def _expand(declared: list[int] | None) -> onnx.ModelProto:
    return _model([helper.make_node("Expand", ["x", "shape"], ["y"])],
                  [helper.make_tensor_value_info("x", T.FLOAT, [1, 3, 1]),
                   helper.make_tensor_value_info("shape", T.INT64, ["n"])],
                  [helper.make_tensor_value_info("y", T.FLOAT, declared)])


def test_expand_with_shape_input_takes_the_declared_output_shape() -> None:
    # simple/test_expand_shape_model*: the output shape comes from an input's values
    result = compile_onnx(ModelSpec(_expand([2, 3, 4]), {"shape": [3]}))
    (out,) = [a for a in result.anchors if a.kind == "output"]
    assert out.shape == (2, 3, 4)
    x = np.arange(3, dtype=np.float32).reshape(1, 3, 1)
    got = _run(result, {"x": x, "shape": np.array([2, 1, 4], np.int64)})
    np.testing.assert_array_equal(got["y"], np.broadcast_to(x, (2, 3, 4)))


def test_expand_shape_model_from_onnx_compiles_with_input_shape() -> None:
    import os
    path = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "simple",
                        "test_expand_shape_model3", "model.onnx")
    result = compile_onnx(ModelSpec(path, {"shape": [3]}))
    assert [a.shape for a in result.anchors if a.kind == "output"] == [(3, 3, 3)]


def test_expand_without_declared_shape_is_refused_by_name() -> None:
    with pytest.raises(CompileError, match="cannot determine the shape of output 'y'.*"
                       "--input_shape.*declare the output's shape"):
        compile_onnx(ModelSpec(_expand(None), {"shape": [3]}))


@pytest.mark.parametrize("kind,vi,reason", [
    ("string", helper.make_tensor_value_info("s", T.STRING, [2]), "string tensors"),
    ("sequence", helper.make_tensor_sequence_value_info("s", T.FLOAT, [2]), "sequence inputs"),
    ("optional", helper.make_value_info("s", helper.make_optional_type_proto(
        helper.make_tensor_type_proto(T.FLOAT, [2]))), "optional inputs"),
])
def test_inputs_the_ipu_cannot_stream_are_refused_naming_the_feature(
        kind: str, vi: onnx.ValueInfoProto, reason: str) -> None:
    m = _model([helper.make_node("Identity", ["s"], ["o"])], [vi],
               [helper.make_value_info("o", vi.type)], opset=18)
    with pytest.raises(CompileError, match=rf"input 's' is .*\(unsupported: {reason}\)"):
        compile_onnx(ModelSpec(m))


def test_zero_size_tensors_compile_and_run() -> None:
    m = _model([helper.make_node("Identity", ["x"], ["y"]),
                helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0)],
               [helper.make_tensor_value_info("x", T.FLOAT, [0, 4])],
               [helper.make_tensor_value_info("y", T.FLOAT, [0, 4]),
                helper.make_tensor_value_info("s", T.FLOAT, [])])
    result = compile_onnx(ModelSpec(m))
    shapes = {a.name: a.shape for a in result.anchors}
    assert shapes == {"x": (0, 4), "y": (0, 4), "s": ()}
    got = _run(result, {"x": np.zeros((0, 4), np.float32)})
    assert got["y"].shape == (0, 4)
    assert got["s"].shape == () and float(got["s"]) == 0.0


def test_strict_inference_failure_falls_back_to_onnxruntime() -> None:
    # onnx's strict shape inference rejects MeanVarianceNormalization's own function body
    m = _model([helper.make_node("MeanVarianceNormalization", ["x"], ["y"])],
               [helper.make_tensor_value_info("x", T.FLOAT, [1, 2, 2, 2])],
               [helper.make_tensor_value_info("y", T.FLOAT, [1, 2, 2, 2])])
    result = compile_onnx(ModelSpec(m))
    x = np.arange(8, dtype=np.float32).reshape(1, 2, 2, 2)
    got = _run(result, {"x": x})
    mean = x.mean(axis=(0, 2, 3), keepdims=True)
    std = np.sqrt(((x - mean) ** 2).mean(axis=(0, 2, 3), keepdims=True))
    np.testing.assert_allclose(got["y"], (x - mean) / (std + 1e-9), rtol=1e-4, atol=1e-5)


def test_fp16_converts_sequence_empty_default_dtype() -> None:
    # simple/test_sequence_model1: SequenceEmpty() is a float sequence unless told otherwise
    import os
    path = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "simple",
                        "test_sequence_model1", "model.onnx")
    result = compile_onnx(ModelSpec(path, precision="fp16"))
    assert {a.name: a.dtype for a in result.anchors if a.kind == "output"} == {"out": "F16"}
    (node,) = [n for n in result.output_model.graph.node if n.op_type == "SequenceEmpty"]
    assert [(a.name, a.i) for a in node.attribute] == [("dtype", T.FLOAT16)]


def test_fp16_window_functions_and_ml_only_models() -> None:
    # a window op's float output comes from its output_datatype attribute
    m = _model([helper.make_node("HannWindow", ["n"], ["w"])],
               [helper.make_tensor_value_info("n", T.INT32, [])],
               [helper.make_tensor_value_info("w", T.FLOAT, [8])], opset=17)
    result = compile_onnx(ModelSpec(m, precision="fp16"))
    assert {a.name: a.dtype for a in result.anchors if a.kind == "output"} == {"w": "F16"}
    # a model importing only ai.onnx.ml gets the default domain for the Casts fp16 adds
    g = helper.make_graph([helper.make_node("Binarizer", ["x"], ["y"], domain="ai.onnx.ml",
                                            threshold=1.0)], "ml",
                          [helper.make_tensor_value_info("x", T.FLOAT, [3])],
                          [helper.make_tensor_value_info("y", T.FLOAT, [3])])
    ml = helper.make_model(g, opset_imports=[helper.make_opsetid("ai.onnx.ml", 1)])
    result = compile_onnx(ModelSpec(ml, precision="fp16"))
    got = _run(result, {"x": np.array([0.5, 1.0, 2.0], np.float16)})
    np.testing.assert_array_equal(got["y"], [0, 0, 1])


def test_initializers_read_only_inside_subgraphs_are_kept() -> None:
    w = numpy_helper.from_array(np.full((2,), 5, np.float32), "w")
    then_g = helper.make_graph([helper.make_node("Add", ["x", "w"], ["t"])], "then", [],
                               [helper.make_tensor_value_info("t", T.FLOAT, [2])])
    else_g = helper.make_graph([helper.make_node("Identity", ["x"], ["e"])], "else", [],
                               [helper.make_tensor_value_info("e", T.FLOAT, [2])])
    m = _model([helper.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g)],
               [helper.make_tensor_value_info("c", T.BOOL, []),
                helper.make_tensor_value_info("x", T.FLOAT, [2])],
               [helper.make_tensor_value_info("y", T.FLOAT, [2])], [w])
    result = compile_onnx(ModelSpec(m))
    assert [t.name for t in result.output_model.graph.initializer] == ["w"]
    x = np.array([1, 2], np.float32)
    got = _run(result, {"c": np.array(True), "x": x})
    np.testing.assert_array_equal(got["y"], x + 5)


def test_fp16_constant_of_shape_without_value_is_fp16_zero() -> None:
    m = _model([helper.make_node("ConstantOfShape", ["s"], ["z"]),
                helper.make_node("Add", ["z", "x"], ["y"])],
               [helper.make_tensor_value_info("s", T.INT64, [1]),
                helper.make_tensor_value_info("x", T.FLOAT, [3])],
               [helper.make_tensor_value_info("y", T.FLOAT, [3])])
    result = compile_onnx(ModelSpec(m, precision="fp16"))
    x = np.array([1, 2, 3], np.float16)
    got = _run(result, {"s": np.array([3], np.int64), "x": x})
    assert got["y"].dtype == np.float16
    np.testing.assert_array_equal(got["y"], x)


def test_fp16_keeps_ops_without_an_fp16_form_in_fp32() -> None:
    # BitCast of float32 bits and EyeLike (no fp16 kernel) run in fp32 between casts, with
    # the model's fp16 interface
    m = _model([helper.make_node("BitCast", ["x"], ["b"], to=T.INT32),
                helper.make_node("EyeLike", ["i"], ["e"], dtype=T.FLOAT)],
               [helper.make_tensor_value_info("x", T.FLOAT, [2]),
                helper.make_tensor_value_info("i", T.INT32, [2, 2])],
               [helper.make_tensor_value_info("b", T.INT32, [2]),
                helper.make_tensor_value_info("e", T.FLOAT, [2, 2])], opset=26)
    try:
        import onnxruntime as ort
        ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception as exc:   # BitCast is opset 26: older onnxruntime releases lack it
        pytest.skip(f"the installed onnxruntime cannot run BitCast: {str(exc)[:120]}")
    result = compile_onnx(ModelSpec(m, precision="fp16"))
    assert {a.name: a.dtype for a in result.anchors if a.direction == "out"} == \
        {"b": "S32", "e": "F16"}
    x = np.array([1.5, -2.0], np.float16)
    got = _run(result, {"x": x, "i": np.zeros((2, 2), np.int32)})
    np.testing.assert_array_equal(got["b"], x.astype(np.float32).view(np.int32))
    np.testing.assert_array_equal(got["e"], np.eye(2, dtype=np.float16))
    ops = [n.op_type for n in result.output_model.graph.node]
    assert ops.count("Cast") == 2 and "BitCast" in ops and "EyeLike" in ops
