"""``poprt``: compile ONNX models for the emulated IPU (seed 004's compiler command).

    poprt --input_model model.onnx --input_shape X=1,3,224,224 --precision fp16 \\
          --export_popef --output_dir out --ipu_version ipu21 --batches_per_step 4
    poprt --config_yaml config.yaml          # model fusion (seed 004, section 5.7)

Exit status: 0 on success; 2 on any failure of the command (bad usage, a model
refused, a bad option value or config, an output that cannot be written), each
reported as one ``poprt: error: ...`` line, as argparse reports bad usage.
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import sys
from typing import Any, NoReturn

__all__ = ["main", "build_parser"]


_MAX_ERROR = 1000
"""Characters of the error line at most: messages shorten what they echo (shm.errors.echo);
this is the backstop for one that does not."""


def _error(text: str) -> None:
    """The one ``poprt: error: ...`` line: newlines folded, at most _MAX_ERROR characters."""
    from shm.errors import echo

    print(f"poprt: error: {echo(' '.join(text.split()), _MAX_ERROR, quote=False)}",
          file=sys.stderr)


def _bool_or_path(text: str) -> "bool | str":
    """A yes/no word, or else a path (``--export_popef out/model.popef``)."""
    try:
        return _bool(text)
    except argparse.ArgumentTypeError:
        if not text:
            raise
        return text


def _bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    from shm.errors import echo

    raise argparse.ArgumentTypeError(f"expected true or false, got {echo(text)}")


class _Parser(argparse.ArgumentParser):
    """argparse, with the value it echoes in a usage error shortened."""

    def error(self, message: str) -> NoReturn:
        from shm.errors import echo

        super().error(echo(" ".join(message.split()), _MAX_ERROR, quote=False))


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="poprt", description="Compile ONNX models into a PopEF file for the IPU emulator.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--input_model", help="the ONNX model to compile")
    src.add_argument("--config_yaml", help="a YAML configuration (model fusion)")
    p.add_argument("--input_shape", action="append", metavar="NAME=d0,d1,...", default=None,
                   help="fix an input's shape (repeatable); the first dim is the batch")
    p.add_argument("--precision", choices=["fp32", "fp16"], default=None,
                   help="fp16 converts the model's float tensors to half precision")
    p.add_argument("--output_dir", default=None, help="where outputs are written (default ./)")
    p.add_argument("--output_model", default=None,
                   help="where the transformed ONNX model is written: a path, absolute or "
                        "relative to --output_dir (it may lie outside it)")
    p.add_argument("--export_popef", nargs="?", const=True, default=None, type=_bool_or_path,
                   metavar="[true|false|PATH]",
                   help="write the PopEF file: --popef_name in --output_dir, or at PATH "
                        "(absolute or relative to --output_dir, anywhere)")
    p.add_argument("--ipu_version", choices=["ipu2", "ipu21"], default=None)
    p.add_argument("--batches_per_step", type=int, default=None,
                   help="device iterations per Main program run (default 1)")
    p.add_argument("--max_tensor_size", type=int, default=None,
                   help="refuse tensors larger than this many bytes (-1: no limit)")
    p.add_argument("--weights_as_tensor_data", nargs="?", const=True, default=None, type=_bool,
                   help="export float initializers as PopEF tensor data fed by the Load "
                        "program instead of compiling them into the executable")
    p.add_argument("--save_weights", nargs="?", const=True, default=None, type=_bool,
                   help="with --weights_as_tensor_data: a Save program streams each weight "
                        "back through an output anchor '<name>_saved'")
    p.add_argument("--compress", nargs="?", const=True, default=None, type=_bool,
                   help="zlib-compress the executable blob")
    p.add_argument("--num_ipus", type=int, default=None,
                   help="IPUs the model is sharded over (a power of two; default 1)")
    p.add_argument("--manual_sharding_config", default=None, metavar="shard.yaml",
                   help="YAML with sharding_info (node -> IPU) and pipelining_info "
                        "(node -> stage) maps")
    p.add_argument("--enable_pipelining", nargs="?", const=True, default=None, type=_bool,
                   help="run the IPUs' parts as a pipeline (stage s on batch i while stage "
                        "s+1 works on batch i-1)")
    p.add_argument("--popef_name", default=None,
                   help="PopEF file name inside --output_dir (default executable.popef); a "
                        "name that leaves --output_dir is refused")
    p.add_argument("-v", "--verbose", action="store_true", help="log what the compiler does")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="poprt: %(message)s")
    from host_runtime.errors import BadRequestError
    from host_runtime.poprt.compiler import compile, load_config_yaml, parse_input_shape
    from ipu_emulator.errors import CompileError
    from shm.errors import echo

    try:
        if args.config_yaml:
            overrides: dict[str, Any] = {
                "output_dir": args.output_dir, "output_model": args.output_model,
                "export_popef": args.export_popef, "ipu_version": args.ipu_version,
                "batches_per_step": args.batches_per_step,
                "max_tensor_size": args.max_tensor_size,
                "weights_as_tensor_data": args.weights_as_tensor_data,
                "save_weights": args.save_weights, "compress": args.compress,
                "popef_name": args.popef_name, "precision": args.precision,
                "input_shape": args.input_shape, "num_ipus": args.num_ipus,
                "manual_sharding_config": args.manual_sharding_config,
                "enable_pipelining": args.enable_pipelining}
            cfg = load_config_yaml(args.config_yaml, overrides)
            if args.output_dir is not None:
                cfg.output_dir = pathlib.Path(args.output_dir)
            out = compile(cfg.models, cfg.output_dir, **cfg.options)
        else:
            shapes = dict(parse_input_shape(s) for s in (args.input_shape or []))
            precision = args.precision or "fp32"
            output_model = args.output_model
            if output_model is None:
                output_model = f"{pathlib.Path(args.input_model).stem}.{precision}.onnx"
            out = compile(
                args.input_model, args.output_dir or ".",
                export_popef=args.export_popef if isinstance(args.export_popef, str)
                else bool(args.export_popef), popef_name=args.popef_name or
                "executable.popef", output_model=output_model,
                ipu_version=args.ipu_version or "ipu21",
                batches_per_step=args.batches_per_step if args.batches_per_step is not None else 1,
                weights_as_tensor_data=bool(args.weights_as_tensor_data),
                save_weights=bool(args.save_weights),
                max_tensor_size=args.max_tensor_size if args.max_tensor_size is not None else -1,
                compress=bool(args.compress), input_shapes=shapes, precision=precision,
                num_ipus=args.num_ipus or 1,
                manual_sharding_config=args.manual_sharding_config,
                enable_pipelining=bool(args.enable_pipelining))
    except (CompileError, BadRequestError) as exc:
        _error(str(exc))
        return 2
    except OSError as exc:   # what the checks above could not foresee (a disk that fills)
        _error(f"{exc.strerror or exc}" + (f": {echo(exc.filename, 200)}" if exc.filename
                                           else ""))
        return 2
    except Exception as exc:   # a bug: still one line (the traceback with --verbose)
        logging.getLogger("poprt").debug("unexpected failure", exc_info=True)
        _error(f"unexpected {type(exc).__name__}: {exc}")
        return 2
    exe = out.result.executable
    if exe.num_ipus > 1:
        print(f"poprt: sharded over {exe.num_ipus} IPUs"
              + (" (pipelined)" if args.enable_pipelining else ""))
    print(f"poprt: compiled {exe.attributes.get('models', '')} for {args.ipu_version or 'ipu21'}"
          f" ({len(out.result.anchors)} anchors, device memory {exe.required_bytes} bytes)")
    errors = out.result.fp16_error
    if errors:
        worst = max(errors, key=lambda k: errors[k][0])
        mean = sum(e[1] for e in errors.values()) / len(errors)
        print(f"poprt: fp16 vs fp32 on a sample: max relative error {errors[worst][0]:.3g} "
              f"({worst}), mean {mean:.3g}")
    if out.output_model_path is not None:
        print(f"poprt: wrote {out.output_model_path}")
    if out.popef_path is not None:
        print(f"poprt: wrote {out.popef_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
