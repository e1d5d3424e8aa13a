"""Tensor memory: the seeds' memory views, and shared (zero-copy) host memory."""

from __future__ import annotations

from host_runtime.memory._shared import empty_shared, is_shared
from host_runtime.memory._views import ConstTensorMemoryView, InputMemoryView, OutputMemory, OutputMemoryView, PopefPaths, TensorMemory, TensorMemoryView

__all__ = ["empty_shared", "is_shared", "ConstTensorMemoryView", "InputMemoryView", "OutputMemory", "OutputMemoryView", "PopefPaths", "TensorMemory", "TensorMemoryView"]
