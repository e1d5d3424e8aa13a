"""``model_runtime_example_generate_simple_popef``: the seeds' example model.

``output = (A * weights) + B``: stream inputs ``tensor_A`` and ``tensor_B``,
``weights`` stored as PopEF tensor data and fed by the Load program, output
``tensor_C``, and a Save program that streams the device's ``weights`` back
through the output anchor ``weights_saved``. Built through the compiler from
an ONNX graph (Mul + Add, weights exported as tensor data).
"""

from __future__ import annotations

import argparse
import os
import sys

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    import onnx

__all__ = ["build_simple_model", "write_simple_popef", "main"]


def build_simple_model(shape: tuple[int, ...] = (1, 4), dtype: str = "float32",
                       seed: int = 0) -> "onnx.ModelProto":
    """The example's ONNX graph with random weights drawn from ``seed``."""
    import onnx
    from onnx import helper, numpy_helper

    np_dtype = np.dtype(dtype)
    elem = helper.np_dtype_to_tensor_dtype(np_dtype)
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal(shape).astype(np_dtype) if np_dtype.kind == "f" \
        else rng.integers(-8, 8, size=shape).astype(np_dtype)
    graph = helper.make_graph(
        [helper.make_node("Mul", ["tensor_A", "weights"], ["A_times_weights"], name="mul"),
         helper.make_node("Add", ["A_times_weights", "tensor_B"], ["tensor_C"], name="add")],
        "simple_model",
        [helper.make_tensor_value_info("tensor_A", elem, list(shape)),
         helper.make_tensor_value_info("tensor_B", elem, list(shape))],
        [helper.make_tensor_value_info("tensor_C", elem, list(shape))],
        initializer=[numpy_helper.from_array(weights, "weights")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    onnx.checker.check_model(model)
    return model


def write_simple_popef(path: str | os.PathLike[str], shape: tuple[int, ...] = (1, 4),
                       dtype: str = "float32", batches_per_step: int = 1, seed: int = 0,
                       compress: bool = False) -> str | os.PathLike[str]:
    """Compile the example model and write it as a PopEF file at ``path``."""
    from host_runtime.poprt.compiler import write_popef
    from ipu_emulator.compiler import CompileOptions, ModelSpec, compile_onnx

    model = build_simple_model(tuple(int(d) for d in shape), dtype, seed)
    result = compile_onnx(ModelSpec(model), CompileOptions(
        name="simple_model", weights_as_tensor_data=True, save_weights=True,
        device_iterations=int(batches_per_step)))
    write_popef(result, path, compress=compress)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="model_runtime_example_generate_simple_popef",
        description="Write the example PopEF model: tensor_C = tensor_A * weights + tensor_B.")
    parser.add_argument("path", nargs="?", default="model.popef",
                        help="PopEF file to write (default: model.popef)")
    parser.add_argument("--shape", default="1,4", help="tensor shape, e.g. 1,4 (default)")
    parser.add_argument("--dtype", default="float32", help="numpy dtype (default float32)")
    parser.add_argument("--batches_per_step", type=int, default=1,
                        help="device iterations per Main program run (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    parser.add_argument("--compress", action="store_true", help="zlib-compress the executable")
    args = parser.parse_args(argv)
    try:
        shape = tuple(int(d) for d in args.shape.split(",") if d.strip())
    except ValueError:
        parser.error(f"--shape {args.shape!r} must be comma-separated integers")
    try:
        write_simple_popef(args.path, shape, args.dtype, args.batches_per_step, args.seed,
                           args.compress)
    except (ValueError, TypeError) as exc:
        print(f"model_runtime_example_generate_simple_popef: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.path}: tensor_C = tensor_A * weights + tensor_B, shape {list(shape)}, "
          f"{args.dtype}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
