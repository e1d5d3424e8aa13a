"""Host memory an IPU process reads in place (the emulated DMA of input transfers).

A host may allocate input tensors in shared memory (``host_runtime.empty_shared``).
It then sends such an input as a TAG_SHARED descriptor (see
:data:`ipu_emulator.ipu_protocol.HOST_MEMORY`) instead of copying it into the stream
ring, and the IPU process resolves the descriptor to a view of that region:
onnxruntime reads the host's array where it is.

Mappings are kept by name, most recently used last, at most ``_MAX`` of them.
The host unlinks a region when its last array dies. An unlinked region stays
mapped here until it is evicted or swept. Each first use of a new name sweeps
the cache, so the memory of freed host arrays is given back at the next new
one at the latest (and when the executable is unloaded).
"""

from __future__ import annotations

import collections
import logging
import os

from shm import Region, ShmError, naming

from ipu_emulator.ipu_protocol import read_host_memory_descriptor
from ipu_emulator.errors import HostMemoryError

__all__ = ["HostMemory", "HostMemoryError"]

_log = logging.getLogger(__name__)

_MAX = 64
"""Most host regions kept mapped by one IPU process."""
_MAX_RESOLVED = 1024
"""Most descriptors remembered (the cache is emptied when full)."""


_Resolved = tuple[memoryview, tuple[tuple[str, memoryview], ...]]
"""An input's host memory, and (output handle, host memory) of each redirected output."""


class HostMemory:
    """The host regions this IPU process has mapped, by name."""

    def __init__(self) -> None:
        self._regions: collections.OrderedDict[str, Region] = collections.OrderedDict()
        # descriptor bytes -> the view it resolved to: a host sends the same few arrays
        # again and again (one look-up instead of ~2 us of parsing and slicing)
        self._resolved: dict[bytes, _Resolved] = {}
        self._writes: frozenset[str] | None = None

    def set_writes(self, handles: frozenset[str] | None) -> None:
        """Only redirections of these output streams are kept (None: all). One IPU of a
        multi-IPU device gets descriptors naming outputs another IPU writes: dropping them
        keeps its iterations in the C step (the host copies what is not redirected)."""
        if handles != self._writes:
            self._writes = handles
            self._resolved.clear()

    @property
    def resolved(self) -> dict[bytes, "_Resolved"]:
        """The cache behind :meth:`resolve` (the same dict for the life of this object),
        for callers that look up before calling."""
        return self._resolved

    def resolve(self, descriptor: memoryview, nbytes: int) -> _Resolved:
        """What ``descriptor`` (a slot's payload) points to: the ``nbytes`` of input and
        the (output handle, view) of each output to write into host memory."""
        key = descriptor.tobytes()
        got = self._resolved.get(key)
        if got is not None and len(got[0]) == nbytes:
            return got
        got = self._resolve(key, nbytes)
        if len(self._resolved) >= _MAX_RESOLVED:
            self._resolved.clear()
        self._resolved[key] = got
        return got

    def _resolve(self, raw: bytes, nbytes: int) -> _Resolved:
        ref = read_host_memory_descriptor(raw)
        if ref.nbytes != nbytes:
            raise HostMemoryError(f"host memory {ref.region}: the host sent {ref.nbytes} bytes, "
                                  f"one transfer is {nbytes} bytes")
        view = self._view(ref.region, ref.offset, ref.nbytes)
        writes = self._writes
        return view, tuple((r.handle, self._view(r.region, r.offset, r.nbytes))
                           for r in ref.redirects if writes is None or r.handle in writes)

    def _view(self, name: str, offset: int, size: int) -> memoryview:
        region = self._regions.get(name)
        if region is None:
            region = self._attach(name)
        else:
            self._regions.move_to_end(name)
        if offset < 0 or size < 0 or offset + size > region.size:
            raise HostMemoryError(f"host memory {name}: bytes {offset}..{offset + size} are "
                                  f"outside the region of {region.size} bytes")
        return region.buf[offset:offset + size]

    def _attach(self, name: str) -> Region:
        parsed = naming.parse_name(name)
        if parsed is None or parsed.kind != "hostmem":
            raise HostMemoryError(f"{name!r} does not name host memory of this emulator")
        self.sweep()
        self._resolved.clear()   # views of regions that may be evicted below
        try:
            region = Region.attach(name)
        except ShmError as exc:
            raise HostMemoryError(f"host memory {name} is gone (was its array freed while a "
                                  f"request used it?): {exc}") from exc
        self._regions[name] = region
        while len(self._regions) > _MAX:
            _, old = self._regions.popitem(last=False)
            old.close()
        return region

    def sweep(self) -> None:
        """Unmap the regions whose names the host has unlinked."""
        for name in [n for n in self._regions
                     if not os.path.exists(os.path.join(naming.SHM_DIR, n.lstrip("/")))]:
            self._resolved.clear()
            self._regions.pop(name).close()
            _log.debug("unmapped host memory %s (freed by the host)", name)

    def close(self) -> None:
        for region in self.detach():
            region.close()

    def detach(self) -> list[Region]:
        """Forget every host region (none is mapped any more as far as this object
        knows); the caller closes them."""
        self._resolved.clear()
        regions = list(self._regions.values())
        self._regions.clear()
        return regions
