"""``Reader``: parse PopEF files into blobs, checking every byte it trusts.

A reader accumulates the blobs of every file it parses (the seeds call
``parseFile`` once per path, then hand the reader to ``ModelBuilder``).
Each blob remembers where it came from (``BlobInfo``) so that later
consistency errors can name the file, the blob and the offset.

Any damage raises ``PopefError``; no struct, json, zlib, numpy or Unicode
error escapes, and no length read from the file is used before it has been
checked against the bytes the file still holds.

Large payloads of a file (executables and tensor data of a file of ``MAP_MIN_BYTES``
or more) are not copied into this process's memory: they are read-only views of a
mapped file, whose pages the kernel keeps in its page cache, shared and reclaimable,
instead of a private copy per process (:func:`drop_pages` lets this process's mapping
of them go once they have been read).

The file mapped is not the user's but a *snapshot* of it this process owns: an
unnamed file (``O_TMPFILE``, mode 0600) in the file's own folder (else the temporary
folder), filled once by the kernel (``copy_file_range``: no copy through this
process, and none at all where the file system shares extents), then mapped. Nobody
else can name it, so nobody can cut it short or rewrite it: a PopEF file truncated or
rewritten in place while a model read from it is in use (or before ``auto_reset``
loads it again) changes nothing, where a mapping of the file itself would fault the
process reading it (SIGBUS). IPU processes open the snapshot as
``/proc/<pid>/fd/<fd>`` (:func:`file_span`). A file changed while the snapshot is
taken is refused (cut short: fewer bytes than it had; rewritten: the checksums).
Where no folder takes an unnamed file the snapshot is an anonymous memory file
(``memfd``), which costs memory rather than page cache.

A reader given :class:`PendingChecksums` checks the payloads it maps on threads of their
own (zlib lets go of the GIL) while its caller goes on with the blobs; the caller waits
for them (``wait()`` raises the ``PopefError`` of a damaged payload) before it trusts the
bytes. ``ModelRunner`` does so to start its IPU processes' template meanwhile.
"""

from __future__ import annotations

import copy
import io
import logging
import mmap
import os
import errno
import queue
import tempfile
import threading
import weakref
import zlib
from dataclasses import dataclass
from typing import BinaryIO, Callable, Iterator, Protocol, Union

from host_runtime.errors import PopefError, ResourceLimitError
from host_runtime.popef import _format as fmt
from host_runtime.popef import blobs
from host_runtime.popef._schema import SchemaError, decode_metadata
from host_runtime.popef.model import (ExecutableBlob, FeedData, Metadata, Opaque, TensorData)
from ipu_emulator.safe_files import NotRegularFileError, open_regular
from shm import OutOfFileDescriptorsError, buffer_address, limits
from shm.errors import echo

__all__ = ["Reader", "BlobInfo", "MAP_MIN_BYTES", "PendingChecksums", "drop_pages",
           "file_identity", "file_span"]


MAP_MIN_BYTES = 1 << 20
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)   # every page is read at once (the checksum)
"""Payloads of a file this large or larger are mapped views of the file, not copies."""

_log = logging.getLogger(__name__)

BytesLike = Union[bytes, bytearray, memoryview]


@dataclass(frozen=True)
class BlobInfo:
    """Where one blob was found and what its header said."""

    type: fmt.BlobType
    name: str
    path: str
    offset: int          # of the blob header, from the start of the file
    size: int            # total bytes: header + name + payload
    payload_size: int    # bytes stored (compressed size for compressed executables)
    checksum: int        # crc32 of the stored payload (verified)
    compressed: bool
    aux: int             # feed data: transfers; compressed executable: decompressed size

    @property
    def label(self) -> str:
        """``tensor data 'weights'``: how error messages name this blob."""
        return f"{self.type.label} {echo(self.name)}"


Blob = Union[Metadata, ExecutableBlob, TensorData, FeedData, Opaque]


class _Seekable(Protocol):
    def read(self, n: int, /) -> bytes: ...

    def seek(self, pos: int, /) -> int: ...


