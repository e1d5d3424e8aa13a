"""Tensor memory as the seeds spell it, over numpy.

The C++ API passes ``(pointer, size)`` pairs; the Python listings pass numpy
arrays and read results with ``np.frombuffer(result[name], dtype=...)``,
``future[name].numpy()`` and ``np.array(x, copy=False)``. Python 3.11 classes
cannot export the buffer protocol themselves, so the memory types are thin
``np.ndarray`` subclasses: they *are* buffers (``np.frombuffer`` works), they
keep the memory they borrow alive by reference, and numpy 2's copy semantics
hold (``np.array(x, copy=False)`` is a view, ``copy=True`` a copy).

============================  ===============================================
``TensorMemory``              memory the runtime owns; ``numpy()`` copies it
``TensorMemoryView``          a writable view of the user's memory;
                              ``numpy()`` is a view sharing that memory
``ConstTensorMemoryView``     a read-only view of the user's memory
``InputMemoryView``           ``dict[str, ConstTensorMemoryView]`` (numpy ok)
``OutputMemoryView``          ``dict[str, TensorMemoryView]`` (numpy ok)
``OutputMemory``              ``dict[str, TensorMemory]``
``PopefPaths``                ``list[str]`` of PopEF files
============================  ===============================================
"""

from __future__ import annotations

import os
from typing import Any, Iterable

import numpy as np

from host_runtime.errors import BadRequestError

__all__ = [
    "TensorMemory",
    "TensorMemoryView",
    "ConstTensorMemoryView",
    "InputMemoryView",
    "OutputMemoryView",
    "OutputMemory",
    "PopefPaths",
    "as_readable_array",
    "as_writable_array",
]

_U8 = np.dtype(np.uint8)


def _buffer_array(data: Any, data_size_bytes: int | None, writable: bool) -> np.ndarray:
    """A numpy array over ``data`` (no copy); bytes-like data becomes uint8."""
    if isinstance(data, np.ndarray):
        arr = data
    else:
        try:
            mv = memoryview(data)
        except TypeError:
            raise BadRequestError(
                f"tensor memory must be a numpy array or a bytes-like object, "
                f"got {type(data).__name__}") from None
        if writable and mv.readonly:
            raise BadRequestError(
                f"output memory must be writable, got a read-only {type(data).__name__}")
        arr = np.frombuffer(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv, dtype=_U8)
    if data_size_bytes is not None:
        size = int(data_size_bytes)
        if size < 0 or size > arr.nbytes:
            raise BadRequestError(
                f"data_size_bytes must be between 0 and the buffer's {arr.nbytes} bytes, "
                f"got {size}")
        if size != arr.nbytes:
            if not arr.flags.c_contiguous:
                raise BadRequestError("a partial view needs C-contiguous memory")
            arr = arr.reshape(-1).view(_U8)[:size]
    return arr


class TensorMemory(np.ndarray):
    """Memory allocated and owned by the runtime (or by ``TensorMemory(n)``).

    ``TensorMemory(data_size_bytes)`` allocates zeroed bytes as in C++. The
    runtime returns typed, shaped instances. ``numpy()`` returns a copy, as
    the seeds' listings expect for runner-allocated outputs.
    """

    def __new__(cls, data_size_bytes: int = 0) -> "TensorMemory":
        n = int(data_size_bytes)
        if n < 0:
            raise BadRequestError(f"data_size_bytes must be >= 0, got {n}")
        return np.zeros(n, dtype=_U8).view(cls)

    @classmethod
    def allocate(cls, shape: Iterable[int], dtype: Any) -> "TensorMemory":
        """Uninitialised memory of the given shape and type (used by the runner)."""
        return np.empty(tuple(shape), dtype=dtype).view(cls)

    @property
    def data_size_bytes(self) -> int:
        return int(self.nbytes)

    def getView(self) -> "TensorMemoryView":
        return self.view(TensorMemoryView)

    def getConstView(self) -> "ConstTensorMemoryView":
        return ConstTensorMemoryView(self)

    def numpy(self) -> np.ndarray:
        """A copy of the data as a plain numpy array."""
        return np.array(self, copy=True, subok=False)


