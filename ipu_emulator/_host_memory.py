"""Host memory an IPU process reads in place (the emulated DMA of input transfers).

A host may allocate input tensors in shared memory (``host_runtime.empty_shared``).
It then sends such an input as a TAG_SHARED descriptor (see
:data:`ipu_emulator.protocol.HOST_MEMORY`) instead of copying it into the stream
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

from ipu_emulator.protocol import HOST_MEMORY

__all__ = ["HostMemory", "HostMemoryError"]

_log = logging.getLogger(__name__)

_MAX = 64
"""Most host regions kept mapped by one IPU process."""


class HostMemoryError(Exception):
    """A TAG_SHARED descriptor that cannot be resolved (the message says why)."""


class HostMemory:
    """The host regions this IPU process has mapped, by name."""

    def __init__(self) -> None:
        self._regions: collections.OrderedDict[str, Region] = collections.OrderedDict()

    def resolve(self, descriptor: memoryview, nbytes: int) -> memoryview:
        """The ``nbytes`` of host memory that ``descriptor`` (a slot's payload) points to."""
        if len(descriptor) <= HOST_MEMORY.size:
            raise HostMemoryError(f"a shared-memory descriptor of {len(descriptor)} bytes is "
                                  f"too short (at least {HOST_MEMORY.size + 1} expected)")
        offset, size = HOST_MEMORY.unpack_from(descriptor)
        name = bytes(descriptor[HOST_MEMORY.size:]).decode("ascii", "replace")
        if size != nbytes:
            raise HostMemoryError(f"host memory {name}: the host sent {size} bytes, one "
                                  f"transfer is {nbytes} bytes")
        region = self._regions.get(name)
        if region is None:
            region = self._attach(name)
        else:
            self._regions.move_to_end(name)
        if offset < 0 or offset + size > region.size:
            raise HostMemoryError(f"host memory {name}: bytes {offset}..{offset + size} are "
                                  f"outside the region of {region.size} bytes")
        return region.buf[offset:offset + size]

    def _attach(self, name: str) -> Region:
        parsed = naming.parse_name(name)
        if parsed is None or parsed.kind != "hostmem":
            raise HostMemoryError(f"{name!r} does not name host memory of this emulator")
        self.sweep()
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
            self._regions.pop(name).close()
            _log.debug("unmapped host memory %s (freed by the host)", name)

    def close(self) -> None:
        for region in self._regions.values():
            region.close()
        self._regions.clear()