class PendingChecksums:
    """The checksums of mapped payloads a reader left to a thread (see the module
    docstring), computed one after another there: ``wait()`` joins it and raises the
    ``PopefError`` of the first payload that does not match, as the reader would have;
    always call it (also on an error path), so that no thread reads a file its caller
    has given up."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[memoryview, int, Callable[[int], PopefError]]
                                       | None] = queue.SimpleQueue()
        self._done: list[tuple[int, int, Callable[[int], PopefError]]] = []
        self._thread: threading.Thread | None = None

    def add(self, payload: memoryview, expected: int,
            error: Callable[[int], PopefError]) -> None:
        """Check ``payload`` against ``expected`` on the thread; ``error(computed)`` is the
        error of a mismatch."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="popef-checksums",
                                            daemon=True)
            self._thread.start()
        self._queue.put((payload, expected, error))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            payload, expected, error = item
            try:
                crc = _crc32(payload)
                drop_pages(payload)
            except Exception:   # pragma: no cover - a mapping gone under it: not its crc
                crc = -1
            self._done.append((crc, expected, error))

    def wait(self) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._queue.put(None)
        thread.join()
        done, self._done = self._done, []
        for crc, expected, error in done:
            if crc != expected:
                raise error(crc)


class Reader:
    """Parses one or more PopEF files; the blobs of all of them are kept.

    ``pending``: the checksums of the payloads it maps are computed there, on threads,
    and the caller waits for them (see the module docstring); default: here, at once."""

    def __init__(self, *, pending: PendingChecksums | None = None) -> None:
        self._entries: list[tuple[BlobInfo, Blob]] = []
        self._paths: list[str] = []
        self._pending = pending

    # -- parsing ------------------------------------------------------------

    def parseFile(self, path: str | os.PathLike[str]) -> None:
        """Parse every blob of the file at ``path``."""
        spath = os.fspath(path)
        try:
            f = open_regular(spath)   # (a FIFO planted at the path is refused, not waited on)
        except NotRegularFileError as exc:
            raise PopefError(f"the path is not a regular file but a {exc.kind}; expected a "
                             "PopEF file", path=spath) from None
        except OSError as exc:
            named = limits.named_error(exc, f"opening PopEF file {echo(spath)}")
            if isinstance(named, OutOfFileDescriptorsError):   # not a damaged file
                raise ResourceLimitError(str(named)) from named
            raise PopefError(f"cannot open PopEF file: {exc.strerror or exc}",
                             path=spath) from None
        with f:
            try:
                size = os.fstat(f.fileno()).st_size
            except OSError as exc:  # pragma: no cover - fstat on an open file
                raise PopefError(f"cannot stat PopEF file: {exc}", path=spath) from None
            mapped = None
            if size >= MAP_MIN_BYTES:   # (a regular file: open_regular)
                snap = _snapshot(f.fileno(), size, spath)
                try:
                    # populated at once for the checksum here; a checksum on a thread
                    # reads its pages there, the caller going on meanwhile
                    populate = _POPULATE if self._pending is None else 0
                    mapped = _FileMap(snap, size, flags=mmap.MAP_SHARED | populate,
                                      prot=mmap.PROT_READ)
                except (OSError, ValueError) as exc:
                    os.close(snap)
                    raise PopefError(f"cannot map the snapshot of PopEF file: {exc}",
                                     path=spath) from None
                mapped.path = f"/proc/{os.getpid()}/fd/{snap}"
                mapped.identity = _identity(os.fstat(snap))
                weakref.finalize(mapped, os.close, snap)   # the snapshot goes with its views
                with os.fdopen(os.dup(snap), "rb") as copy:   # parsed from it, whole
                    self._parse(copy, size, spath, mapped)
                return
            self._parse(f, size, spath, mapped)

    def parseStream(self, stream: BinaryIO | BytesLike, name: str = "<bytes>") -> None:
        """Parse a PopEF image from bytes or a binary stream (read to its end)."""
        if isinstance(stream, (bytes, bytearray, memoryview)):
            data = bytes(stream)
            self._parse(io.BytesIO(data), len(data), name)
            return
        if not callable(getattr(stream, "read", None)):
            raise PopefError(f"parseStream expects bytes or a binary stream, got "
                             f"{type(stream).__name__}", path=name)
        try:
            seekable = getattr(stream, "seekable", None)
            if seekable is not None and seekable():
                start = stream.tell()
                end = stream.seek(0, io.SEEK_END)
                stream.seek(start)
                self._parse(_Window(stream, start), end - start, name)
                return
            data = stream.read()
        except OSError as exc:
            raise PopefError(f"cannot read PopEF stream: {exc}", path=name) from None
        if not isinstance(data, (bytes, bytearray)):
            raise PopefError(f"stream returned {type(data).__name__}, expected bytes "
                             "(open it in binary mode)", path=name)
        self._parse(io.BytesIO(bytes(data)), len(data), name)

    # -- what was read ---------------------------------------------------------

    # (the real module's blob readers, popef.blobs; the blobs themselves: entries())

    def metadata(self) -> list[Metadata]:
        """Copies of the metadata read (changing one changes nothing here)."""
        return [copy.deepcopy(b) for _, b in self._entries if isinstance(b, Metadata)]

    def executables(self) -> list[blobs.ExecutableReader]:
        return blobs.executable_readers([b for _, b in self._entries])

    def tensors(self) -> list[blobs.TensorReader]:
        return blobs.tensor_readers([b for _, b in self._entries])

    def feeds(self) -> list[blobs.FeedReader]:
        return blobs.feed_readers([b for _, b in self._entries])

    def opaqueBlobs(self) -> list[blobs.OpaqueReader]:
        return blobs.opaque_readers([b for _, b in self._entries])

    def blobs(self) -> list[BlobInfo]:
        """Every blob parsed so far, in file order."""
        return [info for info, _ in self._entries]

    def entries(self) -> list[tuple[BlobInfo, Blob]]:
        """Every blob with where it came from (used by ``ModelBuilder``)."""
        return list(self._entries)

    def paths(self) -> list[str]:
        return list(self._paths)

    # -- the parser --------------------------------------------------------------

    def _parse(self, f: _Seekable, size: int, path: str,
               mapped: mmap.mmap | None = None) -> None:
        parsed = _FileParser(f, size, path, mapped, self._pending).parse()
        # All or nothing: a damaged file adds no blobs.
        self._entries.extend(parsed)
        self._paths.append(path)
        _log.debug("parsed %d blobs from %s", len(parsed), path)


