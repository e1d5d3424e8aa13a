"""Small helpers of PopRT's ``poprt.utils``."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import onnx

__all__ = ["get_logger", "onnx_tensor_dtype_to_np_dtype", "get_input_info_from_model_proto"]


def get_logger(name: str = "poprt") -> logging.Logger:
    """PopRT's logger (PopRT 1.0.2's examples pass it to ``Converter.convert``): the
    ``logging`` logger ``name``, which the converter and compiler log to."""
    return logging.getLogger(name)


def onnx_tensor_dtype_to_np_dtype(tensor_type: int) -> np.dtype:
    """``onnx.TensorProto.FLOAT`` -> ``np.dtype('float32')``."""
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor_type))


def get_input_info_from_model_proto(model: onnx.ModelProto) -> dict[str, Any]:
    """name -> ``(shape, numpy dtype)`` of the model's inputs (initializers excluded); a
    dynamic dim is its name (or -1)."""
    inits = {t.name for t in model.graph.initializer}
    out: dict[str, Any] = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        tt = vi.type.tensor_type
        dims: list[Any] = [d.dim_value if d.HasField("dim_value") else (d.dim_param or -1)
                           for d in tt.shape.dim]
        out[vi.name] = (dims, onnx_tensor_dtype_to_np_dtype(tt.elem_type))
    return out
