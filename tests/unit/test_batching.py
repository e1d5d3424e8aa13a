"""TensorSpec validation and sample copying (no processes)."""

from __future__ import annotations

import numpy as np
import pytest

from host_runtime.runner._batching import TensorSpec, batch_of, copy_samples
from host_runtime.errors import BadRequestError


def spec(shape=(4, 2), dynamic=False, batch_dim=0, dtype=np.float32):
    return TensorSpec("x", "x", tuple(shape), np.dtype(dtype), True, batch_dim, dynamic)


def test_fixed_batch_accepts_multiples_only():
    s = spec()
    assert s.batch == 4 and s.nbytes == 32 and s.sample_nbytes == 8
    assert s.samples_of(np.zeros((8, 2), np.float32)) == 8
    with pytest.raises(BadRequestError,
                       match=r"input 'x': expected shape \[N\*4, 2\] \(N >= 1\), got shape \[3, 2\]"):
        s.samples_of(np.zeros((3, 2), np.float32))


def test_dtype_mismatch_names_both():
    with pytest.raises(BadRequestError, match="input 'x': expected dtype float32, got float64"):
        spec().samples_of(np.zeros((4, 2)))


def test_dynamic_batch_any_count_on_dim_1():
    s = spec(shape=(3, 4, 2), dynamic=True, batch_dim=1)
    assert s.samples_of(np.zeros((3, 7, 2), np.float32)) == 7
    with pytest.raises(BadRequestError, match=r"expected shape \[3, N, 2\] \(any N >= 1 on dimension 1\)"):
        s.samples_of(np.zeros((2, 7, 2), np.float32))


def test_raw_bytes_checked_by_size():
    s = spec()
    assert s.samples_of(np.zeros(64, np.uint8)) == 8
    with pytest.raises(BadRequestError, match="expected a multiple of 32 bytes \\(one transfer"):
        s.samples_of(np.zeros(40, np.uint8))
    d = spec(dynamic=True)
    assert d.samples_of(np.zeros(24, np.uint8)) == 3
    scalar = spec(shape=(), batch_dim=None)
    assert scalar.samples_of(np.zeros(4, np.uint8)) == 1
    with pytest.raises(BadRequestError, match="expected 4 bytes"):
        scalar.samples_of(np.zeros(8, np.uint8))


def test_typed_view_does_not_copy():
    s = spec()
    raw = np.arange(64, dtype=np.uint8)
    t = s.typed(raw, 8)
    assert t.shape == (8, 2) and t.dtype == np.float32 and np.shares_memory(t, raw)


def test_copy_samples_along_dim_1():
    s = spec(shape=(2, 4), dynamic=True, batch_dim=1)
    slot = np.zeros((2, 4), np.float32)
    src = np.arange(6, dtype=np.float32).reshape(2, 3)
    copy_samples(slot, 1, src, 0, 3, s)
    np.testing.assert_array_equal(slot, [[0, 0, 1, 2], [0, 3, 4, 5]])


def test_batch_of_reports_disagreement():
    assert batch_of({"a": 4, "b": 4}) == 4
    with pytest.raises(BadRequestError, match="disagree on the batch size: a has 4, b has 8"):
        batch_of({"a": 4, "b": 8})