class _Window:
    """A seekable stream seen from ``start`` (so offsets are relative to it)."""

    def __init__(self, stream: BinaryIO, start: int) -> None:
        self._s = stream
        self._start = start

    def read(self, n: int) -> bytes:
        return self._s.read(n)

    def seek(self, pos: int) -> int:
        return self._s.seek(self._start + pos) - self._start


class _FileParser:
    def __init__(self, f: _Seekable, size: int, path: str,
                 mapped: mmap.mmap | None = None,
                 pending: PendingChecksums | None = None) -> None:
        self.f = f
        self.size = size
        self.path = path
        self.mapped = mapped
        self.pending = pending
        self.last_header_crc = 0

    def error(self, msg: str, offset: int, blob: str | None = None) -> PopefError:
        return PopefError(msg, path=self.path, blob=blob, offset=offset)

    def read_exact(self, offset: int, n: int, what: str, blob: str | None = None) -> bytes:
        # Callers have already checked offset + n <= size; a short read means
        # the file shrank while we read it.
        try:
            self.f.seek(offset)
            data = self.f.read(n)
        except (OSError, ValueError) as exc:
            raise self.error(f"cannot read {what}: {exc}", offset, blob) from None
        if not isinstance(data, (bytes, bytearray)):
            raise self.error(f"stream returned {type(data).__name__}, expected bytes (open "
                             "it in binary mode)", offset, blob)
        if len(data) != n:
            got = len(data)
            raise self.error(f"file is truncated: {what} needs {n} bytes, got {got}",
                             offset, blob)
        return bytes(data)

    def parse(self) -> list[tuple[BlobInfo, Blob]]:
        if self.size < fmt.FILE_HEADER_SIZE:
            raise self.error(f"file is truncated: {self.size} bytes is shorter than the "
                             f"{fmt.FILE_HEADER_SIZE}-byte PopEF file header", 0)
        magic, version, reserved = fmt.unpack_file_header(
            self.read_exact(0, fmt.FILE_HEADER_SIZE, "the file header"))
        if magic != fmt.FILE_MAGIC:
            raise self.error(f"not a PopEF file: magic is {magic!r}, expected "
                             f"{fmt.FILE_MAGIC!r}", 0)
        if version != fmt.FILE_FORMAT_VERSION:
            raise self.error(f"unsupported PopEF file format version {version}; this "
                             f"reader supports version {fmt.FILE_FORMAT_VERSION}", 8)
        if reserved & ~fmt.KNOWN_FILE_FLAGS:
            raise self.error(f"file header flags are 0x{reserved:x}; this reader knows "
                             f"0x{fmt.KNOWN_FILE_FLAGS:x} (the end record)", 12)
        end = self.size
        record = None
        if reserved & fmt.FILE_FLAG_END_RECORD and self.size >= (fmt.FILE_HEADER_SIZE
                                                                  + fmt.END_RECORD_SIZE):
            record = fmt.unpack_end_record(self.read_exact(
                self.size - fmt.END_RECORD_SIZE, fmt.END_RECORD_SIZE, "the end record"))
            if record is not None:
                end = self.size - fmt.END_RECORD_SIZE
        out: list[tuple[BlobInfo, Blob]] = []
        offset = fmt.FILE_HEADER_SIZE
        index = 0
        chain = 0
        while offset < end:
            if record is None and reserved & fmt.FILE_FLAG_END_RECORD and (
                    end - offset < fmt.BLOB_HEADER_SIZE):
                raise self.error(
                    f"file is truncated or damaged: its last {end - offset} bytes are "
                    "neither a blob nor the end record its header announces", offset,
                    f"#{index}")
            info, blob = self.parse_blob(offset, index, end)
            out.append((info, blob))
            chain = fmt.chain_crc(chain, self.last_header_crc)
            offset += info.size
            index += 1
        if reserved & fmt.FILE_FLAG_END_RECORD:
            self.check_end(record, out, chain)
        return out

    def check_end(self, record: tuple[int, int, int] | None,
                  blobs: list[tuple[BlobInfo, Blob]], chain: int) -> None:
        """The file announced an end record: it must end with it, and the record must
        count the blobs found (else the file was cut short or appended to)."""
        last = (f"the last one {blobs[-1][0].label} at offset {blobs[-1][0].offset}"
                if blobs else "none")
        if record is None:
            raise self.error(
                f"file is truncated: it ends at byte {self.size} after {len(blobs)} whole "
                f"blob(s) ({last}) without the end record its header announces: the rest "
                "of the file (blobs after these, and the end record) is missing",
                self.size)
        count, at, want = record
        if count != len(blobs) or at != self.size - fmt.END_RECORD_SIZE or want != chain:
            raise self.error(
                f"file does not match its end record: the record says {count} blob(s) "
                f"ending at byte {at}, the file holds {len(blobs)} blob(s) ({last}) ending "
                f"at byte {self.size - fmt.END_RECORD_SIZE}"
                + ("" if want == chain or count != len(blobs) else
                   ", and their headers are not the ones written")
                + " (cut short and appended to, or damaged)",
                self.size - fmt.END_RECORD_SIZE)

    def parse_blob(self, offset: int, index: int, end: int) -> tuple[BlobInfo, Blob]:
        """The blob at ``offset`` (blobs end at ``end``: the end record or the file's end)."""
        where = f"#{index}"
        remaining = end - offset
        if remaining < fmt.BLOB_HEADER_SIZE:
            raise self.error(f"file is truncated: {remaining} bytes left, a blob header "
                             f"needs {fmt.BLOB_HEADER_SIZE}", offset, where)
        raw = self.read_exact(offset, fmt.BLOB_HEADER_SIZE, "a blob header", where)
        h = fmt.unpack_blob_header(raw)
        if h.magic != fmt.BLOB_MAGIC:
            raise self.error(f"blob header magic is {h.magic!r}, expected {fmt.BLOB_MAGIC!r} "
                             "(damaged file or a wrong blob size before it)", offset, where)
        if h.name_len > fmt.MAX_NAME_BYTES:
            raise self.error(f"blob name length {h.name_len} exceeds the limit of "
                             f"{fmt.MAX_NAME_BYTES} bytes", offset + 16, where)
        if h.total_size > remaining:
            raise self.error(f"blob size {h.total_size} is larger than the {remaining} "
                             "bytes left in the file (truncated or damaged)", offset + 8,
                             self.guess_label(h, offset, remaining, where))
        if h.total_size != fmt.BLOB_HEADER_SIZE + h.name_len + h.payload_len:
            raise self.error(f"blob size {h.total_size} disagrees with header "
                             f"({fmt.BLOB_HEADER_SIZE}) + name ({h.name_len}) + payload "
                             f"({h.payload_len}) bytes", offset + 8, where)
        name_raw = self.read_exact(offset + fmt.BLOB_HEADER_SIZE, h.name_len, "a blob name",
                                   where)
        if fmt.header_crc(raw, name_raw) != h.header_crc:
            raise self.error("blob header checksum mismatch (the header or the name is "
                             "damaged)", offset, where)
        self.last_header_crc = h.header_crc
        try:
            name = name_raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.error("blob name is not valid UTF-8", offset + fmt.BLOB_HEADER_SIZE,
                             where) from None
        try:
            btype = fmt.BlobType(h.blob_type)
        except ValueError:
            raise self.error(f"unknown blob type {h.blob_type}; expected one of "
                             + ", ".join(f"{t.value} ({t.label})" for t in fmt.BlobType),
                             offset + 4, f"{where} {echo(name)}") from None
        label = f"{where} {btype.label} {echo(name)}"
        if h.version != fmt.BLOB_FORMAT_VERSION:
            raise self.error(f"unsupported blob format version {h.version}; this reader "
                             f"supports version {fmt.BLOB_FORMAT_VERSION}", offset + 6, label)
        if h.flags & ~fmt.KNOWN_FLAGS:
            raise self.error(f"unknown blob flags 0x{h.flags:x}", offset + 20, label)
        compressed = bool(h.flags & fmt.FLAG_COMPRESSED)
        if compressed and btype is not fmt.BlobType.EXECUTABLE:
            raise self.error("only executable blobs may be compressed", offset + 20, label)
        payload_off = offset + fmt.BLOB_HEADER_SIZE + h.name_len
        if btype is fmt.BlobType.METADATA and h.payload_len > fmt.MAX_METADATA_BYTES:
            raise self.error(f"metadata of {h.payload_len} bytes exceeds the limit of "
                             f"{fmt.MAX_METADATA_BYTES}", offset + 24, label)
        payload: bytes | memoryview
        if (self.mapped is not None and h.payload_len >= MAP_MIN_BYTES and not compressed
                and btype in (fmt.BlobType.EXECUTABLE, fmt.BlobType.TENSOR_DATA)):
            payload = memoryview(self.mapped)[payload_off:payload_off + h.payload_len]
        else:
            payload = self.read_exact(payload_off, h.payload_len, "a blob payload", label)

        def mismatch(crc: int) -> PopefError:
            return self.error(f"payload checksum mismatch: stored 0x{h.payload_crc:08x}, "
                              f"computed 0x{crc:08x}", payload_off, label)
        if self.pending is not None and isinstance(payload, memoryview):
            self.pending.add(payload, h.payload_crc, mismatch)
        else:
            crc = _crc32(payload)
            drop_pages(payload)
            if crc != h.payload_crc:
                raise mismatch(crc)
        info = BlobInfo(btype, name, self.path, offset, h.total_size, h.payload_len,
                        h.payload_crc, compressed, h.aux)
        blob = self.decode(btype, name, payload, h.aux, compressed, payload_off, label)
        return info, blob

    def guess_label(self, h: fmt.BlobHeader, offset: int, remaining: int, where: str) -> str:
        """Best-effort ``#4 opaque 'name'`` for a blob whose sizes are already wrong."""
        try:
            kind = fmt.BlobType(h.blob_type).label
        except ValueError:
            return where
        if fmt.BLOB_HEADER_SIZE + h.name_len > remaining:
            return f"{where} {kind}"
        try:
            name = self.read_exact(offset + fmt.BLOB_HEADER_SIZE, h.name_len, "a blob name",
                                   where).decode("utf-8")
        except (PopefError, UnicodeDecodeError):
            return f"{where} {kind}"
        return f"{where} {kind} {echo(name)}"

    def decode(self, btype: fmt.BlobType, name: str, payload: bytes | memoryview, aux: int,
               compressed: bool, payload_off: int, label: str) -> Blob:
        if btype is not fmt.BlobType.FEED_DATA and not (
                btype is fmt.BlobType.EXECUTABLE and compressed) and aux != 0:
            raise self.error(f"header field aux is {aux}, expected 0 for this blob type",
                             payload_off, label)
        if btype is fmt.BlobType.METADATA:
            try:
                md = decode_metadata(bytes(payload))
            except SchemaError as exc:
                raise self.error(f"metadata does not match its schema: {exc}", payload_off,
                                 label) from None
            if md.executable() != name:
                raise self.error(f"metadata blob is named {echo(name)} but its metadata names "
                                 f"executable {echo(md.executable())}", payload_off, label)
            return md
        if btype is fmt.BlobType.EXECUTABLE:
            if compressed:
                check_decompress(bytes(payload), aux, self.path, label, payload_off)
            return ExecutableBlob(name, payload, compressed)
        if not name:
            raise self.error(f"{btype.label} blob has an empty name", payload_off, label)
        if btype is fmt.BlobType.TENSOR_DATA:
            return TensorData(name, payload)
        if btype is fmt.BlobType.FEED_DATA:
            if not 1 <= aux <= fmt.MAX_FEED_TRANSFERS:
                raise self.error(f"feed data has {aux} transfers, expected 1.."
                                 f"{fmt.MAX_FEED_TRANSFERS}", payload_off, label)
            if len(payload) % aux:
                raise self.error(f"feed data of {len(payload)} bytes is not a whole number "
                                 f"of {aux} transfers", payload_off, label)
            return FeedData(name, bytes(payload), aux)
        return Opaque(name, bytes(payload))


