"""The byte layout of a PopEF file (this emulator's encoding).

::

    file   := file_header blob*
    file_header (16 bytes, little-endian)
      0  8s  magic            b"IPUPOPEF"
      8  u32 format_version   FILE_FORMAT_VERSION (1)
     12  u32 reserved         0

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


def pack_file_header() -> bytes:
    return _FILE_HEADER.pack(FILE_MAGIC, FILE_FORMAT_VERSION, 0)


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
