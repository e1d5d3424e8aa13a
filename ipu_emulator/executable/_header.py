"""The executable's fixed header: its ``struct`` layout, its one encoder
(``ExecutableHeader.pack``) and its one decoder (``ExecutableHeader.unpack``,
``read_header``). A host reads it alone before loading (cheap: ``HEADER_SIZE`` bytes).
"""

from __future__ import annotations

import dataclasses
import struct
import zlib
from dataclasses import dataclass
from typing import Any

from ipu_emulator.errors import ExecutableError
from ipu_emulator.executable._limits import _IPU_VERSIONS, _MAX_BYTES, _MAX_REPEAT

MAGIC = b"IPUEMUX\x00"
FORMAT_VERSION = 1

# magic, version, header_len, flags, ipu_version, num_ipus, device_iterations,
# memory_bytes, required_bytes, program_offset, program_length, graphs_offset,
# graphs_length, total_length, body_crc32, package_hash, name, header_crc32
_HEADER = struct.Struct("<8sIIIIIIQQQQQQQI64s128s")
HEADER_SIZE = _HEADER.size + 4
_HEADER_CRC = struct.Struct("<I")


@dataclass(frozen=True)
class ExecutableHeader:
    """The fixed header of an executable: what a host needs before loading it.

    ``pack()`` is its one encoder, ``unpack()`` (``read_header``) its one decoder; the
    bytes are ``HEADER_SIZE`` long and end with a CRC-32 of the rest (the module
    docstring's layout). ``version`` is the format version; the section offsets and
    lengths and ``total_length`` are byte counts from the start of the executable.
    """

    name: str
    package_hash: str
    ipu_version: int
    num_ipus: int
    device_iterations: int
    memory_bytes: int
    required_bytes: int
    version: int
    total_length: int
    program_offset: int
    program_length: int
    graphs_offset: int
    graphs_length: int
    body_crc32: int

    def pack(self) -> bytes:
        """The header's ``HEADER_SIZE`` bytes, its CRC-32 last."""
        head = _HEADER.pack(
            MAGIC, self.version, HEADER_SIZE, 0, self.ipu_version, self.num_ipus,
            self.device_iterations, self.memory_bytes, self.required_bytes,
            self.program_offset, self.program_length, self.graphs_offset,
            self.graphs_length, self.total_length, self.body_crc32,
            self.package_hash.encode("ascii"), self.name.encode())
        return head + _HEADER_CRC.pack(zlib.crc32(head))

    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview) -> "ExecutableHeader":
        """Decode and check the header at the start of ``data`` (reads ``HEADER_SIZE``
        bytes); raises ``ExecutableError`` naming the byte offset of any damage."""
        view = memoryview(data)
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        if len(view) < HEADER_SIZE:
            raise ExecutableError(
                f"executable is {len(view)} bytes, shorter than its {HEADER_SIZE}-byte "
                "header (truncated)", offset=len(view))
        whole = bytes(view[:HEADER_SIZE])
        known = _decoded.get(whole)
        if known is not None and cls is ExecutableHeader:
            return known
        raw = whole[:_HEADER.size]
        (magic, version, header_len, flags, ipu_version, num_ipus, iterations, memory_bytes,
         required_bytes, p_off, p_len, g_off, g_len, total, body_crc, phash,
         name) = _HEADER.unpack(raw)
        if magic != MAGIC:
            raise ExecutableError(f"bad magic {magic!r}; expected {MAGIC!r} (not an IPU "
                                  "emulator executable)", offset=0)
        if version != FORMAT_VERSION:
            raise ExecutableError(f"unsupported executable format version {version}; this "
                                  f"emulator reads version {FORMAT_VERSION}", offset=8)
        (hcrc,) = _HEADER_CRC.unpack(whole[_HEADER.size:])
        if zlib.crc32(raw) != hcrc:
            raise ExecutableError("header checksum mismatch (damaged header)",
                                  offset=_HEADER.size)
        if header_len != HEADER_SIZE:
            raise ExecutableError(f"header length {header_len}; expected {HEADER_SIZE}",
                                  offset=12)
        if flags != 0:
            raise ExecutableError(f"unknown header flags {flags:#x}", offset=16)
        if ipu_version not in _IPU_VERSIONS:
            raise ExecutableError(f"ipu_version {ipu_version}; expected one of "
                                  f"{_IPU_VERSIONS}", offset=20)
        if not 1 <= num_ipus <= 1024 or not 1 <= iterations <= _MAX_REPEAT:
            raise ExecutableError(f"num_ipus {num_ipus} / device_iterations {iterations} "
                                  "out of range", offset=24)
        if memory_bytes > _MAX_BYTES or required_bytes > _MAX_BYTES or total > _MAX_BYTES:
            raise ExecutableError("memory or length field out of range", offset=32)
        try:
            phash_s = phash.rstrip(b"\0").decode("ascii")
            name_s = name.rstrip(b"\0").decode("utf-8")
        except UnicodeDecodeError:
            raise ExecutableError("header name or package hash is not valid text",
                                  offset=_HEADER.size - 192) from None
        header = cls(name=name_s, package_hash=phash_s, ipu_version=ipu_version,
                     num_ipus=num_ipus, device_iterations=iterations,
                     memory_bytes=memory_bytes, required_bytes=required_bytes,
                     version=version, total_length=total, program_offset=p_off,
                     program_length=p_len, graphs_offset=g_off, graphs_length=g_len,
                     body_crc32=body_crc)
        if cls is ExecutableHeader:   # (as they are read: a subclass's are not kept)
            if len(_decoded) >= _DECODED_MAX:
                _decoded.clear()
            _decoded[whole] = header
        return header

    def as_dict(self) -> dict[str, Any]:
        """The fields by name (for tools that print or serialise them)."""
        return dataclasses.asdict(self)


# Headers decoded, by their bytes (a header is frozen: the same bytes decode to an equal
# one). A host reads its model's header several times per runner made, and an IPU process
# once per LOAD. A damaged header is never kept: it is refused each time.
_decoded: dict[bytes, ExecutableHeader] = {}
_DECODED_MAX = 64


def read_header(data: bytes | bytearray | memoryview) -> ExecutableHeader:
    """Decode and check the fixed header only (cheap: reads ``HEADER_SIZE`` bytes):
    ``ExecutableHeader.unpack(data)``."""
    return ExecutableHeader.unpack(data)
