"""The blob objects of Graphcore's ``popef`` Python module, over this project's container.

What a program written for the real module reads and writes::

    reader = popef.Reader(); reader.parseFile(path)
    for exe in reader.executables():        # ExecutableReader: .name, .isCompressed, executable()
        blob = writer.createExecutable(exe.name, True)      # a BlobWriter
        data = exe.executable(); blob.write(data, len(data))
    for t in reader.tensors():              # TensorReader: .info (TensorDataInfo), data()
        blob = writer.createTensorData(t.info)
        blob.write(t.data().tobytes(), t.info.tensorInfo().sizeInBytes())
    for f in reader.feeds(): ...            # FeedReader: .info (FeedDataInfo), data()
    for o in reader.opaqueBlobs(): ...      # OpaqueReader: .name, .executable, data()

The container is this project's own (``_format``): a tensor- or feed-data blob carries
its anchor's name and bytes, not a tensor info, and an opaque blob its name but not its
executable's. So a reader's ``TensorReader.info.tensorInfo()`` is the tensor info of the
anchor of that name in the reader's metadata (``U8 [bytes]`` where no metadata names it),
and ``OpaqueReader.executable`` the executable of the reader's metadata ('' where it has
none or several); the writer refuses a tensor info that disagrees with the metadata's.

A ``BlobWriter`` keeps what is written to it and writes its blob when it is closed: by
``close()``, by the next ``create*``/``write*`` of its writer (one blob writer is active at
a time, as in the real module) or by the writer's ``close()``.
"""

from __future__ import annotations

import io
from typing import Any, Callable, Iterable

import numpy as np

from shm.errors import echo

from host_runtime.errors import BadRequestError, InvalidStateError
from host_runtime.popef.model import (DataType, ExecutableBlob, FeedData, Metadata, Opaque,
                                      TensorData, TensorInfo)

__all__ = ["TensorDataInfo", "FeedDataInfo", "ExecutableReader", "TensorReader",
           "FeedReader", "OpaqueReader", "BlobWriter", "popefTypeToNumpyDType",
           "numpyDTypeToPopefType", "executable_readers", "tensor_readers", "feed_readers",
           "opaque_readers"]


def popefTypeToNumpyDType(data_type: DataType) -> np.dtype:
    """The numpy dtype of a ``popef.DataType`` (FP8 types have none: BadRequestError)."""
    return DataType(data_type).numpyDType()


def numpyDTypeToPopefType(dtype: Any) -> DataType:
    """The ``popef.DataType`` of a numpy dtype (or anything ``np.dtype`` takes)."""
    return DataType.fromNumpy(dtype)


class TensorDataInfo:
    """Names the anchor a tensor-data blob feeds and its tensor info."""

    def __init__(self, name: str = "", tensor_info: TensorInfo | None = None) -> None:
        self._name = str(name)
        self._tensor_info = TensorInfo() if tensor_info is None else _info(tensor_info)

    def name(self) -> str:
        return self._name

    def setName(self, name: str) -> None:
        self._name = str(name)

    def tensorInfo(self) -> TensorInfo:
        return self._tensor_info

    def setTensorInfo(self, tensor_info: TensorInfo) -> None:
        self._tensor_info = _info(tensor_info)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TensorDataInfo) and type(other) is type(self) and (
            self._name, self._tensor_info) == (other._name, other._tensor_info)

    __hash__ = None   # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._name!r}, {self._tensor_info!r})"


class FeedDataInfo(TensorDataInfo):
    """Names the anchor a feed-data blob feeds and the tensor info of one transfer."""


def _info(tensor_info: object) -> TensorInfo:
    if not isinstance(tensor_info, TensorInfo):
        raise BadRequestError(f"expected a popef.TensorInfo, got {type(tensor_info).__name__}")
    return tensor_info


# -- reading ----------------------------------------------------------------------------------

