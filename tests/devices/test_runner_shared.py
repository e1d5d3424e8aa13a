"""Inputs in host shared memory (``empty_shared``): the device reads them in place, on both
kinds of IPU (tests/devices/conftest.py: an IPU process maps the regions, a loopback IPU
maps them a second time in this process)."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

import host_runtime as model_runtime
from host_runtime.memory._shared import SHARED_MIN_BYTES
from shm import naming

SHAPE = (16, 256)     # 16 KiB per float32 tensor: above SHARED_MIN_BYTES


@pytest.fixture(scope="module")
def runner(kind, model_path):
    cfg = model_runtime.ModelRunnerConfig()
    cfg.ring_buffer_size_multiplier = 4
    r = kind.runner(model_path, cfg)
    yield r
    r.close()


def _region_of(arr: np.ndarray) -> str:
    from host_runtime.memory._shared import shared_location

    loc = shared_location(arr)
    assert loc is not None
    return loc[0]


def test_shared_inputs_are_read_in_place_and_give_numpy_results(kind, runner, weights):
    assert SHAPE[0] * SHAPE[1] * 4 >= SHARED_MIN_BYTES
    rng = np.random.default_rng(5)
    a = model_runtime.empty_shared(SHAPE, np.float32)
    b = model_runtime.empty_shared(SHAPE, np.float32)
    assert model_runtime.is_shared(a) and a.flags.c_contiguous and a.shape == SHAPE
    assert kind.maps(_region_of(a)) == kind.maps(_region_of(b)) == 0
    for k in range(3):
        a[...] = rng.standard_normal(SHAPE)
        b[...] = k
        out = runner.execute({"tensor_A": a, "tensor_B": b})["tensor_C"]
        np.testing.assert_allclose(out, a * weights + b, rtol=1e-6)
    # the device side mapped the arrays' regions, once each: it did not get copies
    assert kind.maps(_region_of(a)) == kind.maps(_region_of(b)) == 1


def test_many_shared_requests_in_flight(runner, weights):
    ins = [(model_runtime.empty_shared(SHAPE), model_runtime.empty_shared(SHAPE))
           for _ in range(6)]
    for k, (a, b) in enumerate(ins):
        a[...], b[...] = k, -k
    outs = [np.empty(SHAPE, np.float32) for _ in ins]
    futures = [runner.executeAsync({"tensor_A": a, "tensor_B": b}, {"tensor_C": o})
               for (a, b), o in zip(ins, outs)]
    for f in futures:
        f.wait()
    for (a, b), o in zip(ins, outs):
        np.testing.assert_allclose(o, a * weights + b, rtol=1e-6)


def test_shared_outputs_are_written_in_place_by_the_ipu(kind, runner, weights):
    a, b = model_runtime.empty_shared(SHAPE), model_runtime.empty_shared(SHAPE)
    outs = [model_runtime.empty_shared(SHAPE) for _ in range(3)]
    private = np.zeros(SHAPE, np.float32)
    for k, out in enumerate(outs):
        a[...], b[...] = k + 1, 0.5
        out[...] = np.nan
        runner.execute({"tensor_A": a, "tensor_B": b}, {"tensor_C": out})
        np.testing.assert_allclose(out, a * weights + b, rtol=1e-6)
    assert all(kind.maps(_region_of(o)) == 1 for o in outs)
    # private output memory beside shared inputs: copied back as usual
    runner.execute({"tensor_A": a, "tensor_B": b}, {"tensor_C": private})
    np.testing.assert_allclose(private, a * weights + b, rtol=1e-6)
    # a shared output with private inputs: nothing carries the redirection, copied back
    out = outs[0]
    out[...] = np.nan
    runner.execute({"tensor_A": np.array(a), "tensor_B": np.array(b)}, {"tensor_C": out})
    np.testing.assert_allclose(out, a * weights + b, rtol=1e-6)
    fut = runner.executeAsync({"tensor_A": a, "tensor_B": b}, {"tensor_C": outs[1]})
    assert np.shares_memory(np.array(fut["tensor_C"], copy=False), outs[1])


def test_mixed_and_ineligible_inputs_are_copied_as_usual(runner, weights):
    big = model_runtime.empty_shared((SHAPE[0], 2 * SHAPE[1]))
    big[...] = np.arange(big.size, dtype=np.float32).reshape(big.shape)
    strided = big[:, ::2]                  # in shared memory, but not contiguous
    assert not model_runtime.is_shared(strided)
    b = np.full(SHAPE, 2.0, np.float32)     # private memory
    out = runner.execute({"tensor_A": strided, "tensor_B": b})["tensor_C"]
    np.testing.assert_allclose(out, strided * weights + b, rtol=1e-6)
    rows = big.reshape(-1)[: SHAPE[0] * SHAPE[1]].reshape(SHAPE)   # a contiguous view
    assert model_runtime.is_shared(rows)
    out = runner.execute({"tensor_A": rows, "tensor_B": b})["tensor_C"]
    np.testing.assert_allclose(out, rows * weights + b, rtol=1e-6)
    assert not model_runtime.is_shared(rows * 2) and not model_runtime.is_shared([1.0])


def test_region_is_freed_with_its_last_view():
    a = model_runtime.empty_shared((1024,), np.int32)
    name = _region_of(a)
    path = os.path.join(naming.SHM_DIR, name.lstrip("/"))
    view = a[10:20]
    del a
    gc.collect()
    assert os.path.exists(path)        # a view still uses it
    view[...] = 7
    del view
    gc.collect()
    assert not os.path.exists(path)


@pytest.mark.parametrize("shape,dtype,match", [
    ((-1, 4), np.float32, r"shape must be non-negative, got \[-1, 4\]"),
    ((4,), object, "dtype object holds Python objects"),
])
def test_bad_allocations_are_refused(shape, dtype, match):
    with pytest.raises(ValueError, match=match):
        model_runtime.empty_shared(shape, dtype)


def _big_gather():
    """out = x[idx] with x float[4096], idx int64[2048]: every tensor is shareable."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Gather", ["x", "idx"], ["out"], axis=0)], "big_gather",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4096]),
         helper.make_tensor_value_info("idx", TensorProto.INT64, [2048])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2048])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


