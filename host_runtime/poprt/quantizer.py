"""PopRT's fp8 quantizer: refused by name (``NotSupportedError``): fp8 arithmetic has no
kernels on the host, so the emulator cannot calibrate or run fp8 models."""

from __future__ import annotations

from typing import Any

import onnx

from host_runtime.poprt._errors import NotSupportedError

__all__ = ["quantize", "FP8Quantizer"]

_WHY = ("fp8 quantization is not supported by the IPU emulator: fp8 arithmetic has no "
        "kernels on the host; convert with precision 'fp16' instead")


class FP8Quantizer:
    """Refused: see the module docstring."""

    def __init__(self, output_dir: str, loss_type: str, data_preprocess: str | None = None,
                 precision: str = "fp8", num_of_layers_keep_fp16: int = 0,
                 options: dict[str, Any] | None = None) -> None:
        raise NotSupportedError(_WHY)


def quantize(onnx_model: onnx.ModelProto, input_model: str, output_dir: str,
             data_preprocess: str | None = None, precision: str = "fp8",
             quantize_loss_type: str = "kld", num_of_layers_keep_fp16: int = 0,
             options: dict[str, Any] | None = None) -> onnx.ModelProto:
    """Refused: see the module docstring."""
    raise NotSupportedError(_WHY)
