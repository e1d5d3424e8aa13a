"""PopRT's converter: ``Converter``, ``Sharder`` and ``MFConverter``.

``Converter(...).convert(model)`` turns an ONNX model into the model the compiler
takes: input shapes fixed, outputs removed or added, the user's passes run, the
precision converted (fp16 with the compiler's own conversion). The ``poprt``
command builds its Converter from its flags (``tools/poprt.py``), so both give the
same model. Options whose work is only for the IPU's speed (Gelu/LayerNorm
patterns, remaps, serialisation, merging) run their registered passes, which leave
the emulated result unchanged; options the emulator cannot honour raise
``NotSupportedError`` naming them (docs/poprt_compile.md lists which is which).
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Sequence

import onnx

from host_runtime.errors import BadRequestError
from host_runtime.poprt._errors import NotSupportedError
from host_runtime.poprt._onnx_util import copy_model, main_opset, parse_skip_list
from host_runtime.poprt._sharding_props import record_sharding
from host_runtime.poprt.passes import Pass, PassManager, get_pass

__all__ = ["Converter", "Sharder", "MFConverter", "PRECISIONS"]

_log = logging.getLogger("poprt")
PRECISIONS = ("fp32", "fp16", "fp8", "fp8_weight")

# option -> the registered pass it runs when set (passes that keep the emulated result)
_OPTION_PASSES = {
    "enable_erf_gelu": "erf_gelu_pattern",
    "enable_insert_remap": "auto_insert_remap",
    "serialize_matmul": "serialize_matmul",
    "serialize_matmul_add": "serialize_matmul_add",
    "merge_matmul": "merge_matmul",
    "merge_matmul_add": "merge_matmul_add",
    "merge_moe": "merge_moe",
    "fold_periodic_initializer": "fold_periodic_initializer",
    "enable_compress_pattern": "compress_pattern",
    "merge_if_with_same_cond": "merge_if_with_same_cond",
}
# option -> why the emulator refuses it
_REFUSED = {
    "pack_args": "packing rewrites attention into the IPU's packed custom ops",
    "eightbitsio": "8-bit I/O inserts an IPU normalisation custom op",
    "apply_hcsr": "host concat/split merges inputs through the HCSR custom op",
    "quantize": "fp8 quantization needs fp8 kernels the host does not have",
}
# passes PopRT runs by default (skip_passes may name them)
DEFAULT_PASSES = ("int64_to_int32", "layer_norm_pattern", "gelu_pattern", "replace_softmax",
                  "sort_graph")
"""What every conversion runs (``skip_passes`` leaves one out). ``int64_to_int32``: the
converted model's int64 inputs and outputs are int32, as PopRT documents (the IPU has
no int64)."""


class Converter:
    """Convert a general ONNX model to the model the emulator's compiler takes."""

    def __init__(self, *, input_shape: Mapping[str, Sequence[int]] | None = None,
                 convert_version: int = 11, precision: str = "fp32",
                 checkpoints: Any = None, eightbitsio: bool = False,
                 fp16_skip_op_types: Any = None, skip_passes: Any = None,
                 used_passes: Sequence["str | Pass"] = (), check: bool = False,
                 disable_fast_norm: bool = False, pack_args: dict[str, Any] | None = None,
                 fp8_skip_op_names: Any = None, fp8_params: str = "F143,F143,0,0",
                 quantize: bool = False, enable_insert_remap: bool = False,
                 enable_erf_gelu: bool = False, serialize_matmul: dict[str, str] | None = None,
                 serialize_matmul_add: dict[str, str] | None = None,
                 merge_matmul: str | None = None, merge_matmul_add: str | None = None,
                 merge_moe: str | None = None, remap_mode: Any = ("after_matmul",),
                 max_tensor_size: int = -1, infer_shape_ahead: bool = False,
                 enable_avoid_overflow_patterns: bool = False,
                 disable_progress_bar: bool = False, batch_size: int | None = None,
                 batch_axis: int | None = None, remove_outputs: Any = (),
                 fold_periodic_initializer: bool = False, enable_compress_pattern: bool = False,
                 merge_if_with_same_cond: bool = False, apply_hcsr: Any = None,
                 logger: logging.Logger | None = None) -> None:
        if precision not in PRECISIONS:
            raise BadRequestError(f"precision must be one of {list(PRECISIONS)}, got "
                                  f"{precision!r}")
        given = {"pack_args": pack_args, "eightbitsio": eightbitsio, "apply_hcsr": apply_hcsr,
                 "quantize": quantize}
        for key, value in given.items():
            if value:
                raise NotSupportedError(f"Converter option {key} is not supported by the IPU "
                                        f"emulator: {_REFUSED[key]}")
        self.input_shape = {str(k): [int(d) for d in v] for k, v in (input_shape or {}).items()}
        self.convert_version = int(convert_version)
        self.precision = precision
        self.checkpoints = parse_skip_list(checkpoints, "checkpoints")
        self.fp16_skip_op_types = parse_skip_list(fp16_skip_op_types, "fp16_skip_op_types")
        self.skip_passes = parse_skip_list(skip_passes, "skip_passes")
        registered = Pass.get_registered_passes()
        unknown = [p for p in self.skip_passes if p not in registered]
        if unknown:
            raise BadRequestError(f"skip_passes names unregistered passes {unknown}")
        self.used_passes = list(used_passes)
        for p in self.used_passes:      # unknown names fail now, not after the slow part
            if isinstance(p, str) and p not in registered:
                Pass.get_pass(p)
        self.check = bool(check)
        self.max_tensor_size = int(max_tensor_size)
        self.infer_shape_ahead = bool(infer_shape_ahead)
        self.enable_avoid_overflow_patterns = bool(enable_avoid_overflow_patterns)
        self.batch_size, self.batch_axis = batch_size, batch_axis
        if (batch_size is None) != (batch_axis is None):
            raise BadRequestError("batch_size and batch_axis go together; got batch_size="
                                  f"{batch_size!r}, batch_axis={batch_axis!r}")
        self.remove_outputs = parse_skip_list(list(remove_outputs or ()), "remove_outputs")
        self.options = {"enable_erf_gelu": enable_erf_gelu,
                        "enable_insert_remap": enable_insert_remap,
                        "serialize_matmul": serialize_matmul,
                        "serialize_matmul_add": serialize_matmul_add,
                        "merge_matmul": merge_matmul, "merge_matmul_add": merge_matmul_add,
                        "merge_moe": merge_moe, "fold_periodic_initializer":
                        fold_periodic_initializer, "enable_compress_pattern":
                        enable_compress_pattern, "merge_if_with_same_cond": merge_if_with_same_cond}
        self.disable_fast_norm = bool(disable_fast_norm)
        self.remap_mode = parse_skip_list(list(remap_mode or ()), "remap_mode")
        self.fp8_skip_op_names = parse_skip_list(fp8_skip_op_names, "fp8_skip_op_names")
        self.fp8_params = fp8_params
        # fp8_params checked now (the pass parses them)
        get_pass("float_to_fp8", fp8_params, self.fp8_skip_op_names,
                 precision if precision.startswith("fp8") else "fp8")
        self.disable_progress_bar = bool(disable_progress_bar)
        self.logger = logger or _log
        self.fp16_plan: Any = None
        """After an fp16 ``convert``: the compiler's fp16 plan (its fp32 sample)."""

    def passes(self) -> list["str | Pass"]:
        """The passes ``convert`` runs, in order."""
        out: list[str | Pass] = []
        if self.input_shape or self.batch_size is not None:
            out.append(get_pass("const_input_shape", self.input_shape, self.batch_size,
                                self.batch_axis))
        if self.infer_shape_ahead:
            out += [get_pass("constant_folding", self.max_tensor_size), "shape_inference"]
        if self.remove_outputs:
            out.append(get_pass("remove_outputs", self.remove_outputs))
        if self.checkpoints:
            out.append(get_pass("add_checkpoints", self.checkpoints))
        used = {p if isinstance(p, str) else p.name for p in self.used_passes}
        defaults = [p for p in DEFAULT_PASSES if p not in used
                    and not (p == "layer_norm_pattern" and self.disable_fast_norm)]
        out += [p for p in defaults if p not in self.skip_passes]
        out += [p for k, p in _OPTION_PASSES.items() if self.options.get(k)
                and p not in self.skip_passes]
        out += self.used_passes
        if self.precision != "fp32" and "float_to_half" not in self.skip_passes:
            out.append(get_pass("float_to_half", self.fp16_skip_op_types,
                                self.enable_avoid_overflow_patterns))
        if self.precision in ("fp8", "fp8_weight"):
            out.append(get_pass("float_to_fp8", self.fp8_params, self.fp8_skip_op_names,
                                self.precision))
        return out

    def convert(self, model: onnx.ModelProto,
                logger: logging.Logger | None = None) -> onnx.ModelProto:
        """Convert ``model`` (unchanged itself); returns the converted ModelProto.
        ``logger``: where this conversion logs (PopRT 1.0.2's ``convert(model, logger)``;
        default the converter's own)."""
        if not isinstance(model, onnx.ModelProto):
            raise BadRequestError(f"Converter.convert expects an onnx.ModelProto, got "
                                  f"{type(model).__name__}")
        if logger is not None and not isinstance(logger, logging.Logger):
            raise BadRequestError(f"Converter.convert: logger must be a logging.Logger, got "
                                  f"{type(logger).__name__}")
        if logger is not None and logger is not self.logger:
            kept, self.logger = self.logger, logger
            try:
                return self.convert(model)
            finally:
                self.logger = kept
        origin = copy_model(model) if self.check else model
        out = self._opset(copy_model(model))
        manager = PassManager()
        manager.add_passes(self.passes())
        out = manager.run(out)
        self.fp16_plan = next((getattr(p, "plan") for p in manager.get_passes()
                               if hasattr(p, "plan")), None)
        if self.check:
            from host_runtime.poprt._check import compare_with_onnxruntime

            compare_with_onnxruntime(origin, out)
        return out

    def _opset(self, model: onnx.ModelProto) -> onnx.ModelProto:
        have = main_opset(model)
        if have and have < self.convert_version:
            try:
                return onnx.version_converter.convert_version(model, self.convert_version)
            except Exception as exc:  # noqa: BLE001 - the model runs at its own opset
                self.logger.warning("converting the model from opset %d to %d failed (%s); it "
                                    "is kept at opset %d, which the emulator runs as well",
                                    have, self.convert_version,
                                    str(exc).splitlines()[0][:200] if str(exc) else
                                    type(exc).__name__, have)
        if have > self.convert_version:
            self.logger.info("the model's opset %d is newer than convert_version %d: kept (the "
                             "emulator runs every opset onnxruntime runs)", have,
                             self.convert_version)
        return model


