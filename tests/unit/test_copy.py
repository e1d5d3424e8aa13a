"""Large transfer copies shared with a helper thread (shm.copy)."""

from __future__ import annotations

import numpy as np
import pytest

from shm.copy import PARALLEL_MIN_BYTES, copy_bytes
from tests._helpers import finish


@pytest.mark.parametrize("n", [0, 1, 4095, PARALLEL_MIN_BYTES - 1, PARALLEL_MIN_BYTES,
                               PARALLEL_MIN_BYTES + 4097, 3 * PARALLEL_MIN_BYTES + 12345])
@pytest.mark.parametrize("streamed", [True, False], ids=["stream_copy", "numpy"])
def test_every_byte_arrives(n, streamed, monkeypatch):
    if not streamed:   # as built without the C core
        monkeypatch.setattr("shm.copy._stream", None)
    src = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    dst = np.zeros(n + 16, np.uint8)
    copy_bytes(memoryview(dst)[8:8 + n], memoryview(src))
    np.testing.assert_array_equal(dst[8:8 + n], src)
    assert not dst[:8].any() and not dst[8 + n:].any()   # nothing outside the window


def _copy_in_child() -> None:
    import os

    n = PARALLEL_MIN_BYTES + 3
    src = np.arange(n, dtype=np.uint8)
    dst = np.zeros(n, np.uint8)
    copy_bytes(memoryview(dst), memoryview(src))
    os._exit(0 if np.array_equal(dst, src) else 3)


def test_a_forked_child_copies_with_its_own_helper_thread():
    import multiprocessing as mp

    n = PARALLEL_MIN_BYTES
    copy_bytes(memoryview(np.zeros(n, np.uint8)), memoryview(np.ones(n, np.uint8)))  # helper up
    child = mp.get_context("fork").Process(target=_copy_in_child)
    child.start()
    finish(child, 30)


def test_the_caller_does_not_wait_for_a_helper_that_is_not_running():
    """The helper thread is held up (here: by a job whose lock the test holds): the caller
    takes every chunk itself and returns, without waiting for the helper to start."""
    import threading

    from shm import copy as _copy

    jobs = _copy._helper()
    n = 2 * PARALLEL_MIN_BYTES + 5
    blocker = _copy._Job(np.zeros(1, np.uint8), np.zeros(1, np.uint8))
    blocker.lock.acquire()
    jobs.put(blocker)                  # the helper takes it and blocks on its lock
    try:
        src = np.random.default_rng(5).integers(0, 256, n, dtype=np.uint8)
        dst = np.zeros(n, np.uint8)
        done = threading.Event()
        caller = threading.Thread(target=lambda: (copy_bytes(memoryview(dst), memoryview(src)),
                                                  done.set()))
        caller.start()
        assert done.wait(30), "copy_bytes waited for the held-up helper"
        caller.join()
        np.testing.assert_array_equal(dst, src)
    finally:
        blocker.lock.release()
    # the helper is free again and shares the next copy
    dst2 = np.zeros(n, np.uint8)
    copy_bytes(memoryview(dst2), memoryview(src))
    np.testing.assert_array_equal(dst2, src)


_stream = pytest.importorskip("shm._ringcore").stream_copy


@pytest.mark.parametrize("start,stop", [(0, 0), (0, 1), (3, 70), (1, 4095), (0, 4096),
                                        (17, 199999), (5, 200000 - 7)])
def test_stream_copy_writes_exactly_its_window(start, stop):
    """Non-temporal stores from any alignment: the window arrives, nothing around it."""
    n = 200000
    src = np.random.default_rng(stop).integers(0, 256, n, dtype=np.uint8)
    dst = np.zeros(n, np.uint8)
    _stream(dst, src, start, stop)
    np.testing.assert_array_equal(dst[start:stop], src[start:stop])
    assert not dst[:start].any() and not dst[stop:].any()


def test_stream_copy_refuses_what_it_cannot_copy():
    a, b = np.zeros(8, np.uint8), np.zeros(9, np.uint8)
    with pytest.raises(ValueError, match=r"one length .* got lengths 8 and 9"):
        _stream(a, b, 0, 8)
    with pytest.raises(ValueError, match=r"\[2, 9\)"):
        _stream(a, a.copy(), 2, 9)
    with pytest.raises(ValueError, match=r"\[5, 4\)"):
        _stream(a, a.copy(), 5, 4)
    with pytest.raises(BufferError, match="not writable"):
        _stream(bytes(8), a, 0, 8)
    with pytest.raises(TypeError, match="expected 4 arguments, got 2"):
        _stream(a, a)