def check_decompress(payload: bytes, expected: int, path: str | None, label: str | None,
                     offset: int | None) -> bytes:
    """Decompress a compressed executable, never producing more than ``expected`` bytes."""
    limit = min(fmt.MAX_DECOMPRESSED_BYTES, max(len(payload), 1) * fmt.MAX_COMPRESSION_RATIO)
    if expected > limit:
        raise PopefError(f"compressed executable claims {expected} bytes from "
                         f"{len(payload)} compressed bytes, more than zlib can produce",
                         path=path, blob=label, offset=offset)
    d = zlib.decompressobj()
    try:
        # max_length bounds the allocation; eof is only set once the stream
        # has ended and every byte of output has been returned.
        out = d.decompress(payload, expected + 1)
    except zlib.error as exc:
        raise PopefError(f"compressed executable is damaged: {exc}", path=path, blob=label,
                         offset=offset) from None
    if len(out) != expected or not d.eof or d.unused_data:
        raise PopefError(f"compressed executable does not decompress to the {expected} "
                         "bytes its header states", path=path, blob=label, offset=offset)
    return out


def _crc32(data: bytes | memoryview) -> int:
    if isinstance(data, bytes):
        return zlib.crc32(data)
    crc = 0
    for a in range(0, len(data), 8 << 20):   # a page-cache mapping: read it chunk by chunk
        crc = zlib.crc32(data[a:a + (8 << 20)], crc)
    return crc


