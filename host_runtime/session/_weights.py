"""One read-only copy of a model's weights in shared memory for every session of a process.

An executable keeps its graphs' large initializers in its weights section
(``ipu_emulator.executable``). A session does not copy that section into its
own executable region: it asks :func:`shared_weights` for the region that holds
it, which is made once per content and kept while any session uses it::

    ModelRunner (replicas 0..R-1)  --->  Session 0 ... Session R-1
                                             \\          /
                                        SharedWeights (one per content, this process)
                                              |  region /ipuemu_<tag>_<pid>_<token>_wts
                                              v
                     IPU process 0 ... IPU process R-1: mapped read-only, given to
                     onnxruntime where it lies (no copy)

The content key is the executable header's body checksum, its length and the
section's span; a hit is confirmed by comparing the bytes (a checksum match of
different weights gets a region of its own). Reference counting alone frees the
region: sessions hold the :class:`SharedWeights`, the registry holds it weakly,
and the last reference dropped (or :meth:`SharedWeights.close`) unmaps and
unlinks it. The name carries this process's pid, so a crash of this process
leaves it to the IPU processes and ``ipu-emulator cleanup`` like every other
region; an IPU process that still maps a region unlinked here keeps its pages
until it lets go of them.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
import zlib

import numpy as np

from shm import Region

from host_runtime.devices import translated
from host_runtime.errors import PopefError
from host_runtime.popef.reader import drop_pages
from ipu_emulator.executable import read_header

__all__ = ["SharedWeights", "shared_weights", "live_weights"]

_log = logging.getLogger(__name__)
_lock = threading.Lock()
_live: dict[tuple[int, int, int, int, int], "weakref.ref[SharedWeights]"] = {}
_CHUNK = 8 << 20


class SharedWeights:
    """A shared-memory region holding one executable's weights section (read by IPUs)."""

    def __init__(self, region: Region, key: tuple[int, int, int, int, int],
                 source: object) -> None:
        self._region: Region | None = region
        self._source = source   # the bytes it was filled from (a session holds them anyway)
        self._key = key
        self.name = region.name
        self.size = region.size
        self._finalizer = weakref.finalize(self, _release, region, key)

    def matches(self, source: object, weights: memoryview) -> bool:
        """Whether the region holds exactly these bytes (of ``source``)."""
        region = self._region
        if region is None or len(weights) > region.size:
            return False
        if source is self._source:
            return True
        have = np.frombuffer(region.buf, np.uint8, len(weights))
        return bool(np.array_equal(have, np.frombuffer(weights, np.uint8)))

    def close(self) -> None:
        """Unmap and unlink now (idempotent); sessions that hold it must not load again."""
        self._region = None
        self._finalizer()


def _release(region: Region, key: tuple[int, int, int, int, int]) -> None:
    with _lock:
        ref = _live.get(key)
        if ref is not None and ref() is None:
            del _live[key]
    region.close()
    region.unlink()


def shared_weights(exe: bytes | memoryview, start: int, length: int) -> SharedWeights:
    """The region holding ``exe[start:start + length]`` (the weights section), made now if
    this process has none of that content. Raises ``PopefError`` if the bytes no longer
    match the executable's checksum (a PopEF file changed under a model read from it),
    ``SharedMemoryFullError`` if /dev/shm cannot hold them."""
    view = memoryview(exe)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    header = read_header(view)
    key = (os.getpid(), int(header["body_crc32"]), len(view), start, length)
    weights = view[start:start + length]
    with _lock:
        ref = _live.get(key)
        found = ref() if ref is not None else None
    if found is not None and found.matches(exe, weights):
        return found
    with translated("the weights region", length):
        region = Region.create(max(1, length), kind="wts", prefault=False)
    try:
        _fill(region, view, start, length, int(header["body_crc32"]), header["name"])
    except BaseException:
        region.close()
        region.unlink()
        raise
    made = SharedWeights(region, key, exe)
    with _lock:
        if found is None:   # a checksum twin keeps its own region (and its registry place)
            _live[key] = weakref.ref(made)
    _log.debug("weights of %r: %d bytes in %s", header["name"], length, region.name)
    return made


def _fill(region: Region, view: memoryview, start: int, length: int, crc_want: int,
          name: str) -> None:
    """Copy the section in chunks, checking the executable's body checksum on the way (the
    bytes are read once more from a PopEF file's mapping: it must not have changed)."""
    from ipu_emulator.executable import HEADER_SIZE

    crc = zlib.crc32(view[HEADER_SIZE:start])
    dest = region.buf
    for a in range(0, length, _CHUNK):
        b = min(length, a + _CHUNK)
        chunk = view[start + a:start + b]
        dest[a:b] = chunk
        drop_pages(chunk)   # a PopEF file's mapping: read once more, let go again
        crc = zlib.crc32(dest[a:b], crc)
    if start + length != len(view):
        crc = zlib.crc32(view[start + length:], crc)
    if crc != crc_want:
        raise PopefError(f"executable {name!r}: its bytes no longer match their checksum "
                         f"(computed {crc:#010x}, header {crc_want:#010x}): was the PopEF "
                         "file changed after it was read? Load it again")


def live_weights() -> list[tuple[str, int]]:
    """``(region name, bytes)`` of every weights region this process holds (diagnostics)."""
    with _lock:
        refs = list(_live.values())
    return [(w.name, w.size) for w in (r() for r in refs) if w is not None]
