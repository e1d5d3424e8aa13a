"""ModelRunner on both kinds of IPU (tests/devices/conftest.py): every execution mode of
seeds 000/001, checked with numpy.

One module-scoped runner per kind serves the mode tests (it is healthy after each,
which the bad-input tests also check); tests that need other options make
their own runner (``make_runner``) and close it.
"""

from __future__ import annotations

import numpy as np
import pytest

import host_runtime as model_runtime
from host_runtime import popef
from host_runtime.errors import BadRequestError
from tests._helpers import run_in_threads

from tests.devices._example import SHAPE, check_healthy, pair, rand


@pytest.fixture(scope="module")
def runner(kind, model_path):
    r = kind.runner(model_runtime.PopefPaths([model_path]))
    yield r
    r.close()


# ------------------------------------------------------------------ descriptions
def test_descriptions(runner):
    ins = runner.getExecuteInputs()
    assert [(d.name, d.shape, d.size_in_bytes) for d in ins] == [
        ("tensor_A", [4, 3], 48), ("tensor_B", [4, 3], 48)]
    assert all(d.numpy_data_type() == np.float32 for d in ins)
    assert all(d.data_type == popef.DataType.F32 for d in ins)
    outs = runner.getExecuteOutputs()
    assert [(d.name, d.shape) for d in outs] == [("tensor_C", [4, 3])]
    model_ins = {d.name: d.popef_contains_tensor_data for d in runner.getModelInputs()}
    assert model_ins == {"tensor_A": False, "tensor_B": False, "weights": True}
    assert {d.name for d in runner.getModelOutputs()} == {"tensor_C", "weights_saved"}
    assert runner.config().replication_factor == 1


def test_the_submitting_threads_id_is_left_for_the_ipu_process(runner, weights):
    """The IPU process keeps off the CPU of the host thread that submits requests
    (ipu_emulator.ipu._placement): the replica writes that thread's id into its input rings."""
    import threading

    rings = list(runner._replicas[0].input_rings().values())
    check_healthy(runner, weights)
    assert {r.user_word() for r in rings} == {threading.get_native_id()}
    seen = {}

    def other() -> None:
        check_healthy(runner, weights)
        seen["tid"] = threading.get_native_id()
    worker = threading.Thread(target=other)
    worker.start()
    worker.join()
    assert {r.user_word() for r in rings} == {seen["tid"]} != {threading.get_native_id()}


# ------------------------------------------------------------------ execution modes
def test_sync_input_memory_view_runner_allocated(runner, weights):
    a, b = pair()
    view = model_runtime.InputMemoryView()
    view["tensor_A"] = a
    view["tensor_B"] = b
    result = runner.execute(view)
    assert isinstance(result, model_runtime.OutputMemory)
    tm = result["tensor_C"]
    assert isinstance(tm, model_runtime.TensorMemory) and tm.data_size_bytes == 48
    got = np.frombuffer(result["tensor_C"], dtype=np.float32).reshape(SHAPE)
    np.testing.assert_allclose(got, a * weights + b, rtol=1e-6)


def test_sync_user_allocated_output_view(runner, weights):
    a, b = pair()
    out = np.zeros(SHAPE, np.float32)
    iv = model_runtime.InputMemoryView()
    iv.update(tensor_A=a, tensor_B=b)
    ov = model_runtime.OutputMemoryView()
    ov["tensor_C"] = out
    assert runner.execute(iv, ov) is None
    np.testing.assert_allclose(out, a * weights + b, rtol=1e-6)


def test_async_runner_allocated(runner, weights):
    a, b = pair()
    iv = model_runtime.InputMemoryView()
    iv.update(tensor_A=a, tensor_B=b)
    fut = runner.executeAsync(iv)
    fut.wait()
    assert fut.done() and list(fut) == ["tensor_C"]
    got = np.frombuffer(fut["tensor_C"], dtype=np.float32).reshape(SHAPE)
    np.testing.assert_allclose(got, a * weights + b, rtol=1e-6)


