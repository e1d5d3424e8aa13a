"""PopRT's passes over models built here: every documented name is registered; each pass
that changes a model is compared with the original on onnxruntime; IPU-only passes return
the model as given; refused ones raise by name; users' passes register and run."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from host_runtime import poprt
from host_runtime.errors import BadRequestError
from host_runtime.poprt._check import run_onnxruntime
from host_runtime.poprt.passes import Pass, PassManager, PassNotSupportedError, register

F = TensorProto.FLOAT


def _model(nodes, inputs, outputs, inits=(), opset=13, name="g"):
    g = helper.make_graph(nodes, name, inputs, outputs, list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m


def _vi(name, dims, t=F):
    return helper.make_tensor_value_info(name, t, dims)


def _init(name, arr):
    return numpy_helper.from_array(np.asarray(arr), name)


RNG = np.random.default_rng(7)


def _same(before, after, feeds, rtol=1e-5):
    want = run_onnxruntime(before, feeds)
    got = run_onnxruntime(after, feeds)
    for k, v in want.items():
        if k in got:
            np.testing.assert_allclose(np.asarray(got[k], np.float64), np.asarray(v, np.float64),
                                       rtol=rtol, atol=rtol)
    return got


DOCUMENTED = {
    "add_checkpoints", "apply_host_concat_split", "apply_ir_pass", "attention_padding",
    "auto_insert_remap", "batchnorm_workaround", "check_unsupported_attribute",
    "check_with_fake_data", "compress_pattern", "const_batch_size", "const_input_shape",
    "constant_folding", "cumsum_workaround", "double_to_float", "eight_bits_io",
    "eliminate_deadend", "eliminate_duplicate_initializer", "eliminate_duplicate_nodes",
    "eliminate_identity", "eliminate_nop_arithmetic", "eliminate_nop_cast",
    "eliminate_nop_expand", "eliminate_nop_flatten", "eliminate_nop_if", "eliminate_nop_pad",
    "eliminate_nop_reshape", "eliminate_nop_transpose", "eliminate_unused_initializer",
    "erf_gelu_pattern", "expand_if", "extract_constant_to_initializer", "fill_squeeze_axes",
    "final_check", "float_ops_workaround", "float_to_fp8", "float_to_half", "float_to_int8",
    "float_to_mixed", "fold_periodic_initializer", "fuse_bn_into_conv", "fuse_bn_into_gemm",
    "fuse_cast_into_onehot", "fuse_consecutive_arithmetic", "fuse_consecutive_cast",
    "fuse_consecutive_reshape", "fuse_consecutive_squeeze", "fuse_consecutive_transpose",
    "fuse_consecutive_unsqueeze", "fuse_mul_into_matmul", "fused_attention", "gelu_pattern",
    "indices_workaround", "insert_attention_mask", "int64_to_int32", "layer_norm_pattern",
    "layer_precision_compare", "manual_sharding", "matmul_rotary_embedding",
    "merge_if_with_same_cond", "merge_matmul", "merge_matmul_add", "merge_moe",
    "merge_multi_slice", "merge_variant_if", "model_io_info_stat", "model_overview",
    "move_subgraph_initializer", "onehot_workaround", "overlap_io", "packed_transformer",
    "post_expand", "pre_scale", "remove_duplicated_initializer", "remove_empty_concat_inputs",
    "remove_initializer_from_input", "remove_input_cast", "remove_outputs",
    "replace_bn_with_mul_add", "replace_castlike", "replace_clip_empty_inputs",
    "replace_consecutive_cast_with_notzero", "replace_div_with_mul",
    "replace_einsum_with_matmul", "replace_erf_with_erfv2", "replace_gemm_with_matmul",
    "replace_greater_or_equal", "replace_groupnorm_with_fast_norm", "replace_half_reducemean",
    "replace_hardswish", "replace_isinf", "replace_less_or_equal", "replace_nonzero",
    "replace_pow", "replace_round", "replace_softmax", "replace_where_mask",
    "replace_where_with_mul_add", "replace_where_with_wherev2", "serialize_matmul",
    "serialize_matmul_add", "shape_inference", "sort_graph", "topk_workaround",
    "trace_folding", "unique_name_for_nodes"}


def test_every_documented_pass_is_registered_in_its_module():
    assert DOCUMENTED <= set(poprt.get_registered_passes())
    from host_runtime.poprt.passes.float_to_half import Float2Half
    from host_runtime.poprt.passes.workarounds import TopKWorkaround
    assert Float2Half.name == "float_to_half" and TopKWorkaround.name == "topk_workaround"
    assert poprt.passes.layer_precision_compare.LayerPrecisionCompare.name == \
        "layer_precision_compare"


def test_ipu_only_passes_return_the_model_and_say_so():
    m = _model([helper.make_node("Relu", ["x"], ["y"])], [_vi("x", [2])], [_vi("y", [2])])
    p = poprt.get_pass("gelu_pattern")
    assert p(m) is m
    assert "leaves the emulated result unchanged" in type(p).__doc__


def test_refused_passes_raise_by_name():
    m = _model([helper.make_node("Relu", ["x"], ["y"])], [_vi("x", [2])], [_vi("y", [2])])
    with pytest.raises(PassNotSupportedError, match="'float_to_int8' is not supported"):
        poprt.get_pass("float_to_int8")(m)


def test_unknown_pass_is_named():
    with pytest.raises(BadRequestError, match="no pass is registered as 'nope'"):
        poprt.get_pass("nope")


def test_user_pass_registers_and_runs_with_constraints():
    @register("test_add_to_sub")
    class AddToSub(Pass):
        def run(self, onnx_model):
            def transform(graph, _main):
                for n in graph.node:
                    if n.op_type == "Add":
                        n.op_type = "Sub"
                return graph
            onnx_model.graph.CopyFrom(self.traverse_graph(onnx_model.graph, transform))
            return onnx_model

    @Pass.constraint_passes("depend", ["test_add_to_sub"])
    @register("test_after")
    class After(Pass):
        def run(self, onnx_model):
            return onnx_model

    assert "test_add_to_sub" in poprt.get_registered_passes()
    pm = PassManager(["test_after"])
    assert pm.get_all_pass_names() == ["test_add_to_sub", "test_after"]
    m = _model([helper.make_node("Add", ["x", "y"], ["z"])], [_vi("x", [3]), _vi("y", [3])],
               [_vi("z", [3])])
    out = pm.run(m)
    x, y = RNG.random(3, dtype=np.float32), RNG.random(3, dtype=np.float32)
    np.testing.assert_allclose(run_onnxruntime(out, {"x": x, "y": y})["z"], x - y)
    with pytest.raises(BadRequestError, match="already registered"):
        register("test_add_to_sub")(After)
    Pass.against_passes(["test_after"])(AddToSub)
    with pytest.raises(BadRequestError, match="cannot run together"):
        PassManager(["test_add_to_sub", "test_after"])
    Pass.property_register("against", [])(AddToSub)


def test_const_input_shape_and_batch():
    x = helper.make_tensor_value_info("x", F, ["N", 4])
    m = _model([helper.make_node("Relu", ["x"], ["y"])], [x], [_vi("y", ["N", 4])])
    out = poprt.get_pass("const_input_shape", {"x": [3, 4]})(m)
    assert [d.dim_value for d in out.graph.input[0].type.tensor_type.shape.dim] == [3, 4]
    out = poprt.get_pass("const_input_shape", {}, batch_size=5, batch_axis=0)(m)
    assert [d.dim_value for d in out.graph.input[0].type.tensor_type.shape.dim] == [5, 4]
    out = poprt.get_pass("const_batch_size", 2)(m)
    assert [d.dim_value for d in out.graph.input[0].type.tensor_type.shape.dim] == [2, 4]
    _same(m, out, {"x": RNG.standard_normal((2, 4)).astype(np.float32)})
    from ipu_emulator.errors import CompileError
    with pytest.raises(CompileError, match="not an input"):
        poprt.get_pass("const_input_shape", {"nope": [1]})(m)


def test_float_to_half_skips_op_types():
    nodes = [helper.make_node("Mul", ["x", "w"], ["a"]), helper.make_node("Sigmoid", ["a"], ["y"])]
    m = _model(nodes, [_vi("x", [2, 3])], [_vi("y", [2, 3])],
               [_init("w", RNG.standard_normal((2, 3)).astype(np.float32))])
    out = poprt.get_pass("float_to_half", skip_op_types=["Sigmoid"])(m)
    assert out.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT16
    sig = next(n for n in out.graph.node if n.op_type == "Sigmoid")
    casts = {n.output[0]: n for n in out.graph.node if n.op_type == "Cast"}
    assert sig.input[0] in casts and helper.get_attribute_value(
        casts[sig.input[0]].attribute[0]) == TensorProto.FLOAT
    x = RNG.standard_normal((2, 3)).astype(np.float32)
    want = run_onnxruntime(m, {"x": x})["y"]
    got = run_onnxruntime(out, {"x": x.astype(np.float16)})["y"]
    assert got.dtype == np.float16
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=5e-3, atol=5e-3)


def test_float_to_half_keeps_declared_output_shapes_inference_cannot_find():
    """com.microsoft's Gelu has no shape function in onnx: the output keeps its shape."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["t"]),
             helper.make_node("Gelu", ["t"], ["y"], domain="com.microsoft")]
    m = _model(nodes, [_vi("x", [3, 4])], [_vi("y", [3, 4])],
               [_init("w", RNG.standard_normal((4, 4)).astype(np.float32))])
    m.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    for out in (poprt.get_pass("float_to_half")(m), poprt.Converter(precision="fp16").convert(m)):
        tt = out.graph.output[0].type.tensor_type
        assert tt.elem_type == TensorProto.FLOAT16
        assert [d.dim_value for d in tt.shape.dim] == [3, 4]
        x = RNG.standard_normal((3, 4)).astype(np.float32)
        got = run_onnxruntime(out, {"x": x.astype(np.float16)})["y"].astype(np.float32)
        np.testing.assert_allclose(got, run_onnxruntime(m, {"x": x})["y"], rtol=1e-2, atol=1e-2)


