"""Compiling real-world-shaped graphs and comparing with onnxruntime run on the original."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from ipu_emulator.compiler import CompileOptions, CompileResult, ModelSpec, compile_onnx
from ipu_emulator.executable import Executable
from ipu_emulator.ipu.interpreter import Interpreter
from tests.models import mixed_types_model, mobilenet_like, resnet_like, run_reference
from tests.models.arrayio import ArrayIO

_BUILDERS = {"resnet": resnet_like, "mobilenet": mobilenet_like}
_NP = {"F32": np.float32, "F16": np.float16, "S32": np.int32, "S64": np.int64, "BOOL": np.bool_}


def _run(result: CompileResult, inputs: dict[str, list[np.ndarray]],
         iterations: int = 1) -> dict[str, list[np.ndarray]]:
    feeds = {k: list(v) for k, v in inputs.items()}
    for a in result.anchors:
        if a.kind == "weight":
            feeds[a.name] = [np.frombuffer(a.data, _NP[a.dtype]).reshape(a.shape)]
    outs = {a.name: (np.dtype(_NP[a.dtype]), a.shape) for a in result.anchors
            if a.direction == "out"}
    io = ArrayIO(feeds, outs)
    interp = Interpreter(Executable.from_bytes(result.executable.to_bytes()))
    interp.run_program(0, io)
    interp.run_program(1, io)
    assert len(io.outputs[next(iter(outs))]) == iterations
    return io.outputs


@pytest.mark.parametrize("name", ["resnet", "mobilenet"])
@pytest.mark.parametrize("weights_as_tensor_data", [False, True])
def test_big_graph_matches_onnxruntime(name: str, weights_as_tensor_data: bool) -> None:
    build = _BUILDERS[name]
    model = build(batch="N")
    assert len(model.graph.node) >= 150
    result = compile_onnx(ModelSpec(model, {"image": [2, 3, 32, 32]}),
                          CompileOptions(weights_as_tensor_data=weights_as_tensor_data,
                                         device_iterations=2))
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal((2, 3, 32, 32)).astype(np.float32) for _ in range(2)]
    outs = _run(result, {"image": xs}, iterations=2)
    reference = build(batch=2)
    for k, x in enumerate(xs):
        ref = run_reference(reference, {"image": x})
        np.testing.assert_allclose(outs["logits"][k], ref["logits"], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(outs["probs"][k], ref["probs"], rtol=1e-4, atol=1e-6)
    weights = [a for a in result.anchors if a.kind == "weight"]
    if weights_as_tensor_data:
        floats = [t for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
        assert {a.name for a in weights} == {t.name for t in floats}
        assert all(a.programs == (0,) for a in weights)
        assert len(result.executable.programs[0].body) == len(weights)
        assert result.executable.attributes["constant_bytes"] == "0"
    else:
        assert weights == []
        assert int(result.executable.attributes["constant_bytes"]) > 0


@pytest.mark.parametrize("name", ["resnet", "mobilenet"])
def test_fp16_precision_keeps_meaning(name: str) -> None:
    build = _BUILDERS[name]
    result = compile_onnx(ModelSpec(build(batch=2), {}, "fp16"),
                          CompileOptions(weights_as_tensor_data=True))
    anchors = {a.name: a for a in result.anchors}
    assert anchors["image"].dtype == "F16" and anchors["logits"].dtype == "F16"
    assert {a.dtype for a in result.anchors if a.kind == "weight"} == {"F16"}
    x = np.random.default_rng(6).standard_normal((2, 3, 32, 32)).astype(np.float32)
    outs = _run(result, {"image": [x.astype(np.float16)]})
    ref = run_reference(build(batch=2), {"image": x})
    scale = np.abs(ref["logits"]).max()
    np.testing.assert_allclose(outs["logits"][0].astype(np.float32), ref["logits"],
                               atol=0.02 * scale)
    assert (outs["logits"][0].argmax(1) == ref["logits"].argmax(1)).all()
    # The transformed ONNX model is itself an fp16 model with the same meaning.
    fp16_ref = run_reference(result.output_model, {"image": x.astype(np.float16)})
    np.testing.assert_allclose(fp16_ref["logits"].astype(np.float32), ref["logits"],
                               atol=0.02 * scale)
    types = {vi.name: vi.type.tensor_type.elem_type for vi in result.output_model.graph.input}
    assert types["image"] == onnx.TensorProto.FLOAT16


def test_anchors_match_the_graph_interface() -> None:
    model = mobilenet_like(batch="N")
    result = compile_onnx(ModelSpec(model, {"image": [3, 3, 32, 32]}),
                          CompileOptions(device_iterations=5, ipu_version="ipu2"))
    ins = [a for a in result.anchors if a.kind == "input"]
    outs = [a for a in result.anchors if a.kind == "output"]
    assert [(a.name, a.dtype, a.shape) for a in ins] == [("image", "F32", (3, 3, 32, 32))]
    assert [(a.name, a.dtype, a.shape) for a in outs] == [("logits", "F32", (3, 10)),
                                                          ("probs", "F32", (3, 10))]
    assert all(a.programs == (1,) and a.handle == a.name for a in ins + outs)
    exe = result.executable
    assert (exe.ipu_version, exe.device_iterations) == (2, 5)
    assert exe.streams["image"] == ("in", "F32", [3, 3, 32, 32], 3 * 3 * 32 * 32 * 4)
    assert exe.streams["probs"].direction == "out"
    assert result.program_flow == {"load": [0], "main": [1], "save": [2]}
    assert not result.fused and result.subgraphs == {}


def test_int_and_bool_tensors() -> None:
    result = compile_onnx(ModelSpec(mixed_types_model()))
    dtypes = {a.name: (a.dtype, a.shape) for a in result.anchors}
    assert dtypes == {"x": ("F32", (2, 3)), "ids": ("S64", (2, 3)), "mask": ("BOOL", (2, 3)),
                      "masked": ("F32", (2, 3)), "count": ("S32", ()), "both": ("BOOL", (2, 3))}
    rng = np.random.default_rng(7)
    feeds = {"x": rng.standard_normal((2, 3)).astype(np.float32),
             "ids": rng.integers(-3, 4, (2, 3)).astype(np.int64),
             "mask": rng.random((2, 3)) > 0.4}
    outs = _run(result, {k: [v] for k, v in feeds.items()})
    ref = run_reference(mixed_types_model(), feeds)
    np.testing.assert_allclose(outs["masked"][0], ref["masked"], rtol=1e-6)
    assert outs["count"][0] == int(feeds["mask"].sum())
    assert outs["both"][0].dtype == np.bool_
    np.testing.assert_array_equal(outs["both"][0], ref["both"])


def test_control_flow_and_resize_in_fp32_and_fp16() -> None:
    """If with sub-graphs reading outer values, and Resize whose scales must stay float32."""
    from onnx import TensorProto as T
    from onnx import helper, numpy_helper

    from tests.models import make_model

    then_g = helper.make_graph([helper.make_node("Mul", ["r", "two"], ["o1"])], "then", [],
                               [helper.make_tensor_value_info("o1", T.FLOAT, [1, 1, 4, 4])])
    else_g = helper.make_graph([helper.make_node("Neg", ["r"], ["o2"])], "else", [],
                               [helper.make_tensor_value_info("o2", T.FLOAT, [1, 1, 4, 4])])
    g = helper.make_graph(
        [helper.make_node("Resize", ["x", "", "scales"], ["r"], mode="nearest"),
         helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
         helper.make_node("Greater", ["s", "zero"], ["c"]),
         helper.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g)],
        "g", [helper.make_tensor_value_info("x", T.FLOAT, [1, 1, 2, 2])],
        [helper.make_tensor_value_info("y", T.FLOAT, [1, 1, 4, 4])],
        initializer=[numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales"),
                     numpy_helper.from_array(np.array(0, np.float32), "zero"),
                     numpy_helper.from_array(np.array(2, np.float32), "two")])
    model = make_model(g)
    for precision, dt in (("fp32", np.float32), ("fp16", np.float16)):
        result = compile_onnx(ModelSpec(model, {}, precision))
        if precision == "fp16":
            scales = next(t for t in result.output_model.graph.initializer if t.name == "scales")
            assert scales.data_type == T.FLOAT
        interp = Interpreter(result.executable)
        for sign in (1, -1):
            x = sign * np.arange(1, 5, dtype=np.float32).reshape(1, 1, 2, 2)
            io = ArrayIO({"x": [x.astype(dt)]}, {"y": (np.dtype(dt), (1, 1, 4, 4))})
            interp.run_program(1, io)
            np.testing.assert_array_equal(io.outputs["y"][0].astype(np.float32),
                                          run_reference(model, {"x": x})["y"])
