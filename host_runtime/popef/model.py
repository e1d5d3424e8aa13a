"""The PopEF data model: what a model file describes, independent of its encoding.

Names and method spellings follow the seeds' Python listings (``anchor.name()``,
``tensorInfo().shape()``, ``numpyDType()``, ``metadata.anchors()``...). Objects
are plain values: they compare equal field by field, which the round-trip
tests rely on.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import zlib
from dataclasses import dataclass, field
from typing import Any, Iterable, TypeVar

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
    "Option",
]


class DataType(enum.Enum):
    """Element types. FP8 types exist in PopEF (``F8`` in older SDKs, ``F8143`` and
    ``F8152`` later); this emulator refuses them."""

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
    F8 = "F8"

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

    def setShape(self, shape: Iterable[int]) -> None:
        shp = tuple(int(d) for d in shape)
        if any(d < 0 for d in shp):
            raise BadRequestError(f"tensor shape must have non-negative dims, got {list(shp)}")
        object.__setattr__(self, "_shape", shp)

    def setDataType(self, dtype: DataType) -> None:
        object.__setattr__(self, "_dtype", DataType(dtype))

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

    def setName(self, name: str) -> None:
        self._name = str(name)

    def setHandle(self, handle: str) -> None:
        self._handle = str(handle)

    def setTensorInfo(self, tensor_info: TensorInfo) -> None:
        if not isinstance(tensor_info, TensorInfo):
            raise BadRequestError(f"setTensorInfo expects a popef.TensorInfo, got "
                                  f"{type(tensor_info).__name__}")
        self._tensor_info = tensor_info

    def setIsPerReplica(self, is_per_replica: bool) -> None:
        self._is_per_replica = bool(is_per_replica)

    def setType(self, type: TensorType) -> None:
        self._type = TensorType(type)

    def setPrograms(self, programs: Iterable[int]) -> None:
        self._programs = tuple(int(p) for p in programs)

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

    def setLoad(self, programs: Iterable[int]) -> None:
        self._load = tuple(int(p) for p in programs)

    def setMain(self, programs: Iterable[int]) -> None:
        self._main = tuple(int(p) for p in programs)

    def setSave(self, programs: Iterable[int]) -> None:
        self._save = tuple(int(p) for p in programs)


class Option:
    """One engine or device option of a ``Metadata`` (``Option(name, value)``)."""

    __slots__ = ("_name", "_value")

    def __init__(self, name: str, value: str) -> None:
        self._name, self._value = str(name), str(value)

    def name(self) -> str:
        return self._name

    def value(self) -> str:
        return self._value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Option) and (self._name, self._value) == (other._name,
                                                                            other._value)

    def __hash__(self) -> int:
        return hash((self._name, self._value))

    def __repr__(self) -> str:
        return f"Option({self._name!r}, {self._value!r})"


def _options(options: object, what: str) -> dict[str, str]:
    """A dict of option texts from a dict, or from ``Option``s or ``(name, value)`` pairs."""
    items = options.items() if isinstance(options, dict) else options
    out: dict[str, str] = {}
    try:
        for item in items:   # type: ignore[attr-defined]
            name, value = (item.name(), item.value()) if isinstance(item, Option) else item
            out[str(name)] = str(value)
    except (TypeError, ValueError):
        raise BadRequestError(f"{what} expects a dict of strings or a list of popef.Option, "
                              f"got {type(options).__name__}") from None
    return out


def programs_by_role(flow: ProgramFlow) -> dict[int, str]:
    """The programs of ``flow`` named by their roles: "load", "main", "save" (a role's
    later programs "load_1", ...; a program in two roles by its first)."""
    names: dict[int, str] = {}
    for role, progs in (("load", flow.load()), ("main", flow.main()), ("save", flow.save())):
        for k, index in enumerate(progs):
            names.setdefault(index, role if k == 0 else f"{role}_{k}")
    return names


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
    _is_pod: bool = False
    _num_processes: int = 1
    _seed_handle: str = ""
    _programs_map: dict[int, str] = field(default_factory=dict)   # set by the producer

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
        self._is_pod = False
        self._num_processes = 1
        self._seed_handle = ""
        self._programs_map = {}

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

    def isPOD(self) -> bool:
        return self._is_pod

    def numProcesses(self) -> int:
        return self._num_processes

    def seedHandle(self) -> str:
        """The stream handle of the random seed ('' if none: inference has none)."""
        return self._seed_handle

    # -- setters (the writer checks the whole against the schema) ---------------------

    def setAnchors(self, anchors: Iterable[Anchor]) -> None:
        self._anchors = tuple(anchors)

    def setProgramFlow(self, flow: ProgramFlow) -> None:
        if not isinstance(flow, ProgramFlow):
            raise BadRequestError(f"setProgramFlow expects a popef.ProgramFlow, got "
                                  f"{type(flow).__name__}")
        self._program_flow = flow

    def setReplicationFactor(self, value: int) -> None:
        self._replication_factor = int(value)

    def setNumIpus(self, value: int) -> None:
        self._num_ipus = int(value)

    def setIpuVersion(self, value: int) -> None:
        self._ipu_version = int(value)

    def setExecutable(self, name: str) -> None:
        self._executable = str(name)

    def setIsInference(self, value: bool) -> None:
        self._is_inference = bool(value)

    def setDeviceIterations(self, value: int) -> None:
        self._device_iterations = int(value)

    def setEngineOptions(self, options: object) -> None:
        self._engine_options = _options(options, "setEngineOptions")

    def setDeviceOptions(self, options: object) -> None:
        self._device_options = _options(options, "setDeviceOptions")

    def setIsPOD(self, value: bool) -> None:
        self._is_pod = bool(value)

    def setNumProcesses(self, value: int) -> None:
        self._num_processes = int(value)

    def setSeedHandle(self, handle: str) -> None:
        self._seed_handle = str(handle)

    def programsMap(self) -> dict[int, str]:
        """Program index -> program name: as the producer set it (``setProgramsMap``),
        else each program of the program flow named by its role ("load", "main", "save";
        a role's later programs "load_1", ...; a program in two roles by its first)."""
        if self._programs_map:
            return dict(self._programs_map)
        return programs_by_role(self._program_flow)

    def setProgramsMap(self, programs: object) -> None:
        """Name the programs: ``{index: name}`` (an empty dict: named by their roles)."""
        if not isinstance(programs, dict) or not all(
                isinstance(k, int) and not isinstance(k, bool) and k >= 0
                and isinstance(v, str) for k, v in programs.items()):
            raise BadRequestError("setProgramsMap expects a dict of program index (int >= 0) "
                                  f"-> name (str), got {programs!r:.200}")
        self._programs_map = dict(programs)

    def anchor(self, name: str) -> Anchor | None:
        for a in self._anchors:
            if a.name() == name:
                return a
        return None


_Blob = TypeVar("_Blob", "TensorData", "ExecutableBlob", "Model")


def _copy_fields(obj: _Blob, memo: dict[int, Any]) -> _Blob:
    """A deep copy of a blob or model made of its fields only: not what the runtime keeps
    on it (its executable's decoded programs, the check it passed), which the copy works
    out again if it needs. A read-only view of bytes (a large payload, a view of the file's
    snapshot) is shared: nothing can change it; a writable one is copied into bytes."""
    new = object.__new__(type(obj))
    memo[id(obj)] = new
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, memoryview):
            value = value if value.readonly else value.tobytes()
        else:
            value = copy.deepcopy(value, memo)
        object.__setattr__(new, f.name, value)
    return new


@dataclass
class TensorData:
    """Bytes for one anchor (usually weights), fed by the Load program (a large one read
    from a file is a read-only view of the file's mapping, see ``popef.Reader``)."""

    anchor: str
    data: bytes | memoryview

    def name(self) -> str:
        return self.anchor

    def __deepcopy__(self, memo: dict[int, Any]) -> "TensorData":
        return _copy_fields(self, memo)


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

    def __deepcopy__(self, memo: dict[int, Any]) -> "ExecutableBlob":
        return _copy_fields(self, memo)

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
    """One model assembled from the blobs of one or more PopEF files (``Model()``: empty,
    as Graphcore's module makes one)."""

    metadata: Metadata = field(default_factory=Metadata)
    executable: ExecutableBlob = field(default_factory=lambda: ExecutableBlob("", b""))
    tensors: list[TensorData] = field(default_factory=list)
    feeds: list[FeedData] = field(default_factory=list)
    opaques: list[Opaque] = field(default_factory=list)

    def __deepcopy__(self, memo: dict[int, Any]) -> "Model":
        return _copy_fields(self, memo)   # (checked again if given to a runner)

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