def test_int64_to_int32_and_double_to_float():
    m = _model([helper.make_node("Add", ["i", "c"], ["o"])], [_vi("i", [3], TensorProto.INT64)],
               [_vi("o", [3], TensorProto.INT64)], [_init("c", np.array([1, 2, 3], np.int64))])
    out = poprt.get_pass("int64_to_int32")(m)
    assert out.graph.input[0].type.tensor_type.elem_type == TensorProto.INT32
    assert out.graph.output[0].type.tensor_type.elem_type == TensorProto.INT32
    got = run_onnxruntime(out, {"i": np.array([4, 5, 6], np.int32)})["o"]
    assert got.dtype == np.int32 and got.tolist() == [5, 7, 9]
    d = TensorProto.DOUBLE
    m = _model([helper.make_node("Mul", ["x", "c"], ["y"])], [_vi("x", [2], d)], [_vi("y", [2], d)],
               [_init("c", np.array([0.5, 2.0]))])
    out = poprt.get_pass("double_to_float")(m)
    assert out.graph.initializer[0].data_type == F
    got = run_onnxruntime(out, {"x": np.array([2.0, 3.0], np.float32)})["y"]
    assert got.dtype == np.float32 and got.tolist() == [1.0, 6.0]


def test_remove_outputs_and_add_checkpoints():
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Neg", ["a"], ["b"]),
             helper.make_node("Exp", ["x"], ["c"])]
    m = _model(nodes, [_vi("x", [4])], [_vi("b", [4]), _vi("c", [4])])
    out = poprt.get_pass("remove_outputs", ["c"])(m)
    assert [o.name for o in out.graph.output] == ["b"]
    assert "Exp" not in {n.op_type for n in out.graph.node}
    out = poprt.get_pass("add_checkpoints", ["a"])(m)
    x = RNG.standard_normal(4).astype(np.float32)
    assert run_onnxruntime(out, {"x": x})["a"].tolist() == np.maximum(x, 0).tolist()
    with pytest.raises(BadRequestError, match="not outputs"):
        poprt.get_pass("remove_outputs", ["zz"])(m)


