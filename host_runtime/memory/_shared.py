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

An array belongs to the process that made it. A process forked from it shares the
array's pages with its parent (a write in one is seen by the other, and by the
parent's IPUs): there the array is no longer shared memory of this process
(``is_shared`` is False), passing it to a runner raises ForkedProcessError
(``check_owned``), and the child's exit or its dropping the array never unlinks the
parent's region.
"""

from __future__ import annotations

import bisect
import math
import os
import threading
import weakref
from typing import Any, Optional

import numpy as np

from shm import (FileSizeLimitError, OutOfFileDescriptorsError, Region, ShmFullError,
                 buffer_address as _address)

from host_runtime._fork import current_pid, forked_error
from host_runtime.errors import ResourceLimitError, SharedMemoryFullError

__all__ = ["empty_shared", "is_shared", "shared_location", "check_owned", "SHARED_MIN_BYTES"]

SHARED_MIN_BYTES = 4096
"""Smaller inputs are copied: a copy is then cheaper than the IPU's look-up."""


_lock = threading.Lock()
# Live regions, sorted by base address: (bases, [(base, end, name)]), replaced whole.
_table: tuple[list[int], list[tuple[int, int, str]]] = ([], [])
# In a forked child: the regions of arrays its parent (or an earlier ancestor) made,
# (base, end, name, creator pid). Empty in a process that never forked with arrays alive.
_inherited: list[tuple[int, int, str, int]] = []
_creator = current_pid()   # of the entries of _table


def _after_fork_in_child() -> None:
    global _lock, _table, _inherited, _creator
    _lock = threading.Lock()   # a thread of the parent may have held it at the fork
    _inherited = [*_inherited, *((b, e, n, _creator) for b, e, n in _table[1])]
    _table = ([], [])
    _creator = current_pid()


os.register_at_fork(after_in_child=_after_fork_in_child)


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
    try:
        region = Region.create(max(nbytes, 1), kind="hostmem")
    except (OutOfFileDescriptorsError, FileSizeLimitError) as exc:
        raise ResourceLimitError(f"cannot create an empty_shared array of {nbytes} bytes: "
                                 f"{exc}") from exc
    except ShmFullError as exc:
        raise SharedMemoryFullError(f"cannot create an empty_shared array of {nbytes} bytes: "
                                    f"{exc}") from exc
    arr = region.ndarray(dt, shp)
    base = _address(region.buf)
    _add(base, base + region.size, region.name)
    weakref.finalize(arr, _free, base, region, os.getpid())
    return arr


def is_shared(arr: Any) -> bool:
    """True if ``arr`` lies wholly in memory from :func:`empty_shared` and is C-contiguous."""
    return isinstance(arr, np.ndarray) and shared_location(arr) is not None


def shared_location(arr: np.ndarray) -> Optional[tuple[str, int]]:
    """(region name, byte offset) of ``arr``'s data, or None if it is not shared memory
    of this process (an array the parent of a forked process made is not)."""
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


def check_owned(*groups: Any) -> None:
    """For the other packages of host_runtime (a runner's request): ForkedProcessError if
    an array of ``groups`` (mappings of name to array, sequences of arrays, or None) lies in
    an empty_shared array that the parent of this forked process made. Free (one test of an
    empty list) in a process that inherited none."""
    if not _inherited:
        return
    for group in groups:
        if group is None:
            continue
        values = group.values() if hasattr(group, "values") else group
        for v in values:
            if not isinstance(v, np.ndarray) or v.nbytes == 0:
                continue
            addr = int(v.__array_interface__["data"][0])
            for base, end, name, creator in _inherited:
                if base <= addr < end:
                    raise forked_error(f"the empty_shared array in {name}", creator)


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
    global _table, _inherited
    with _lock:
        entries = [e for e in _table[1] if e[0] != base]
        _table = ([e[0] for e in entries], entries)
        if _inherited:
            _inherited = [e for e in _inherited if e[0] != base]
    region.close()
    if os.getpid() == creator:
        region.unlink()
