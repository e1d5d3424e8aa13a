"""The compiler back end: ONNX models -> an executable for the emulated IPU.

``check_interface(model, label)`` refuses up front a model whose inputs or outputs the
IPU cannot stream (before its dynamic dims are known).
``compile_onnx(ModelSpec(...), CompileOptions(...)) -> CompileResult`` gives the
``Executable`` plus the anchor descriptions a front end needs to write PopEF
(``host_runtime.poprt.compiler`` does that, and the ``poprt`` command).
"""

from __future__ import annotations

from ipu_emulator.compiler._backend import compile_onnx
from ipu_emulator.compiler._types import (
    INDEX_NAME, LOAD_PROGRAM, MAIN_PROGRAM, SAVE_PROGRAM, TARGETS, AnchorDesc, CompileOptions,
    CompileResult, ModelSpec, Target)
from ipu_emulator.compiler._fp16_range import relative_error
from ipu_emulator.compiler._fusion import fuse_models
from ipu_emulator.compiler._onnx import load_model, ort_session
from ipu_emulator.compiler._precision import Fp16RangeWarning
from ipu_emulator.compiler._prepare import _fix_input_shapes as fix_input_shapes
from ipu_emulator.compiler._prepare import check_interface, prepare, to_fp16
from ipu_emulator.compiler._parts import describe_parts
from ipu_emulator.compiler._sharding import check_map, load_sharding_yaml
from ipu_emulator.errors import CompileError

__all__ = [
    "compile_onnx",
    "check_interface",
    "check_map",
    "describe_parts",
    "prepare",
    "to_fp16",
    "fix_input_shapes",
    "relative_error",
    "fuse_models",
    "load_model",
    "ort_session",
    "load_sharding_yaml",
    "ModelSpec",
    "CompileOptions",
    "CompileResult",
    "AnchorDesc",
    "Target",
    "TARGETS",
    "CompileError",
    "Fp16RangeWarning",
    "INDEX_NAME",
    "LOAD_PROGRAM",
    "MAIN_PROGRAM",
    "SAVE_PROGRAM",
]