def test_remove_input_cast():
    m = _model([helper.make_node("Cast", ["x"], ["xi"], to=TensorProto.INT32),
                helper.make_node("Gather", ["table", "xi"], ["y"])],
               [_vi("x", [2], TensorProto.FLOAT16)], [_vi("y", [2, 3])],
               [_init("table", RNG.standard_normal((5, 3)).astype(np.float32))])
    out = poprt.get_pass("remove_input_cast")(m)
    assert out.graph.input[0].type.tensor_type.elem_type == TensorProto.INT32
    got = run_onnxruntime(out, {"x": np.array([1, 4], np.int32)})["y"]
    want = run_onnxruntime(m, {"x": np.array([1, 4], np.float16)})["y"]
    np.testing.assert_array_equal(got, want)


def test_constant_folding_respects_max_tensor_size():
    nodes = [helper.make_node("Mul", ["c", "c"], ["c2"]), helper.make_node("Add", ["x", "c2"], ["y"])]
    m = _model(nodes, [_vi("x", [4])], [_vi("y", [4])], [_init("c", np.arange(4, dtype=np.float32))])
    out = poprt.get_pass("constant_folding")(m)
    assert [n.op_type for n in out.graph.node] == ["Add"]
    _same(m, out, {"x": RNG.standard_normal(4).astype(np.float32)})
    assert len(poprt.get_pass("constant_folding", 8)(m).graph.node) == 2


