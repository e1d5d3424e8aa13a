"""Every pass PopRT 1.5 documents, under its registered name and in its documented module.

Three kinds:

- implemented here over ONNX graphs (``_types``, ``_graph``, ``_rewrite``): they change
  the model as PopRT's do (shapes, precision, outputs, constants, rewrites);
- IPU-only work (PopART custom ops such as Gelu, FastNorm or SoftmaxV2, memory layout,
  serialisation, overlapped I/O): registered, they return the model unchanged, because
  the emulator computes the standard ONNX form, which gives the same values; their
  docstring says so (``effect``);
- passes that would change the model's interface or precision in a way the emulator
  cannot reproduce (int8 and mixed fp8 quantization, packing, 8-bit I/O, host
  concat/split):
  running them raises ``PassNotSupportedError`` naming the pass.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from typing import Any

import onnx

from host_runtime.poprt._errors import NotSupportedError
from host_runtime.poprt._sharding_props import record_sharding
from host_runtime.poprt.passes import _fp8, _graph, _host_concat, _rewrite, _types
from host_runtime.poprt.passes._base import Pass, _registrar

__all__ = ["install", "PassNotSupportedError", "UNCHANGED", "REFUSED"]

UNCHANGED = "leaves the emulated result unchanged (the model is returned as given)"
REFUSED = "refused: the emulator cannot reproduce it"


class PassNotSupportedError(NotSupportedError):
    """A documented PopRT pass the emulator cannot apply."""


# (module, class, registered name, implementation or None, what PopRT does)
_IMPL: list[tuple[str, str, str, type[Pass]]] = [
    ("add_checkpoints", "AddCheckpoints", "add_checkpoints", _graph.AddCheckpoints),
    ("apply_host_concat_split", "ApplyHostConcatSplit", "apply_host_concat_split",
     _host_concat.ApplyHostConcatSplit),
    ("check_with_fake_data", "CheckWithFakeData", "check_with_fake_data", _graph.CheckWithFakeData),
    ("const_batch_size", "ConstBatchSize", "const_batch_size", _types.ConstBatchSize),
    ("const_input_shape", "ConstInputShape", "const_input_shape", _types.ConstInputShape),
    ("constant_folding", "ConstantFolding", "constant_folding", _graph.ConstantFolding),
    ("double_to_float", "DoubleToFloat", "double_to_float", _types.DoubleToFloat),
    ("apply_ir_pass", "eliminate_deadend", "eliminate_deadend", _graph.EliminateDeadend),
    ("apply_ir_pass", "eliminate_duplicate_initializer", "eliminate_duplicate_initializer",
     _graph.RemoveDuplicatedInitializer),
    ("apply_ir_pass", "eliminate_identity", "eliminate_identity", _graph.EliminateIdentity),
    ("apply_ir_pass", "eliminate_nop_arithmetic", "eliminate_nop_arithmetic",
     _rewrite.EliminateNopArithmetic),
    ("apply_ir_pass", "eliminate_nop_cast", "eliminate_nop_cast", _rewrite.EliminateNopCast),
    ("apply_ir_pass", "eliminate_nop_expand", "eliminate_nop_expand", _rewrite.EliminateNopExpand),
    ("apply_ir_pass", "eliminate_nop_flatten", "eliminate_nop_flatten",
     _rewrite.EliminateNopFlatten),
    ("apply_ir_pass", "eliminate_nop_pad", "eliminate_nop_pad", _rewrite.EliminateNopPad),
    ("apply_ir_pass", "eliminate_nop_reshape", "eliminate_nop_reshape",
     _rewrite.EliminateNopReshape),
    ("apply_ir_pass", "eliminate_nop_transpose", "eliminate_nop_transpose",
     _rewrite.EliminateNopTranspose),
    ("apply_ir_pass", "eliminate_unused_initializer", "eliminate_unused_initializer",
     _graph.EliminateUnusedInitializer),
    ("apply_ir_pass", "extract_constant_to_initializer", "extract_constant_to_initializer",
     _graph.ExtractConstantToInitializer),
    ("apply_ir_pass", "fuse_bn_into_conv", "fuse_bn_into_conv", _rewrite.FuseBnIntoConv),
    ("apply_ir_pass", "fuse_consecutive_transpose", "fuse_consecutive_transpose",
     _rewrite.FuseConsecutiveTranspose),
    ("apply_ir_pass", "unique_name_for_nodes", "unique_name_for_nodes", _graph.UniqueNameForNodes),
    ("fill_squeeze_axes", "FillSqueezeAxes", "fill_squeeze_axes", _rewrite.FillSqueezeAxes),
    ("float_to_fp8", "Float2FP8", "float_to_fp8", _fp8.Float2FP8),
    ("float_to_half", "Float2Half", "float_to_half", _types.Float2Half),
    ("fuse_bn_into_gemm", "FuseBnIntoGemm", "fuse_bn_into_gemm", _rewrite.FuseBnIntoGemm),
    ("fuse_mul_into_matmul", "FuseMulIntoMatmul", "fuse_mul_into_matmul", _rewrite.FuseMulIntoMatmul),
    ("int64_to_int32", "Int64ToInt32", "int64_to_int32", _types.Int64ToInt32),
    ("model_io_info_overview", "modelIOInfoOverview", "model_io_info_stat",
     _graph.ModelIOInfoOverview),
    ("model_overview", "ModelOverview", "model_overview", _graph.ModelOverview),
    ("remove_duplicated_initializer", "RemoveDuplicatedInitializer",
     "remove_duplicated_initializer", _graph.RemoveDuplicatedInitializer),
    ("remove_initializer_from_input", "RemoveInitializerFromInput",
     "remove_initializer_from_input", _graph.RemoveInitializerFromInput),
    ("remove_input_cast", "RemoveInputCast", "remove_input_cast", _types.RemoveInputCast),
    ("remove_outputs", "RemoveOutputs", "remove_outputs", _graph.RemoveOutputs),
    ("replace_bn_with_mul_add", "ReplaceBNWithMulAdd", "replace_bn_with_mul_add",
     _rewrite.ReplaceBNWithMulAdd),
    ("replace_castlike", "ReplaceCastLike", "replace_castlike", _types.ReplaceCastLike),
    ("replace_div_with_mul", "ReplaceDivWithMul", "replace_div_with_mul", _rewrite.ReplaceDivWithMul),
    ("replace_gemm_with_matmul", "ReplaceGemmWithMatMul", "replace_gemm_with_matmul",
     _rewrite.ReplaceGemmWithMatMul),
    ("replace_greater_or_equal", "ReplaceGreaterOrEqual", "replace_greater_or_equal",
     _rewrite.ReplaceGreaterOrEqual),
    ("replace_less_or_equal", "ReplaceLessOrEqual", "replace_less_or_equal",
     _rewrite.ReplaceLessOrEqual),
    ("replace_hardswish", "ReplaceHardSwish", "replace_hardswish", _rewrite.ReplaceHardSwish),
    ("replace_pow", "ReplacePow", "replace_pow", _rewrite.ReplacePow),
    ("replace_where_with_mul_add", "ReplaceWhereWithMulAdd", "replace_where_with_mul_add",
     _rewrite.ReplaceWhereWithMulAdd),
    ("shape_inference", "ReplacePow", "shape_inference", _types.ShapeInference),
    ("sort_graph", "SortGraph", "sort_graph", _graph.SortGraph),
]

# Passes whose work is for the IPU only: (module, class, name, what PopRT does)
_IPU_ONLY: list[tuple[str, str, str, str]] = [
    ("attention_padding", "AttentionPadding", "attention_padding", "pads attention MatMuls for speed"),
    ("auto_insert_remap", "AutoInsertRemap", "auto_insert_remap", "inserts Remap ops (tensor layout)"),
    ("workarounds", "BatchNormWorkaround", "batchnorm_workaround", "works around PopART's BatchNorm"),
    ("check_unspported_attribute", "ReplaceUnsupportedAttr", "check_unsupported_attribute",
     "checks attributes PopART does not support"),
    ("compress_pattern", "CompressPattern", "compress_pattern", "uses the MaskCompress custom op"),
    ("workarounds", "CumSumWorkaround", "cumsum_workaround", "works around PopART's CumSum"),
    ("apply_ir_pass", "eliminate_duplicate_nodes", "eliminate_duplicate_nodes", "merges equal nodes"),
    ("apply_ir_pass", "eliminate_nop_if", "eliminate_nop_if", "removes If with equal branches"),
    ("erf_gelu_pattern", "ErfGeluPattern", "erf_gelu_pattern", "uses the Gelu custom op for Erf-Gelu"),
    ("expand_if", "ExpandIf", "expand_if", "restructures If nodes for PopART"),
    ("final_check", "FinalCheck", "final_check", "checks types and shapes for PopART"),
    ("workarounds", "FloatOpsWorkaround", "float_ops_workaround", "casts ops PopART needs in float"),
    ("fold_periodic_initializer", "FoldPeriodicInitializer", "fold_periodic_initializer",
     "folds periodic initializers to save memory"),
    ("fuse_cast_into_onehot", "FuseCastIntoOnehot", "fuse_cast_into_onehot", "fuses Cast into OneHot"),
    ("apply_ir_pass", "fuse_consecutive_arithmetic", "fuse_consecutive_arithmetic", "fuses arithmetic"),
    ("apply_ir_pass", "fuse_consecutive_cast", "fuse_consecutive_cast", "fuses Casts"),
    ("apply_ir_pass", "fuse_consecutive_reshape", "fuse_consecutive_reshape", "fuses Reshapes"),
    ("apply_ir_pass", "fuse_consecutive_squeeze", "fuse_consecutive_squeeze", "fuses Squeezes"),
    ("apply_ir_pass", "fuse_consecutive_unsqueeze", "fuse_consecutive_unsqueeze", "fuses Unsqueezes"),
    ("fused_attention", "FusedAttention", "fused_attention", "uses a fused attention custom op"),
    ("gelu_pattern", "GeluPattern", "gelu_pattern", "uses the Gelu custom op"),
    ("workarounds", "IndicesWorkaround", "indices_workaround", "works around Gather indices"),
    ("insert_attention_mask", "InsertAttentionMask", "insert_attention_mask",
     "uses the AttentionMask custom op"),
    ("layer_norm_pattern", "LayerNormPattern", "layer_norm_pattern", "uses GroupNorm for LayerNorm"),
    ("matmul_rotary_embedding", "MatmulRotaryEmbedding", "matmul_rotary_embedding",
     "computes rotary embeddings as MatMul"),
    ("merge_if_with_same_cond", "MergeIfWithSameCond", "merge_if_with_same_cond", "merges If nodes"),
    ("merge_matmul", "MergeMatmul", "merge_matmul", "merges MatMuls for speed"),
    ("merge_matmul_add", "MergeMatmulAdd", "merge_matmul_add", "merges MatMul/Add pairs for speed"),
    ("merge_moe", "MergeMoE", "merge_moe", "merges mixture-of-experts for speed"),
    ("merge_multi_slice", "MergeMultiSlice", "merge_multi_slice", "merges Slices"),
    ("merge_variant_if", "MergeVariantIf", "merge_variant_if", "moves nodes into If branches"),
    ("move_subgraph_initializer", "MoveSubgraphInitializer", "move_subgraph_initializer",
     "moves sub-graph initializers to the main graph for PopART"),
    ("workarounds", "OneHotWorkaround", "onehot_workaround", "works around PopART's OneHot"),
    ("overlap_io", "OverlapIO", "overlap_io", "overlaps I/O with compute"),
    ("post_expand", "PostExpand", "post_expand", "moves Expand later"),
    ("pre_scale", "PreScale", "pre_scale", "scales Q by 1/sqrt(d) before the MatMul"),
    ("workarounds", "RemoveEmptyConcatInputs", "remove_empty_concat_inputs",
     "removes empty Concat inputs for PopART"),
    ("replace_clip_empty_inputs", "ReplaceClipInputs", "replace_clip_empty_inputs",
     "fills empty Clip inputs for PopART"),
    ("replace_consecutive_cast_with_notzero", "ReplaceConsecuiveCastWithNotZero",
     "replace_consecutive_cast_with_notzero", "uses the NotZero custom op"),
    ("apply_ir_pass", "replace_einsum_with_matmul", "replace_einsum_with_matmul",
     "computes Einsum as MatMul"),
    ("replace_erf_with_erfv2", "ReplaceErfWithErfV2", "replace_erf_with_erfv2", "uses ErfV2"),
    ("replace_groupnorm_with_fast_norm", "ReplaceGroupNormWithFastNorm",
     "replace_groupnorm_with_fast_norm", "uses the FastNorm custom op"),
    ("replace_half_reducemean", "ReplaceHalfReduceMean", "replace_half_reducemean",
     "computes fp16 ReduceMean as ReduceSum and Mul"),
    ("replace_isinf", "ReplaceIsInf", "replace_isinf", "uses IsInfV2"),
    ("replace_nonzero", "ReplaceNonZero", "replace_nonzero", "replaces single-element NonZero"),
    ("replace_round", "ReplaceRound", "replace_round", "uses RoundV2 (half to even, as ONNX)"),
    ("replace_softmax", "ReplaceSoftmax", "replace_softmax", "uses SoftmaxV2"),
    ("replace_where_mask", "ReplaceWhereMask", "replace_where_mask", "masks attention by Add"),
    ("replace_where_with_wherev2", "ReplaceWhereWithWhereV2", "replace_where_with_wherev2",
     "uses WhereV2"),
    ("serialize_matmul", "SerializeMatmul", "serialize_matmul", "serialises MatMuls to save memory"),
    ("serialize_matmul_add", "SerializeMatmulAdd", "serialize_matmul_add",
     "serialises MatMul/Add to save memory"),
    ("workarounds", "TopKWorkaround", "topk_workaround", "makes TopK's axis positive"),
    ("apply_ir_pass", "trace_folding", "trace_folding", "folds traced constants"),
]

# Passes the emulator refuses: (module, class, name, why)
_REFUSED: list[tuple[str, str, str, str]] = [
    ("eight_bits_io", "EightBitsIO", "eight_bits_io",
     "8-bit I/O inserts an IPU normalisation custom op"),
    ("float_to_int8", "Float2Int8", "float_to_int8",
     "int8 conversion uses IPU custom quantization ops"),
    ("float_to_mixed", "Float2Mixed", "float_to_mixed", "mixed fp8 precision needs fp8 kernels"),
    ("layer_precision_compare", "LayerPrecisionCompare", "layer_precision_compare",
     "it compares fp8 layers against the IPU"),
    ("packed_transformer", "PackedTransformer", "packed_transformer",
     "packing changes the inputs to the IPU's packed attention custom ops"),
]


class _Unchanged(Pass):
    effect = UNCHANGED

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)

    def run(self, onnx_model: onnx.ModelProto) -> onnx.ModelProto:
        return onnx_model


class _Refused(Pass):
    effect = REFUSED
    why = ""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)

    def run(self, onnx_model: onnx.ModelProto) -> onnx.ModelProto:
        raise PassNotSupportedError(f"pass {self.name!r} is not supported by the IPU "
                                    f"emulator: {self.why}")


class ApplyIrPass(Pass):
    """Run the passes named in ``passes`` in order (PopRT's ONNX IR passes)."""

    def __init__(self, passes: list[str] | None = None) -> None:
        super().__init__()
        self.passes = list(passes or [])

    def run(self, onnx_model: onnx.ModelProto) -> onnx.ModelProto:
        for name in self.passes:
            onnx_model = Pass.get_pass(name)(onnx_model)
        return onnx_model


class ManualSharding(Pass):
    """Record ``sharding_info`` (node -> IPU) and ``pipelining_info`` (node -> stage) in
    the model, as ``poprt.converter.Sharder`` does; ``Compiler.compile`` with
    ``virtual_graph_mode = "manual"`` shards by them."""

    def __init__(self, sharding_info: dict[str, int] | None = None,
                 pipelining_info: dict[str, int] | None = None) -> None:
        super().__init__()
        self.sharding_info = dict(sharding_info or {})
        self.pipelining_info = dict(pipelining_info or {})

    def run(self, onnx_model: onnx.ModelProto) -> onnx.ModelProto:
        return record_sharding(onnx_model, self.sharding_info, self.pipelining_info)


def _module(package: types.ModuleType, name: str) -> types.ModuleType:
    full = f"{package.__name__}.{name}"
    mod = sys.modules.get(full)
    if mod is None:
        mod = types.ModuleType(full, f"PopRT's poprt.passes.{name} (see {package.__name__}).")
        mod.__package__ = package.__name__
        # a spec of its own, as an imported module has (importlib.util.find_spec, the
        # module names ipu-emulator run maps, reload all read it)
        mod.__spec__ = importlib.machinery.ModuleSpec(full, None, origin=package.__file__)
        sys.modules[full] = mod
        setattr(package, name, mod)
    return mod


def install(package: types.ModuleType) -> None:
    """Register every documented pass and create its documented module under
    ``package`` (``host_runtime.poprt.passes``)."""
    for mod, cls_name, name, impl in _IMPL:
        cls = type(cls_name, (impl,), {"__doc__": impl.__doc__, "__module__": f"{package.__name__}.{mod}"})
        _registrar(name, override=True)(cls)
        setattr(_module(package, mod), cls_name, cls)
    for mod, cls_name, name, what in _IPU_ONLY:
        doc = (f"PopRT {what}. On the emulator this pass {UNCHANGED}: the emulator "
               "computes the standard ONNX form, which gives the same values.")
        cls = type(cls_name, (_Unchanged,), {"__doc__": doc, "__module__": f"{package.__name__}.{mod}"})
        _registrar(name, override=True)(cls)
        setattr(_module(package, mod), cls_name, cls)
    for mod, cls_name, name, why in _REFUSED:
        doc = f"Not supported by the IPU emulator: {why}. Running it raises PassNotSupportedError."
        cls = type(cls_name, (_Refused,), {"__doc__": doc, "why": why,
                                           "__module__": f"{package.__name__}.{mod}"})
        _registrar(name, override=True)(cls)
        setattr(_module(package, mod), cls_name, cls)
    setattr(_module(package, "shape_inference"), "infer_shapes", _types.infer_shapes)
    for cls_name, cls, name in (("ApplyIrPass", ApplyIrPass, "apply_ir_pass"),
                                ("ManualSharding", ManualSharding, "manual_sharding")):
        _registrar(name, override=True)(cls)
        setattr(_module(package, name), cls_name, cls)