def test_async_user_allocated(runner, weights):
    a, b = pair()
    out = np.zeros(SHAPE, np.float32)
    fut = runner.executeAsync({"tensor_A": a, "tensor_B": b}, {"tensor_C": out})
    fut.wait()
    np.testing.assert_allclose(out, a * weights + b, rtol=1e-6)
    assert np.shares_memory(out, fut["tensor_C"].numpy())


def test_sync_numpy_dicts(runner, weights):
    a, b = pair()
    result = runner.execute({"tensor_A": a, "tensor_B": b})
    assert type(result["tensor_C"]) is np.ndarray and result["tensor_C"].shape == SHAPE
    np.testing.assert_allclose(result["tensor_C"], a * weights + b, rtol=1e-6)
    out = {"tensor_C": np.zeros(SHAPE, np.float32)}
    runner.execute({"tensor_A": a, "tensor_B": b}, out)
    np.testing.assert_allclose(out["tensor_C"], a * weights + b, rtol=1e-6)


def test_inputs_of_the_model_shape_in_any_memory_layout(runner, weights):
    """The common-request path (exact dtype and shape) copes with strided inputs too."""
    a, b = pair()
    wide = rand((SHAPE[0], 2 * SHAPE[1]), seed=3)
    inputs = {"tensor_A": np.asfortranarray(a), "tensor_B": wide[:, ::2]}
    assert not inputs["tensor_A"].flags.c_contiguous and not inputs["tensor_B"].flags.c_contiguous
    expected = a * weights + wide[:, ::2]
    np.testing.assert_allclose(runner.execute(inputs)["tensor_C"], expected, rtol=1e-6)
    fut = runner.executeAsync(inputs)
    assert isinstance(fut["tensor_C"], model_runtime.TensorMemory)
    np.testing.assert_allclose(fut["tensor_C"].numpy(), expected, rtol=1e-6)
    # a subclass of ndarray and a mapping that is not a dict take the general path
    sub = {"tensor_A": a.view(np.recarray).view(np.ndarray), "tensor_B": b}
    np.testing.assert_allclose(runner.execute(sub)["tensor_C"], a * weights + b, rtol=1e-6)
    view = model_runtime.InputMemoryView()
    view["tensor_A"], view["tensor_B"] = a, b
    np.testing.assert_allclose(np.frombuffer(runner.execute(view)["tensor_C"], np.float32
                                             ).reshape(SHAPE), a * weights + b, rtol=1e-6)


def test_async_numpy_runner_allocated_copy_and_view_semantics(runner, weights):
    a, b = pair()
    fut = runner.executeAsync({"tensor_A": a, "tensor_B": b})
    fut.wait()
    item = fut["tensor_C"]
    tensor = item.numpy()
    copy = np.array(item, copy=True)
    view = np.array(item, copy=False)
    assert not np.shares_memory(view, copy)
    assert not np.shares_memory(tensor, copy)
    assert not np.shares_memory(tensor, view)
    assert np.shares_memory(view, item)
    for x in (tensor, copy, view):
        np.testing.assert_allclose(x, a * weights + b, rtol=1e-6)


def test_async_numpy_user_allocated_shares_memory(runner, weights):
    a, b = pair()
    out = {"tensor_C": np.zeros(SHAPE, np.float32)}
    fut = runner.executeAsync({"tensor_A": a, "tensor_B": b}, out)
    fut.wait()
    item = fut["tensor_C"]
    assert np.shares_memory(out["tensor_C"], item.numpy())
    assert np.shares_memory(out["tensor_C"], np.array(item, copy=False))
    assert not np.shares_memory(out["tensor_C"], np.array(item, copy=True))
    np.testing.assert_allclose(out["tensor_C"], a * weights + b, rtol=1e-6)