def _bn(name, c):
    return [_init(f"{name}_s", RNG.random(c, dtype=np.float32) + 0.5),
            _init(f"{name}_b", RNG.standard_normal(c).astype(np.float32)),
            _init(f"{name}_m", RNG.standard_normal(c).astype(np.float32)),
            _init(f"{name}_v", RNG.random(c, dtype=np.float32) + 0.5)]


@pytest.mark.parametrize("name, nodes, inits, op_gone", [
    ("replace_gemm_with_matmul",
     [helper.make_node("Gemm", ["x", "w", "b"], ["y"], transB=1, alpha=0.5, beta=2.0)],
     [_init("w", RNG.standard_normal((5, 4)).astype(np.float32)),
      _init("b", RNG.standard_normal(5).astype(np.float32))], "Gemm"),
    ("replace_div_with_mul", [helper.make_node("Div", ["x", "d"], ["y"])],
     [_init("d", np.float32(4.0))], "Div"),
    ("replace_pow", [helper.make_node("Pow", ["x", "e"], ["y"])], [_init("e", np.float32(3.0))],
     "Pow"),
    ("fuse_mul_into_matmul", [helper.make_node("MatMul", ["x", "w"], ["t"]),
                              helper.make_node("Mul", ["t", "s"], ["y"])],
     [_init("w", RNG.standard_normal((4, 4)).astype(np.float32)), _init("s", np.float32(3.0))],
     "Mul"),
    ("fuse_consecutive_transpose", [helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0]),
                                    helper.make_node("Transpose", ["t"], ["t2"], perm=[1, 0]),
                                    helper.make_node("Relu", ["t2"], ["y"])], [], None),
    ("eliminate_identity", [helper.make_node("Identity", ["x"], ["t"]),
                            helper.make_node("Relu", ["t"], ["y"])], [], "Identity"),
])
def test_rewrites_keep_values(name, nodes, inits, op_gone):
    m = _model(nodes, [_vi("x", [3, 4])], [_vi("y", None)], inits)
    out = poprt.get_pass(name)(m)
    if op_gone:
        assert op_gone not in {n.op_type for n in out.graph.node}
    _same(m, out, {"x": RNG.standard_normal((3, 4)).astype(np.float32)})


