"""The reference's Python spellings that the project refused or ignored (issue 21), run as
written over real IPU processes, results checked with numpy: ``execute(inputs,
replica_id)``, ``InputQueue(buffer, info)`` / ``OutputQueue(buffer, info)``, flat
``ConstTensorMemoryView`` / ``TensorMemoryView``, ``setUserInputHandler`` with
``predProgramFlowMain``, ``ModelRunner.config()``, and ``frozen_inputs`` for a Main
input the PopEF file also feeds."""

from __future__ import annotations

import dataclasses
import io

import numpy as np
import pytest

import host_runtime as model_runtime
from host_runtime import popef
from host_runtime.errors import BadRequestError, InvalidStateError
from host_runtime.poprt.compiler import write_popef
from host_runtime.queues import InputQueue, InputRingBuffer, OutputQueue, OutputRingBuffer
from host_runtime.session._session import Session
from host_runtime.session.predicates import predicate_factory
from ipu_emulator.compiler import CompileOptions, ModelSpec, compile_onnx
from tests._helpers import weights_of, write_example
from tests.models import simple_model

SHAPE = (2, 3)

pytestmark = pytest.mark.usefixtures("private_machine")


def rand(seed):
    return np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32)


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    path = write_example(tmp_path_factory.mktemp("example"), SHAPE)
    return path, weights_of(popef.load_model([path]), SHAPE)


@pytest.fixture(scope="module")
def runner2(example):
    cfg = model_runtime.ModelRunnerConfig()
    cfg.replication_factor = 2
    with model_runtime.ModelRunner(example[0], cfg) as r:
        yield r


def test_execute_and_execute_async_take_replica_id_positionally(runner2, example):
    """Seed 002: execute(input_data, replica_id) and executeAsync(input_data, replica_id)."""
    w = example[1]
    a, b = rand(1), rand(2)
    want = a * w + b
    for rid in (0, 1):
        out = runner2.execute({"tensor_A": a, "tensor_B": b}, rid)
        np.testing.assert_allclose(out["tensor_C"], want, rtol=1e-6)
        fut = runner2.executeAsync({"tensor_A": a, "tensor_B": b}, rid)
        np.testing.assert_allclose(fut.result(timeout=60)["tensor_C"], want, rtol=1e-6)
    with pytest.raises(BadRequestError, match=r"replica_id 2 is out of range"):
        runner2.execute({"tensor_A": a, "tensor_B": b}, 2)
    with pytest.raises(BadRequestError, match=r"replica_id given twice"):
        runner2.execute({"tensor_A": a, "tensor_B": b}, 1, replica_id=1)


def test_flat_const_tensor_memory_views(runner2, example):
    """The reference's views are pointer and size: a flat float32 view of each tensor (here
    slices of one buffer holding every input) is taken by its bytes."""
    w = example[1]
    a, b = rand(3), rand(4)
    one = np.concatenate([a.reshape(-1), b.reshape(-1)])      # one buffer, every tensor
    n = a.size
    inputs = {"tensor_A": model_runtime.ConstTensorMemoryView(one[:n], a.nbytes),
              "tensor_B": model_runtime.ConstTensorMemoryView(one[n:], b.nbytes)}
    got = runner2.execute(inputs)["tensor_C"]
    np.testing.assert_allclose(np.asarray(got).reshape(SHAPE), a * w + b, rtol=1e-6)
    out = np.zeros(n, np.float32)                               # a flat output view too
    runner2.execute(inputs, {"tensor_C": model_runtime.TensorMemoryView(out)})
    np.testing.assert_allclose(out.reshape(SHAPE), a * w + b, rtol=1e-6)
    with pytest.raises(BadRequestError, match=r"expected a multiple of 24 bytes .* got 20 bytes"):
        runner2.execute({"tensor_A": model_runtime.ConstTensorMemoryView(one[:n - 1]),
                         "tensor_B": inputs["tensor_B"]})


def test_queue_constructors_as_the_reference_spells_them(example):
    info = popef.load_model([example[0]]).metadata.anchor("tensor_A").tensorInfo()
    rb_in, rb_out = InputRingBuffer(4, "tensor_A"), OutputRingBuffer(4, "tensor_C")
    q_in, q_out = InputQueue(rb_in, info), OutputQueue(rb_out, info)
    assert q_in.tensorInfo() is info and q_in.numBuffers() == 4 and q_in.name() == "tensor_A"
    assert q_out.tensorInfo() is info and q_out.name() == "tensor_C"
    a = rand(5)
    q_in.enqueue(a, a.nbytes)
    item = rb_in.readLock()
    np.testing.assert_array_equal(np.frombuffer(item.data, np.float32).reshape(SHAPE), a)
    rb_in.readComplete()
    with pytest.raises(BadRequestError, match=r"buffer must be an SpscRingBuffer"):
        InputQueue(info, info)


