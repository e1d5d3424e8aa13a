"""The seeds' Python listings run against the project with only their imports changed.

Seed 000, chapter 3: listings 3.2 (execution modes), 3.4 (replication), 3.6
(multithreading) and 3.8 (frozen inputs), on the example model the seeds generate
(``tensor_C = tensor_A * weights + tensor_B``, shape [1, 4]). Each test makes the
listing's API calls in the listing's order (the argument parsing and the printing
aside) and checks every output against numpy where the listing only prints it. The
PopRT listing of seed 004 (run.py) is ``tests/integration/test_poprt_runner.py::
test_seed_run_py``.

Imports, as the README says::

    import host_runtime as model_runtime        # was: import model_runtime
    from host_runtime import popef              # was: import popef
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta

import numpy as np
import pytest

import host_runtime as model_runtime
from host_runtime import popef

pytestmark = pytest.mark.usefixtures("private_machine")


def wait_config():
    # every Python listing of seed 000 spells it so
    return model_runtime.DeviceWaitConfig(
        model_runtime.DeviceWaitStrategy.WAIT_WITH_TIMEOUT,
        timeout=timedelta(seconds=600),
        sleepTime=timedelta(seconds=1))


def expected(inputs, weights):
    return inputs["tensor_A"] * weights + inputs["tensor_B"]


# ------------------------------------------------------------------ listing 3.2
def test_listing_3_2_execution_modes(model_path, weights):
    config = model_runtime.ModelRunnerConfig()
    config.device_wait_config = wait_config()
    assert config.device_wait_config.strategy is model_runtime.DeviceWaitStrategy.WAIT_WITH_TIMEOUT
    assert "ModelRunnerConfig(" in str(config)     # print("Creating ModelRunner with", config)
    model_runner = model_runtime.ModelRunner(model_runtime.PopefPaths([model_path]),
                                             config=config)
    try:
        input_descriptions = model_runner.getExecuteInputs()
        input_tensors = [
            np.random.randn(*input_desc.shape).astype(input_desc.numpy_data_type())
            for input_desc in input_descriptions
        ]
        input_view = model_runtime.InputMemoryView()
        for input_desc, input_tensor in zip(input_descriptions, input_tensors):
            input_view[input_desc.name] = input_tensor
        input_numpy = dict()
        for input_desc, input_tensor in zip(input_descriptions, input_tensors):
            input_numpy[input_desc.name] = input_tensor
        want = expected(input_numpy, weights)
        output_descriptions = model_runner.getExecuteOutputs()
        assert [d.name for d in output_descriptions] == ["tensor_C"]

        # synchronousExecutionModeLibraryAllocatedOutput
        result = model_runner.execute(input_view)
        for output_desc in output_descriptions:
            output_tensor = np.frombuffer(
                result[output_desc.name],
                dtype=output_desc.numpy_data_type()).reshape(output_desc.shape)
            np.testing.assert_allclose(output_tensor, want, rtol=1e-6)

        # synchronousExecutionModeUserAllocatedOutput
        output_tensors = [np.zeros(d.shape, dtype=d.numpy_data_type())
                          for d in output_descriptions]
        output_view = model_runtime.OutputMemoryView()
        for desc, tensor in zip(output_descriptions, output_tensors):
            output_view[desc.name] = tensor
        model_runner.execute(input_view, output_view)
        for desc, tensor in zip(output_descriptions, output_tensors):
            np.testing.assert_allclose(tensor, want, rtol=1e-6)

        # synchronousExecutionModeLibraryAllocatedNumpyInputOutput
        output_tensors = model_runner.execute(input_numpy)
        for desc in output_descriptions:
            tensor = output_tensors[desc.name]
            assert tensor.shape == tuple(desc.shape) and tensor.dtype == np.float32
            np.testing.assert_allclose(tensor, want, rtol=1e-6)

        # synchronousExecutionModeUserAllocatedNumpyInputOutput
        numpy_output = {}
        for output_desc in output_descriptions:
            numpy_output[output_desc.name] = np.zeros(
                output_desc.shape, dtype=output_desc.numpy_data_type())
        model_runner.execute(input_numpy, numpy_output)
        for desc in output_descriptions:
            np.testing.assert_allclose(numpy_output[desc.name], want, rtol=1e-6)

        # asynchronousExecutionModeLibraryAllocatedOutput
        result = model_runner.executeAsync(input_view)
        assert isinstance(result, model_runtime.OutputFutureMemory)
        result.wait()
        for output_desc in output_descriptions:
            output_tensor = np.frombuffer(
                result[output_desc.name],
                dtype=output_desc.numpy_data_type()).reshape(output_desc.shape)
            np.testing.assert_allclose(output_tensor, want, rtol=1e-6)

        # asynchronousExecutionModeUserAllocatedOutput
        output_tensors = [np.zeros(d.shape, dtype=d.numpy_data_type())
                          for d in output_descriptions]
        output_view = model_runtime.OutputMemoryView()
        for desc, tensor in zip(output_descriptions, output_tensors):
            output_view[desc.name] = tensor
        future = model_runner.executeAsync(input_view, output_view)
        assert isinstance(future, model_runtime.OutputFutureMemoryView)
        future.wait()
        for desc, tensor in zip(output_descriptions, output_tensors):
            np.testing.assert_allclose(tensor, want, rtol=1e-6)

        # asynchronousExecutionModeLibraryAllocatedNumpyOutput
        future = model_runner.executeAsync(input_numpy)
        future.wait()
        for desc in model_runner.getExecuteOutputs():
            future_py_array = future[desc.name]
            tensor = future_py_array.numpy()
            tensor_copy = np.array(future_py_array, copy=True)
            tensor_view = np.array(future_py_array, copy=False)
            assert not np.shares_memory(tensor_view, tensor_copy)
            assert not np.shares_memory(tensor, tensor_copy)
            assert not np.shares_memory(tensor, tensor_view)
            for t in (tensor, tensor_copy, tensor_view):
                np.testing.assert_allclose(t, want, rtol=1e-6)

        # asynchronousExecutionModeUserAllocatedNumpyOutput
        numpy_output = {}
        for output_desc in output_descriptions:
            numpy_output[output_desc.name] = np.zeros(
                output_desc.shape, dtype=output_desc.numpy_data_type())
        future = model_runner.executeAsync(input_numpy, numpy_output)
        future.wait()
        for desc in output_descriptions:
            output_tensor = numpy_output[desc.name]
            future_py_array_view = future[desc.name]
            tensor_from_future_object = future_py_array_view.numpy()
            assert np.shares_memory(output_tensor, tensor_from_future_object)
            tensor_view = np.array(future_py_array_view, copy=False)
            assert np.shares_memory(output_tensor, tensor_view)
            assert np.shares_memory(tensor_from_future_object, tensor_view)
            tensor_copy = np.array(future_py_array_view, copy=True)
            assert not np.shares_memory(tensor_from_future_object, tensor_copy)
            assert not np.shares_memory(output_tensor, tensor_copy)
            np.testing.assert_allclose(output_tensor, want, rtol=1e-6)
            np.testing.assert_allclose(tensor_copy, want, rtol=1e-6)
    finally:
        model_runner.close()    # the listing leaves this to interpreter exit


# ------------------------------------------------------------------ listing 3.4
def test_listing_3_4_replication(model_path, weights):
    num_replicas = 2
    config = model_runtime.ModelRunnerConfig()
    config.replication_factor = num_replicas
    config.device_wait_config = wait_config()
    runner = model_runtime.ModelRunner(model_runtime.PopefPaths([model_path]), config=config)
    try:
        input_descriptions = runner.getExecuteInputs()
        input = model_runtime.InputMemoryView()   # noqa: A001 - as the listing (unused there)
        input_descriptions = runner.getExecuteInputs()
        input_tensors = [
            np.random.randn(*input_desc.shape).astype(input_desc.numpy_data_type())
            for input_desc in input_descriptions
        ]
        input_view = model_runtime.InputMemoryView()
        for input_desc, input_tensor in zip(input_descriptions, input_tensors):
            input_view[input_desc.name] = input_tensor
        want = expected(dict(zip([d.name for d in input_descriptions], input_tensors)), weights)
        devices = set()
        for replica_id in range(num_replicas):
            result = runner.execute(input_view, replica_id=replica_id)
            output_descriptions = runner.getExecuteOutputs()
            for output_desc in output_descriptions:
                output_tensor = np.frombuffer(
                    result[output_desc.name],
                    dtype=output_desc.numpy_data_type()).reshape(output_desc.shape)
                np.testing.assert_allclose(output_tensor, want, rtol=1e-6)
            devices.add(runner._replicas[replica_id].session.device().getId())
        assert len(devices) == num_replicas      # one IPU each
        assert isinstance(input, dict)
    finally:
        runner.close()


# ------------------------------------------------------------------ listing 3.6
def test_listing_3_6_multithreading(model_path, weights):
    config = model_runtime.ModelRunnerConfig()
    config.thread_safe = True
    config.device_wait_config = wait_config()
    model_runner = model_runtime.ModelRunner(model_runtime.PopefPaths([model_path]),
                                             config=config)
    errors = []
    checked = []

    def workerMain(model_runner, worker_id):
        try:
            num_requests = 5
            input_descriptions = model_runner.getExecuteInputs()
            input_requests = []
            for _ in range(num_requests):
                input_requests.append([
                    np.random.randn(*input_desc.shape).astype(input_desc.numpy_data_type())
                    for input_desc in input_descriptions
                ])
            futures = []
            for req_id in range(num_requests):
                input_view = model_runtime.InputMemoryView()
                for input_desc, input_tensor in zip(input_descriptions, input_requests[req_id]):
                    input_view[input_desc.name] = input_tensor
                futures.append(model_runner.executeAsync(input_view))
            for req_id, future in enumerate(futures):
                future.wait()
                inputs = dict(zip([d.name for d in input_descriptions], input_requests[req_id]))
                np.testing.assert_allclose(np.asarray(future["tensor_C"]),
                                           expected(inputs, weights), rtol=1e-6)
                checked.append((worker_id, req_id))
        except Exception as exc:  # reported by the main thread
            errors.append(exc)

    try:
        num_workers = 4
        threads = [threading.Thread(target=workerMain, args=(model_runner, worker_id))
                   for worker_id in range(num_workers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        model_runner.close()
    assert errors == []
    assert sorted(checked) == [(w, r) for w in range(4) for r in range(5)]


# ------------------------------------------------------------------ listing 3.8
def load_model(popef_paths):
    for model_file in popef_paths:
        assert os.path.isfile(model_file) is True
        reader = popef.Reader()
        reader.parseFile(model_file)

        meta = reader.metadata()
        exec = reader.executables()   # noqa: A001 - as the listing
        assert meta and exec
        return popef.ModelBuilder(reader).createModel()


def test_listing_3_8_frozen_inputs(model_path, weights):
    model = load_model([model_path])

    frozen_input_name = "tensor_B"
    tensor_b_anchor = popef.Anchor()
    for anchor in model.metadata.anchors():
        if anchor.name() == frozen_input_name:
            tensor_b_anchor = anchor
            break
    else:
        raise AssertionError(f"anchor {frozen_input_name} not found")

    tensor_b_info = tensor_b_anchor.tensorInfo()
    tensor_b = np.random.randn(*tensor_b_info.shape()).astype(tensor_b_info.numpyDType())

    config = model_runtime.ModelRunnerConfig()
    frozen_inputs = model_runtime.InputMemoryView()
    frozen_inputs[frozen_input_name] = tensor_b
    config.frozen_inputs = frozen_inputs
    config.device_wait_config = wait_config()

    model_runner = model_runtime.ModelRunner(model, config=config)
    try:
        input_descriptions = model_runner.getExecuteInputs()
        assert [d.name for d in input_descriptions] == ["tensor_A"]    # tensor_B is frozen
        input_tensors = [
            np.random.randn(*input_desc.shape).astype(input_desc.numpy_data_type())
            for input_desc in input_descriptions
        ]
        input_view = model_runtime.InputMemoryView()
        for input_desc, input_tensor in zip(input_descriptions, input_tensors):
            input_view[input_desc.name] = input_tensor

        result = model_runner.execute(input_view)
        output_descriptions = model_runner.getExecuteOutputs()
        for output_desc in output_descriptions:
            output_tensor = np.frombuffer(
                result[output_desc.name],
                dtype=output_desc.numpy_data_type()).reshape(output_desc.shape)
            np.testing.assert_allclose(output_tensor, input_tensors[0] * weights + tensor_b,
                                       rtol=1e-6)
    finally:
        model_runner.close()
