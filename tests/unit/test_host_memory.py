"""The IPU side of shared host memory: resolving TAG_SHARED descriptors."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from host_runtime.memory._shared import empty_shared, shared_location
from ipu_emulator.ipu._host_memory import HostMemory, HostMemoryError
from ipu_emulator.ipu_protocol import HOST_MEMORY, host_memory_descriptor
from shm import naming


def _descriptor(name: str, offset: int, nbytes: int, outputs=()) -> memoryview:
    return memoryview(host_memory_descriptor(name, offset, nbytes, list(outputs)))


def test_resolves_to_the_hosts_bytes_and_sweeps_freed_regions():
    arr = empty_shared((8, 8), np.float32)
    arr[...] = np.arange(64).reshape(8, 8)
    name, offset = shared_location(arr[2:])
    mem = HostMemory()
    try:
        view, outputs = mem.resolve(_descriptor(name, offset, 6 * 8 * 4), 6 * 8 * 4)
        assert outputs == ()
        np.testing.assert_array_equal(np.frombuffer(view, np.float32), arr[2:].reshape(-1))
        arr[3, 0] = -1.0                     # the same memory, not a copy
        assert np.frombuffer(view, np.float32)[8] == -1.0
        del view
        del arr
        gc.collect()
        mem.sweep()
        assert not mem._regions
    finally:
        mem.close()


def test_bad_descriptors_say_what_is_wrong():
    arr = empty_shared((16,), np.uint8)
    name, _ = shared_location(arr)
    mem = HostMemory()
    try:
        with pytest.raises(HostMemoryError, match="the host sent 8 bytes, one transfer is 16"):
            mem.resolve(_descriptor(name, 0, 8), 16)
        with pytest.raises(HostMemoryError, match=r"bytes 4096\.\.4112 are outside the region"):
            mem.resolve(_descriptor(name, 4096, 16), 16)
        with pytest.raises(HostMemoryError, match="does not name host memory of this emulator"):
            mem.resolve(_descriptor("/etc_passwd", 0, 16), 16)
        with pytest.raises(HostMemoryError, match="too short"):
            mem.resolve(memoryview(b"\0" * (HOST_MEMORY.size - 1)), 16)
        with pytest.raises(HostMemoryError, match="ends inside its outputs"):
            mem.resolve(memoryview(_truncated(name)), 16)
        gone = naming.new_name("hostmem")      # well-formed, never created
        with pytest.raises(HostMemoryError, match=f"host memory {gone} is gone"):
            mem.resolve(_descriptor(gone, 0, 16), 16)
    finally:
        mem.close()


def _truncated(name: str) -> bytes:
    """A descriptor announcing one output redirection and stopping before it."""
    return host_memory_descriptor(name, 0, 16, [("out", name, 0, 16)])[:-20]


def test_output_redirections_resolve_to_host_memory():
    src, dst = empty_shared((4,), np.float32), empty_shared((2, 4), np.float32)
    (s_name, s_off), (d_name, d_off) = shared_location(src), shared_location(dst[1])
    mem = HostMemory()
    try:
        view, outputs = mem.resolve(_descriptor(s_name, s_off, 16, [("C", d_name, d_off, 16)]), 16)
        assert [h for h, _ in outputs] == ["C"]
        np.frombuffer(outputs[0][1], np.float32)[:] = [1, 2, 3, 4]
        np.testing.assert_array_equal(dst[1], [1, 2, 3, 4])
        with pytest.raises(HostMemoryError, match="has 3 bytes after its end"):
            mem.resolve(memoryview(_descriptor(s_name, s_off, 16).tobytes() + b"xyz"), 16)
    finally:
        mem.close()