def test_user_input_handler_with_pred_program_flow_main_keeps_popef_weights(example, device):
    """predProgramFlowMain(flow) with its default reject policy (BIND_EMPTY_CB): the Load
    program's weights, which the PopEF file feeds, keep the file's data."""
    path, w = example
    flow = popef.load_model([path]).metadata.programFlow()
    a, b = rand(6), rand(7)
    data = {"tensor_A": a, "tensor_B": b, "weights": np.full(SHAPE, 5.0, np.float32)}
    asked, outs = [], []

    def factory(info):
        asked.append(info.name())
        arr = data[info.name()]

        def cb(view):
            np.frombuffer(view, np.uint8)[:] = arr.view(np.uint8).ravel()
        return cb

    def sink(info):
        return lambda view: outs.append(np.frombuffer(view, np.float32).reshape(SHAPE).copy())

    pred = predicate_factory.anchor_callbacks.predProgramFlowMain(flow)
    with Session(path) as s:
        s.bindToDevice(device)
        s.setUserInputHandler(factory, pred)
        s.setUserOutputHandler(sink)
        s.runMainPrograms()
    assert sorted(asked) == ["tensor_A", "tensor_B", "weights"]
    np.testing.assert_allclose(outs[-1], a * w + b, rtol=1e-6)    # the file's weights


@pytest.fixture(scope="module")
def device():
    from host_runtime.devices import DeviceManager

    dev = DeviceManager().getDevice(1)
    yield dev
    dev.close()


def test_config_returns_the_runners_configuration_read_only(runner2):
    cfg = runner2.config()
    assert cfg is runner2.config() and cfg.replication_factor == 2
    with pytest.raises(InvalidStateError, match=r"ModelRunnerConfig.timeout_ns: this is a "
                                                r"ModelRunner's configuration"):
        cfg.timeout_ns = 1
    with pytest.raises(InvalidStateError, match=r"frozen_inputs of a ModelRunner"):
        cfg.frozen_inputs["tensor_B"] = np.zeros(SHAPE, np.float32)
    assert cfg.timeout_ns == 5 * 10**9 and dict(cfg.frozen_inputs) == {}
    again = cfg.copy()                      # a mutable copy for another runner
    again.replication_factor = 1
    assert again.replication_factor == 1 and cfg.replication_factor == 2


def test_frozen_input_wins_over_popef_data_for_a_main_input(tmp_path):
    """tensor_B is a Main input whose value the PopEF file also carries: frozen_inputs
    decides it, and execute no longer needs it."""
    result = compile_onnx([ModelSpec(simple_model(SHAPE), {}, "fp32")], CompileOptions())
    file_b = np.full(SHAPE, 100.0, np.float32)
    result.anchors[:] = [dataclasses.replace(a, data=file_b.tobytes()) if a.name == "tensor_B"
                         else a for a in result.anchors]
    buf = io.BytesIO()
    write_popef(result, buf)
    path = tmp_path / "fed.popef"
    path.write_bytes(buf.getvalue())
    w = next(np.frombuffer(t.data, np.float32).reshape(SHAPE).copy()
             for t in [_init(simple_model(SHAPE), "weights")])
    a, frozen_b = rand(8), rand(9)
    # without frozen_inputs: the file's tensor_B
    with model_runtime.ModelRunner(str(path)) as r:
        assert [d.name for d in r.getExecuteInputs()] == ["tensor_A"]
        np.testing.assert_allclose(r.execute({"tensor_A": a})["tensor_C"], a * w + file_b,
                                   rtol=1e-6)
    cfg = model_runtime.ModelRunnerConfig()
    cfg.frozen_inputs = {"tensor_B": model_runtime.ConstTensorMemoryView(frozen_b)}
    with model_runtime.ModelRunner(str(path), cfg) as r:
        assert [d.name for d in r.getExecuteInputs()] == ["tensor_A"]
        for _ in range(2):
            np.testing.assert_allclose(r.execute({"tensor_A": a})["tensor_C"],
                                       a * w + frozen_b, rtol=1e-6)


class _init:
    def __init__(self, model, name):
        from onnx import numpy_helper
        t = next(t for t in model.graph.initializer if t.name == name)
        self.data = numpy_helper.to_array(t).tobytes()
