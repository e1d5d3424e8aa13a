"""``Writer``: write blobs to a PopEF file (layout in ``_format``).

::

    with popef.Writer("model.popef") as w:
        w.writeMetadata(metadata)
        w.writeExecutable(metadata.executable(), exe_bytes, compress=True)
        w.writeTensorData("weights", weights_array)

The real module's blob writers (``popef.blobs``)::

    with popef.Writer("model.popef") as w:
        w.writeMetadata(metadata)
        blob = w.createExecutable(metadata.executable(), True)     # a BlobWriter
        blob.write(exe_bytes, len(exe_bytes))
        blob = w.createTensorData(popef.TensorDataInfo("weights", info))
        blob.write(weights.tobytes(), info.sizeInBytes())          # written on the next create*

Inputs are checked before anything is written (metadata against the same
schema the reader enforces), so a Writer never produces a file the Reader
refuses. Wrong input raises ``BadRequestError``.

Given a path, the Writer writes a temporary file in the same folder and renames
it into place on ``close()`` (``host_runtime._atomic_file``): the file appears
whole or not at all, a ``with`` block left by an exception leaves the path as
it was, and a symlink at the path is replaced, never written through.
"""

from __future__ import annotations

import logging
import os
import weakref
import zlib
from typing import Any, BinaryIO, Callable

import numpy as np

from shm.errors import echo

from host_runtime._atomic_file import AtomicFile
from host_runtime.errors import BadRequestError, InvalidStateError
from host_runtime.popef import _format as fmt
from host_runtime.popef._schema import SchemaError, encode_metadata
from host_runtime.popef.blobs import (BlobWriter, FeedDataInfo, TensorDataInfo, agrees,
                                      check_info)
from host_runtime.popef.model import ExecutableBlob, Metadata, Model, TensorInfo

__all__ = ["Writer", "save_model"]

_log = logging.getLogger(__name__)


_PAYLOAD_ALIGNMENT = 64