class Sharder:
    """Manual sharding: record ``sharding_info`` (node name -> IPU) and
    ``pipelining_info`` (node name -> pipeline stage) in the model;
    ``Compiler.compile`` with ``virtual_graph_mode = "manual"`` places the nodes by them
    (as ``--manual_sharding_config`` does)."""

    def __init__(self, sharding_info: dict[str, int] | None = None,
                 pipelining_info: dict[str, int] | None = None) -> None:
        from ipu_emulator.compiler import check_map

        self.sharding_info = check_map(sharding_info, "sharding_info") if sharding_info else {}
        self.pipelining_info = check_map(pipelining_info, "pipelining_info") \
            if pipelining_info else {}

    def run(self, model: onnx.ModelProto) -> onnx.ModelProto:
        return record_sharding(model, self.sharding_info, self.pipelining_info)


class MFConverter:
    """Model fusion: ``convert([m0, m1, ...])`` gives one ONNX model holding each model
    as a sub-graph (names prefixed ``graphK/``) and the ``index`` input that selects
    one; compile it with ``CompilerOptions.enable_model_fusion = True``."""

    def convert(self, models: Sequence[onnx.ModelProto]) -> onnx.ModelProto:
        from ipu_emulator.compiler import INDEX_NAME, fuse_models

        models = list(models)
        if len(models) < 2 or not all(isinstance(m, onnx.ModelProto) for m in models):
            raise BadRequestError("MFConverter.convert expects a list of at least two "
                                  "onnx.ModelProto")
        return fuse_models(models, INDEX_NAME, onnx.TensorProto.INT32, [1])
