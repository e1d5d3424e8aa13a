"""Run two ONNX models on the same random inputs with onnxruntime and compare them
(PopRT's ``--check`` and ``check_with_fake_data``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx

from host_runtime.errors import BadRequestError

__all__ = ["random_feeds", "run_onnxruntime", "compare_with_onnxruntime", "ConversionCheckError"]


class ConversionCheckError(BadRequestError):
    """The converted model computes other values than the original."""


def random_feeds(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    """Uniform [0, 1) floats, zero integers and false booleans for the static inputs."""
    from onnx.helper import tensor_dtype_to_np_dtype

    rng = np.random.default_rng(seed)
    inits = {t.name for t in model.graph.initializer}
    feeds: dict[str, np.ndarray] = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else -1 for d in tt.shape.dim]
        if any(d < 0 for d in dims):
            raise BadRequestError(f"input {vi.name!r} has a dynamic shape {dims}; give its "
                                  "shape (input_shape) to check the conversion")
        dtype = np.dtype(tensor_dtype_to_np_dtype(tt.elem_type))
        if dtype.kind == "f":
            feeds[vi.name] = rng.random(dims, dtype=np.float32).astype(dtype)
        else:
            feeds[vi.name] = np.zeros(dims, dtype)
    return feeds


def run_onnxruntime(model: onnx.ModelProto, feeds: dict[str, Any]) -> dict[str, np.ndarray]:
    from ipu_emulator.compiler import ort_session

    sess: Any = ort_session(model)
    names = [o.name for o in sess.get_outputs()]
    wanted = {i.name: i.type for i in sess.get_inputs()}
    typed = {}
    for k, v in feeds.items():
        if k in wanted:
            want = {"tensor(float16)": np.float16, "tensor(float)": np.float32,
                    "tensor(int32)": np.int32, "tensor(int64)": np.int64}.get(wanted[k])
            typed[k] = np.asarray(v).astype(want) if want is not None else np.asarray(v)
    return dict(zip(names, sess.run(names, typed)))


def compare_with_onnxruntime(origin: onnx.ModelProto, converted: onnx.ModelProto,
                             rtol: float | None = None) -> None:
    """Raise ConversionCheckError when an output of ``converted`` differs from
    ``origin``'s on random inputs (tolerance: 1e-4 relative, 2e-2 when fp16 is involved)."""
    feeds = random_feeds(converted)
    try:
        want = run_onnxruntime(origin, feeds)
        got = run_onnxruntime(converted, feeds)
    except BadRequestError:
        raise
    except Exception as exc:
        raise ConversionCheckError(f"the conversion check could not run the models: {exc}"
                                   ) from None
    for name, ref in want.items():
        if name not in got:
            continue
        out = np.asarray(got[name])
        half = out.dtype == np.float16 or ref.dtype == np.float16
        tol = rtol if rtol is not None else (2e-2 if half else 1e-4)
        if ref.dtype.kind in "fc":
            ok = np.allclose(out.astype(np.float64), ref.astype(np.float64), rtol=tol,
                             atol=tol * max(1.0, float(np.max(np.abs(ref), initial=0.0))),
                             equal_nan=True)
        else:
            ok = np.array_equal(out.astype(ref.dtype), ref)
        if not ok or out.shape != ref.shape:
            raise ConversionCheckError(
                f"output {name!r} of the converted model differs from the original on random "
                f"inputs (shape {out.shape} vs {ref.shape}, tolerance {tol})")
