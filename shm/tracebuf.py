"""A bounded ring of fixed-size binary records in shared memory: one process writes, any reads.

A timeline recorder (``ipu_emulator.trace``) gives each IPU process one of
these: the process writes an event as one record, never blocks and never
allocates; when the ring is full the oldest records are overwritten (and counted
as dropped). Another process maps the same region and reads what is there at
any time, also after the writer died: a crashed writer loses at most the record
it was writing.

::

    offset  size  field                       written by
    0       4     magic b"IPTR"               creator
    4       2     version (1)                 creator
    6       2     record size (48)            creator
    8       4     capacity (records)          creator
    12      4     writer pid                  writer (at attach)
    16      4     writer label (int, e.g. the IPU index)  writer
    20      4     (reserved)
    24      8     records written so far      writer, after each record
    32      32    (reserved)
    64      48 x capacity  records: record k at 64 + (k % capacity) * 48

    record: ts_ns i64 | dur_ns i64 | code u32 | tid u32 | a i64 | b i64 | c i64

Time stamps are ``CLOCK_MONOTONIC`` nanoseconds (``time.monotonic_ns``), which is
the same clock in every process of a Linux machine. The meaning of ``code`` and
``a``/``b``/``c`` is the writer's (this module knows none). A C writer (the IPU's
step, ``ipu_emulator/ipu/_stepcore.c``) writes records in the same layout
through :attr:`TraceBuffer.buf`, from the same thread as the Python writer.

The region is made by the host that starts the writer (``create``), named by
:mod:`shm.naming` (kind ``trace``); the writer attaches it by name; the creator
unlinks the name once the writer has attached, so nothing is left in /dev/shm
whatever happens to either process, and each keeps its mapping.
"""

from __future__ import annotations

import struct

from .region import Region

__all__ = ["TraceBuffer", "RECORD", "HEADER_SIZE", "COUNT_OFFSET", "MAGIC"]

MAGIC = b"IPTR"
_VERSION = 1
RECORD = struct.Struct("<qqIIqqq")
"""One record: ts_ns, dur_ns, code, tid, a, b, c (48 bytes)."""
_HEADER = struct.Struct("<4sHHIIi")
HEADER_SIZE = 64
COUNT_OFFSET = 24
_COUNT = struct.Struct("<Q")
_MAX_CAPACITY = 1 << 24


class TraceBuffer:
    """The ring of records in one region (see the module docstring)."""

    def __init__(self, region: Region) -> None:
        buf = region.buf
        if len(buf) < HEADER_SIZE:
            raise ValueError(f"trace buffer {region.name}: {len(buf)} bytes is smaller than "
                             f"its {HEADER_SIZE}-byte header")
        magic, version, size, capacity, _, _ = _HEADER.unpack_from(buf, 0)
        if magic != MAGIC or version != _VERSION or size != RECORD.size:
            raise ValueError(f"trace buffer {region.name}: not a version-{_VERSION} trace "
                             f"buffer (magic {magic!r}, version {version}, record {size})")
        if not 1 <= capacity <= _MAX_CAPACITY or HEADER_SIZE + capacity * size > len(buf):
            raise ValueError(f"trace buffer {region.name}: capacity {capacity} does not fit "
                             f"{len(buf)} bytes")
        self.region = region
        self.buf = buf
        self.capacity = capacity

    @classmethod
    def create(cls, capacity: int) -> "TraceBuffer":
        """A new region of ``capacity`` records (owned: this process may unlink it)."""
        if not 1 <= capacity <= _MAX_CAPACITY:
            raise ValueError(f"a trace buffer holds 1..{_MAX_CAPACITY} records, got {capacity}")
        region = Region.create(HEADER_SIZE + capacity * RECORD.size, kind="trace",
                               prefault=False)
        try:
            _HEADER.pack_into(region.buf, 0, MAGIC, _VERSION, RECORD.size, capacity, 0, 0)
            _COUNT.pack_into(region.buf, COUNT_OFFSET, 0)
            return cls(region)
        except BaseException:
            region.close()
            region.unlink()
            raise

    @classmethod
    def attach(cls, name: str) -> "TraceBuffer":
        return cls(Region.attach(name, prefault=False))

    @property
    def name(self) -> str:
        return self.region.name

    def set_writer(self, pid: int, label: int) -> None:
        """The writer says who it is (read by whoever merges the buffers)."""
        struct.pack_into("<Ii", self.buf, 12, pid, label)

    def writer(self) -> tuple[int, int]:
        """(pid, label) the writer set (0, 0 before it attached)."""
        pid, label = struct.unpack_from("<Ii", self.buf, 12)
        return int(pid), int(label)

    def written(self) -> int:
        """Records written so far (also those overwritten since)."""
        return int(_COUNT.unpack_from(self.buf, COUNT_OFFSET)[0])

    def write(self, code: int, ts: int, dur: int, a: int = 0, b: int = 0, c: int = 0,
              tid: int = 0) -> None:
        """Append one record; the oldest is overwritten when the ring is full."""
        buf = self.buf
        n = _COUNT.unpack_from(buf, COUNT_OFFSET)[0]
        RECORD.pack_into(buf, HEADER_SIZE + (n % self.capacity) * RECORD.size,
                         ts, dur, code, tid, a, b, c)
        _COUNT.pack_into(buf, COUNT_OFFSET, n + 1)

    def records(self) -> tuple[list[tuple[int, int, int, int, int, int, int]], int]:
        """(the records held, oldest first; how many were dropped, overwritten)."""
        n = self.written()
        cap = self.capacity
        first = max(0, n - cap)
        out = []
        size = RECORD.size
        for k in range(first, n):
            out.append(RECORD.unpack_from(self.buf, HEADER_SIZE + (k % cap) * size))
        return out, first

    def unlink(self) -> None:
        """Destroy the name (idempotent); the mappings stay."""
        self.region.unlink()

    def close(self) -> None:
        self.region.close()
