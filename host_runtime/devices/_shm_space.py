"""Room in /dev/shm for a session's rings and regions, and the error when there is none.

A model's stream rings and device-memory region live in /dev/shm. A Docker
container's default 64 MiB is easily too small (one [4096, 4096] float32 anchor
is 64 MiB a transfer): ``check_room`` adds up what a session will create and
refuses it at once, and ``translated`` turns a failure at creation into the host's
error: ``SharedMemoryFullError`` when /dev/shm is full (naming what was asked and
what /dev/shm has), ``ResourceLimitError`` when the process ran out of file
descriptors or into its file-size limit (``shm.limits`` names which, with the
numbers); never "/dev/shm full" for a limit that has nothing to do with it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Callable, Iterator, Sequence

from shm import (FileSizeLimitError, OutOfFileDescriptorsError, Region, Ring, ShmError,
                 ShmFullError, limits)

from host_runtime.errors import ResourceLimitError, SharedMemoryFullError
from ipu_emulator import ipu_protocol
from ipu_emulator.errors import UnsafePathError

__all__ = ["SHM_DIR", "ring_bytes", "check_room", "translated", "free_bytes"]

SHM_DIR = "/dev/shm"


def ring_bytes(slot_size: int, slots: int) -> int:
    """Bytes of /dev/shm a ring of ``slots`` slots of ``slot_size`` bytes takes."""
    return Ring.region_size(slot_size, slots)


def free_bytes() -> tuple[int, int] | None:
    """(free, total) bytes of /dev/shm, or None when it cannot be asked."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def _has() -> str:
    room = free_bytes()
    if room is None:
        return f"{SHM_DIR} cannot be asked how much it has"
    return f"{SHM_DIR} has {room[0]} bytes free of {room[1]}"


def check_room(what: str, items: Sequence[tuple[str, int]]) -> None:
    """Refuse ``items`` ((name, bytes) each) that /dev/shm cannot hold all together."""
    room = free_bytes()
    if room is None:
        return
    total = sum(n for _, n in items)
    if total <= room[0]:
        return
    largest = sorted(items, key=lambda it: -it[1])[:3]
    raise SharedMemoryFullError(
        f"{what} need {total} bytes of shared memory ({len(items)} in all; largest: "
        + ", ".join(f"{name} {n} bytes" for name, n in largest)
        + f"), but {_has()}; enlarge {SHM_DIR} (docker run --shm-size=...) or use "
        "smaller anchors / ring_buffer_size_multiplier")


@contextlib.contextmanager
def translated(what: str, nbytes: int) -> Iterator[None]:
    """Creating ``what`` of ``nbytes`` bytes: a failure there becomes the host's error
    (ResourceLimitError for descriptors and file size, else SharedMemoryFullError)."""
    try:
        yield
    except (ShmError, OSError, ValueError, MemoryError) as exc:
        if isinstance(exc, UnsafePathError):   # a planted link, not a full /dev/shm
            raise
        named: BaseException | None = exc
        try:
            if not isinstance(exc, (OutOfFileDescriptorsError, FileSizeLimitError, ShmFullError)):
                named = limits.named_error(exc, f"creating {what}", nbytes)
                if named is not None:
                    named.__cause__ = exc
            if isinstance(named, (OutOfFileDescriptorsError, FileSizeLimitError)):
                raise ResourceLimitError(f"cannot create {what}: {named}") from named
            if isinstance(named, ShmFullError):
                raise SharedMemoryFullError(f"cannot create {what} of {nbytes} bytes in shared "
                                            f"memory: {named}") from named
            if isinstance(exc, ShmError):
                raise SharedMemoryFullError(f"cannot create {what} of {nbytes} bytes in shared "
                                            f"memory: {exc}; {_has()}") from exc
            if isinstance(exc, OSError):
                raise SharedMemoryFullError(f"cannot create {what} of {nbytes} bytes in shared "
                                            f"memory: {exc.strerror or exc}; {_has()}") from exc
        finally:   # this frame is in the raised error's traceback: no cycle through it
            named = None
        raise


def filled_region(what: str, kind: str, size: int, fill: Callable[[Region], None],
                  prefault: bool = True) -> Region:
    """A new region of ``size`` bytes (at least 1) filled by ``fill``: a failure to create
    it is the host's named error (``translated``), a failure while filling it leaves
    nothing behind."""
    with translated(what, size):
        region = Region.create(max(1, size), kind=kind, prefault=prefault)
    try:
        fill(region)
    except BaseException:
        region.close()
        region.unlink()
        raise
    return region


def load_spec_region(region: Region | None, spec: ipu_protocol.LoadSpec,
                     executable: bytes | memoryview) -> Region:
    """The region a LOAD names: ``spec`` encoded (``ipu_protocol.encode_load_spec``, at the
    offset it needs), then ``executable``. ``region`` (the one an earlier LOAD named) is
    rewritten in place, the executable left where it is; when the spec grew past the
    executable's offset, a new region is made and then ``region`` closed and unlinked."""
    if region is not None:
        at = ipu_protocol.decode_load_spec(region.buf).executable_offset
        prefix = ipu_protocol.encode_load_spec(
            dataclasses.replace(spec, executable_offset=at))
        if len(prefix) <= at:
            region.buf[:len(prefix)] = prefix
            return region
    prefix = ipu_protocol.spec_prefix(spec)
    size = len(prefix) + len(executable)

    def fill(made: Region) -> None:
        made.buf[:len(prefix)] = prefix
        made.buf[len(prefix):size] = executable
    made = filled_region("the executable region", "exe", size, fill)
    if region is not None:   # it grew: the old one goes
        region.close()
        region.unlink()
    return made