_COPY_CHUNK = 64 << 20


def _snapshot(src: int, size: int, path: str) -> int:
    """A descriptor of an unnamed private copy of the ``size`` bytes of ``src`` (see the
    module docstring). Raises ``PopefError`` if the file is shorter than ``size`` (cut
    while it was read), ``ResourceLimitError`` if no place has room for the copy."""
    full: list[str] = []
    for fd, where in _unnamed_files(os.path.dirname(os.path.abspath(path))):
        try:
            done = _copy_range(src, fd, size)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM, errno.EFBIG):
                full.append(f"{where}: {exc.strerror or exc}")
                continue    # the next place
            raise PopefError(f"cannot read PopEF file: {exc.strerror or exc}",
                             path=path) from None
        except BaseException:
            os.close(fd)
            raise
        if done != size:
            os.close(fd)
            raise PopefError(f"file is truncated: it had {size} bytes when opened and {done} "
                             "could be read (cut short while it was read)", path=path,
                             offset=done)
        return fd
    raise ResourceLimitError(
        f"no room for the private snapshot of PopEF file {echo(path)} ({size} bytes): "
        + "; ".join(full) + "; free space there, or load the model from bytes "
        "(popef.Reader.parseStream)")


def _unnamed_files(folder: str) -> Iterator[tuple[int, str]]:
    """``(fd, where)`` of an unnamed 0600 file in ``folder``, then in the temporary
    folder, then an anonymous memory file: the caller takes the first with room."""
    flags = getattr(os, "O_TMPFILE", 0) | os.O_RDWR | os.O_CLOEXEC
    if flags & ~(os.O_RDWR | os.O_CLOEXEC):
        for where in dict.fromkeys((folder, tempfile.gettempdir())):
            try:
                yield os.open(where, flags, 0o600), where
            except OSError:
                continue
    yield os.memfd_create("popef-snapshot", os.MFD_CLOEXEC), "memory (memfd)"


