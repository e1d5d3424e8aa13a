"""``poprt.optimizer.Optimizer``: run a list of passes over a model (what PopRT's BERT
example and benchmarks call; the same as ``PassManager``)."""

from __future__ import annotations

from typing import Iterable

import onnx

from host_runtime.poprt.passes import Pass, PassManager

__all__ = ["Optimizer"]


class Optimizer:
    """``Optimizer(['layer_norm_pattern', 'gelu_pattern']).run(model)``."""

    def __init__(self, passes: Iterable["str | Pass"] = ()) -> None:
        self.manager = PassManager(list(passes))

    def run(self, model: onnx.ModelProto) -> onnx.ModelProto:
        return self.manager.run(model)
