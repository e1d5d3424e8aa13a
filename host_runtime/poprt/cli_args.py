"""The ``poprt`` command's flags (PopRT 1.5's) and what they build: a ``Converter`` and
``CompilerOptions``, compiled by ``Compiler`` as a Python program would
(``tools/poprt.py`` is the thin command around this module)."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import pathlib
import sys
from typing import Any

from host_runtime.errors import BadRequestError
from host_runtime.poprt._errors import NotSupportedError

__all__ = ["add_arguments", "informational", "run", "converter_from_args",
           "options_from_args", "key_values"]

_log = logging.getLogger("poprt")

# flags refused by name: flag -> why
_REFUSED = {
    "custom_library_so_paths": "custom operator libraries are PopART .so files the emulator "
                               "cannot load",
    "custom_shape_inference": "it belongs to custom operators, which the emulator does not "
                              "have",
    "perf_tuner": "PopRT 1.5 does not implement it either",
}
# flags that only matter with fp8 precision (refused itself)
_FP8_ONLY = ("calibration_with_data", "data_preprocess", "num_of_layers_keep_fp16",
             "precision_compare", "fp8_skip_op_names", "fp8_params", "calibration_loss_type")


def _bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    from shm.errors import echo

    raise argparse.ArgumentTypeError(f"expected true or false, got {echo(text)}")


def _bool_or_path(text: str) -> "bool | str":
    """A yes/no word, or else a path (``--export_popef out/model.popef``)."""
    try:
        return _bool(text)
    except argparse.ArgumentTypeError:
        if not text:
            raise
        return text


def _flag(p: argparse.ArgumentParser, name: str, help: str) -> None:
    p.add_argument(name, nargs="?", const=True, default=None, type=_bool, help=help)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every flag of PopRT 1.5's ``poprt`` (and the emulator's few more)."""
    p.add_argument("-i", "--input_model", help="the ONNX model to convert and compile")
    p.add_argument("--config_yaml", help="a YAML configuration (model fusion)")
    p.add_argument("--input_shape", action="extend", nargs="+", metavar="NAME=d0,d1,...",
                   default=None, help="fix inputs' shapes (repeatable)")
    p.add_argument("--precision", choices=["fp32", "fp16", "fp8", "fp8_weight"], default=None,
                   help="fp16 converts float tensors to half precision; fp8 is refused")
    p.add_argument("--output_dir", default=None, help="where outputs are written (default ./)")
    p.add_argument("--output_model", default=None,
                   help="the converted ONNX model: a path, absolute or relative to --output_dir")
    p.add_argument("--export_popef", nargs="?", const=True, default=None, type=_bool_or_path,
                   metavar="[true|false|PATH]", help="write the PopEF file")
    p.add_argument("--popef_name", default=None,
                   help="PopEF file name inside --output_dir (default executable.popef)")
    p.add_argument("--ipu_version", choices=["ipu2", "ipu21"], default=None)
    p.add_argument("--batches_per_step", type=int, default=None)
    p.add_argument("--max_tensor_size", type=int, default=None,
                   help="bytes: the largest tensor constant folding makes, and the largest "
                        "tensor compiled (-1: no limit)")
    p.add_argument("--num_ipus", type=int, default=None, help="IPUs the model is sharded over")
    p.add_argument("--manual_sharding_config", default=None, metavar="shard.yaml")
    _flag(p, "--enable_pipelining", "pipeline the IPUs' stages")
    _flag(p, "--only_manual_sharding", "only record the sharding in --output_model")
    _flag(p, "--weights_as_tensor_data", "weights as PopEF tensor data (constant_weights off)")
    _flag(p, "--save_weights", "a Save program streams each weight back")
    _flag(p, "--compress", "zlib-compress the executable blob")
    p.add_argument("--num_io_tiles", type=int, default=None)
    p.add_argument("--available_memory_proportion", type=float, default=None)
    p.add_argument("--compiler_options", action="extend", nargs="+", metavar="KEY=VAL",
                   default=None, help="CompilerOptions fields")
    p.add_argument("--popart_options", action="extend", nargs="+", metavar="KEY=VAL",
                   default=None, help="kept as engine options (no effect on results)")
    _flag(p, "--disable_compilation_progress_bar", "no progress bar")
    _flag(p, "--optimize_internal_exchange_code", "a Poplar memory option (no effect here)")
    p.add_argument("--convert_version", type=int, default=11)
    p.add_argument("--batch_size", type=int, default=None)
    p.add_argument("--batch_axis", type=int, default=None)
    p.add_argument("--checkpoints", default=None, help="tensors to add as outputs (a,b)")
    p.add_argument("--remove_outputs", default=None, help="outputs to remove (a,b)")
    p.add_argument("--fp16_skip_op_types", default=None)
    p.add_argument("--skip_passes", default=None)
    p.add_argument("--passes", default=None, help="registered passes to run (a,b)")
    p.add_argument("--custom_pass_config", action="append", default=None, metavar="FILE.py",
                   help="a Python file registering passes")
    _flag(p, "--list_all_passes", "print the registered passes and exit")
    _flag(p, "--check", "compare the converted model with the original (onnxruntime)")
    _flag(p, "--run", "run the compiled model once on random inputs")
    _flag(p, "--show", "print the model's inputs and outputs and exit")
    _flag(p, "--show_io_stat", "print the model's input/output statistics and exit")
    _flag(p, "--infer_shape_ahead", "fold constants and infer shapes first")
    for name in ("disable_fast_norm", "enable_erf_gelu", "enable_insert_remap",
                 "fold_periodic_initializer", "enable_compress_pattern",
                 "merge_if_with_same_cond", "enable_avoid_overflow_patterns", "eightbitsio"):
        _flag(p, f"--{name}", "see docs/poprt_compile.md")
    p.add_argument("--remap_mode", default=None)
    for name in ("serialize_matmul", "serialize_matmul_add", "pack_args"):
        p.add_argument(f"--{name}", action="extend", nargs="+", metavar="KEY=VAL", default=None)
    for name in ("merge_matmul", "merge_matmul_add", "merge_moe"):
        p.add_argument(f"--{name}", default=None)
    p.add_argument("--apply_hcsr", action="extend", nargs="+", default=None)
    p.add_argument("--framework", default="onnx", choices=["onnx", "tensorflow"])
    p.add_argument("--custom_library_so_paths", action="extend", nargs="+", default=None)
    p.add_argument("--custom_shape_inference", default=None)
    _flag(p, "--perf_tuner", "not implemented (refused)")
    p.add_argument("--calibration_loss_type", default=None,
                   choices=["mse", "mae", "snr", "kld", "cos_dist", "gptq"])
    _flag(p, "--calibration_with_data", "fp8 only")
    p.add_argument("--data_preprocess", default=None)
    p.add_argument("--num_of_layers_keep_fp16", type=int, default=None)
    _flag(p, "--precision_compare", "fp8 only")
    p.add_argument("--fp8_skip_op_names", default=None)
    p.add_argument("--fp8_params", default=None)
    p.add_argument("--logging_level", default="WARNING",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"])
    p.add_argument("--print_completion", choices=["bash", "zsh"], default=None)
    p.add_argument("-v", "--version", action="store_true", help="print the version and exit")
    p.add_argument("--verbose", action="store_true", help="log what the compiler does")
    p.add_argument("command", nargs="?", choices=["tf2onnx"], default=None,
                   help="tf2onnx: refused (TensorFlow is not supported)")


def key_values(items: list[str] | None, what: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for it in items or []:
        key, sep, value = it.partition("=")
        if not sep or not key:
            raise BadRequestError(f"{what}: {it!r} must look like KEY=VALUE")
        out[key] = value
    return out


def _load_custom_passes(files: list[str] | None) -> None:
    for k, path in enumerate(files or []):
        p = pathlib.Path(path)
        if not p.is_file():
            raise BadRequestError(f"--custom_pass_config {path!r} is not a file")
        spec = importlib.util.spec_from_file_location(f"_poprt_custom_pass_{k}_{p.stem}", p)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, str(p.resolve().parent))
        try:
            spec.loader.exec_module(module)
        except BadRequestError:
            raise
        except Exception as exc:
            raise BadRequestError(f"--custom_pass_config {path!r} failed: {type(exc).__name__}: "
                                  f"{exc}") from None
        finally:
            sys.path.pop(0)


def informational(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int | None:
    """``--version``, ``--print_completion``, ``--list_all_passes``, ``--show``: print and
    return the exit status; refusals raise; None: go on and compile."""
    from host_runtime.poprt import __version__

    if args.version:
        print(f"poprt {__version__}")
        return 0
    if args.print_completion:
        import re

        flags = " ".join(sorted(set(re.findall(r"(?<![\w-])--?[a-z][\w]*", parser.format_usage()))))
        print(f"complete -W \"{flags}\" poprt" if args.print_completion == "bash"
              else f"compdef '_arguments \"*: :({flags})\"' poprt")
        return 0
    for name, why in _REFUSED.items():
        if getattr(args, name):
            raise NotSupportedError(f"--{name} is not supported by the IPU emulator: {why}")
    if args.command == "tf2onnx" or args.framework == "tensorflow":
        raise NotSupportedError("TensorFlow models (tf2onnx, --framework tensorflow) are not "
                                "supported by the IPU emulator; convert with tf2onnx first")
    _load_custom_passes(args.custom_pass_config)
    if args.list_all_passes:
        from host_runtime.poprt.passes import get_registered_passes

        for name, cls in sorted(get_registered_passes().items()):
            print(f"{name}\t{getattr(cls, 'effect', '')}")
        return 0
    if (args.show or args.show_io_stat) and args.input_model:
        import onnx

        from host_runtime.poprt.passes import get_pass

        get_pass("model_io_info_stat")(onnx.load(args.input_model, load_external_data=False))
        return 0
    return None


def converter_from_args(args: argparse.Namespace) -> Any:
    """The ``poprt.Converter`` the flags describe."""
    from host_runtime.poprt.compiler import parse_input_shape
    from host_runtime.poprt.converter import Converter

    used = [n for n in _FP8_ONLY if getattr(args, n) not in (None, False)
            and n not in ("fp8_skip_op_names", "fp8_params")]
    if args.precision in ("fp32", "fp16", None):
        used += [n for n in ("fp8_skip_op_names", "fp8_params") if getattr(args, n)]
    if used:
        _log.warning("--%s: fp8 calibration and comparison need an IPU (or, with fp32/fp16, do "
                     "not apply); ignored", ", --".join(used))
    shapes = dict(parse_input_shape(s) for s in (args.input_shape or []))
    return Converter(
        input_shape=shapes, convert_version=args.convert_version,
        precision=args.precision or "fp32", checkpoints=args.checkpoints,
        eightbitsio=bool(args.eightbitsio), fp16_skip_op_types=args.fp16_skip_op_types,
        skip_passes=args.skip_passes,
        used_passes=[s for s in (args.passes or "").split(",") if s.strip()],
        check=bool(args.check), disable_fast_norm=bool(args.disable_fast_norm),
        pack_args=key_values(args.pack_args, "--pack_args") or None,
        enable_insert_remap=bool(args.enable_insert_remap),
        enable_erf_gelu=bool(args.enable_erf_gelu),
        serialize_matmul=key_values(args.serialize_matmul, "--serialize_matmul") or None,
        serialize_matmul_add=key_values(args.serialize_matmul_add,
                                        "--serialize_matmul_add") or None,
        merge_matmul=args.merge_matmul, merge_matmul_add=args.merge_matmul_add,
        merge_moe=args.merge_moe,
        remap_mode=(args.remap_mode or "after_matmul").split(","),
        max_tensor_size=args.max_tensor_size if args.max_tensor_size is not None else -1,
        infer_shape_ahead=bool(args.infer_shape_ahead),
        enable_avoid_overflow_patterns=bool(args.enable_avoid_overflow_patterns),
        disable_progress_bar=bool(args.disable_compilation_progress_bar),
        batch_size=args.batch_size, batch_axis=args.batch_axis,
        remove_outputs=[s for s in (args.remove_outputs or "").split(",") if s.strip()],
        fold_periodic_initializer=bool(args.fold_periodic_initializer),
        enable_compress_pattern=bool(args.enable_compress_pattern),
        merge_if_with_same_cond=bool(args.merge_if_with_same_cond),
        apply_hcsr=args.apply_hcsr, fp8_skip_op_names=args.fp8_skip_op_names,
        fp8_params=args.fp8_params or "F143,F143,0,0")


def options_from_args(args: argparse.Namespace) -> Any:
    """The ``CompilerOptions`` the flags describe."""
    from host_runtime.poprt._options import FIELDS, CompilerOptions

    opts = CompilerOptions()
    opts.ipu_version = args.ipu_version or "ipu21"
    if args.batches_per_step is not None:
        opts.batches_per_step = args.batches_per_step
    if args.num_ipus is not None:
        opts.num_ipus = args.num_ipus
    if args.num_io_tiles is not None:
        opts.num_io_tiles = args.num_io_tiles
    if args.available_memory_proportion is not None:
        opts.available_memory_proportion = args.available_memory_proportion
    if args.enable_pipelining:
        opts.enable_pipelining = True
    if args.weights_as_tensor_data:
        opts.constant_weights = False
    if args.disable_compilation_progress_bar:
        opts.show_compilation_progress_bar = False
    for key, text in key_values(args.compiler_options, "--compiler_options").items():
        if key not in FIELDS:
            raise BadRequestError(f"--compiler_options: no option {key!r}; the options are "
                                  f"{', '.join(FIELDS)}")
        kind = FIELDS[key][1]
        value: Any = text
        if kind is bool:
            value = _bool(text)
        elif kind in (int, float):
            try:
                value = kind(text)
            except ValueError:
                raise BadRequestError(f"--compiler_options {key}={text!r}: expected "
                                      f"{kind.__name__}") from None
        elif kind in (list, dict, object):
            raise BadRequestError(f"--compiler_options {key} takes a {kind.__name__}; set it "
                                  "from Python")
        setattr(opts, key, value)
    engine = dict(opts.engine_options)
    engine.update({f"popart.{k}": v for k, v in
                   key_values(args.popart_options, "--popart_options").items()})
    if args.optimize_internal_exchange_code:
        engine["opt.internalExchangeOptimisationTarget"] = "memory"
    opts.engine_options = engine
    return opts


def run(args: argparse.Namespace) -> Any:
    """Convert and compile as the flags say; returns the ``CompileOutput`` (None for
    ``--only_manual_sharding``, which writes the sharded model only)."""
    if args.config_yaml:
        return _run_fusion(args)
    import onnx

    from host_runtime.poprt._compile_api import compile_result, popef_extras
    from host_runtime.poprt.compiler import write_outputs
    from host_runtime.poprt.converter import Sharder
    from ipu_emulator.compiler import load_sharding_yaml
    from ipu_emulator.compiler import load_model

    converter = converter_from_args(args)
    options = options_from_args(args)
    model, folder, _label = load_model(args.input_model)
    if args.manual_sharding_config is not None:
        shard, stages = load_sharding_yaml(args.manual_sharding_config)
        model = Sharder(shard, stages).run(model)
        options.virtual_graph_mode = "manual"
        if args.num_ipus is None and shard:   # (PopRT's command has no --num_ipus)
            need = max(shard.values()) + 1    # IPUs come in powers of two: 3 shards on 4
            options.num_ipus = 1 << (need - 1).bit_length()
    precision = args.precision or "fp32"
    out_dir = pathlib.Path(args.output_dir or ".")
    output_model = args.output_model or f"{pathlib.Path(args.input_model).stem}.{precision}.onnx"
    if args.only_manual_sharding:
        from host_runtime.poprt._writing import write_file
        from host_runtime.poprt.compiler import _anywhere, _make_dir

        path = _anywhere(out_dir, output_model, "output_model")
        _make_dir(path.parent, "the folder of output_model")
        write_file(path, lambda f: onnx.save(model, f))
        print(f"poprt: wrote {path}")
        return None
    converted = converter.convert(model)
    # --max_tensor_size bounds what constant folding makes (the converter's), as PopRT's
    result = compile_result(converted, None, options, save_weights=bool(args.save_weights),
                            base_dir=folder)
    if converter.fp16_plan is not None:
        _fp16_report(result, converter.fp16_plan)
    engine, blobs = popef_extras(options)
    export = args.export_popef if isinstance(args.export_popef, str) else bool(args.export_popef)
    out = write_outputs(result, out_dir, export_popef=export,
                        popef_name=args.popef_name or "executable.popef",
                        output_model=output_model, compress=bool(args.compress),
                        engine_options=engine, opaques=blobs)
    if args.run:
        out.ran = _run_once(result, options)   # type: ignore[attr-defined]
    return out


def _fp16_report(result: Any, plan: Any) -> None:
    from ipu_emulator.compiler import relative_error

    try:
        result.fp16_error.update(relative_error(result.output_model, plan))
    except Exception as exc:  # noqa: BLE001 - the report is informative only
        _log.info("fp16 vs fp32 comparison skipped: %s", exc)


def _run_once(result: Any, options: Any) -> str:
    import numpy as np

    from host_runtime.poprt._compile_api import Executable, popef_bytes
    from host_runtime.runner import ModelRunner

    exe = Executable(popef_bytes(result, options))
    with ModelRunner(exe) as runner:
        rng = np.random.default_rng(0)
        feeds = {d.name: rng.random(d.shape).astype(d.numpy_data_type())
                 for d in runner.getExecuteInputs()}
        outs = runner.execute(feeds)
    return ", ".join(f"{k} {list(np.asarray(v).shape)}" for k, v in outs.items())


# flags the model fusion configuration (--config_yaml) takes
_FUSION_FLAGS = {"config_yaml", "output_dir", "output_model", "export_popef", "ipu_version",
                 "batches_per_step", "max_tensor_size", "weights_as_tensor_data",
                 "save_weights", "compress", "popef_name", "precision", "input_shape",
                 "num_ipus", "manual_sharding_config", "enable_pipelining", "verbose",
                 "logging_level", "framework", "convert_version", "remap_mode"}


def _run_fusion(args: argparse.Namespace) -> Any:
    from host_runtime.poprt.compiler import compile, load_config_yaml

    extra = sorted(k for k, v in vars(args).items()
                   if k not in _FUSION_FLAGS and v not in (None, False))
    if extra:
        raise BadRequestError(f"--config_yaml (model fusion) does not take "
                              f"{', '.join('--' + k for k in extra)}; convert each model first "
                              "(poprt.Converter) or compile it alone")

    overrides: dict[str, Any] = {
        "output_dir": args.output_dir, "output_model": args.output_model,
        "export_popef": args.export_popef, "ipu_version": args.ipu_version,
        "batches_per_step": args.batches_per_step, "max_tensor_size": args.max_tensor_size,
        "weights_as_tensor_data": args.weights_as_tensor_data,
        "save_weights": args.save_weights, "compress": args.compress,
        "popef_name": args.popef_name, "precision": args.precision,
        "input_shape": args.input_shape, "num_ipus": args.num_ipus,
        "manual_sharding_config": args.manual_sharding_config,
        "enable_pipelining": args.enable_pipelining}
    cfg = load_config_yaml(args.config_yaml, overrides)
    if args.output_dir is not None:
        cfg.output_dir = pathlib.Path(args.output_dir)
    return compile(cfg.models, cfg.output_dir, **cfg.options)
