"""fp8 as the emulator can do it: values rounded to the IPU's fp8 formats, computed in fp16.

The IPU multiplies fp8 operands (``F143``: 1 sign, 4 exponent, 3 mantissa bits;
``F152``: 5 exponent, 2 mantissa bits; Graphcore's formats, which onnx names
FLOAT8E4M3FNUZ and FLOAT8E5M2FNUZ) with a power-of-two scale. The host has no fp8
arithmetic, so ``Float2FP8`` rounds what the IPU would hold in fp8 to fp8's values
(round to nearest even, saturating at the format's largest value) and computes in
fp16: the weights of Conv/MatMul/Gemm once at conversion time (``fp8_weight`` and
``fp8``), and with ``fp8`` their activation inputs at run time by a few standard ONNX
ops. The values are those of fp8 operands; the accumulation is fp16/fp32's.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from host_runtime.errors import BadRequestError
from host_runtime.poprt._onnx_util import (constant_value, make_const,
                                          parse_skip_list, prune, unique)
from host_runtime.poprt.passes._rewrite import _Rewrite

__all__ = ["Float2FP8", "FORMATS", "round_to_fp8", "parse_fp8_params"]

# format -> (mantissa bits, smallest normal exponent, largest finite value)
FORMATS = {"F143": (3, -7, 240.0), "F152": (2, -15, 57344.0)}
_TARGETS = {"Conv": 1, "MatMul": 1, "Gemm": 1}


def parse_fp8_params(value: Any) -> tuple[str, str, int, int]:
    """``"F143,F143,0,0"`` (or a list) -> (input format, weight format, input scale,
    weight scale)."""
    items = value.split(",") if isinstance(value, str) else list(value)
    if len(items) != 4:
        raise BadRequestError(f"fp8_params must be 'input_format,weight_format,input_scale,"
                              f"weight_scale', got {value!r}")
    fin, fw = str(items[0]).strip(), str(items[1]).strip()
    for f in (fin, fw):
        if f not in FORMATS:
            raise BadRequestError(f"fp8 format must be one of {sorted(FORMATS)}, got {f!r}")
    try:
        return fin, fw, int(items[2]), int(items[3])
    except (TypeError, ValueError):
        raise BadRequestError(f"fp8_params scales must be integers, got {value!r}") from None


def round_to_fp8(x: np.ndarray, fmt: str, scale: int = 0) -> np.ndarray:
    """``x`` rounded to the values fp8 ``fmt`` holds of ``x * 2**scale``, divided back."""
    mant, emin, top = FORMATS[fmt]
    v = np.asarray(x, np.float64) * 2.0 ** scale
    with np.errstate(divide="ignore"):
        e = np.maximum(np.floor(np.log2(np.abs(v))), emin)
    q = np.exp2(e - mant)
    out = np.clip(np.round(v / q) * q, -top, top)
    result: np.ndarray = (out / 2.0 ** scale).astype(np.asarray(x).dtype)
    return result


class Float2FP8(_Rewrite):
    """Round Conv/MatMul/Gemm weights (``convert_model='fp8_weight'``) and also their
    activation inputs (``'fp8'``) to fp8 values, keeping fp16 arithmetic; ops named in
    ``skip_op_names`` keep their precision. Changes the model's values as fp8 does."""

    def __init__(self, fp8_params: Any = ("F143", "F143", 0, 0), skip_op_names: Any = None,
                 convert_model: str = "fp8", fp8_input_dict: dict[str, int] | None = None,
                 fp8_weight_dict: dict[str, int] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fin, self.fw, self.sin, self.sw = parse_fp8_params(fp8_params)
        if convert_model not in ("fp8", "fp8_weight"):
            raise BadRequestError(f"convert_model must be 'fp8' or 'fp8_weight', got "
                                  f"{convert_model!r}")
        self.convert_model = convert_model
        self.skip = set(parse_skip_list(skip_op_names, "skip_op_names"))
        self.input_scales = dict(fp8_input_dict or {})
        self.weight_scales = dict(fp8_weight_dict or {})

    def run(self, onnx_model: onnx.ModelProto) -> onnx.ModelProto:
        self._inits = {t.name for t in onnx_model.graph.initializer}
        return prune(super().run(onnx_model))

    def rewrite(self, g: onnx.GraphProto, n: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        """``n``'s weight rounded in place; with ``'fp8'``, nodes rounding its input first."""
        k = _TARGETS.get(n.op_type)
        if k is None or n.name in self.skip or len(n.input) <= k:
            return None
        w = constant_value(g, n.input[k])
        if w is not None and w.dtype.kind == "f" and n.input[k] in self._inits:
            scale = self.weight_scales.get(n.name, self.sw)
            n.input[k] = make_const(g, f"{n.input[k]}__fp8", round_to_fp8(w, self.fw, scale))
        if self.convert_model != "fp8":
            return None
        return [*self._round_input(g, n, 0, self.input_scales.get(n.name, self.sin)), n]

    def _round_input(self, g: onnx.GraphProto, n: onnx.NodeProto, k: int,
                     scale: int) -> list[onnx.NodeProto]:
        """Nodes that round input ``k`` of ``n`` to fp8 values (computed in fp32)."""
        mant, emin, top = FORMATS[self.fin]
        tag = unique(g, f"{n.name or n.op_type}__fp8_in{k}")
        src = n.input[k]
        c = {key: make_const(g, f"{tag}_{key}", np.array(v, np.float32)) for key, v in {
            "up": 2.0 ** scale, "down": 2.0 ** -scale, "ln2": math.log(2.0), "emin": emin,
            "mant": mant, "two": 2.0, "lo": -top, "hi": top}.items()}
        names = {s: f"{tag}_{s}" for s in ("f", "v", "a", "l", "l2", "fl", "e", "em", "q", "d",
                                            "r", "m", "cl", "o", "t")}
        nodes = [
            helper.make_node("Cast", [src], [names["f"]], to=TensorProto.FLOAT, name=tag),
            helper.make_node("Mul", [names["f"], c["up"]], [names["v"]]),
            helper.make_node("Abs", [names["v"]], [names["a"]]),
            helper.make_node("Log", [names["a"]], [names["l"]]),
            helper.make_node("Div", [names["l"], c["ln2"]], [names["l2"]]),
            helper.make_node("Floor", [names["l2"]], [names["fl"]]),
            helper.make_node("Max", [names["fl"], c["emin"]], [names["e"]]),
            helper.make_node("Sub", [names["e"], c["mant"]], [names["em"]]),
            helper.make_node("Pow", [c["two"], names["em"]], [names["q"]]),
            helper.make_node("Div", [names["v"], names["q"]], [names["d"]]),
            helper.make_node("Round", [names["d"]], [names["r"]]),
            helper.make_node("Mul", [names["r"], names["q"]], [names["m"]]),
            helper.make_node("Max", [names["m"], c["lo"]], [names["cl"]]),
            helper.make_node("Min", [names["cl"], c["hi"]], [names["o"]]),
            helper.make_node("Mul", [names["o"], c["down"]], [names["t"]]),
        ]
        back = f"{tag}_out"
        nodes.append(helper.make_node("Cast", [names["t"]], [back],
                                      to=self.types.get(src, TensorProto.FLOAT)))
        n.input[k] = back
        return nodes