def test_raw_bytes_inputs_and_outputs(runner, weights):
    """C++-style (pointer, size) memory: ConstTensorMemoryView / TensorMemoryView over bytes."""
    a, b = pair()
    iv = model_runtime.InputMemoryView()
    iv["tensor_A"] = model_runtime.ConstTensorMemoryView(a.tobytes(), 48)
    iv["tensor_B"] = bytearray(b.tobytes())
    out = bytearray(48)
    ov = model_runtime.OutputMemoryView()
    ov["tensor_C"] = model_runtime.TensorMemoryView(out)
    runner.execute(iv, ov)
    np.testing.assert_allclose(np.frombuffer(out, np.float32).reshape(SHAPE), a * weights + b,
                               rtol=1e-6)


def test_multiple_of_model_batch_is_split_into_transfers(runner, weights):
    a, b = pair((12, 3))
    result = runner.execute({"tensor_A": a, "tensor_B": b})
    assert result["tensor_C"].shape == (12, 3)
    np.testing.assert_allclose(result["tensor_C"], a * np.tile(weights, (3, 1)) + b, rtol=1e-6)


def test_many_requests_in_flight_complete_in_order(runner, weights):
    reqs = [pair() for _ in range(40)]   # more than the rings hold: submit has to drain
    futures = [runner.executeAsync({"tensor_A": a, "tensor_B": b}) for a, b in reqs]
    for (a, b), fut in zip(reversed(reqs), reversed(futures)):   # waited newest first
        np.testing.assert_allclose(fut["tensor_C"], a * weights + b, rtol=1e-6)


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize("inputs,outputs,match", [
    (lambda a, b: {"tensor_A": a, "tensor_X": b}, None,
     "unknown input tensor 'tensor_X'; the model's execute inputs are 'tensor_A', 'tensor_B'"),
    (lambda a, b: {"tensor_A": a}, None, "missing input tensor\\(s\\) 'tensor_B'"),
    (lambda a, b: {"tensor_A": a[:, :2].copy(), "tensor_B": b}, None,
     r"input 'tensor_A': expected shape \[N\*4, 3\] \(N >= 1\), got shape \[4, 2\]"),
    (lambda a, b: {"tensor_A": a.astype(np.float64), "tensor_B": b}, None,
     "input 'tensor_A': expected dtype float32, got float64"),
    (lambda a, b: {"tensor_A": a.tobytes()[:40], "tensor_B": b}, None,
     "input 'tensor_A': expected a multiple of 48 bytes \\(one transfer.*got 40 bytes"),
    (lambda a, b: {"tensor_A": np.zeros((3, 3), np.float32), "tensor_B": np.zeros((3, 3), np.float32)},
     None, r"expected shape \[N\*4, 3\] \(N >= 1\), got shape \[3, 3\]"),
    (lambda a, b: {"tensor_A": np.zeros((8, 3), np.float32), "tensor_B": b}, None,
     "disagree on the batch size.*tensor_A has 2, tensor_B has 1"),
    (lambda a, b: {"tensor_A": a, "tensor_B": b}, {"tensor_C": bytearray(16)},
     "output 'tensor_C': the buffer is too small; expected 48 bytes.*got 16 bytes"),
    (lambda a, b: {"tensor_A": a, "tensor_B": b}, {"tensor_C": np.zeros((2, 3), np.float32)},
     r"output 'tensor_C': expected shape \[4, 3\] for this request, got shape \[2, 3\]"),
    (lambda a, b: {"tensor_A": a, "tensor_B": b}, {"nope": np.zeros(SHAPE, np.float32)},
     "unknown output tensor 'nope'"),
    (lambda a, b: {"tensor_A": a, "tensor_B": b}, {}, "missing output tensor\\(s\\) 'tensor_C'"),
])
def test_bad_requests_are_refused_and_runner_stays_usable(runner, weights, inputs, outputs, match):
    a, b = pair()
    with pytest.raises(BadRequestError, match=match):
        runner.execute(inputs(a, b), outputs)
    with pytest.raises(BadRequestError, match=match):
        runner.executeAsync(inputs(a, b), outputs)
    check_healthy(runner, weights)


