"""How a request's tensors map onto whole transfers of the model's anchors.

A transfer is one slot of an anchor's stream ring: exactly the anchor's
shape (``model shape``). A request carries ``n`` *samples* along the batch
dimension:

- batching disabled (``batching_dim == 0xFFFFFFFF``): dimension 0 is the
  batch; ``n`` must be a multiple of the model's batch ``B`` and the request
  is ``n / B`` whole transfers;
- batching on dimension ``d``: any ``n >= 1``; samples are packed into
  transfers of ``B`` samples, across requests, and the last partial transfer
  is padded with zeros when it is flushed.

``TensorSpec`` validates one user tensor against its anchor and returns a
typed view shaped ``model shape with n on the batch dimension``, without
copying; ``copy_samples`` moves samples between such views and slots.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from host_runtime.errors import BadRequestError

__all__ = ["TensorSpec", "copy_samples", "batch_of"]

_U8 = np.dtype(np.uint8)


def _shape_str(shape: Any) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


@dataclass
class TensorSpec:
    """One Main-program anchor as the runner sees it."""

    name: str
    handle: str
    shape: tuple[int, ...]
    dtype: np.dtype
    is_input: bool
    batch_dim: int | None          # None: the tensor has no batch dimension (exact shape only)
    dynamic: bool                  # batching_dim set: any sample count
    nbytes: int = field(init=False)
    batch: int = field(init=False)          # model's samples per transfer
    sample_nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.dtype = np.dtype(self.dtype)
        n = self.dtype.itemsize
        for d in self.shape:
            n *= int(d)
        self.nbytes = n
        bd = self.batch_dim
        if bd is not None and (bd >= len(self.shape) or self.shape[bd] <= 0):
            self.batch_dim = bd = None
        self.batch = self.shape[bd] if bd is not None else 1
        self.sample_nbytes = self.nbytes // self.batch if self.batch else 0

    @property
    def kind(self) -> str:
        return "input" if self.is_input else "output"

    def shape_for(self, samples: int) -> tuple[int, ...]:
        """The shape of a user tensor holding ``samples`` samples."""
        d = self.batch_dim
        if d is None:
            return self.shape
        return self.shape[:d] + (samples,) + self.shape[d + 1:]

    def expected(self) -> str:
        d = self.batch_dim
        if d is None:
            return f"shape {_shape_str(self.shape)}"
        dims = [str(x) for x in self.shape]
        if self.dynamic:
            dims[d] = "N"
            return f"shape [{', '.join(dims)}] (any N >= 1 on dimension {d})"
        dims[d] = f"N*{self.batch}" if self.batch != 1 else "N"
        return f"shape [{', '.join(dims)}] (N >= 1)"

    def samples_of(self, arr: np.ndarray) -> int:
        """Validate ``arr`` (typed, or raw uint8 bytes) and return its sample count.

        A flat (1-D) ``ConstTensorMemoryView``/``TensorMemoryView`` of any dtype counts as
        raw memory, as the reference's pointer-and-size views do: its bytes decide."""
        raw = (arr.dtype == _U8 and self.dtype != _U8) or (
            arr.ndim == 1 and len(self.shape) != 1 and _is_view(arr)
            and arr.flags.c_contiguous)
        if not raw and arr.dtype != self.dtype:
            raise BadRequestError(
                f"{self.kind} {self.name!r}: expected dtype {self.dtype}, got {arr.dtype}")
        d = self.batch_dim
        if raw:
            size = arr.nbytes
            if d is None:
                if size != self.nbytes:
                    raise BadRequestError(
                        f"{self.kind} {self.name!r}: expected {self.nbytes} bytes "
                        f"({self.expected()}, dtype {self.dtype}), got {size} bytes")
                return 1
            per_sample = self.dynamic
            unit = self.sample_nbytes if per_sample else self.nbytes
            if unit == 0 or size == 0 or size % unit:
                what = "one sample" if per_sample else "one transfer"
                raise BadRequestError(
                    f"{self.kind} {self.name!r}: expected a multiple of {unit} bytes ({what} of "
                    f"{self.expected()}, dtype {self.dtype}), got {size} bytes")
            return size // unit * (1 if per_sample else self.batch)
        shape = tuple(int(x) for x in arr.shape)
        if d is None:
            if shape != self.shape:
                raise BadRequestError(f"{self.kind} {self.name!r}: expected {self.expected()}, "
                                      f"got shape {_shape_str(shape)}")
            return 1
        ok = (len(shape) == len(self.shape) and shape[:d] == self.shape[:d]
              and shape[d + 1:] == self.shape[d + 1:] and shape[d] >= 1)
        if ok and not self.dynamic:
            ok = shape[d] % self.batch == 0
        if not ok:
            raise BadRequestError(f"{self.kind} {self.name!r}: expected {self.expected()}, "
                                  f"got shape {_shape_str(shape)}")
        return shape[d]

    def typed(self, arr: np.ndarray, samples: int) -> np.ndarray:
        """``arr`` viewed as this tensor's dtype and ``shape_for(samples)`` (no copy if possible)."""
        shape = self.shape_for(samples)
        if arr.dtype == self.dtype and tuple(arr.shape) == shape:
            return arr
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
        return arr.reshape(-1).view(_U8).view(self.dtype).reshape(shape)

    def index(self, start: int, stop: int) -> tuple[slice, ...]:
        d = self.batch_dim or 0
        return (slice(None),) * d + (slice(start, stop),)


def _is_view(arr: np.ndarray) -> bool:
    from host_runtime.memory import ConstTensorMemoryView, TensorMemoryView

    return isinstance(arr, (ConstTensorMemoryView, TensorMemoryView))


def copy_samples(dst: np.ndarray, dst_start: int, src: np.ndarray, src_start: int,
                 count: int, spec: TensorSpec) -> None:
    """``dst[samples dst_start:+count] = src[samples src_start:+count]`` along the batch dim."""
    if spec.batch_dim is None:
        dst[...] = src
        return
    dst[spec.index(dst_start, dst_start + count)] = src[spec.index(src_start, src_start + count)]


def batch_of(counts: dict[str, int]) -> int:
    """The one sample count all tensors agree on; BadRequestError naming the disagreement."""
    values = set(counts.values())
    if len(values) > 1:
        detail = ", ".join(f"{k} has {v}" for k, v in counts.items())
        raise BadRequestError(f"the request's tensors disagree on the batch size: {detail}")
    return values.pop() if values else 0