class TensorMemoryView(np.ndarray):
    """Mutable view of memory someone else allocated.

    ``TensorMemoryView(data, data_size_bytes=None)`` wraps a numpy array or a
    writable bytes-like object without copying; ``numpy()`` is a view that
    shares the memory.
    """

    def __new__(cls, data: Any, data_size_bytes: int | None = None) -> "TensorMemoryView":
        arr = _buffer_array(data, data_size_bytes, writable=True)
        if not arr.flags.writeable:
            raise BadRequestError("output memory must be writable, got a read-only array")
        return arr.view(cls)

    @property
    def data_size_bytes(self) -> int:
        return int(self.nbytes)

    def numpy(self) -> np.ndarray:
        """A plain numpy view of the same memory (no copy)."""
        return self.view(np.ndarray)


class ConstTensorMemoryView(np.ndarray):
    """Immutable view of memory someone else allocated (inputs)."""

    def __new__(cls, data: Any = b"", data_size_bytes: int | None = None) -> "ConstTensorMemoryView":
        arr = _buffer_array(data, data_size_bytes, writable=False).view(cls)
        arr.flags.writeable = False
        return arr

    @property
    def data_size_bytes(self) -> int:
        return int(self.nbytes)

    def numpy(self) -> np.ndarray:
        return self.view(np.ndarray)


def as_readable_array(value: Any, name: str) -> np.ndarray:
    """Normalise one input value to a numpy array without copying."""
    if isinstance(value, np.ndarray):
        return value
    try:
        return _buffer_array(value, None, writable=False)
    except BadRequestError as exc:
        raise BadRequestError(f"input {name!r}: {exc}") from None


def as_writable_array(value: Any, name: str) -> np.ndarray:
    """Normalise one output value to a writable numpy array without copying."""
    if isinstance(value, np.ndarray):
        if not value.flags.writeable:
            raise BadRequestError(f"output {name!r}: expected writable memory, got a read-only array")
        return value
    try:
        return _buffer_array(value, None, writable=True)
    except BadRequestError as exc:
        raise BadRequestError(f"output {name!r}: {exc}") from None


class InputMemoryView(dict):  # type: ignore[type-arg]
    """Mapping from input tensor name to its (borrowed, read-only) memory.

    Values may be numpy arrays, ``ConstTensorMemoryView``/``TensorMemory``
    or any bytes-like object; they are kept by reference, not copied.
    """

    def __setitem__(self, name: str, value: Any) -> None:
        if not isinstance(name, str):
            raise BadRequestError(f"tensor names are str, got {type(name).__name__}")
        super().__setitem__(name, as_readable_array(value, name))

    def update(self, *args: Any, **kwargs: Any) -> None:
        for k, v in dict(*args, **kwargs).items():
            self[k] = v


class OutputMemoryView(dict):  # type: ignore[type-arg]
    """Mapping from output tensor name to user-allocated writable memory."""

    def __setitem__(self, name: str, value: Any) -> None:
        if not isinstance(name, str):
            raise BadRequestError(f"tensor names are str, got {type(name).__name__}")
        super().__setitem__(name, as_writable_array(value, name))

    def update(self, *args: Any, **kwargs: Any) -> None:
        for k, v in dict(*args, **kwargs).items():
            self[k] = v


class OutputMemory(dict):  # type: ignore[type-arg]
    """Mapping from output tensor name to runtime-allocated ``TensorMemory``."""


class PopefPaths(list):  # type: ignore[type-arg]
    """The PopEF files that together hold one model."""

    def __init__(self, paths: Iterable[str | os.PathLike[str]] | str | os.PathLike[str] = ()) -> None:
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        super().__init__(os.fspath(p) for p in paths)
