"""poprt.Converter over scripted models (checked with onnxruntime), and the poprt command
accepting every flag PopRT 1.5 documents."""

from __future__ import annotations

import numpy as np
import pytest
import onnx
from onnx import TensorProto, helper, numpy_helper

from host_runtime import poprt
from host_runtime.errors import BadRequestError
from host_runtime.poprt._check import run_onnxruntime

F = TensorProto.FLOAT


def _model(opset=9):
    w = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(3, 4) / 10, "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("Relu", ["h"], ["y"], name="relu"),
             helper.make_node("Neg", ["h"], ["z"], name="neg")]
    g = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("x", F, ["N", 3])],
                          [helper.make_tensor_value_info("y", F, ["N", 4]),
                           helper.make_tensor_value_info("z", F, ["N", 4])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 7
    return m


def test_converter_shapes_outputs_opset_and_check():
    m = _model()
    conv = poprt.Converter(batch_size=2, batch_axis=0, remove_outputs=["z"], checkpoints="h",
                           check=True, convert_version=11)
    out = conv.convert(m)
    assert next(o.version for o in out.opset_import if o.domain == "") == 11
    assert [d.dim_value for d in out.graph.input[0].type.tensor_type.shape.dim] == [2, 3]
    assert [o.name for o in out.graph.output] == ["y", "h"]
    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    got = run_onnxruntime(out, {"x": x})
    np.testing.assert_allclose(got["y"], run_onnxruntime(m, {"x": x})["y"], rtol=1e-6)
    assert m.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "N"   # input untouched


def test_converter_passes_follow_the_options():
    conv = poprt.Converter(input_shape={"x": [1, 3]}, enable_erf_gelu=True,
                           skip_passes="gelu_pattern", used_passes=["int64_to_int32"],
                           precision="fp16", disable_fast_norm=True)
    names = [p if isinstance(p, str) else p.name for p in conv.passes()]
    assert names == ["const_input_shape", "replace_softmax", "sort_graph", "erf_gelu_pattern",
                     "int64_to_int32", "float_to_half"]
    with pytest.raises(BadRequestError, match=r"skip_passes names unregistered passes \['x'\]"):
        poprt.Converter(skip_passes="x")
    with pytest.raises(BadRequestError, match="batch_size and batch_axis go together"):
        poprt.Converter(batch_size=2)


def test_converted_int64_inputs_and_outputs_are_int32():
    """PopRT documents that a converted model's int64 inputs become int32 (the IPU has
    none): a benchmark harness feeds int32 to the converted model and int64 to the
    original on onnxruntime, and compares the two."""
    emb = numpy_helper.from_array(np.arange(20, dtype=np.float32).reshape(10, 2), "emb")
    g = helper.make_graph(
        [helper.make_node("Gather", ["emb", "ids"], ["e"]),
         helper.make_node("ArgMax", ["e"], ["best"], axis=-1, keepdims=0),
         helper.make_node("Add", ["ids", "ids"], ["twice"])], "ids",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", 4])],
        [helper.make_tensor_value_info("best", TensorProto.INT64, ["N", 4]),
         helper.make_tensor_value_info("twice", TensorProto.INT64, ["N", 4])], [emb])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    out = poprt.Converter(input_shape={"ids": [2, 4]}).convert(m)
    types = {v.name: v.type.tensor_type.elem_type for v in [*out.graph.input, *out.graph.output]}
    assert types == {"ids": TensorProto.INT32, "twice": TensorProto.INT32,
                     "best": TensorProto.INT32}
    ids = np.random.default_rng(2).integers(0, 10, (2, 4))
    got = run_onnxruntime(out, {"ids": ids.astype(np.int32)})
    want = run_onnxruntime(m, {"ids": ids.astype(np.int64)})
    for k in want:
        assert got[k].dtype == np.int32
        np.testing.assert_array_equal(got[k], want[k])
    kept = poprt.Converter(input_shape={"ids": [2, 4]}, skip_passes="int64_to_int32").convert(m)
    assert kept.graph.input[0].type.tensor_type.elem_type == TensorProto.INT64
    assert [p if isinstance(p, str) else p.name for p in poprt.Converter().passes()] == \
        ["int64_to_int32", "layer_norm_pattern", "gelu_pattern", "replace_softmax", "sort_graph"]


def test_fp16_converter_keeps_values_close():
    m = _model(13)
    out = poprt.Converter(input_shape={"x": [2, 3]}, precision="fp16").convert(m)
    x = np.random.default_rng(1).standard_normal((2, 3)).astype(np.float32)
    got = run_onnxruntime(out, {"x": x.astype(np.float16)})
    want = run_onnxruntime(m, {"x": x})
    assert got["y"].dtype == np.float16
    np.testing.assert_allclose(got["y"].astype(np.float32), want["y"], rtol=1e-2, atol=1e-2)


DOCUMENTED_FLAGS = [
    ["--apply_hcsr", "fp32,[512,1]"], ["--available_memory_proportion", "0.5"],
    ["--batch_size", "1"], ["--batch_axis", "0"], ["--batches_per_step", "2"],
    ["--calibration_with_data"], ["--calibration_loss_type", "mse"], ["--check"],
    ["--checkpoints", "a"], ["--compiler_options", "num_ipus=1"], ["--config_yaml", "c.yaml"],
    ["--convert_version", "13"], ["--custom_library_so_paths", "a.so"],
    ["--custom_pass_config", "p.py"], ["--custom_shape_inference", "s.py"],
    ["--data_preprocess", "d.pkl"], ["--disable_compilation_progress_bar"],
    ["--disable_fast_norm"], ["--eightbitsio"], ["--merge_if_with_same_cond"],
    ["--enable_compress_pattern"], ["--enable_erf_gelu"], ["--enable_insert_remap"],
    ["--export_popef"], ["--fold_periodic_initializer"], ["--fp16_skip_op_types", "Gelu"],
    ["--enable_avoid_overflow_patterns"], ["--fp8_skip_op_names", "Conv_1"],
    ["--fp8_params", "F143,F143,0,0"], ["--framework", "onnx"], ["--infer_shape_ahead"],
    ["-i", "m.onnx"], ["--input_shape", "a=1,2", "b=3"], ["--ipu_version", "ipu2"],
    ["--list_all_passes"], ["--logging_level", "INFO"], ["--manual_sharding_config", "s.yaml"],
    ["--max_tensor_size", "100"], ["--num_io_tiles", "32"], ["--num_of_layers_keep_fp16", "1"],
    ["--only_manual_sharding"], ["--optimize_internal_exchange_code"], ["--output_dir", "o"],
    ["--output_model", "m2.onnx"], ["--pack_args", "max_valid_num=90"], ["--passes", "a,b"],
    ["--perf_tuner"], ["--popart_options", "a=b"], ["--precision", "fp8_weight"],
    ["--precision_compare"], ["--print_completion", "zsh"], ["--remap_mode", "after_matmul"],
    ["--remove_outputs", "z"], ["--run"], ["--serialize_matmul", "MatMul_1=4"],
    ["--serialize_matmul_add", "MatMul_1/Add_2=4"], ["--merge_matmul", "a,b"],
    ["--merge_matmul_add", "a,b,c,d"], ["--merge_moe", "a,b,c,d"], ["--show"],
    ["--show_io_stat"], ["--skip_passes", "sort_graph"], ["-v"], ["tf2onnx"],
]


@pytest.mark.parametrize("flag", DOCUMENTED_FLAGS, ids=lambda f: f[0])
def test_every_documented_flag_parses(flag):
    from tools.poprt import build_parser

    build_parser().parse_args(flag)


def test_refused_flags_are_named(tmp_path, capsys):
    from tools.poprt import main

    for flag, word in ((["--perf_tuner"], "--perf_tuner is not supported"),
                       (["--framework", "tensorflow"], "TensorFlow models"),
                       (["--precision", "fp8", "--calibration_with_data"],
                        "does not exist"),
                       (["--pack_args", "a=1"], "pack_args is not supported")):
        assert main(["-i", str(tmp_path / "m.onnx"), *flag]) == 2
        assert word in capsys.readouterr().err


def _fp8_ref(a, t=TensorProto.FLOAT8E4M3FNUZ):
    """onnx's own conversion to Graphcore's fp8 (FNUZ) values: the reference."""
    a = np.asarray(a, np.float32)
    return numpy_helper.to_array(helper.make_tensor("r", t, a.shape, a.flatten().tolist())
                                 ).astype(np.float32).reshape(a.shape)


@pytest.mark.parametrize("precision", ["fp8_weight", "fp8"])
def test_fp8_rounds_operands_as_the_ipu_holds_them(precision):
    rng = np.random.default_rng(5)
    w = (rng.standard_normal((3, 4)) * 3).astype(np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "m",
                          [helper.make_tensor_value_info("x", F, [2, 3])],
                          [helper.make_tensor_value_info("y", F, [2, 4])],
                          [numpy_helper.from_array(w, "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    out = poprt.Converter(precision=precision, fp8_params="F143,F143,0,1").convert(m)
    x = (rng.standard_normal((2, 3)) * 3).astype(np.float16)
    got = run_onnxruntime(out, {"x": x})["y"].astype(np.float32)
    wq = (_fp8_ref(w.astype(np.float16).astype(np.float32) * 2) / 2)
    xq = _fp8_ref(x.astype(np.float32)) if precision == "fp8" else x.astype(np.float32)
    np.testing.assert_allclose(got, xq @ wq, rtol=2e-3, atol=2e-3)
    skipped = poprt.Converter(precision=precision, fp8_skip_op_names="mm").convert(m)
    np.testing.assert_allclose(run_onnxruntime(skipped, {"x": x})["y"].astype(np.float32),
                               x.astype(np.float32) @ w, rtol=5e-3, atol=5e-3)


def test_fp8_pass_on_two_unnamed_matmuls_gives_a_valid_model():
    """``get_pass("float_to_fp8")(model)`` (PopRT's documented use) on two MatMuls neither
    of which is named: each input is rounded through nodes of names of its own."""
    rng = np.random.default_rng(6)
    w = rng.standard_normal((4, 4)).astype(np.float32)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["t"]),
                           helper.make_node("MatMul", ["t", "w"], ["y"])], "m",
                          [helper.make_tensor_value_info("x", F, [2, 4])],
                          [helper.make_tensor_value_info("y", F, [2, 4])],
                          [numpy_helper.from_array(w, "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    out = poprt.get_pass("float_to_fp8")(m)
    assert sum(n.op_type == "Round" for n in out.graph.node) == 2   # both inputs rounded
    onnx.checker.check_model(out, full_check=True)
    x = rng.standard_normal((2, 4)).astype(np.float32)
    got = run_onnxruntime(out, {"x": x})["y"]
    np.testing.assert_allclose(got, x @ w @ w, rtol=0.25, atol=0.25)   # fp8: 3 mantissa bits


def test_config_yaml_refuses_converter_flags(tmp_path, capsys):
    from tools.poprt import main

    assert main(["--config_yaml", str(tmp_path / "c.yaml"), "--passes", "sort_graph"]) == 2
    assert "--config_yaml (model fusion) does not take --passes" in capsys.readouterr().err