def test_replica_id_out_of_range(runner, weights):
    a, b = pair()
    with pytest.raises(BadRequestError, match="replica_id 1 is out of range; expected 0..0"):
        runner.execute({"tensor_A": a, "tensor_B": b}, replica_id=1)
    check_healthy(runner, weights)


# ------------------------------------------------------------------ monitoring
def test_monitoring_grows_with_requests(runner):
    before = runner.getMonitoringStatisticsTotalCount({})["request_monitoring_statistics_count"]
    a, b = pair()
    for _ in range(7):
        runner.execute({"tensor_A": a, "tensor_B": b})
    info: dict = {}
    assert runner.getMonitoringStatisticsTotalCount(info) is info
    assert set(info) == {"request_monitoring_statistics_count",
                         "read_preparation_monitoring_statistics_count",
                         "read_queue_monitoring_statistics_count",
                         "computation_monitoring_statistics_count"}
    assert info["request_monitoring_statistics_count"] == before + 7
    trace = runner.getTimeTrace({})
    assert trace["request_duration_us"] > 0
    assert trace["request_duration_us"] == pytest.approx(
        trace["read_preparation_duration_us"] + trace["read_queue_duration_us"]
        + trace["computation_duration_us"], rel=1e-6, abs=1e-3)
    mean = runner.getMonitoringStatisticsMean({})
    p = runner.getMonitoringStatisticsPercentile({}, 0.999)
    assert mean["request_monitoring_statistics_mean_us"] > 0
    assert p["request_monitoring_statistics_percentile_us"] >= mean[
        "computation_monitoring_statistics_mean_us"]


