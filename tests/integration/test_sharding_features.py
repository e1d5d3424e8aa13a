"""The runtime's features work unchanged on sharded and pipelined models.

A two-input model ``y = relu(relu(x @ w0) + b) @ w1`` is cut over 2 IPUs: ``x``
streams to IPU 0, ``b`` to IPU 1 (the IPU that consumes it). On the sharded and on
the pipelined compilation: Session.createQueueManager, ModelRunnerConfig.frozen_inputs,
the monitoring statistics and timeout_ns (validate_io_params off, ``b`` missing ->
DeviceTimeoutError); outputs are compared with onnxruntime in this process.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import numpy as np
import onnx
import pytest

import host_runtime as model_runtime
from host_runtime.errors import DeviceTimeoutError
from host_runtime.poprt.compiler import compile as poprt_compile
from host_runtime.session._session import Session

BATCH, WIDTH = 2, 16
SHAPE = (BATCH, WIDTH)

pytestmark = pytest.mark.usefixtures("private_machine")


def two_input_model() -> onnx.ModelProto:
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(11)
    w0 = (rng.standard_normal((WIDTH, WIDTH)) / 4).astype(np.float32)
    w1 = (rng.standard_normal((WIDTH, WIDTH)) / 4).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w0"], ["m0"], name="mm0"),
             helper.make_node("Relu", ["m0"], ["r0"], name="relu0"),
             helper.make_node("Add", ["r0", "b"], ["s"], name="add"),
             helper.make_node("Relu", ["s"], ["r1"], name="relu1"),
             helper.make_node("MatMul", ["r1", "w1"], ["y"], name="mm1")]
    g = helper.make_graph(
        nodes, "two_inputs",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(SHAPE)),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, list(SHAPE))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(SHAPE))],
        initializer=[numpy_helper.from_array(w0, "w0"), numpy_helper.from_array(w1, "w1")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


MODEL = two_input_model()


def reference(x: np.ndarray, b: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    sess = ort.InferenceSession(MODEL.SerializeToString(), providers=["CPUExecutionProvider"])
    return np.asarray(sess.run(None, {"x": x, "b": b})[0])


def rand(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32)


@pytest.fixture(scope="module", params=["sharded", "pipelined"])
def popef_path(request, tmp_path_factory) -> str:
    pipelined = request.param == "pipelined"
    out = poprt_compile(MODEL, tmp_path_factory.mktemp(request.param), num_ipus=2,
                        sharding_info={"relu0": 0, "mm1": 1},
                        pipelining_info={"relu0": 0, "mm1": 1} if pipelined else None,
                        enable_pipelining=pipelined, batches_per_step=2 if pipelined else 1)
    return str(out.popef_path)


def check(y: np.ndarray, x: np.ndarray, b: np.ndarray) -> None:
    np.testing.assert_allclose(y, reference(x, b), rtol=1e-5, atol=1e-5)


def test_queue_manager(popef_path):
    """One runMainPrograms is one step: batches_per_step (2 when pipelined) batches of
    each queue, the pipeline filled and drained within it."""
    runs = 2
    bps = 2 if "pipelined" in popef_path else 1
    n = runs * bps
    xs, bs = [rand(k) for k in range(n)], [rand(100 + k) for k in range(n)]
    ys = [np.zeros(SHAPE, np.float32) for _ in range(n)]
    errors: list[BaseException] = []
    with Session(popef_path) as s:
        qm = s.createQueueManager()

        def device_loop() -> None:
            try:
                for _ in range(runs):
                    s.runMainPrograms()
            except BaseException as exc:
                errors.append(exc)
        t = threading.Thread(target=device_loop)
        t.start()
        for x, b, y in zip(xs, bs, ys):
            qm.inputs["x"].enqueue(x, x.nbytes)
            qm.inputs["b"].enqueue(b, b.nbytes)
            qm.outputs["y"].enqueue(y, y.nbytes)
        t.join(120)
        assert not t.is_alive() and not errors, errors
        assert len(set(s.device().pids())) == 2    # one IPU process per IPU
    for x, b, y in zip(xs, bs, ys):
        check(y, x, b)


def test_frozen_inputs(popef_path):
    b = rand(7)
    cfg = model_runtime.ModelRunnerConfig()
    cfg.frozen_inputs = {"b": b}                 # consumed by IPU 1
    with model_runtime.ModelRunner(popef_path, config=cfg) as r:
        assert [d.name for d in r.getExecuteInputs()] == ["x"]
        xs = [rand(20 + k) for k in range(4)]
        futs = [r.executeAsync({"x": x}) for x in xs]
        for x, f in zip(xs, futs):
            check(f.result(timeout=120)["y"], x, b)


def test_monitoring_statistics(popef_path):
    with model_runtime.ModelRunner(popef_path) as r:
        before = r.getMonitoringStatisticsTotalCount({})["request_monitoring_statistics_count"]
        for k in range(5):
            x, b = rand(k), rand(50 + k)
            check(r.execute({"x": x, "b": b})["y"], x, b)
        count = r.getMonitoringStatisticsTotalCount({})
        assert count["request_monitoring_statistics_count"] == before + 5
        assert count["computation_monitoring_statistics_count"] >= 5
        mean = r.getMonitoringStatisticsMean({})
        assert mean["request_monitoring_statistics_mean_us"] > 0
        assert mean["computation_monitoring_statistics_mean_us"] > 0


def test_timeout_on_a_missing_input_then_recovers(popef_path):
    cfg = model_runtime.ModelRunnerConfig(validate_io_params=False,
                                          timeout_ns=timedelta(milliseconds=200))
    with model_runtime.ModelRunner(popef_path, config=cfg) as r:
        x, b = rand(1), rand(2)
        check(r.execute({"x": x, "b": b})["y"], x, b)
        with pytest.raises(DeviceTimeoutError, match="timed out after 200 ms waiting for "
                                                     "input 'b'"):
            r.execute({"x": x})                  # b (IPU 1's input) never comes
        x, b = rand(3), rand(4)
        check(r.execute({"x": x, "b": b})["y"], x, b)
