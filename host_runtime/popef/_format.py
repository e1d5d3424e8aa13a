"""The byte layout of a PopEF file (this emulator's encoding).

::

    file   := file_header blob* [end_record]
    file_header (16 bytes, little-endian)
      0  8s  magic            b"IPUPOPEF"
      8  u32 format_version   FILE_FORMAT_VERSION (1)
     12  u32 flags            bit 0: the file ends with an end record (what the
                              Writer writes); 0: no end record (older files)

    end_record (32 bytes, little-endian; the last bytes of a file that announces it)
      0  8s  magic            b"POPEFEND"
      8  u64 blobs            how many blobs the file holds
     16  u64 offset           where the record starts (= the bytes of all blobs + 16)
     24  u32 chain_crc32      zlib.crc32 over the header_crc32 of every blob, in order
     28  u32 record_crc32     zlib.crc32 of bytes 0..28 of the record

    A file whose header announces an end record and that does not end with the
    right one was cut short (anywhere, also exactly between two blobs) or
    appended to, and is refused.

    blob   := blob_header name payload
    blob_header (48 bytes, little-endian)
      0  4s  magic            b"BLOB"
      4  u16 blob_type        BlobType (1 executable .. 5 opaque)
      6  u16 blob_version     BLOB_FORMAT_VERSION (1)
      8  u64 total_size       48 + name_len + payload_len (jump to the next blob)
     16  u32 name_len         UTF-8 bytes of the name, <= MAX_NAME_BYTES
     20  u32 flags            bit 0: payload is zlib-compressed (executables only)
     24  u64 payload_len
     32  u64 aux              feed data: number of transfers;
                              compressed executable: decompressed size; else 0
     40  u32 payload_crc32    zlib.crc32 of the payload bytes as stored
     44  u32 header_crc32     zlib.crc32 of bytes 0..40 of this header + the name

    name: metadata -> the executable it describes; executable -> its name;
          tensor / feed data -> the anchor it feeds; opaque -> its name.
    payload: metadata -> UTF-8 JSON checked against ``_schema``;
             others -> raw bytes.

Every length is checked against the bytes that remain in the file before it
is used, so a damaged length can never make the reader allocate more than the
file holds.
"""

from __future__ import annotations

import enum
import struct
import zlib

__all__ = ["BlobType"]

FILE_MAGIC = b"IPUPOPEF"
FILE_FORMAT_VERSION = 1
_FILE_HEADER = struct.Struct("<8sII")
FILE_HEADER_SIZE = _FILE_HEADER.size  # 16

BLOB_MAGIC = b"BLOB"
BLOB_FORMAT_VERSION = 1
_BLOB_HEADER = struct.Struct("<4sHHQIIQQII")
BLOB_HEADER_SIZE = _BLOB_HEADER.size  # 48
_CRC_COVERED = BLOB_HEADER_SIZE - 4    # header bytes covered by header_crc32

FILE_FLAG_END_RECORD = 0x1
KNOWN_FILE_FLAGS = FILE_FLAG_END_RECORD
END_MAGIC = b"POPEFEND"
_END_RECORD = struct.Struct("<8sQQII")
END_RECORD_SIZE = _END_RECORD.size   # 32

FLAG_COMPRESSED = 0x1
KNOWN_FLAGS = FLAG_COMPRESSED

MAX_NAME_BYTES = 4096
MAX_METADATA_BYTES = 16 * 1024 * 1024
# zlib cannot expand more than ~1032:1; a larger claim is damage.
MAX_COMPRESSION_RATIO = 1100
MAX_DECOMPRESSED_BYTES = 1 << 34
MAX_FEED_TRANSFERS = 1 << 32


class BlobType(enum.IntEnum):
    """The kinds of blob a PopEF file holds."""

    EXECUTABLE = 1
    METADATA = 2
    TENSOR_DATA = 3
    FEED_DATA = 4
    OPAQUE = 5

    @property
    def label(self) -> str:
        return self.name.lower().replace("_", " ")


assert FILE_HEADER_SIZE == 16 and BLOB_HEADER_SIZE == 48


def pack_file_header(flags: int = FILE_FLAG_END_RECORD) -> bytes:
    return _FILE_HEADER.pack(FILE_MAGIC, FILE_FORMAT_VERSION, flags)


def chain_crc(crc: int, header_crc32: int) -> int:
    """The end record's ``chain_crc32`` so far, with one more blob's header checksum."""
    return zlib.crc32(struct.pack("<I", header_crc32), crc)


def pack_end_record(blobs: int, offset: int, chain: int) -> bytes:
    head = _END_RECORD.pack(END_MAGIC, blobs, offset, chain, 0)[:END_RECORD_SIZE - 4]
    return head + struct.pack("<I", zlib.crc32(head))


def unpack_end_record(raw: bytes) -> tuple[int, int, int] | None:
    """``(blobs, offset, chain_crc32)`` of an end record, None if ``raw`` is not one."""
    magic, blobs, offset, chain, crc = _END_RECORD.unpack(raw)
    if magic != END_MAGIC or crc != zlib.crc32(raw[:END_RECORD_SIZE - 4]):
        return None
    return blobs, offset, chain


def unpack_file_header(raw: bytes) -> tuple[bytes, int, int]:
    magic, version, reserved = _FILE_HEADER.unpack(raw)
    return magic, version, reserved


class BlobHeader:
    """The decoded fixed part of a blob header."""

    __slots__ = ("magic", "blob_type", "version", "total_size", "name_len", "flags",
                 "payload_len", "aux", "payload_crc", "header_crc")

    def __init__(self, magic: bytes, blob_type: int, version: int, total_size: int,
                 name_len: int, flags: int, payload_len: int, aux: int, payload_crc: int,
                 header_crc: int) -> None:
        self.magic = magic
        self.blob_type = blob_type
        self.version = version
        self.total_size = total_size
        self.name_len = name_len
        self.flags = flags
        self.payload_len = payload_len
        self.aux = aux
        self.payload_crc = payload_crc
        self.header_crc = header_crc


def pack_blob_header(blob_type: BlobType, name: bytes, payload_len: int, payload_crc: int,
                     flags: int = 0, aux: int = 0) -> bytes:
    total = BLOB_HEADER_SIZE + len(name) + payload_len
    head = _BLOB_HEADER.pack(BLOB_MAGIC, int(blob_type), BLOB_FORMAT_VERSION, total,
                             len(name), flags, payload_len, aux, payload_crc, 0)
    crc = zlib.crc32(name, zlib.crc32(head[:_CRC_COVERED]))
    return head[:_CRC_COVERED] + struct.pack("<I", crc)


def unpack_blob_header(raw: bytes) -> BlobHeader:
    return BlobHeader(*_BLOB_HEADER.unpack(raw))


def header_crc(raw_header: bytes, name: bytes) -> int:
    return zlib.crc32(name, zlib.crc32(raw_header[:_CRC_COVERED]))