@pytest.mark.parametrize("name, op, inits", [
    ("replace_pow", "Pow", [_init("e", np.float32(2.0))]),
    ("replace_gemm_with_matmul", "Gemm", [_init("w", RNG.standard_normal((4, 4)).astype(np.float32))]),
    ("replace_where_with_mul_add", "Where", [_init("z", np.float32(0.5))]),
    ("replace_hardswish", "HardSwish", []),
    ("replace_div_with_mul", "Div", [_init("d", np.float32(4.0))]),
])
def test_rewrites_of_two_unnamed_nodes_give_a_valid_model(name, op, inits):
    """Two nodes of the rewritten kind, neither named (as onnx.helper makes them): the
    names the pass makes for the second differ from the first's."""
    def node(x, y):
        if op == "Pow":
            return [helper.make_node("Pow", [x, "e"], [y])]
        if op == "Gemm":
            return [helper.make_node("Gemm", [x, "w"], [y], transB=1)]
        if op == "Where":
            return [helper.make_node("Greater", [x, "z"], [y + "_c"]),
                    helper.make_node("Where", [y + "_c", x, "z"], [y])]
        if op == "HardSwish":
            return [helper.make_node("HardSwish", [x], [y])]
        return [helper.make_node("Div", [x, "d"], [y])]
    m = _model(node("x", "t") + node("t", "y"), [_vi("x", [3, 4])], [_vi("y", [3, 4])], inits,
               opset=14)
    out = poprt.get_pass(name)(m)
    assert op not in {n.op_type for n in out.graph.node}
    onnx.checker.check_model(out, full_check=True)
    names = [n.name for n in out.graph.node if n.name]
    assert len(set(names)) == len(names), names
    _same(m, out, {"x": RNG.standard_normal((3, 4)).astype(np.float32)})


def test_batchnorm_rewrites_keep_values():
    bn = helper.make_node("BatchNormalization", ["c", "bn_s", "bn_b", "bn_m", "bn_v"], ["y"])
    conv = helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1])
    m = _model([conv, bn], [_vi("x", [1, 2, 5, 5])], [_vi("y", [1, 3, 5, 5])],
               [_init("w", RNG.standard_normal((3, 2, 3, 3)).astype(np.float32))] + _bn("bn", 3))
    feeds = {"x": RNG.standard_normal((1, 2, 5, 5)).astype(np.float32)}
    fused = poprt.get_pass("fuse_bn_into_conv")(m)
    assert [n.op_type for n in fused.graph.node] == ["Conv"]
    _same(m, fused, feeds, rtol=1e-4)
    mul_add = poprt.get_pass("replace_bn_with_mul_add")(m)
    assert "BatchNormalization" not in {n.op_type for n in mul_add.graph.node}
    _same(m, mul_add, feeds, rtol=1e-4)


def test_comparisons_where_and_castlike_keep_values():
    B = TensorProto.BOOL
    nodes = [helper.make_node("GreaterOrEqual", ["x", "z"], ["ge"]),
             helper.make_node("LessOrEqual", ["x", "z"], ["le"]),
             helper.make_node("Where", ["ge", "x", "z"], ["w"]),
             helper.make_node("CastLike", ["ge", "x"], ["cl"])]
    m = _model(nodes, [_vi("x", [6]), _vi("z", [6])],
               [_vi("ge", [6], B), _vi("le", [6], B), _vi("w", [6]), _vi("cl", [6])], opset=15)
    out = m
    for name in ("replace_greater_or_equal", "replace_less_or_equal",
                 "replace_where_with_mul_add", "replace_castlike"):
        out = poprt.get_pass(name)(out)
    ops = {n.op_type for n in out.graph.node}
    assert not ops & {"GreaterOrEqual", "LessOrEqual", "Where", "CastLike"}
    x = np.array([1, 2, 3, 4, 5, 6], np.float32)
    got = _same(m, out, {"x": x, "z": np.full(6, 3.0, np.float32)})
    assert got["ge"].tolist() == [False, False, True, True, True, True]


