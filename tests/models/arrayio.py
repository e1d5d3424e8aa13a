"""A ``StreamIO`` over numpy arrays for interpreter tests."""

from __future__ import annotations

import numpy as np

__all__ = ["ArrayIO"]


class ArrayIO:
    """Feeds each input handle from a list of arrays (one per transfer) and
    collects each output handle's transfers as arrays of the given dtype/shape."""

    def __init__(self, inputs: dict[str, list[np.ndarray]],
                 outputs: dict[str, tuple[np.dtype, tuple[int, ...]]]) -> None:
        self._inputs = {h: list(v) for h, v in inputs.items()}
        self._out_spec = outputs
        self.reads: list[str] = []
        self.outputs: dict[str, list[np.ndarray]] = {h: [] for h in outputs}

    def read_input(self, handle: str, dest: memoryview) -> None:
        self.reads.append(handle)
        arr = np.ascontiguousarray(self._inputs[handle].pop(0))
        src = arr.reshape(-1).view(np.uint8)
        assert len(dest) == src.nbytes, (handle, len(dest), src.nbytes)
        np.frombuffer(dest, np.uint8)[:] = src

    def write_output(self, handle: str, src: memoryview) -> None:
        dtype, shape = self._out_spec[handle]
        self.outputs[handle].append(np.frombuffer(bytes(src), dtype).reshape(shape))