# ------------------------------------------------------------------ threads
def test_concurrent_multi_transfer_requests(runner, weights):
    """Threads draining each other's transfers, requests longer than the rings: every
    request completes only when all its transfers are back."""
    errors: list[str] = []
    r = runner

    def worker(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(20):
                n = int(rng.integers(1, 12))   # up to 11 transfers: more than a ring holds
                a, b = (rng.standard_normal((4 * n, 3)).astype(np.float32) for _ in range(2))
                if rng.random() < 0.5:
                    out = r.execute({"tensor_A": a, "tensor_B": b})["tensor_C"]
                else:
                    out = r.executeAsync({"tensor_A": a, "tensor_B": b})["tensor_C"].numpy()
                np.testing.assert_allclose(out, a * np.tile(weights, (n, 1)) + b, rtol=1e-6)
        except Exception as exc:
            errors.append(f"worker {seed}: {exc!r}")
    run_in_threads(worker, range(5))
    assert errors == []


def test_fused_execute_and_requests_in_flight_from_other_threads(runner, weights):
    """Plain executes (the fused path when the replica is idle, Replica.run_idle) beside
    threads keeping unwaited futures in flight: every result is right, every request is
    counted, and a plain execute's outputs are writable arrays of their own."""
    errors: list[str] = []
    r = runner
    count = r.getMonitoringStatisticsTotalCount({})["request_monitoring_statistics_count"]
    a, b = pair()
    out = r.execute({"tensor_A": a, "tensor_B": b})["tensor_C"]
    assert type(out) is np.ndarray and out.shape == SHAPE and out.flags.writeable
    np.testing.assert_allclose(out, a * weights + b, rtol=1e-6)
    out[...] = 0   # its own memory: the next result is not affected
    np.testing.assert_allclose(r.execute({"tensor_A": a, "tensor_B": b})["tensor_C"],
                               a * weights + b, rtol=1e-6)

    def worker(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(40):
                a, b = (rng.standard_normal(SHAPE).astype(np.float32) for _ in range(2))
                if seed % 2:
                    got = r.execute({"tensor_A": a, "tensor_B": b})["tensor_C"]
                else:
                    fut = r.executeAsync({"tensor_A": a, "tensor_B": b})
                    got = fut["tensor_C"].numpy()
                np.testing.assert_allclose(got, a * weights + b, rtol=1e-6)
        except Exception as exc:
            errors.append(f"worker {seed}: {exc!r}")
    run_in_threads(worker, range(4))
    assert errors == []
    assert r.getMonitoringStatisticsTotalCount({})["request_monitoring_statistics_count"] \
        == count + 2 + 4 * 40


def test_a_model_without_inputs_answers_every_request(make_runner, tmp_path):
    """A model with no input streams (onnx's node/test_constant): the device's outputs
    carry no request's number, and every request, sync, async and fused, gets them."""
    import io

    import onnx
    from onnx import helper, numpy_helper

    from host_runtime.poprt.compiler import write_popef
    from ipu_emulator.compiler import CompileOptions, ModelSpec, compile_onnx

    value = np.arange(6, dtype=np.float32).reshape(2, 3)
    node = helper.make_node("Constant", [], ["values"],
                            value=numpy_helper.from_array(value, "const"))
    graph = helper.make_graph([node], "constant", [], [
        helper.make_tensor_value_info("values", onnx.TensorProto.FLOAT, [2, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    buf = io.BytesIO()
    write_popef(compile_onnx([ModelSpec(model, {}, "fp32")], CompileOptions()), buf)
    path = tmp_path / "constant.popef"
    path.write_bytes(buf.getvalue())
    with make_runner(str(path)) as runner:
        assert runner.getExecuteInputs() == []
        for _ in range(3):
            np.testing.assert_array_equal(runner.execute({})["values"], value)
        futures = [runner.executeAsync({}) for _ in range(3)]
        for fut in futures:
            fut.wait()
            np.testing.assert_array_equal(fut["values"].numpy(), value)


def test_the_common_request_is_checked_and_laid_in_one_call_each_whatever_its_arrays(
        runner, weights, monkeypatch):
    """An idle replica's plain ``execute`` checks its inputs and writes them with one C
    call each (shm.arrays); an input those calls do not take (not contiguous, another
    layout, a subclass) still gets the right answer, through the same path or the
    general one."""
    from shm import arrays

    path = runner._replicas[0]._life.path
    a, b = pair()
    # (not on the path matrix's legs without the rings' C core or the runner's fast paths)
    if arrays.IN_C and path.fusable and path.inputs[0].ring.c_handle() is not None:
        assert [name for name, _ in path._write_plan] == ["tensor_B", "tensor_A"]
        assert runner._intake._plain_plan is not None
        check_healthy(runner, weights)   # (a first write through Ring takes the rings' role)
        laid = []
        write = arrays.write_arrays
        monkeypatch.setattr(arrays, "write_arrays", lambda *args: laid.append(write(*args))
                            or laid[-1])
        check_healthy(runner, weights)
        assert laid == [2]   # both inputs, in the one call
        monkeypatch.undo()
    wide = np.zeros((SHAPE[0], 2 * SHAPE[1]), np.float32)
    wide[:, ::2] = b
    tagged = b.astype(np.dtype(np.float32, metadata={"unit": "m"}))
    for given_b in (b, wide[:, ::2], tagged, b.view(np.ma.MaskedArray)):
        for given_a in (a, a.copy(order="F")):
            out = runner.execute({"tensor_A": given_a, "tensor_B": given_b})
            np.testing.assert_allclose(out["tensor_C"], a * weights + b, rtol=1e-6)
    with pytest.raises(BadRequestError, match="expected shape"):
        runner.execute({"tensor_A": a, "tensor_B": b.reshape(3, 4)})
    with pytest.raises(BadRequestError, match="'tensor_B': expected dtype float32, got float64"):
        runner.execute({"tensor_A": a, "tensor_B": b.astype(np.float64)})
    check_healthy(runner, weights)
