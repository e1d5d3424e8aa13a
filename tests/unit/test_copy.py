"""Large transfer copies split across two threads (host_runtime._copy)."""

from __future__ import annotations

import numpy as np
import pytest

from host_runtime._copy import PARALLEL_MIN_BYTES, copy_bytes


@pytest.mark.parametrize("n", [0, 1, 4095, PARALLEL_MIN_BYTES - 1, PARALLEL_MIN_BYTES,
                               PARALLEL_MIN_BYTES + 4097, 3 * PARALLEL_MIN_BYTES + 12345])
def test_every_byte_arrives(n):
    src = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    dst = np.zeros(n + 16, np.uint8)
    copy_bytes(memoryview(dst)[8:8 + n], memoryview(src))
    np.testing.assert_array_equal(dst[8:8 + n], src)
    assert not dst[:8].any() and not dst[8 + n:].any()   # nothing outside the window
