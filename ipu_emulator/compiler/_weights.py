"""Large initializers out of a graph and into the executable's weights section.

The IPU process hands them to onnxruntime where they lie (see
``ipu_emulator.executable``): so every replica of a model uses one read-only
copy in shared memory, and the graph stays small whatever the weights weigh.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from ipu_emulator.compiler._onnx import ONNX_TO_DTYPE, stashed
from ipu_emulator.errors import CompileError
from ipu_emulator.executable import ALIGNMENT, ExternalWeight
from shm.errors import echo

__all__ = ["EXTERNAL_MIN_BYTES", "LOCATION", "externalize", "refuse_stashed"]

EXTERNAL_MIN_BYTES = 1024
"""Initializers of fewer bytes stay in the graph."""

LOCATION = "ipu_emulator_weights"
"""The external-data location the graphs name (never a file: the IPU process gives
onnxruntime every such initializer itself)."""

_DATA_FIELDS = ("raw_data", "float_data", "int32_data", "string_data", "int64_data",
                "double_data", "uint64_data")


def externalize(model: onnx.ModelProto, weights: bytearray
                ) -> tuple[bytes, tuple[ExternalWeight, ...]]:
    """``model``'s bytes with its initializers of ``EXTERNAL_MIN_BYTES`` or more appended
    to ``weights`` (each ``ALIGNMENT``-aligned) and named there as external data.
    ``model`` is not changed."""
    big = [t for t in model.graph.initializer
           if t.data_type in ONNX_TO_DTYPE and _nbytes(t) >= EXTERNAL_MIN_BYTES
           and (t.data_location != TensorProto.EXTERNAL or stashed(t) is not None)]
    if not big:
        return model.SerializeToString(), ()
    out = onnx.ModelProto()
    out.CopyFrom(model)
    by_name = {t.name: t for t in out.graph.initializer}
    refs = []
    for t in big:
        weights += bytes(-len(weights) % ALIGNMENT)
        offset = len(weights)
        kept = stashed(t)   # a large initializer left in its external data file
        if kept is not None:
            weights += kept.reshape(-1).view(np.uint8).data
            raw_len = kept.nbytes
        else:
            data = numpy_helper.to_array(t)
            raw = data.astype(data.dtype.newbyteorder("<"), copy=False).tobytes()
            weights += raw
            raw_len = len(raw)
        refs.append(ExternalWeight(t.name, ONNX_TO_DTYPE[t.data_type],
                                   tuple(int(d) for d in t.dims), offset))
        e = by_name[t.name]
        for f in _DATA_FIELDS:
            e.ClearField(f)
        e.data_location = TensorProto.EXTERNAL
        del e.external_data[:]
        for key, value in (("location", LOCATION), ("offset", str(offset)),
                           ("length", str(raw_len))):
            entry = e.external_data.add()
            entry.key, entry.value = key, value
    return out.SerializeToString(), tuple(refs)


def _nbytes(t: TensorProto) -> int:
    n = 1
    for d in t.dims:
        n *= int(d)
    return n * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize


def refuse_stashed(model: onnx.ModelProto, label: str, precision: str, opts: object,
                   combined: bool) -> None:
    """A model whose large initializers stayed in their external data file (over protobuf's
    2 GiB) compiles in fp32 as one model on one IPU, its weights as constants: say so for
    the rest rather than fail somewhere inside."""
    big = [t.name for t in model.graph.initializer if stashed(t) is not None]
    if not big:
        return
    what = ("fp16" if precision != "fp32" else
            "weights as tensor data" if getattr(opts, "weights_as_tensor_data", False) else
            "fusion or sharding" if combined else None)
    if what is not None:
        raise CompileError(
            f"model {echo(label, 200)}: {len(big)} initializer(s) of 1 GiB or more "
            f"({echo(big[:3], 200)}) are compiled from their external data file, in fp32, "
            f"as one model on one IPU; {what} is not supported for them")