class ExecutableReader:
    """An executable blob of a ``Reader``: ``.name``, ``.isCompressed``, ``executable()``."""

    def __init__(self, blob: ExecutableBlob) -> None:
        self._blob = blob

    @property
    def name(self) -> str:
        return self._blob.name()

    @property
    def isCompressed(self) -> bool:
        return self._blob.compressed

    def executableSize(self) -> int:
        """Bytes of the executable, decompressed."""
        return len(self._blob.payload())

    def executable(self) -> bytes:
        """The executable's bytes (decompressed)."""
        return bytes(self._blob.payload())

    def getStandaloneExecutableStream(self) -> io.BytesIO:
        return io.BytesIO(self.executable())

    def __repr__(self) -> str:
        return f"ExecutableReader({self.name!r}, compressed={self.isCompressed})"


class _DataReader:
    """What the tensor- and feed-data readers share: ``.info`` and the bytes."""

    def __init__(self, info: TensorDataInfo, payload: bytes | memoryview) -> None:
        self._info = info
        self._payload = payload

    @property
    def info(self) -> TensorDataInfo:
        return self._info

    def _array(self, leading: tuple[int, ...]) -> np.ndarray:
        ti = self._info.tensorInfo()
        try:
            dtype = ti.numpyDType()
        except BadRequestError:     # FP8: bytes
            return np.frombuffer(self._payload, np.uint8)
        shape = leading + tuple(ti.shape())
        if int(np.prod(shape, dtype=np.int64)) * dtype.itemsize != len(self._payload):
            return np.frombuffer(self._payload, np.uint8)
        return np.frombuffer(self._payload, dtype).reshape(shape)

    def getStandaloneDataStream(self) -> io.BytesIO:
        return io.BytesIO(bytes(self._payload))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._info!r}, {len(self._payload)} bytes)"


class TensorReader(_DataReader):
    """A tensor-data blob: ``.info`` (``TensorDataInfo``), ``data()`` (a read-only numpy
    array of the info's dtype and shape)."""

    def data(self) -> np.ndarray:
        return self._array(())


class FeedReader(_DataReader):
    """A feed-data blob: ``.info`` (``FeedDataInfo``, one transfer's tensor info),
    ``data()`` (the transfers, one after another along a first dimension)."""

    def __init__(self, info: FeedDataInfo, payload: bytes, num_transfers: int) -> None:
        super().__init__(info, payload)
        self._transfers = num_transfers

    @property
    def numTransfers(self) -> int:
        return self._transfers

    def data(self) -> np.ndarray:
        return self._array((self._transfers,))


class OpaqueReader:
    """An opaque blob: ``.name``, ``.executable`` (see the module), ``data()`` (bytes)."""

    def __init__(self, blob: Opaque, executable: str) -> None:
        self._blob = blob
        self._executable = executable

    @property
    def name(self) -> str:
        return self._blob.name()

    @property
    def executable(self) -> str:
        return self._executable

    def data(self) -> bytes:
        return bytes(self._blob.data)

    def getStandaloneDataStream(self) -> io.BytesIO:
        return io.BytesIO(self.data())

    def __repr__(self) -> str:
        return f"OpaqueReader({self.name!r}, executable={self._executable!r})"


def _anchor_info(metadata: Iterable[Metadata], name: str, size: int) -> TensorInfo:
    """The tensor info of anchor ``name`` in the metadata (the first of that name whose
    size divides ``size``), else ``U8 [size]``."""
    for md in metadata:
        a = md.anchor(name)
        if a is not None:
            per = a.tensorInfo().sizeInBytes()
            if per == size or (per and size % per == 0):
                return a.tensorInfo()
    return TensorInfo(DataType.U8, [size])


def executable_readers(blobs: Iterable[object]) -> list[ExecutableReader]:
    return [ExecutableReader(b) for b in blobs if isinstance(b, ExecutableBlob)]


