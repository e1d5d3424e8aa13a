"""What the compiler refuses, and how it says so."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from ipu_emulator.compiler import TARGETS, CompileOptions, ModelSpec, compile_onnx
from ipu_emulator.compiler._onnx import ort_max_ir_version
from ipu_emulator.errors import CompileError
from ipu_emulator.executable import Executable
from ipu_emulator.ipu.interpreter import Interpreter
from tests.models import dynamic_model, make_model, run_reference, simple_model
from tests.models.arrayio import ArrayIO

IPU_BYTES = 1472 * 624 * 1024


def test_targets_have_the_documented_memory() -> None:
    assert TARGETS["ipu2"].memory_bytes == IPU_BYTES == TARGETS["ipu21"].memory_bytes
    assert (TARGETS["ipu2"].version, TARGETS["ipu21"].version) == (2, 21)
    with pytest.raises(CompileError, match="ipu_version 'ipu3' is not supported; expected one "
                                           "of ipu2, ipu21"):
        compile_onnx(ModelSpec(simple_model()), CompileOptions(ipu_version="ipu3"))


def test_dynamic_dims_need_input_shape() -> None:
    with pytest.raises(CompileError, match=r"input 'x' has an unresolved dynamic shape "
                                           r"\(\['\?', 6\]\); fix it with --input_shape"):
        compile_onnx(ModelSpec(dynamic_model()))
    result = compile_onnx(ModelSpec(dynamic_model(), {"x": [4, 6]}))
    shapes = {a.name: a.shape for a in result.anchors}
    assert shapes == {"x": (4, 6), "y": (4, 5)}
    x = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    io = ArrayIO({"x": [x]}, {"y": (np.dtype(np.float32), (4, 5))})
    Interpreter(Executable.from_bytes(result.executable.to_bytes())).run_program(1, io)
    np.testing.assert_allclose(io.outputs["y"][0], run_reference(dynamic_model(), {"x": x})["y"],
                               rtol=1e-5)


def test_input_shape_mistakes_are_named() -> None:
    with pytest.raises(CompileError, match=r"--input_shape names 'z', which is not an input; "
                                           r"the inputs are \['x'\]"):
        compile_onnx(ModelSpec(dynamic_model(), {"z": [1, 6]}))
    with pytest.raises(CompileError, match=r"--input_shape x has 3 dims \[1, 6, 1\] but the "
                                           r"input has rank 2"):
        compile_onnx(ModelSpec(dynamic_model(), {"x": [1, 6, 1]}))
    with pytest.raises(CompileError, match="shape inference failed"):
        compile_onnx(ModelSpec(dynamic_model(), {"x": [2, 7]}))


def test_symbolic_output_dims_are_resolved_by_inference() -> None:
    g = helper.make_graph([helper.make_node("Shape", ["x"], ["s"]),
                           helper.make_node("ConstantOfShape", ["s"], ["y"],
                                            value=numpy_helper.from_array(
                                                np.array([1.0], np.float32)))],
                          "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", "b"])])
    result = compile_onnx(ModelSpec(make_model(g)))
    assert {a.name: a.shape for a in result.anchors} == {"x": (2, 3), "y": (2, 3)}


def test_data_dependent_output_shape_is_refused() -> None:
    g = helper.make_graph([helper.make_node("NonZero", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.INT64, [2, "n"])])
    with pytest.raises(CompileError, match=r"output 'y' has a shape that depends on the input "
                                           r"data \(\[2, '\?'\], .*--input_shape.*graph\.output"):
        compile_onnx(ModelSpec(make_model(g)))


def test_too_big_tensor_is_refused_with_name_and_sizes() -> None:
    n = IPU_BYTES // 4 + 1
    g = helper.make_graph([helper.make_node("Relu", ["huge"], ["out"])], "g",
                          [helper.make_tensor_value_info("huge", TensorProto.FLOAT, [1, n])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, n])])
    with pytest.raises(CompileError) as ei:
        compile_onnx(ModelSpec(make_model(g)), CompileOptions(ipu_version="ipu2"))
    msg = str(ei.value)
    assert "tensor 'huge'" in msg and f"F32[1, {n}]" in msg and f"{n * 4} bytes" in msg
    assert f"the {IPU_BYTES} bytes of one ipu2 IPU (1472 tiles x 638976 bytes per tile)" in msg


def test_model_too_big_in_total_is_refused() -> None:
    n = IPU_BYTES // 4 // 2   # each tensor fits, the three together do not
    g = helper.make_graph([helper.make_node("Add", ["a", "b"], ["c"])], "g",
                          [helper.make_tensor_value_info(x, TensorProto.FLOAT, [n])
                           for x in ("a", "b")],
                          [helper.make_tensor_value_info("c", TensorProto.FLOAT, [n])])
    with pytest.raises(CompileError, match=r"does not fit the device memory of 1 ipu21 IPU\(s\): "
                                           r"it needs \d+ bytes .* but the device has "
                                           f"{IPU_BYTES} bytes.*largest tensor is '[abc]'"):
        compile_onnx(ModelSpec(make_model(g)))


def test_max_tensor_size() -> None:
    with pytest.raises(CompileError, match=r"tensor '\w+' \(F32\[1, 4\]\) is 16 bytes, more than "
                                           "max_tensor_size of 8 bytes"):
        compile_onnx(ModelSpec(simple_model()), CompileOptions(max_tensor_size=8))
    compile_onnx(ModelSpec(simple_model()), CompileOptions(max_tensor_size=16))


def _external_model(tmp_path, location: str) -> str:
    model = simple_model((2, 2), seed=9)
    folder = tmp_path / "m"
    folder.mkdir()
    (tmp_path / "outside.bin").write_bytes(np.ones(4, np.float32).tobytes())
    onnx.external_data_helper.convert_model_to_external_data(
        model, all_tensors_to_one_file=True, location="weights.bin", size_threshold=0)
    onnx.save(model, str(folder / "model.onnx"))
    m = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    for t in m.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = location
    onnx.save(m, str(folder / "model.onnx"))
    return str(folder / "model.onnx")


def test_external_data_inside_the_folder_is_loaded(tmp_path) -> None:
    path = _external_model(tmp_path, "weights.bin")
    result = compile_onnx(ModelSpec(path), CompileOptions(weights_as_tensor_data=True))
    w = next(a for a in result.anchors if a.name == "weights")
    expected = numpy_helper.to_array(simple_model((2, 2), seed=9).graph.initializer[0])
    np.testing.assert_array_equal(np.frombuffer(w.data, np.float32).reshape(2, 2), expected)


@pytest.mark.parametrize("location", ["../outside.bin", "/etc/passwd", "sub/../../outside.bin"])
def test_external_data_outside_the_folder_is_refused(tmp_path, location: str) -> None:
    path = _external_model(tmp_path, location)
    with pytest.raises(CompileError, match=r"initializer 'weights' refers to external data "
                                           f"'{location}' outside the model's folder"):
        compile_onnx(ModelSpec(path))


def test_external_data_symlink_escaping_the_folder_is_refused(tmp_path) -> None:
    path = _external_model(tmp_path, "link.bin")
    os.symlink(tmp_path / "outside.bin", tmp_path / "m" / "link.bin")
    with pytest.raises(CompileError, match="outside the model's folder"):
        compile_onnx(ModelSpec(path))


def test_external_data_bounds_and_missing_file(tmp_path) -> None:
    path = _external_model(tmp_path, "missing.bin")
    with pytest.raises(CompileError, match="external data file 'missing.bin' of initializer "
                                           "'weights' does not exist"):
        compile_onnx(ModelSpec(path))
    m = onnx.load(path, load_external_data=False)
    for e in m.graph.initializer[0].external_data:
        if e.key == "location":
            e.value = "weights.bin"
    m.graph.initializer[0].external_data.add(key="offset", value="1000")
    (tmp_path / "m" / "weights.bin").write_bytes(b"\0" * 16)
    onnx.save(m, path)
    with pytest.raises(CompileError, match=r"wants bytes \[1000, \d+\) of 'weights.bin', which "
                                           "has 16 bytes"):
        compile_onnx(ModelSpec(path))


def test_bad_files_and_types(tmp_path) -> None:
    with pytest.raises(CompileError, match="does not exist"):
        compile_onnx(ModelSpec(str(tmp_path / "nope.onnx")))
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\xff\x00not a model")
    with pytest.raises(CompileError, match="is not a valid ONNX model"):
        compile_onnx(ModelSpec(str(bad)))
    g = helper.make_graph([helper.make_node("Identity", ["s"], ["t"])], "g",
                          [helper.make_tensor_value_info("s", TensorProto.BFLOAT16, [2])],
                          [helper.make_tensor_value_info("t", TensorProto.BFLOAT16, [2])])
    with pytest.raises(CompileError, match="input 's' has element type BFLOAT16, which the IPU "
                                           "emulator does not support"):
        compile_onnx(ModelSpec(make_model(g)))
    with pytest.raises(CompileError, match="precision 'int8' is not supported"):
        compile_onnx(ModelSpec(simple_model(), {}, "int8"))
    with pytest.raises(CompileError, match="batches_per_step must be a positive integer"):
        compile_onnx(ModelSpec(simple_model()), CompileOptions(device_iterations=0))


def test_unsupported_op_is_refused_with_onnxruntime_reason() -> None:
    g = helper.make_graph([helper.make_node("NoSuchOp", ["x"], ["y"], domain="custom.emu")],
                          "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13),
                                            helper.make_opsetid("custom.emu", 1)])
    m.ir_version = 8
    with pytest.raises(CompileError, match="cannot run on the IPU emulator|shape inference"):
        compile_onnx(ModelSpec(m))


def test_fp16_ops_without_cpu_kernels_are_computed_between_casts() -> None:
    """Celu has no fp16 CPU kernel in onnxruntime: it is wrapped, the interface stays fp16."""
    g = helper.make_graph([helper.make_node("Mul", ["x", "k"], ["m"]),
                           helper.make_node("Celu", ["m"], ["y"], alpha=0.5)], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
                          initializer=[numpy_helper.from_array(np.float32([1.5]), "k")])
    model = make_model(g)
    result = compile_onnx(ModelSpec(model, {}, "fp16"))
    assert {(a.name, a.dtype) for a in result.anchors} == {("x", "F16"), ("y", "F16")}
    ops = [n.op_type for n in result.output_model.graph.node]
    assert ops.count("Cast") == 2 and "Celu" in ops
    x = np.linspace(-3, 3, 8, dtype=np.float32).reshape(2, 4)
    io = ArrayIO({"x": [x.astype(np.float16)]}, {"y": (np.dtype(np.float16), (2, 4))})
    Interpreter(Executable.from_bytes(result.executable.to_bytes())).run_program(1, io)
    ref = run_reference(model, {"x": x})["y"]
    np.testing.assert_allclose(io.outputs["y"][0].astype(np.float32), ref, rtol=2e-3, atol=2e-3)


def test_ir_version_is_lowered_for_onnxruntime() -> None:
    model = simple_model()
    model.ir_version = onnx.IR_VERSION
    result = compile_onnx(ModelSpec(model))
    assert result.output_model.ir_version <= ort_max_ir_version()
    Interpreter(result.executable)


@pytest.mark.parametrize("weights_as_tensor_data", [False, True])
def test_initializers_listed_among_inputs_are_not_streams(weights_as_tensor_data: bool) -> None:
    """Old exporters list initializers in graph.input too; they stay weights."""
    model = simple_model((1, 4), seed=1)
    model.graph.input.append(helper.make_tensor_value_info("weights", TensorProto.FLOAT, [1, 4]))
    result = compile_onnx(ModelSpec(model), CompileOptions(
        weights_as_tensor_data=weights_as_tensor_data))
    kinds = {a.name: a.kind for a in result.anchors}
    expected = {"tensor_A": "input", "tensor_B": "input", "tensor_C": "output"}
    if weights_as_tensor_data:
        expected["weights"] = "weight"
    assert kinds == expected
    a, b = np.ones((1, 4), np.float32) * 2, np.ones((1, 4), np.float32)
    feeds = {"tensor_A": [a], "tensor_B": [b]}
    w = numpy_helper.to_array(model.graph.initializer[0])
    if weights_as_tensor_data:
        feeds["weights"] = [w]
    io = ArrayIO(feeds, {"tensor_C": (np.dtype(np.float32), (1, 4))})
    interp = Interpreter(result.executable)
    interp.run_program(0, io)
    interp.run_program(1, io)
    np.testing.assert_allclose(io.outputs["tensor_C"][0], a * w + b, rtol=1e-6)
