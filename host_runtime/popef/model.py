"""The PopEF data model: what a model file describes, independent of its encoding.

Names and method spellings follow the seeds' Python listings (``anchor.name()``,
``tensorInfo().shape()``, ``numpyDType()``, ``metadata.anchors()``...). Objects
are plain values: they compare equal field by field, which the round-trip
tests rely on.
"""

from __future__ import annotations

import enum
import zlib
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from host_runtime.errors import BadRequestError, PopefError

__all__ = [
    "DataType",
    "TensorType",
    "TensorInfo",
    "Anchor",
    "ProgramFlow",
    "Metadata",
    "TensorData",
    "FeedData",
    "Opaque",
    "ExecutableBlob",
    "Model",
]


class DataType(enum.Enum):
    """Element types. FP8 types exist in PopEF; this emulator refuses them."""

    BOOL = "BOOL"
    F16 = "F16"
    F32 = "F32"
    F64 = "F64"
    S8 = "S8"
    U8 = "U8"
    S16 = "S16"
    U16 = "U16"
    S32 = "S32"
    U32 = "U32"
    S64 = "S64"
    U64 = "U64"
    F8143 = "F8143"
    F8152 = "F8152"

    @property
    def itemsize(self) -> int:
        return _numpy_dtype(self).itemsize

    def numpyDType(self) -> np.dtype:
        return _numpy_dtype(self)

    @classmethod
    def fromNumpy(cls, dtype: object) -> "DataType":
        dt = np.dtype(dtype)  # type: ignore[call-overload]
        for member, npdt in _NUMPY.items():
            if npdt == dt:
                return member
        raise BadRequestError(
            f"numpy dtype {dt} has no PopEF data type; expected one of "
            + ", ".join(str(v) for v in _NUMPY.values()))


_NUMPY: dict[DataType, np.dtype] = {
    DataType.BOOL: np.dtype(np.bool_),
    DataType.F16: np.dtype(np.float16),
    DataType.F32: np.dtype(np.float32),
    DataType.F64: np.dtype(np.float64),
    DataType.S8: np.dtype(np.int8),
    DataType.U8: np.dtype(np.uint8),
    DataType.S16: np.dtype(np.int16),
    DataType.U16: np.dtype(np.uint16),
    DataType.S32: np.dtype(np.int32),
    DataType.U32: np.dtype(np.uint32),
    DataType.S64: np.dtype(np.int64),
    DataType.U64: np.dtype(np.uint64),
}


def _numpy_dtype(dt: DataType) -> np.dtype:
    try:
        return _NUMPY[dt]
    except KeyError:
        raise BadRequestError(
            f"data type {dt.value} (FP8) is not supported by the IPU emulator; "
            "expected one of " + ", ".join(m.value for m in _NUMPY)) from None


class TensorType(enum.Enum):
    """Direction of an anchor, as seen from the host."""

    INPUT = "INPUT"
    OUTPUT = "OUTPUT"
    UNKNOWN = "UNKNOWN"


@dataclass(frozen=True)
class TensorInfo:
    """Shape and element type of one transfer of an anchor."""

    _dtype: DataType = DataType.F32
    _shape: tuple[int, ...] = ()

    def __init__(self, dtype: DataType = DataType.F32, shape: Iterable[int] = ()) -> None:
        shp = tuple(int(d) for d in shape)
        if any(d < 0 for d in shp):
            raise BadRequestError(f"tensor shape must have non-negative dims, got {list(shp)}")
        object.__setattr__(self, "_dtype", DataType(dtype))
        object.__setattr__(self, "_shape", shp)

    def shape(self) -> list[int]:
        return list(self._shape)

    def dataType(self) -> DataType:
        return self._dtype

    def numpyDType(self) -> np.dtype:
        return self._dtype.numpyDType()

    def numElements(self) -> int:
        n = 1
        for d in self._shape:
            n *= d
        return n

    def sizeInBytes(self) -> int:
        return self.numElements() * self._dtype.itemsize

    def __repr__(self) -> str:
        return f"TensorInfo({self._dtype.value}, {list(self._shape)})"


@dataclass
class Anchor:
    """One named stream between host and device (an input, output or weight)."""

    _name: str = ""
    _handle: str = ""
    _tensor_info: TensorInfo = field(default_factory=TensorInfo)
    _is_per_replica: bool = False
    _type: TensorType = TensorType.UNKNOWN
    _programs: tuple[int, ...] = ()

    def __init__(self, name: str = "", handle: str | None = None,
                 tensor_info: TensorInfo | None = None, is_per_replica: bool = False,
                 type: TensorType = TensorType.UNKNOWN, programs: Iterable[int] = ()) -> None:
        self._name = name
        self._handle = name if handle is None else handle
        self._tensor_info = tensor_info if tensor_info is not None else TensorInfo()
        self._is_per_replica = bool(is_per_replica)
        self._type = TensorType(type)
        self._programs = tuple(int(p) for p in programs)

    def name(self) -> str:
        return self._name

    def handle(self) -> str:
        return self._handle

    def tensorInfo(self) -> TensorInfo:
        return self._tensor_info

    def isPerReplica(self) -> bool:
        return self._is_per_replica

    def type(self) -> TensorType:
        return self._type

    def programs(self) -> list[int]:
        return list(self._programs)

    def __hash__(self) -> int:
        return hash((self._name, self._handle))

    def __repr__(self) -> str:
        return (f"Anchor({self._name!r}, handle={self._handle!r}, {self._type.value}, "
                f"{self._tensor_info!r}, programs={list(self._programs)})")