class Writer:
    """Writes a PopEF file to a path or to a binary stream it does not own."""

    def __init__(self, path_or_stream: str | os.PathLike[str] | BinaryIO) -> None:
        self._owns = isinstance(path_or_stream, (str, os.PathLike))
        self._atomic: AtomicFile | None = None
        if self._owns:
            self._name = os.fspath(path_or_stream)  # type: ignore[arg-type]
            try:
                self._atomic = AtomicFile(self._name)
            except OSError as exc:
                raise BadRequestError(f"cannot create PopEF file {echo(self._name, 200)}: "
                                      f"{exc.strerror or exc}") from None
            self._f: BinaryIO | None = self._atomic.file
        else:
            name = getattr(path_or_stream, "name", None)
            self._name = name if isinstance(name, str) else "<stream>"
            self._f = path_or_stream  # type: ignore[assignment]
        self._offset = 0
        self._active: BlobWriter | None = None           # the open blob writer
        self._anchors: dict[str, TensorInfo] = {}        # of the metadata written
        self._data_infos: dict[str, TensorInfo] = {}     # of the blob writers' data
        self._blobs = 0
        self._chain = 0       # the end record's chain of blob header checksums
        self._write(fmt.pack_file_header())

    # -- blobs ------------------------------------------------------------------

    def writeMetadata(self, metadata: Metadata) -> None:
        if not isinstance(metadata, Metadata):
            raise BadRequestError(f"writeMetadata expects a popef.Metadata, got "
                                  f"{type(metadata).__name__}")
        try:
            payload = encode_metadata(metadata)
        except SchemaError as exc:
            raise BadRequestError(f"metadata cannot be written: {exc}") from None
        anchors = {a.name(): a.tensorInfo() for a in metadata.anchors()}
        for anchor_name, info in self._data_infos.items():
            agrees(anchors, anchor_name, info)
        self._anchors.update(anchors)
        self._end_active()
        # The executable written next (named as the metadata says) starts its payload at
        # an offset of the file that is a multiple of 64, so that its weights section
        # (64-aligned inside it) is aligned where the file is mapped: an IPU process then
        # hands the weights to onnxruntime where they lie. Trailing blanks are JSON.
        name = metadata.executable().encode("utf-8", "replace")
        end = (self._offset + 2 * fmt.BLOB_HEADER_SIZE + len(name) + len(payload)
               + len(name))
        pad = -end % _PAYLOAD_ALIGNMENT
        if len(payload) + pad <= fmt.MAX_METADATA_BYTES:
            payload += b" " * pad
        self._blob(fmt.BlobType.METADATA, metadata.executable(), payload)

    def writeExecutable(self, name: str, data: Any, compress: bool = False) -> None:
        raw = _as_bytes(data, "executable")
        if compress:
            self._blob(fmt.BlobType.EXECUTABLE, name, zlib.compress(raw, 6),
                       flags=fmt.FLAG_COMPRESSED, aux=len(raw))
        else:
            self._blob(fmt.BlobType.EXECUTABLE, name, raw)

    def writeExecutableBlob(self, blob: ExecutableBlob) -> None:
        """Write an executable blob as it is (already compressed or not)."""
        if blob.compressed:
            raw = blob.payload()
            self._blob(fmt.BlobType.EXECUTABLE, blob.name(), bytes(blob.data),
                       flags=fmt.FLAG_COMPRESSED, aux=len(raw))
        else:
            self._blob(fmt.BlobType.EXECUTABLE, blob.name(), _as_bytes(blob.data, "executable"))

    def writeTensorData(self, anchor_name: str, data: Any) -> None:
        self._nonempty(anchor_name, "tensor data")
        self._blob(fmt.BlobType.TENSOR_DATA, anchor_name, _as_bytes(data, "tensor data"))

    def writeFeedData(self, anchor_name: str, data: Any, num_transfers: int = 1) -> None:
        self._nonempty(anchor_name, "feed data")
        raw = _as_bytes(data, "feed data")
        n = int(num_transfers)
        if not 1 <= n <= fmt.MAX_FEED_TRANSFERS:
            raise BadRequestError(f"feed data for {echo(anchor_name)}: num_transfers must be in "
                                  f"[1, {fmt.MAX_FEED_TRANSFERS}], got {num_transfers}")
        if len(raw) % n:
            raise BadRequestError(f"feed data for {echo(anchor_name)}: {len(raw)} bytes is not a "
                                  f"whole number of {n} transfers")
        self._blob(fmt.BlobType.FEED_DATA, anchor_name, raw, aux=n)

    def writeOpaque(self, name: str, data: Any) -> None:
        self._nonempty(name, "opaque")
        self._blob(fmt.BlobType.OPAQUE, name, _as_bytes(data, "opaque"))

    # -- the real module's blob writers ------------------------------------------------

    def createExecutable(self, name: str, compress: bool = False) -> BlobWriter:
        """A blob writer for the executable ``name`` (zlib-compressed if ``compress``)."""
        self._nonempty(name, "executable")
        return self._begin(f"executable {echo(name)}",
                           lambda w, data: w.writeExecutable(name, data, compress))

    def createTensorData(self, info: TensorDataInfo) -> BlobWriter:
        """A blob writer for the tensor data of anchor ``info.name()``: exactly
        ``info.tensorInfo().sizeInBytes()`` bytes."""
        name, ti = self._data_info(check_info(info, TensorDataInfo, "createTensorData"))

        def commit(w: Writer, data: bytes) -> None:
            if len(data) != ti.sizeInBytes():
                raise BadRequestError(f"tensor data {echo(name)}: {len(data)} bytes written, "
                                      f"its tensor info {ti!r} holds {ti.sizeInBytes()}")
            w.writeTensorData(name, data)
        return self._begin(f"tensor data {echo(name)}", commit)

    def createFeedData(self, info: FeedDataInfo) -> BlobWriter:
        """A blob writer for the feed data of anchor ``info.name()``: one or more transfers
        of ``info.tensorInfo().sizeInBytes()`` bytes each."""
        name, ti = self._data_info(check_info(info, FeedDataInfo, "createFeedData"))

        def commit(w: Writer, data: bytes) -> None:
            per = ti.sizeInBytes()
            if not data or not per or len(data) % per:
                raise BadRequestError(f"feed data {echo(name)}: {len(data)} bytes written, "
                                      f"expected a whole number (>= 1) of transfers of "
                                      f"{per} bytes ({ti!r})")
            w.writeFeedData(name, data, len(data) // per)
        return self._begin(f"feed data {echo(name)}", commit)

    def createOpaqueBlob(self, name: str, executable_name: str = "") -> BlobWriter:
        """A blob writer for the opaque blob ``name`` of executable ``executable_name``
        (which reads back as the file's metadata's executable: see ``popef.blobs``)."""
        self._nonempty(name, "opaque")
        return self._begin(f"opaque {echo(name)}", lambda w, data: w.writeOpaque(name, data))

    def _data_info(self, info: TensorDataInfo) -> tuple[str, TensorInfo]:
        name = info.name()
        ti = TensorInfo(info.tensorInfo().dataType(), info.tensorInfo().shape())   # a copy
        agrees(self._anchors, name, ti)
        self._data_infos[name] = ti
        return name, ti

    def _begin(self, label: str, commit: Callable[["Writer", bytes], None]) -> BlobWriter:
        self._end_active()
        if self._f is None:
            raise InvalidStateError(f"PopEF writer for {echo(self._name, 200)} is closed")
        ref = weakref.ref(self)    # the writer holds its blob writer, not the reverse

        def write_blob(data: bytes) -> None:
            writer = ref()
            if writer is None or writer._f is None:
                raise InvalidStateError(f"the PopEF writer of {label} is closed")
            if writer._active is not None and writer._active.closed:   # this one
                writer._active = None
            commit(writer, data)
        self._active = BlobWriter(label, write_blob)
        return self._active

    def _end_active(self) -> None:
        """Write the open blob writer's blob (one is open at a time)."""
        active, self._active = self._active, None
        if active is not None:
            active.close()

    def writeModel(self, model: Model) -> None:
        """Write every blob of ``model``."""
        self.writeMetadata(model.metadata)
        self.writeExecutableBlob(model.executable)
        for t in model.tensors:
            self.writeTensorData(t.anchor, t.data)
        for fd in model.feeds:
            self.writeFeedData(fd.anchor, fd.data, fd.num_transfers)
        for o in model.opaques:
            self.writeOpaque(o.opaque_name, o.data)

    # -- lifetime ---------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._f is None

    def close(self) -> None:
        """Write the end record and flush; for a path, put the file in place (see the
        module). Idempotent. A file whose writer was not closed has no end record and
        is refused by the Reader as cut short."""
        if self._f is None:
            return
        try:
            self._end_active()
            # the end record: a reader refuses a file that does not end with it (cut
            # short); a failed write of it (a full disk) leaves no file in place, and no
            # second record from a later close()
            self._write(fmt.pack_end_record(self._blobs, self._offset, self._chain))
        except BaseException:
            self.abort()
            raise
        f, self._f = self._f, None
        assert f is not None
        atomic, self._atomic = self._atomic, None
        if atomic is None:
            f.flush()
            return
        try:
            atomic.commit()
        except OSError as exc:
            raise BadRequestError(f"cannot write PopEF file {echo(self._name, 200)}: "
                                  f"{exc.strerror or exc}") from exc

    def abort(self) -> None:
        """Stop writing; a file the Writer was writing to a path does not appear (the
        path keeps what it had). A stream is left as it is. Idempotent."""
        self._f = None
        self._active = None
        atomic, self._atomic = self._atomic, None
        if atomic is not None:
            atomic.abort()

    def __enter__(self) -> "Writer":
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def __del__(self) -> None:
        if getattr(self, "_owns", False) and getattr(self, "_f", None) is not None:
            self.close()

    # -- internals --------------------------------------------------------------

    @staticmethod
    def _nonempty(name: str, what: str) -> None:
        if not isinstance(name, str) or not name:
            raise BadRequestError(f"{what} blob needs a non-empty anchor/blob name, got {echo(name)}")

    def _blob(self, btype: fmt.BlobType, name: str, payload: bytes | memoryview, flags: int = 0,
              aux: int = 0) -> None:
        self._end_active()
        if not isinstance(name, str):
            raise BadRequestError(f"blob name must be a str, got {type(name).__name__}")
        try:
            name_raw = name.encode("utf-8")
        except UnicodeEncodeError:
            raise BadRequestError(f"blob name {echo(name)} cannot be encoded as UTF-8") from None
        if len(name_raw) > fmt.MAX_NAME_BYTES:
            raise BadRequestError(f"blob name of {len(name_raw)} bytes exceeds the limit of "
                                  f"{fmt.MAX_NAME_BYTES}")
        if btype is fmt.BlobType.METADATA and len(payload) > fmt.MAX_METADATA_BYTES:
            raise BadRequestError(f"metadata of {len(payload)} bytes exceeds the limit of "
                                  f"{fmt.MAX_METADATA_BYTES}")
        header = fmt.pack_blob_header(btype, name_raw, len(payload), zlib.crc32(payload),
                                      flags, aux)
        self._write(header + name_raw)
        self._write(payload)
        self._blobs += 1
        self._chain = fmt.chain_crc(self._chain, fmt.unpack_blob_header(header).header_crc)
        _log.debug("wrote %s %r (%d bytes) to %s", btype.label, name, len(payload), self._name)

    def _write(self, data: bytes | memoryview) -> None:
        if self._f is None:
            raise InvalidStateError(f"PopEF writer for {echo(self._name, 200)} is closed")
        self._f.write(data)
        self._offset += len(data)


def _as_bytes(data: Any, what: str) -> bytes | memoryview:
    """A flat byte view of ``data`` (no copy for bytes and contiguous buffers)."""
    if isinstance(data, bytes):
        return data
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data)
        if data.dtype.hasobject:
            raise BadRequestError(f"{what} cannot hold numpy objects (dtype {data.dtype})")
    try:
        view = memoryview(data)
    except TypeError:
        raise BadRequestError(f"{what} must be bytes-like or a numpy array, got "
                              f"{type(data).__name__}") from None
    if view.ndim == 1 and view.format == "B":
        return view
    if not view.c_contiguous or view.ndim == 0 or view.nbytes == 0:
        return view.tobytes()
    try:
        return view.cast("B")
    except TypeError:  # formats memoryview cannot cast
        return view.tobytes()


def save_model(model: Model, path: str | os.PathLike[str]) -> None:
    """Write ``model`` to one PopEF file."""
    with Writer(path) as w:
        w.writeModel(model)

