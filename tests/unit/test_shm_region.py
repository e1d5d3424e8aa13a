"""Unit tests of shm.Region (no other processes)."""

from __future__ import annotations

import gc
import os
import stat

import numpy as np
import pytest

import shm
from shm import Region, ShmClosedError, ShmError


def _entry(name: str) -> str:
    return os.path.join("/dev/shm", name.lstrip("/"))


def test_public_surface() -> None:
    assert sorted(shm.__all__) == sorted([
        "ExitWatch", "PeerDiedError", "PeerWatch", "Region", "Ring", "RingInvalidatedError",
        "RingTimeoutError", "ShmClosedError", "ShmError", "ShmForkedError", "PEER_CHECK",
        "WaitInterrupted",
        "WouldBlock", "buffer_address", "naming", "pid_alive", "remove_dead",
        "describe_process", "process_state", "FileSizeLimitError",
        "OutOfFileDescriptorsError", "ShmFullError", "limits"])
    assert issubclass(shm.RingTimeoutError, TimeoutError)
    assert issubclass(shm.OutOfFileDescriptorsError, OSError)
    assert issubclass(shm.FileSizeLimitError, OSError)
    assert issubclass(shm.ShmFullError, MemoryError)
    for cls in (shm.PeerDiedError, shm.RingInvalidatedError, shm.RingTimeoutError,
                shm.ShmClosedError, shm.WouldBlock, shm.OutOfFileDescriptorsError,
                shm.FileSizeLimitError, shm.ShmFullError):
        assert issubclass(cls, ShmError)
    assert issubclass(shm.ShmForkedError, shm.ShmClosedError)


def test_create_mode_0600_name_and_zero_fill() -> None:
    old = os.umask(0)
    try:
        region = Region.create(10000, kind="mem")
    finally:
        os.umask(old)
    with region:
        st = os.stat(_entry(region.name))
        assert stat.S_IMODE(st.st_mode) == 0o600
        parsed = shm.naming.parse_name(region.name)
        assert parsed is not None
        assert (parsed.pid, parsed.kind, parsed.tag) == (os.getpid(), "mem", shm.naming.current_tag())
        assert region.size == 10000 and region.owner
        assert bytes(region.buf[:16]) == bytes(16)
    assert not os.path.exists(_entry(region.name))


def test_attach_shares_bytes_both_ways() -> None:
    with Region.create(4096) as a:
        b = Region.attach(a.name)
        try:
            assert b.size == 4096 and not b.owner
            a.buf[100:105] = b"hello"
            assert bytes(b.buf[100:105]) == b"hello"
            view = b.ndarray(np.int32, (4,), offset=200)
            view[:] = [1, -2, 3, -4]
            np.testing.assert_array_equal(a.ndarray("<i4", 4, offset=200), [1, -2, 3, -4])
        finally:
            b.close()


def test_view_keeps_mapping_alive_after_close_and_unlink() -> None:
    region = Region.create(1 << 16)
    arr = region.ndarray(np.float64, (8, 8), offset=512)
    arr[:] = np.arange(64).reshape(8, 8)
    raw = np.frombuffer(region.buf, np.uint8)  # numpy over .buf holds no export
    region.close()
    region.unlink()
    assert region.closed
    gc.collect()
    # Still mapped: reading and writing must work (a segfault here is the bug).
    np.testing.assert_array_equal(arr, np.arange(64, dtype=np.float64).reshape(8, 8))
    arr[0, 0] = 42.0
    assert raw[512:520].view(np.float64)[0] == 42.0
    del arr, raw
    gc.collect()


def test_closed_region_refuses_use_and_close_unlink_are_idempotent() -> None:
    region = Region.create(4096)
    region.close()
    region.close()
    with pytest.raises(ShmClosedError, match="is closed in this process"):
        region.buf
    with pytest.raises(ShmClosedError):
        region.ndarray(np.uint8, 4)
    region.unlink()
    region.unlink()
    assert not os.path.exists(_entry(region.name))


def test_ndarray_bounds_and_size_are_checked() -> None:
    with Region.create(1024) as region:
        with pytest.raises(ValueError, match=r"view of 1028 bytes .* at offset 0 does not fit "
                                             r"region .* of 1024 bytes"):
            region.ndarray(np.int32, 257)
        with pytest.raises(ValueError, match="at offset 1020"):
            region.ndarray(np.int64, 1, offset=1020)
        assert region.ndarray(np.uint8, (0,)).size == 0
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="positive int"):
            Region.create(bad)  # type: ignore[arg-type]


def test_attach_missing_name_names_it() -> None:
    name = shm.naming.new_name("region")
    with pytest.raises(ShmError, match=f"no shared-memory region named '{name}'"):
        Region.attach(name)


def test_prefault_off_still_works() -> None:
    with Region.create(1 << 20, prefault=False) as region:
        region.buf[-1] = 7
        other = Region.attach(region.name, prefault=False)
        assert other.buf[-1] == 7
        other.close()


def test_region_larger_than_dev_shm_is_refused_up_front() -> None:
    st = os.statvfs("/dev/shm")
    too_big = st.f_bavail * st.f_frsize + (1 << 30)
    with pytest.raises(shm.ShmFullError, match=rf"^/dev/shm full creating a shared-memory "
                       rf"region of {too_big} bytes: {too_big} bytes needed, /dev/shm has "
                       r"\d+ bytes free of \d+; free it \(ipu-emulator cleanup"):
        Region.create(too_big, prefault=False)


def test_only_a_large_prefaulted_region_is_checked_against_available_memory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # pre-faulting a region larger than the memory left would bring in the OOM killer:
    # refused, naming it; a small one (rings, specs) is not worth reading /proc/meminfo for
    from shm import limits
    from shm.errors import ShmFullError

    asked: list[int] = []

    def none_left() -> int:
        asked.append(1)
        return 0
    monkeypatch.setattr(limits, "memory_available", none_left)
    small = Region.create(4096)
    small.close()
    small.unlink()
    assert asked == []
    with pytest.raises(ShmFullError, match=r"region of 2097152 bytes: only 0 bytes of memory"):
        Region.create(2 << 20)
    assert asked == [1]
    big = Region.create(2 << 20, prefault=False)   # not faulted in now: not asked
    big.close()
    big.unlink()
    assert asked == [1]