@dataclass
class ProgramFlow:
    """Program indices of the load, main and save phases."""

    _load: tuple[int, ...] = ()
    _main: tuple[int, ...] = ()
    _save: tuple[int, ...] = ()

    def __init__(self, load: Iterable[int] = (), main: Iterable[int] = (),
                 save: Iterable[int] = ()) -> None:
        self._load = tuple(int(p) for p in load)
        self._main = tuple(int(p) for p in main)
        self._save = tuple(int(p) for p in save)

    def load(self) -> list[int]:
        return list(self._load)

    def main(self) -> list[int]:
        return list(self._main)

    def save(self) -> list[int]:
        return list(self._save)


@dataclass
class Metadata:
    """What the runtime needs to attach a device and bind every stream."""

    _anchors: tuple[Anchor, ...] = ()
    _program_flow: ProgramFlow = field(default_factory=ProgramFlow)
    _replication_factor: int = 1
    _num_ipus: int = 1
    _ipu_version: int = 21
    _executable: str = ""
    _is_inference: bool = True
    _device_iterations: int = 1
    _engine_options: dict[str, str] = field(default_factory=dict)
    _device_options: dict[str, str] = field(default_factory=dict)
    # Emulator extension: for fused models, which anchors belong to which
    # sub-graph ("graph0" -> ["graph0/X", ...]); empty for ordinary models.
    _subgraphs: dict[str, list[str]] = field(default_factory=dict)

    def __init__(self, anchors: Iterable[Anchor] = (), program_flow: ProgramFlow | None = None,
                 replication_factor: int = 1, num_ipus: int = 1, ipu_version: int = 21,
                 executable: str = "", is_inference: bool = True, device_iterations: int = 1,
                 engine_options: dict[str, str] | None = None,
                 device_options: dict[str, str] | None = None,
                 subgraphs: dict[str, list[str]] | None = None) -> None:
        self._anchors = tuple(anchors)
        self._program_flow = program_flow if program_flow is not None else ProgramFlow()
        self._replication_factor = int(replication_factor)
        self._num_ipus = int(num_ipus)
        self._ipu_version = int(ipu_version)
        self._executable = executable
        self._is_inference = bool(is_inference)
        self._device_iterations = int(device_iterations)
        self._engine_options = dict(engine_options or {})
        self._device_options = dict(device_options or {})
        self._subgraphs = {k: list(v) for k, v in (subgraphs or {}).items()}

    def anchors(self) -> list[Anchor]:
        return list(self._anchors)

    def programFlow(self) -> ProgramFlow:
        return self._program_flow

    def replicationFactor(self) -> int:
        return self._replication_factor

    def numIpus(self) -> int:
        return self._num_ipus

    def ipuVersion(self) -> int:
        return self._ipu_version

    def executable(self) -> str:
        return self._executable

    def isInference(self) -> bool:
        return self._is_inference

    def deviceIterations(self) -> int:
        return self._device_iterations

    def engineOptions(self) -> dict[str, str]:
        return dict(self._engine_options)

    def deviceOptions(self) -> dict[str, str]:
        return dict(self._device_options)

    def subgraphs(self) -> dict[str, list[str]]:
        return {k: list(v) for k, v in self._subgraphs.items()}

    def anchor(self, name: str) -> Anchor | None:
        for a in self._anchors:
            if a.name() == name:
                return a
        return None


@dataclass
class TensorData:
    """Bytes for one anchor (usually weights), fed by the Load program (a large one read
    from a file is a read-only view of the file's mapping, see ``popef.Reader``)."""

    anchor: str
    data: bytes | memoryview

    def name(self) -> str:
        return self.anchor


@dataclass
class FeedData:
    """A sequence of transfers for one anchor (feed data blob)."""

    anchor: str
    data: bytes
    num_transfers: int = 1

    def name(self) -> str:
        return self.anchor


@dataclass
class Opaque:
    """Application-specific bytes the runtime carries but does not interpret."""

    opaque_name: str
    data: bytes

    def name(self) -> str:
        return self.opaque_name


@dataclass
class ExecutableBlob:
    """The device executable (ipu_emulator format), possibly zlib-compressed (a large one
    read from a file is a read-only view of the file's mapping, see ``popef.Reader``)."""

    exec_name: str
    data: bytes | memoryview
    compressed: bool = False

    def name(self) -> str:
        return self.exec_name

    def payload(self) -> bytes | memoryview:
        """The executable bytes, decompressed."""
        if not self.compressed:
            return self.data
        try:
            return zlib.decompress(self.data)
        except zlib.error as exc:
            raise PopefError(f"compressed executable {self.exec_name!r} is damaged: {exc}",
                             blob=f"executable {self.exec_name!r}") from None


@dataclass
class Model:
    """One model assembled from the blobs of one or more PopEF files."""

    metadata: Metadata
    executable: ExecutableBlob
    tensors: list[TensorData] = field(default_factory=list)
    feeds: list[FeedData] = field(default_factory=list)
    opaques: list[Opaque] = field(default_factory=list)

    def tensorData(self, anchor_name: str) -> TensorData | None:
        for t in self.tensors:
            if t.anchor == anchor_name:
                return t
        return None

    def feedData(self, anchor_name: str) -> FeedData | None:
        for f in self.feeds:
            if f.anchor == anchor_name:
                return f
        return None

    def opaque(self, name: str) -> Opaque | None:
        for o in self.opaques:
            if o.opaque_name == name:
                return o
        return None
