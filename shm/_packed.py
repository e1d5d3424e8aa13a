"""Several rings in one shared-memory segment (``Ring.create_packed``).

A session's stream rings are made together, mapped together by the device and
unlinked together; most are small (a slot per transfer of a small tensor). Made one
segment each, every ring costs its creator a name, a ``shm_open``, a truncate, an
allocation, a mapping and an unlink, and its peer a mapping: most of what making and
loading a small model's session costs. Packed, they cost that once.

A ring of a packed segment starts on a page boundary and is named
``<segment name>@<offset>``: ``Ring.attach`` maps the segment (once for several of its
rings, given a ``segments`` dict) and takes the ring at that offset. A
:class:`RegionPart` is what such a ring holds instead of a whole ``Region``: the same
calls (``buf``, ``close``, ``unlink``, ``back``) over its own bytes. The segment stays
mapped until every part of it in this process is closed, and one unlink destroys the
segment's name for all of its rings: the rings of a packed segment are unlinked
together, by their creator.
"""

from __future__ import annotations

from .errors import ShmClosedError, ShmError
from .region import Region
from .settings import is_digits

__all__ = ["SEP", "RegionPart", "Shared", "part_name", "segment_of"]

SEP = "@"


def part_name(segment: str, offset: int) -> str:
    """The name of the ring at ``offset`` of the packed segment ``segment``."""
    return f"{segment}{SEP}{offset}"


def segment_of(name: str) -> tuple[str, int]:
    """``(segment name, offset)`` of a ring's name (offset 0: a segment of its own).
    ShmError for an offset that is not a number."""
    segment, sep, offset = name.rpartition(SEP)
    if not sep:
        return name, 0
    if not is_digits(offset):
        raise ShmError(f"ring name {name!r}: {offset!r} after {SEP!r} is not a byte offset")
    return segment, int(offset)


class Shared:
    """A segment mapped once for several parts: closed when the last part is."""

    __slots__ = ("region", "parts")

    def __init__(self, region: Region) -> None:
        self.region = region
        self.parts = 0


class RegionPart:
    """The bytes ``[offset, offset + size)`` of a shared segment, for one ring."""

    __slots__ = ("_shared", "_offset", "_size", "_name", "_buf")

    def __init__(self, shared: Shared, offset: int, size: int) -> None:
        region = shared.region
        if offset < 0 or size <= 0 or offset + size > region.size:
            raise ValueError(f"part [{offset}, {offset + size}) does not fit region "
                             f"{region.name} of {region.size} bytes")
        self._shared = shared
        self._offset = offset
        self._size = size
        self._name = part_name(region.name, offset)
        self._buf: memoryview | None = region.buf[offset:offset + size]
        shared.parts += 1

    @property
    def name(self) -> str:
        return self._name

    @property
    def size(self) -> int:
        return self._size

    @property
    def owner(self) -> bool:
        return self._shared.region.owner

    @property
    def closed(self) -> bool:
        return self._buf is None

    @property
    def buf(self) -> memoryview:
        buf = self._buf
        if buf is None:
            raise ShmClosedError(f"region {self._name} is closed in this process")
        return buf

    def back(self) -> None:
        """Allocate this part's pages now (``Region.back`` of its range)."""
        self._shared.region.back([(self._offset, self._size)])

    def close(self) -> None:
        """Stop using this part (idempotent); the segment's mapping goes with the last.
        Views handed out stay valid (as ``Region.close``)."""
        if self._buf is None:
            return
        self._buf = None   # dropped, never released: a caller may hold a slice of it
        shared = self._shared
        shared.parts -= 1
        if shared.parts == 0:
            shared.region.close()

    def unlink(self) -> None:
        """Destroy the segment's name (idempotent): every ring of it loses its name."""
        self._shared.region.unlink()
