"""One read-only copy of a model's constant inputs in shared memory for every session.

Inputs whose value never changes (PopEF tensor data of a Load program's input, a
runner's frozen inputs) are not fed through each replica's ring: a session asks
:func:`shared_constants` for the region that holds their values, made once per
content in this process and kept while any session uses it, and names it in
LOAD. Each IPU process maps it read-only; a tensor no program writes is those
pages (no copy in the replica's device memory), one a program writes is copied
into the replica's own memory each time it is streamed in
(``ipu_emulator.ipu._constants``)::

    ModelRunner (replicas 0..R-1)  --->  Session 0 ... Session R-1
                                             \\          /
                                        SharedConstants (one per content, this process)
                                              |  region /ipuemu_<tag>_<pid>_<token>_cst
                                              v
                     IPU process 0 ... IPU process R-1: mapped read-only

The regions of this process are found by their values' anchor handles and sizes, and
one is taken when its bytes equal the values (compared in chunks: a miss costs only
the fill). Reference counting alone frees the region (sessions hold
the :class:`SharedConstants`, the registry holds it weakly), and its name carries
this process's pid, so a crash of this process leaves it to the IPU processes and
``ipu-emulator cleanup`` like every other region.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import Any, Mapping

import numpy as np

from shm import Region

from ipu_emulator.ipu_protocol import LoadConstant, LoadConstants

from host_runtime.devices import filled_region
from host_runtime.popef.reader import drop_pages

__all__ = ["SharedConstants", "shared_constants", "constants_bytes"]

_log = logging.getLogger(__name__)
_lock = threading.Lock()
_Key = tuple[int, tuple[tuple[str, int], ...]]
_live: dict[_Key, list["weakref.ref[SharedConstants]"]] = {}
_ALIGN = 64
_COMPARE = 1 << 20


def _layout(values: Mapping[str, memoryview]) -> tuple[dict[str, tuple[int, int]], int]:
    """handle -> (offset, nbytes), each value ``_ALIGN``-aligned; and the region's size."""
    at: dict[str, tuple[int, int]] = {}
    end = 0
    for h in sorted(values):
        n = memoryview(values[h]).nbytes
        at[h] = (end, n)
        end += -(-n // _ALIGN) * _ALIGN
    return at, end


def constants_bytes(values: Mapping[str, memoryview]) -> int:
    """Bytes of the region that would hold ``values``."""
    return max(1, _layout(values)[1])


def _bytes(value: Any) -> memoryview:
    view = memoryview(value)
    return view if view.ndim == 1 and view.itemsize == 1 else view.cast("B")


class SharedConstants:
    """A shared-memory region holding the values of some constant inputs (read by IPUs)."""

    def __init__(self, region: Region, key: _Key, at: dict[str, tuple[int, int]]) -> None:
        self._region: Region | None = region
        self._key = key
        self._at = at
        self.name = region.name
        self.size = region.size
        self._finalizer = weakref.finalize(self, _release, region, key)

    def matches(self, values: Mapping[str, memoryview]) -> bool:
        """Whether the region holds exactly these values."""
        region = self._region
        if region is None or set(values) != set(self._at):
            return False
        for h, (off, n) in self._at.items():
            value = _bytes(values[h])
            for a in range(0, n, _COMPARE):   # in chunks: no temporary the size of a value
                b = min(n, a + _COMPARE)
                have = np.frombuffer(region.buf, np.uint8, b - a, off + a)
                chunk = value[a:b]
                same = np.array_equal(have, np.frombuffer(chunk, np.uint8))
                drop_pages(chunk)
                if not same:
                    return False
        return True

    def spec(self) -> LoadConstants:
        """The load spec's ``constants`` (``ipu_emulator.ipu_protocol.LoadSpec``)."""
        return LoadConstants(self.name, tuple(LoadConstant(h, off, n)
                                              for h, (off, n) in sorted(self._at.items())))

    def close(self) -> None:
        """Unmap and unlink now (idempotent); sessions that hold it must not load again."""
        self._region = None
        self._finalizer()


def _release(region: Region, key: _Key) -> None:
    with _lock:
        refs = [r for r in _live.get(key, []) if r() is not None]
        if refs:
            _live[key] = refs
        else:
            _live.pop(key, None)
    region.close()
    region.unlink()


def shared_constants(values: Mapping[str, Any]) -> SharedConstants:
    """The region holding ``values`` (handle -> bytes), made now if this process has none
    of that content. Raises ``SharedMemoryFullError`` if /dev/shm cannot hold them."""
    views = {h: _bytes(v) for h, v in values.items()}
    key: _Key = (os.getpid(), tuple((h, len(v)) for h, v in sorted(views.items())))
    with _lock:
        candidates = [r() for r in _live.get(key, [])]
    for found in candidates:
        if found is not None and found.matches(views):
            return found
    at, size = _layout(views)
    def fill(region: Region) -> None:
        for h, (off, n) in at.items():
            region.buf[off:off + n] = views[h]
            drop_pages(views[h])
    region = filled_region("the constants region", "cst", size, fill, prefault=False)
    made = SharedConstants(region, key, at)
    with _lock:
        _live.setdefault(key, []).append(weakref.ref(made))
    _log.debug("constants %s: %d bytes in %s", sorted(at), size, region.name)
    return made
