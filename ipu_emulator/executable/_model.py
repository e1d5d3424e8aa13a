"""The parts an executable is made of: data types, device tensors, streams, graphs and
the instructions of programs (see the package docstring for the language); the
inter-IPU link handles. ``Executable`` itself is ``_executable``'s."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Union

import numpy as np

from ipu_emulator.errors import ExecutableError
from ipu_emulator.executable._limits import ALIGNMENT

# -- inter-IPU links (emulated IPU-Links) -------------------------------------------
# A sharded executable's parts exchange tensors through streams whose handles name the
# link: "__ipulink/<source ipu>/<destination ipu>/<tensor>". The compiler writes them, the
# host wires them IPU to IPU (never through itself), the device runs them as streams.

LINK_PREFIX = "__ipulink/"
SYNC_TENSOR = "__ipusync"
"""The tensor of the link that carries the sharding token (one is put in when links start)."""


def is_link(handle: str) -> bool:
    """True if the stream ``handle`` is an inter-IPU link, not a host anchor."""
    return handle.startswith(LINK_PREFIX)


def is_sync(handle: str) -> bool:
    """A link that carries the sharding token."""
    return is_link(handle) and handle.endswith("/" + SYNC_TENSOR)


IDLE_ATTR = "idle"
"""Attribute ``"1"`` of a multi-IPU executable's part: that IPU holds no node of the model.
The device has it (a model compiled for N IPUs is loaded on N), the host gives it nothing
to run, and such a part must have nothing in it (no graph, stream, tensor or instruction)."""


def parse_link(handle: str) -> tuple[int, int, str]:
    """``"__ipulink/0/1/x"`` -> ``(0, 1, "x")`` (source IPU, destination IPU, tensor)."""
    src, dst, tensor = handle[len(LINK_PREFIX):].split("/", 2)
    return int(src), int(dst), tensor



DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "S8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "S16": np.dtype(np.int16),
    "U16": np.dtype(np.uint16),
    "S32": np.dtype(np.int32),
    "U32": np.dtype(np.uint32),
    "S64": np.dtype(np.int64),
    "U64": np.dtype(np.uint64),
}
ORT_TYPES: dict[str, str] = {
    "tensor(bool)": "BOOL", "tensor(float16)": "F16", "tensor(float)": "F32",
    "tensor(double)": "F64", "tensor(int8)": "S8", "tensor(uint8)": "U8", "tensor(int16)": "S16",
    "tensor(uint16)": "U16", "tensor(int32)": "S32", "tensor(uint32)": "U32",
    "tensor(int64)": "S64", "tensor(uint64)": "U64",
}
"""onnxruntime's type string of a tensor (``NodeArg.type``) -> its PopEF data type name."""
_INDEX_DTYPES = ("S8", "U8", "S16", "U16", "S32", "U32", "S64", "U64")


def numpy_dtype(dtype: str) -> np.dtype:
    """The numpy dtype of a PopEF data type name (``"F32"``...)."""
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ExecutableError(
            f"unknown data type {dtype!r}; expected one of {', '.join(DTYPES)}") from None


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    n = numpy_dtype(dtype).itemsize
    for d in shape:
        n *= d
    return n


@dataclass(frozen=True)
class DeviceTensor:
    """A named, typed region of device memory at ``offset``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return _nbytes(self.dtype, self.shape)


class StreamSpec(NamedTuple):
    """One stream (anchor handle): direction ``"in"`` (host->device) or ``"out"``."""

    direction: str
    dtype: str
    shape: list[int]
    nbytes: int


@dataclass(frozen=True)
class TensorSig:
    """Name, type and shape of one ONNX graph input or output."""

    name: str
    dtype: str
    shape: tuple[int, ...]


class ExternalWeight(NamedTuple):
    """An initializer of a graph whose bytes are in the executable's weights section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int          # in the weights section, ``ALIGNMENT``-aligned

    @property
    def nbytes(self) -> int:
        return _nbytes(self.dtype, self.shape)


@dataclass(frozen=True)
class Graph:
    """A serialized ONNX ModelProto with its interface.

    ``external``: its initializers stored in the executable's weights section (the
    model names them as external data; see the module docstring)."""

    inputs: tuple[TensorSig, ...]
    outputs: tuple[TensorSig, ...]
    model: bytes = field(repr=False)
    external: tuple[ExternalWeight, ...] = ()


@dataclass(frozen=True)
class StreamIn:
    handle: str
    tensor: str


@dataclass(frozen=True)
class StreamOut:
    tensor: str
    handle: str


@dataclass(frozen=True)
class Execute:
    graph: int
    inputs: tuple[tuple[str, str], ...]    # (ONNX input name, device tensor)
    outputs: tuple[tuple[str, str], ...]   # (ONNX output name, device tensor)


@dataclass(frozen=True)
class Repeat:
    count: int
    body: tuple["Instruction", ...]


@dataclass(frozen=True)
class Switch:
    index: str
    branches: tuple[tuple["Instruction", ...], ...]


@dataclass(frozen=True)
class Copy:
    src: str
    dst: str


Instruction = Union[StreamIn, StreamOut, Execute, Repeat, Switch, Copy]


@dataclass(frozen=True)
class Program:
    """One numbered program (``name`` is informative: "load", "main", "save")."""

    name: str
    body: tuple[Instruction, ...]


def plan_memory(specs: list[tuple[str, str, tuple[int, ...]]]) -> tuple[dict[str, DeviceTensor], int]:
    """Lay ``(name, dtype, shape)`` tensors out in device memory, ``ALIGNMENT``-aligned.

    Returns the tensors and the total bytes of device memory they need.
    """
    tensors: dict[str, DeviceTensor] = {}
    offset = 0
    for name, dtype, shape in specs:
        if name in tensors:
            raise ExecutableError(f"device tensor {name!r} is planned twice")
        t = DeviceTensor(name, dtype, tuple(int(d) for d in shape), offset)
        tensors[name] = t
        offset += -(-t.nbytes // ALIGNMENT) * ALIGNMENT
    return tensors, offset