@pytest.mark.ipu_kinds("process", reason="the pytest plugin's model_runner attaches IPU processes")
def test_a_failing_iteration_with_shared_memory_then_auto_reset(kind, compile_onnx,
                                                               model_runner):
    """(Through the pytest plugin's compile_onnx and model_runner fixtures.)"""
    from host_runtime.errors import DeviceExecutionError

    path = compile_onnx(_big_gather(), name="big_gather")
    x = model_runtime.empty_shared((4096,), np.float32)
    x[...] = np.arange(4096, dtype=np.float32)
    idx = model_runtime.empty_shared((2048,), np.int64)
    out = model_runtime.empty_shared((2048,), np.float32)
    with model_runner(path, auto_reset=True) as runner:
        idx[...] = np.arange(2048)[::-1]
        runner.execute({"x": x, "idx": idx}, {"out": out})
        np.testing.assert_array_equal(out, x[idx])
        idx[5] = 99999                           # out of bounds: onnxruntime fails
        out[...] = -1.0
        with pytest.raises(DeviceExecutionError, match="onnxruntime"):
            runner.execute({"x": x, "idx": idx}, {"out": out})
        idx[5] = 5
        private = np.zeros(2048, np.float32)
        runner.execute({"x": x, "idx": idx}, {"out": private})   # after the reset
        np.testing.assert_array_equal(private, x[idx])
        runner.execute({"x": x, "idx": idx}, {"out": out})
        np.testing.assert_array_equal(out, x[idx])


def test_a_forked_child_exiting_keeps_the_parents_region_and_runner(runner, weights):
    """A child of fork() that exits normally runs the exit hooks: the array's finalizer
    and the runners' and devices' hooks. The parent's region and runner must survive."""
    a = model_runtime.empty_shared((1024,), np.float32)
    check = model_runtime.empty_shared(SHAPE), model_runtime.empty_shared(SHAPE)
    check[0][...], check[1][...] = 2.0, 1.0
    path = os.path.join(naming.SHM_DIR, _region_of(a).lstrip("/"))
    pid = os.fork()
    if pid == 0:   # the child: exit as an interpreter does, through its exit hooks
        import atexit
        try:
            atexit._run_exitfuncs()
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert os.path.exists(path)      # still the parent's
    out = runner.execute({"tensor_A": check[0], "tensor_B": check[1]})["tensor_C"]
    np.testing.assert_allclose(out, 2.0 * weights + 1.0, rtol=1e-6)   # still running
    del a
    gc.collect()
    assert not os.path.exists(path)
