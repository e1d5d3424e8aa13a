"""Whether an executable fits a device: one check, made by the host before it sends a
LOAD and by the IPU process when it builds the executable, with the same words."""

from __future__ import annotations

from ipu_emulator.ipu_protocol import ErrorKind

__all__ = ["misfit"]


def misfit(name: str, ipu_version: int, need: int, num_ipus: int | None, *, device: str,
           device_version: int, device_ipus: int, tiles_per_ipu: int, memory_per_tile: int
           ) -> tuple[ErrorKind, str] | None:
    """Why executable ``name`` (compiled for ``ipu_version``, needing ``need`` bytes of
    device memory and ``num_ipus`` IPUs) cannot run on ``device`` (its description), as
    (ErrorKind, message); None if it fits. Checked in this order: IPU version, memory,
    IPU count (``num_ipus`` None: not checked; the host says it where it shards)."""
    if ipu_version != device_version:
        return ErrorKind.REQUEST, (f"executable {name!r} was compiled for ipu{ipu_version}, "
                                   f"but {device} is ipu{device_version}")
    capacity = device_ipus * tiles_per_ipu * memory_per_tile
    if need > capacity:
        return ErrorKind.MEMORY, (
            f"executable {name!r} needs {need} bytes of device memory, but {device} has "
            f"{device_ipus} IPU(s) x {tiles_per_ipu} tiles x {memory_per_tile} bytes per "
            f"tile = {capacity} bytes")
    if num_ipus is not None and num_ipus > device_ipus:
        return ErrorKind.REQUEST, (f"executable {name!r} needs {num_ipus} IPUs, but {device} "
                                   f"has {device_ipus}")
    return None
