"""test_inference.py: an inference suite on emulated IPUs (the ipu_emulator pytest plugin)."""

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper


def scale_and_shift():
    """y = x * 2 + 1, as an ONNX model."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "two"], ["t"]),
         helper.make_node("Add", ["t", "one"], ["y"])],
        "scale_and_shift",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        initializer=[numpy_helper.from_array(np.array(2, np.float32), "two"),
                     numpy_helper.from_array(np.array(1, np.float32), "one")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_runs_on_one_ipu(model_runner):
    runner = model_runner(scale_and_shift())          # compiled once, run on an emulated IPU
    x = np.arange(4, dtype=np.float32).reshape(1, 4)
    np.testing.assert_allclose(runner.execute({"x": x})["y"], x * 2 + 1)


@pytest.mark.ipus(2)
def test_two_replicas(model_runner):
    runner = model_runner(scale_and_shift(), replication_factor=2)
    x = np.ones((1, 4), np.float32)
    for replica in (0, 1):
        np.testing.assert_allclose(runner.execute({"x": x}, replica_id=replica)["y"], 3.0)


@pytest.mark.ipus(64)
def test_needs_a_bigger_machine(model_runner):
    raise AssertionError("skipped: the machine has fewer than 64 IPUs")


def test_popef_files_are_cached(compile_onnx, model_runner):
    path = compile_onnx(scale_and_shift())
    assert compile_onnx(scale_and_shift()) == path    # same model and options: same file
    runner = model_runner(path)
    assert [d.name for d in runner.getExecuteOutputs()] == ["y"]


def test_the_machine_is_private(ipu_machine):
    assert ipu_machine.shm_tag != "g" and ipu_machine.num_ipus >= 2
