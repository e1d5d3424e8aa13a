"""Host memory the emulated IPUs read in place: ``empty_shared``.

An input transfer normally crosses to the IPU process as a copy into a stream
ring slot. An array from :func:`empty_shared` lives in a shared-memory region
instead, so ``ModelRunner.execute``/``executeAsync`` send only where it is (a
small descriptor) and the IPU process runs the model on the array itself: the
emulated counterpart of a device reading pinned host memory by DMA. Use it for
large inputs that are sent many times (fill the array, then run it)::

    a = model_runtime.empty_shared((64, 1024), np.float32)
    a[...] = batch
    runner.executeAsync({"tensor_A": a, ...})

The same rule as for any input applies: the memory must stay valid and
unchanged until the request's result is returned. The region is freed (closed
and unlinked) when the array and every view of it are gone. Arrays of other
origin, non-contiguous views and small tensors (under ``SHARED_MIN_BYTES``)
are copied as usual; requests split into several transfers are copied too.
"""

from __future__ import annotations

import bisect
import math
import os
import threading
import weakref
from typing import Any, Optional

import numpy as np

from shm import Region, buffer_address as _address

__all__ = ["empty_shared", "is_shared", "shared_location", "SHARED_MIN_BYTES"]

SHARED_MIN_BYTES = 4096
"""Smaller inputs are copied: a copy is then cheaper than the IPU's look-up."""


_lock = threading.Lock()
# Live regions, sorted by base address: (bases, [(base, end, name)]), replaced whole.
_table: tuple[list[int], list[tuple[int, int, str]]] = ([], [])


def empty_shared(shape: Any, dtype: Any = np.float32) -> np.ndarray:
    """An uninitialised C-contiguous array in memory the IPU processes read in place."""
    dt = np.dtype(dtype)
    shp = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
    if any(s < 0 for s in shp):
        raise ValueError(f"empty_shared: shape must be non-negative, got {list(shp)}")
    if dt.hasobject:
        raise ValueError(f"empty_shared: dtype {dt} holds Python objects; expected a "
                         "numeric or bool dtype")
    nbytes = math.prod(shp) * dt.itemsize
    region = Region.create(max(nbytes, 1), kind="hostmem")
    arr = region.ndarray(dt, shp)
    base = _address(region.buf)
    _add(base, base + region.size, region.name)
    weakref.finalize(arr, _free, base, region, os.getpid())
    return arr


def is_shared(arr: Any) -> bool:
    """True if ``arr`` lies wholly in memory from :func:`empty_shared` and is C-contiguous."""
    return isinstance(arr, np.ndarray) and shared_location(arr) is not None


def shared_location(arr: np.ndarray) -> Optional[tuple[str, int]]:
    """(region name, byte offset) of ``arr``'s data, or None if it is not shared memory."""
    bases, entries = _table
    if not bases or not arr.flags.c_contiguous:
        return None
    addr = _address(arr)
    i = bisect.bisect_right(bases, addr) - 1
    if i < 0:
        return None
    base, end, name = entries[i]
    if addr + arr.nbytes > end:
        return None
    return name, addr - base


def _add(base: int, end: int, name: str) -> None:
    global _table
    with _lock:
        entries = sorted([*_table[1], (base, end, name)])
        _table = ([e[0] for e in entries], entries)


def _free(base: int, region: Region, creator: int) -> None:
    """The array and all its views are gone: forget, unmap and unlink the region.

    Only the creating process unlinks: a forked child's copies of the array
    going away must not take the name from its parent (and the IPU processes).
    """
    global _table
    with _lock:
        entries = [e for e in _table[1] if e[0] != base]
        _table = ([e[0] for e in entries], entries)
    region.close()
    if os.getpid() == creator:
        region.unlink()
