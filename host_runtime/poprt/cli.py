"""``poprt``: convert and compile ONNX models for the emulated IPU (PopRT 1.5's command;
also ``python -m poprt.cli`` as PopRT 1.0.2 documents it, under ``ipu-emulator run``).

    poprt --input_model model.onnx --input_shape X=1,3,224,224 --precision fp16 \\
          --export_popef --output_dir out --ipu_version ipu21 --batches_per_step 4
    poprt --config_yaml config.yaml          # model fusion (seed 004, section 5.7)
    poprt --list_all_passes --custom_pass_config my_pass.py

Every flag PopRT 1.5 documents is accepted: the command builds a
``poprt.Converter`` and ``poprt.compiler.CompilerOptions`` from its flags
(``host_runtime.poprt.cli_args``) and compiles with ``Compiler`` as a Python
program would, so both give byte-equal PopEF files; flags the emulator cannot honour
are refused by name (docs/poprt_compile.md).

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


class _Parser(argparse.ArgumentParser):
    """argparse, with the value it echoes in a usage error shortened."""

    def error(self, message: str) -> NoReturn:
        from shm.errors import echo

        super().error(echo(" ".join(message.split()), _MAX_ERROR, quote=False))


def build_parser() -> argparse.ArgumentParser:
    from host_runtime.poprt.cli_args import add_arguments

    p = _Parser(prog="poprt",
                description="Convert and compile ONNX models into PopEF files for the IPU "
                            "emulator (PopRT 1.5's flags).")
    add_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = logging.INFO if args.verbose else getattr(logging, args.logging_level)
    logging.basicConfig(level=level, format="poprt: %(message)s")
    from host_runtime.errors import BadRequestError
    from host_runtime.poprt import cli_args
    from ipu_emulator.errors import CompileError, RealModulesError
    from shm.errors import echo

    try:
        if args.custom_pass_config:
            # a user's pass file imports ``poprt`` as PopRT's own do: the names map onto
            # this project (refused by name where Graphcore's real modules are installed)
            from ipu_emulator import run as modules

            modules.install()
        early = cli_args.informational(args, parser)
        if early is not None:
            return early
        if not args.input_model and not args.config_yaml:
            parser.error("one of the arguments -i/--input_model --config_yaml is required")
        out = cli_args.run(args)
    except (CompileError, BadRequestError, RealModulesError) as exc:
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
    if out is not None:
        _report(out, args)
    return 0


def _report(out: Any, args: argparse.Namespace) -> None:
    exe = out.result.executable
    if exe.num_ipus > 1:
        idle = [k for k, part in enumerate(exe.parts) if part.idle]
        print(f"poprt: sharded over {exe.num_ipus} IPUs"
              + (" (pipelined)" if args.enable_pipelining else "")
              + (f"; IPU(s) {idle} hold no node and stay idle" if idle else ""))
    print(f"poprt: compiled {exe.attributes.get('models', '')} for ipu{exe.ipu_version}"
          f" ({len(out.result.anchors)} anchors, device memory {exe.required_bytes} bytes)")
    errors = out.result.fp16_error
    if errors:
        worst = max(errors, key=lambda k: errors[k][0])
        mean = sum(e[1] for e in errors.values()) / len(errors)
        precision = args.precision if args.precision in ("fp8", "fp8_weight") else "fp16"
        print(f"poprt: {precision} vs fp32 on a sample: max relative error {errors[worst][0]:.3g} "
              f"({worst}), mean {mean:.3g}")
    if out.output_model_path is not None:
        print(f"poprt: wrote {out.output_model_path}")
    if out.popef_path is not None:
        print(f"poprt: wrote {out.popef_path}")
    if getattr(out, "ran", None):
        print(f"poprt: ran once on random inputs: {out.ran}")


if __name__ == "__main__":
    sys.exit(main())