def test_structure_passes():
    nodes = [helper.make_node("Relu", ["t"], ["y"]),
             helper.make_node("Squeeze", ["x"], ["t"]),
             helper.make_node("Constant", [], ["k"], value=_init("k", np.float32(2.0))),
             helper.make_node("Mul", ["y", "k"], ["y2"])]
    m = _model(nodes, [_vi("x", [1, 4])], [_vi("y2", [4])],
               [_init("a", np.ones(3, np.float32)), _init("b", np.ones(3, np.float32))], opset=11)
    m.graph.node[0].name = m.graph.node[1].name = "same"
    out = PassManager(["sort_graph", "unique_name_for_nodes", "fill_squeeze_axes",
                       "extract_constant_to_initializer", "remove_duplicated_initializer",
                       "eliminate_unused_initializer"]).run(m)
    assert [n.op_type for n in out.graph.node] == ["Squeeze", "Relu", "Mul"]
    names = [n.name for n in out.graph.node]
    assert len(set(names)) == len(names)
    sq = out.graph.node[0]
    assert helper.get_attribute_value(sq.attribute[0]) == [0]
    assert [t.name for t in out.graph.initializer] == ["k"]
    x = RNG.standard_normal((1, 4)).astype(np.float32)   # the original is out of order
    np.testing.assert_allclose(run_onnxruntime(out, {"x": x})["y2"], np.maximum(x[0], 0) * 2)


def test_check_with_fake_data_finds_a_change():
    m = _model([helper.make_node("Add", ["x", "x"], ["y"])], [_vi("x", [3])], [_vi("y", [3])])
    changed = _model([helper.make_node("Sub", ["x", "x"], ["y"])], [_vi("x", [3])],
                     [_vi("y", [3])])
    assert poprt.get_pass("check_with_fake_data", m)(m) is m
    with pytest.raises(BadRequestError, match="output 'y' of the converted model differs"):
        poprt.get_pass("check_with_fake_data", m)(changed)


def test_model_overview_prints(capsys):
    m = _model([helper.make_node("Relu", ["x"], ["y"])], [_vi("x", [2])], [_vi("y", [2])])
    assert poprt.get_pass("model_overview")(m) is m
    assert "Relu: 1" in capsys.readouterr().out


def test_nop_eliminations_and_hardswish_keep_values():
    nodes = [helper.make_node("Reshape", ["x", "s"], ["r"]),
             helper.make_node("Pad", ["r", "p"], ["pd"]),
             helper.make_node("Add", ["pd", "zero"], ["a"]),
             helper.make_node("Flatten", ["a"], ["f"], axis=1),
             helper.make_node("HardSwish", ["f"], ["y"])]
    inits = [_init("s", np.array([3, 4], np.int64)), _init("p", np.zeros(4, np.int64)),
             _init("zero", np.float32(0.0))]
    m = _model(nodes, [_vi("x", [3, 4])], [_vi("y", [3, 4])], inits, opset=14)
    out = PassManager(["eliminate_nop_reshape", "eliminate_nop_pad", "eliminate_nop_arithmetic",
                       "eliminate_nop_flatten", "replace_hardswish"]).run(m)
    assert [n.op_type for n in out.graph.node] == ["HardSigmoid", "Mul"]
    assert out.graph.initializer == []
    _same(m, out, {"x": (RNG.standard_normal((3, 4)) * 4).astype(np.float32)})


@pytest.mark.parametrize("trans_b, with_c", [(0, True), (1, False)])
def test_fuse_bn_into_gemm_keeps_values(trans_b, with_c):
    w = RNG.standard_normal((5, 3) if trans_b else (3, 5)).astype(np.float32)
    ins = ["x", "w", "c"] if with_c else ["x", "w"]
    gemm = helper.make_node("Gemm", ins, ["g"], transB=trans_b, beta=0.5, alpha=2.0)
    bn = helper.make_node("BatchNormalization", ["g", "bn_s", "bn_b", "bn_m", "bn_v"], ["y"])
    inits = [_init("w", w), _init("c", RNG.standard_normal(5).astype(np.float32))] + _bn("bn", 5)
    m = _model([gemm, bn], [_vi("x", [2, 3])], [_vi("y", [2, 5])], inits)
    out = poprt.get_pass("fuse_bn_into_gemm")(m)
    assert [n.op_type for n in out.graph.node] == ["Gemm"]
    _same(m, out, {"x": RNG.standard_normal((2, 3)).astype(np.float32)}, rtol=1e-4)