def _copy_range(src: int, dst: int, size: int) -> int:
    """Copy ``src[0:size]`` to ``dst`` in the kernel where it can; the bytes copied (fewer
    than ``size``: ``src`` ended early)."""
    done = 0
    kernel = hasattr(os, "copy_file_range")
    while done < size:
        n = min(size - done, _COPY_CHUNK)
        if kernel:
            try:
                got = os.copy_file_range(src, dst, n, done, done)
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL,
                                     errno.EOPNOTSUPP, errno.EBADF):
                    raise
                kernel = False
                continue
        else:
            data = os.pread(src, n, done)
            got = os.pwrite(dst, data, done) if data else 0
        if got == 0:
            break
        done += got
    return done


class _FileMap(mmap.mmap):
    """A read-only mapping of a PopEF file, knowing which file it maps."""

    path: str = ""
    identity: tuple[int, ...] = ()


def _identity(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def file_span(view: bytes | memoryview) -> tuple[str, int] | None:
    """``(path, offset)`` of the file bytes a payload view maps, if the file at that path
    is still the one that was read (same inode, size and time); None for bytes, or a file
    replaced or changed since (its bytes are then only what this process mapped)."""
    obj = view.obj if isinstance(view, memoryview) else None
    if not isinstance(obj, _FileMap) or not obj.path:
        return None
    try:
        if _identity(os.stat(obj.path)) != obj.identity:
            return None
    except OSError:
        return None
    return obj.path, buffer_address(view) - buffer_address(memoryview(obj))


def file_identity(view: bytes | memoryview) -> tuple[int, ...] | None:
    """``(st_dev, st_ino, st_size, st_mtime_ns)`` of the file a payload view maps, as it was
    when it was read (None for bytes): a process that opens the file and finds the same
    reads the bytes this one read (and checked, or is checking)."""
    obj = view.obj if isinstance(view, memoryview) else None
    if not isinstance(obj, _FileMap) or not obj.identity:
        return None
    return obj.identity


def drop_pages(view: bytes | memoryview) -> None:
    """Let this process's mapping of a file-backed payload's pages go (they stay in the
    kernel's page cache and are mapped again when read); nothing for bytes."""
    obj = view.obj if isinstance(view, memoryview) else None
    if not isinstance(obj, mmap.mmap) or not len(view):
        return
    try:
        start = buffer_address(view) - buffer_address(memoryview(obj))
        first = start - start % mmap.PAGESIZE
        obj.madvise(mmap.MADV_DONTNEED, first, start + len(view) - first)
    except (OSError, ValueError):   # pragma: no cover - advice only
        pass
