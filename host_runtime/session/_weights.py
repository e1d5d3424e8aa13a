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

import numpy as np

from shm import Region, limits

from host_runtime.devices import filled_region, free_bytes
from host_runtime.errors import SharedMemoryFullError
from host_runtime.popef.reader import drop_pages, file_span
from host_runtime import popef
from ipu_emulator.executable import ExecutableError, read_header, weights_span

__all__ = ["SharedWeights", "shared_weights", "is_shared", "live_weights", "check_fits",
           "check_model_fits"]

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
    this process has none of that content. Raises ``SharedMemoryFullError`` if /dev/shm
    cannot hold them."""
    view = memoryview(exe)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    header = read_header(view)
    key = (os.getpid(), header.body_crc32, len(view), start, length)
    weights = view[start:start + length]
    with _lock:
        ref = _live.get(key)
        found = ref() if ref is not None else None
    if found is not None and found.matches(exe, weights):
        return found
    region = filled_region("the weights region", "wts", length,
                           lambda r: _fill(r, view, start, length), prefault=False)
    made = SharedWeights(region, key, exe)
    with _lock:
        if found is None:   # a checksum twin keeps its own region (and its registry place)
            _live[key] = weakref.ref(made)
    _log.debug("weights of %r: %d bytes in %s", header.name, length, region.name)
    return made


def is_shared(exe: bytes | memoryview, start: int, length: int) -> bool:
    """Whether this process holds a region of these weights already (by their key)."""
    header = read_header(exe)
    key = (os.getpid(), header.body_crc32, len(exe), start, length)
    with _lock:
        ref = _live.get(key)
    return ref is not None and ref() is not None


def _fill(region: Region, view: memoryview, start: int, length: int) -> None:
    """Copy the section in chunks, letting a PopEF file's mapping go behind (the IPU
    process checks the executable's body checksum over what it is given: bytes of a file
    changed since it was read are refused there)."""
    dest = region.buf
    for a in range(0, length, _CHUNK):
        b = min(length, a + _CHUNK)
        chunk = view[start + a:start + b]
        dest[a:b] = chunk
        drop_pages(chunk)


def live_weights() -> list[tuple[str, int]]:
    """``(region name, bytes)`` of every weights region this process holds (diagnostics)."""
    with _lock:
        refs = list(_live.values())
    return [(w.name, w.size) for w in (r() for r in refs) if w is not None]


def check_fits(name: str, weights: int, per_replica: int, replicas: int, prepack: bool,
               held: bool = False) -> None:
    """Refuse, before anything is made, ``replicas`` replicas of a model that /dev/shm or
    memory cannot hold: ``weights`` bytes of weights once in /dev/shm (unless ``held``
    already), ``per_replica`` bytes of /dev/shm per replica (executable, device memory),
    and with ``prepack`` the weights once more in each IPU process (``held``: the weights
    need no room in /dev/shm: the IPU processes read them from a file). Raises
    ``SharedMemoryFullError`` saying how much is needed and how much there is."""
    shm = (0 if held else weights) + replicas * per_replica
    ram = shm + (replicas * weights if prepack else 0)
    room = free_bytes()
    mib = 1 << 20
    if room is not None and shm > room[0]:
        raise SharedMemoryFullError(
            f"model {name!r} with {replicas} replica(s) needs {shm} bytes "
            f"({shm / mib:.1f} MiB) of shared memory ({0 if held else weights} bytes of "
            f"weights once, "
            f"{per_replica} bytes per replica), but /dev/shm has {room[0]} bytes "
            f"({room[0] / mib:.1f} MiB) free of {room[1]}; enlarge /dev/shm "
            "(docker run --shm-size=...) or use fewer replicas")
    available = limits.memory_available()
    if ram > available:
        raise SharedMemoryFullError(
            f"model {name!r} with {replicas} replica(s) needs {ram} bytes "
            f"({ram / mib:.1f} MiB) of memory ({weights} bytes of weights in shared memory"
            + (f" and in each IPU process, prepacked" if prepack else "")
            + f", {per_replica} bytes per replica), but {available} bytes "
            f"({available / mib:.1f} MiB) are available; use fewer replicas"
            + (" or IPU_EMULATOR_PREPACK=0 (one shared copy of the weights)"
               if prepack else ""))


def check_model_fits(model: popef.Model, replicas: int, prepack: bool) -> None:
    """``check_fits`` for ``replicas`` replicas of ``model`` (nothing for a model without a
    weights section, a multi-IPU executable, nor one that cannot be decoded: its session
    reports that)."""
    exe = model.executable.payload()
    try:
        header = read_header(exe)
        start, length = weights_span(exe) if header.num_ipus == 1 else (len(exe), 0)
    except ExecutableError:
        return
    if not length:   # its rings and regions are checked when the session makes them
        return
    # with prepacking, IPU processes read the weights from a PopEF file the host mapped
    via_file = prepack and isinstance(exe, memoryview) and file_span(exe[start:]) is not None
    check_fits(header.name, length, start + max(64, header.memory_bytes), replicas,
               prepack, held=via_file)
