"""Tensor memory: the seeds' memory views, and shared (zero-copy) host memory."""

from __future__ import annotations

from host_runtime.memory._shared import empty_shared, is_shared
from host_runtime.memory._views import ConstTensorMemoryView, InputMemoryView, OutputMemory, OutputMemoryView, PopefPaths, TensorMemory, TensorMemoryView

# for the other packages of host_runtime (not part of the public surface)
from shm.copy import PARALLEL_MIN_BYTES as PARALLEL_MIN_BYTES, copy_bytes as copy_bytes
from host_runtime.memory._shared import SHARED_MIN_BYTES as SHARED_MIN_BYTES, shared_location as shared_location
from host_runtime.memory._shared import check_owned as check_owned
from host_runtime.memory._views import as_readable_array as as_readable_array, as_writable_array as as_writable_array

__all__ = ["empty_shared", "is_shared", "ConstTensorMemoryView", "InputMemoryView", "OutputMemory", "OutputMemoryView", "PopefPaths", "TensorMemory", "TensorMemoryView"]