def tensor_readers(blobs: list[object]) -> list[TensorReader]:
    mds = [b for b in blobs if isinstance(b, Metadata)]
    return [TensorReader(TensorDataInfo(b.anchor, _anchor_info(mds, b.anchor, len(b.data))),
                         b.data) for b in blobs if isinstance(b, TensorData)]


def feed_readers(blobs: list[object]) -> list[FeedReader]:
    mds = [b for b in blobs if isinstance(b, Metadata)]
    out = []
    for b in blobs:
        if isinstance(b, FeedData):
            per = len(b.data) // b.num_transfers
            out.append(FeedReader(FeedDataInfo(b.anchor, _anchor_info(mds, b.anchor, per)),
                                  b.data, b.num_transfers))
    return out


def opaque_readers(blobs: list[object]) -> list[OpaqueReader]:
    names = {b.executable() for b in blobs if isinstance(b, Metadata)}
    executable = next(iter(names)) if len(names) == 1 else ""
    return [OpaqueReader(b, executable) for b in blobs if isinstance(b, Opaque)]


# -- writing ----------------------------------------------------------------------------------

class BlobWriter:
    """The bytes of one blob being written: ``write(data, size)``, ``stream.write(data)``,
    ``close()`` (see the module for when the blob is written)."""

    def __init__(self, label: str, commit: Callable[[bytes], None]) -> None:
        self._label = label
        self._commit: Callable[[bytes], None] | None = commit
        self._chunks: list[bytes] = []

    @property
    def closed(self) -> bool:
        return self._commit is None

    @property
    def stream(self) -> "BlobWriter":
        """A file-like view: ``stream.write(data)`` appends ``data``."""
        return self

    def writable(self) -> bool:
        return not self.closed

    def write(self, data: Any, size: int | None = None) -> int:
        """Append the first ``size`` bytes of ``data`` (all of it when None); returns the
        bytes appended."""
        if self._commit is None:
            raise InvalidStateError(f"the blob writer of {self._label} is closed (a writer "
                                    "keeps one blob writer open: the next create* or write* "
                                    "closed it)")
        raw = _bytes(data, self._label)
        if size is not None:
            n = int(size)
            if not 0 <= n <= len(raw):
                raise BadRequestError(f"{self._label}: write of size {size} but the data "
                                      f"holds {len(raw)} bytes")
            raw = raw[:n]
        self._chunks.append(raw)
        return len(raw)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        """Write the blob (once; idempotent)."""
        commit, self._commit = self._commit, None
        if commit is None:
            return
        data, self._chunks = b"".join(self._chunks), []
        commit(data)

    def __enter__(self) -> "BlobWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{sum(map(len, self._chunks))} bytes"
        return f"BlobWriter({self._label}, {state})"


def _bytes(data: Any, label: str) -> bytes:
    if isinstance(data, str):
        raise BadRequestError(f"{label}: write expects bytes or a numpy array, got str "
                              "(encode it)")
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).tobytes()
    try:
        return memoryview(data).tobytes()
    except TypeError:
        raise BadRequestError(f"{label}: write expects bytes or a numpy array, got "
                              f"{type(data).__name__}") from None


def check_info(info: object, cls: type[TensorDataInfo], what: str) -> TensorDataInfo:
    """``info`` as ``createTensorData``/``createFeedData`` take it."""
    if not isinstance(info, cls):
        raise BadRequestError(f"{what} expects a popef.{cls.__name__}, got "
                              f"{type(info).__name__}")
    if not info.name():
        raise BadRequestError(f"{what}: the {cls.__name__} has no name (setName)")
    return info


def agrees(md_anchors: dict[str, TensorInfo], name: str, info: TensorInfo) -> None:
    """Refuse a data blob's tensor info that the metadata's anchor of that name contradicts
    (the file could not give it back: see the module)."""
    known = md_anchors.get(name)
    if known is not None and known != info:
        raise BadRequestError(f"data for anchor {echo(name)} has tensor info {info!r} but the "
                              f"metadata's anchor has {known!r}")

