"""Tensor memory types: numpy 2 view/copy semantics the seeds' listings rely on."""

from __future__ import annotations

import numpy as np
import pytest

from host_runtime.errors import BadRequestError
from host_runtime.memory._views import (ConstTensorMemoryView, InputMemoryView, OutputMemoryView,
                                 PopefPaths, TensorMemory, TensorMemoryView)


def test_tensor_memory_allocates_zeroed_bytes_and_copies_on_numpy():
    tm = TensorMemory(16)
    assert tm.data_size_bytes == 16 and tm.dtype == np.uint8
    assert not tm.any()
    copy = tm.numpy()
    assert type(copy) is np.ndarray and not np.shares_memory(copy, tm)


def test_runner_allocated_result_semantics_match_listing():
    src = np.arange(8, dtype=np.float32).reshape(2, 4)
    tm = TensorMemory.allocate((2, 4), np.float32)
    tm[...] = src
    # np.frombuffer on the result works and gives the values
    np.testing.assert_array_equal(np.frombuffer(tm, dtype=np.float32).reshape(2, 4), src)
    tensor = tm.numpy()
    tensor_copy = np.array(tm, copy=True)
    tensor_view = np.array(tm, copy=False)
    assert np.shares_memory(tensor_view, tm)
    assert not np.shares_memory(tensor_view, tensor_copy)
    assert not np.shares_memory(tensor, tensor_copy)
    assert not np.shares_memory(tensor, tensor_view)
    np.testing.assert_array_equal(tensor_view, src)


def test_user_allocated_view_shares_memory():
    user = np.zeros((1, 4), dtype=np.float32)
    v = TensorMemoryView(user)
    tensor = v.numpy()
    assert np.shares_memory(user, tensor)
    assert np.shares_memory(user, np.array(v, copy=False))
    assert not np.shares_memory(user, np.array(v, copy=True))
    v[0, 1] = 5.0
    assert user[0, 1] == 5.0


def test_const_view_is_read_only_and_sized():
    data = bytearray(b"abcdefgh")
    c = ConstTensorMemoryView(data, 4)
    assert c.data_size_bytes == 4
    assert bytes(c) == b"abcd"
    with pytest.raises(ValueError):
        c[0] = 1
    with pytest.raises(BadRequestError, match="between 0 and the buffer's 8 bytes, got 9"):
        ConstTensorMemoryView(data, 9)


def test_tensor_memory_view_refuses_read_only_memory():
    with pytest.raises(BadRequestError, match="writable"):
        TensorMemoryView(b"1234")
    ro = np.zeros(4)
    ro.flags.writeable = False
    with pytest.raises(BadRequestError, match="writable"):
        TensorMemoryView(ro)


def test_input_memory_view_keeps_references_without_copy():
    a = np.ones(4, dtype=np.float32)
    view = InputMemoryView()
    view["a"] = a
    view["b"] = b"\x00" * 8
    assert view["a"] is a
    assert view["b"].dtype == np.uint8 and view["b"].nbytes == 8
    with pytest.raises(BadRequestError, match="input 'c'.*got object"):
        view["c"] = object()


def test_output_memory_view_needs_writable_memory():
    out = OutputMemoryView()
    arr = np.zeros(3)
    out["x"] = arr
    assert out["x"] is arr
    with pytest.raises(BadRequestError, match="output 'y': expected writable memory"):
        ro = np.zeros(3)
        ro.flags.writeable = False
        out["y"] = ro


def test_popef_paths_accepts_one_or_many():
    assert PopefPaths("a.popef") == ["a.popef"]
    assert PopefPaths(["a", "b"]) == ["a", "b"]
