"""ModelRunner on loopback devices (``replica_to_device``): execute / executeAsync, no process.

The seeds' example model with a batch of 4 samples of 3 floats:
``tensor_C = tensor_A * weights + tensor_B``.
"""

from __future__ import annotations

import numpy as np
import pytest

import host_runtime as model_runtime
from host_runtime.devices.loopback import loopback_device, loopback_ipus
from host_runtime.errors import BadRequestError, InvalidStateError
from tests.unit._loopback import model, model_path, offline, weights  # noqa: F401  (fixtures)

SHAPE = (4, 3)


def pair(seed: int, shape: tuple[int, ...] = SHAPE) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape).astype(np.float32),
            rng.standard_normal(shape).astype(np.float32))


@pytest.fixture
def runner(loopback_device, model):
    r = model_runtime.ModelRunner(model, model_runtime.ModelRunnerConfig(
        replica_to_device={0: loopback_device}))
    yield r
    r.close()


def test_execute_and_execute_async_match_numpy(runner, weights):
    a, b = pair(0)
    np.testing.assert_allclose(runner.execute({"tensor_A": a, "tensor_B": b})["tensor_C"],
                               a * weights + b, rtol=1e-6)
    out = np.zeros(SHAPE, np.float32)
    assert runner.execute({"tensor_A": a, "tensor_B": b}, {"tensor_C": out}) is None
    np.testing.assert_allclose(out, a * weights + b, rtol=1e-6)
    reqs = [pair(10 + i) for i in range(16)]
    futures = [runner.executeAsync({"tensor_A": a, "tensor_B": b}) for a, b in reqs]
    for (a, b), fut in zip(reversed(reqs), reversed(futures)):   # waited newest first
        np.testing.assert_allclose(fut["tensor_C"], a * weights + b, rtol=1e-6)


def test_a_multiple_of_the_batch_is_split_into_transfers(runner, weights):
    a, b = pair(1, (12, 3))
    result = runner.execute({"tensor_A": a, "tensor_B": b})
    np.testing.assert_allclose(result["tensor_C"], a * np.tile(weights, (3, 1)) + b, rtol=1e-6)


@pytest.mark.parametrize("inputs,outputs,match", [
    (lambda a, b: {"tensor_A": a[:, :2].copy(), "tensor_B": b}, None,
     r"input 'tensor_A': expected shape \[N\*4, 3\] \(N >= 1\), got shape \[4, 2\]"),
    (lambda a, b: {"tensor_A": a.astype(np.float64), "tensor_B": b}, None,
     "input 'tensor_A': expected dtype float32, got float64"),
    (lambda a, b: {"tensor_A": a}, None, r"missing input tensor\(s\) 'tensor_B'"),
    (lambda a, b: {"tensor_A": a, "tensor_B": b}, {"tensor_C": bytearray(16)},
     "output 'tensor_C': the buffer is too small; expected 48 bytes.*got 16 bytes"),
])
def test_bad_requests_are_refused_and_the_runner_stays_usable(runner, weights, inputs, outputs,
                                                              match):
    a, b = pair(2)
    with pytest.raises(BadRequestError, match=match):
        runner.execute(inputs(a, b), outputs)
    with pytest.raises(BadRequestError, match=match):
        runner.executeAsync(inputs(a, b), outputs)
    np.testing.assert_allclose(runner.execute({"tensor_A": a, "tensor_B": b})["tensor_C"],
                               a * weights + b, rtol=1e-6)


def test_two_replicas_on_two_loopback_devices(model, weights):
    with offline():
        with loopback_device(model) as d0, loopback_device(model) as d1:
            r = model_runtime.ModelRunner(model, model_runtime.ModelRunnerConfig(
                replication_factor=2, replica_to_device={0: d0, 1: d1}))
            try:
                running = []
                for i in range(8):
                    a, b = pair(20 + i)
                    running.append((a, b, r.executeAsync({"tensor_A": a, "tensor_B": b},
                                                         replica_id=i % 2)))
                for a, b, fut in running:
                    np.testing.assert_allclose(fut["tensor_C"], a * weights + b, rtol=1e-6)
                with pytest.raises(BadRequestError, match="replica_id 2 is out of range; "
                                                          "expected 0..1"):
                    r.execute({"tensor_A": a, "tensor_B": b}, replica_id=2)
            finally:
                r.close()
            with pytest.raises(InvalidStateError, match="closed"):
                r.execute({"tensor_A": a, "tensor_B": b})
            # the runner does not close devices it was given
            assert d0.isAttached() and d1.isAttached()


@pytest.mark.parametrize("pipelined,bps", [(False, 1), (True, 2)], ids=["sharded", "pipelined"])
def test_a_model_over_two_loopback_ipus_matches_onnxruntime(tmp_path, pipelined, bps):
    """A 2-IPU device (a GroupLink): two loopback IPUs, the IPU-Link rings between them."""
    import onnx

    from host_runtime import popef
    from tools import poprt
    from tools._chain_model import chain_model, reference, write_shard_yaml

    chain = chain_model(4, width=8, batch=2, seed=7)
    onnx.save(chain, tmp_path / "chain.onnx")
    argv = ["--input_model", str(tmp_path / "chain.onnx"), "--num_ipus", "2",
            "--manual_sharding_config", write_shard_yaml(str(tmp_path / "s.yaml"), 4, 2,
                                                         pipelined),
            "--batches_per_step", str(bps), "--export_popef", "--output_dir",
            str(tmp_path / "out")] + (["--enable_pipelining"] if pipelined else [])
    assert poprt.main(argv) == 0
    m = popef.load_model([str(tmp_path / "out" / "executable.popef")])
    xs = [np.random.default_rng(i).standard_normal((2, 8)).astype(np.float32) for i in range(6)]
    with offline(), loopback_device(m) as dev:
        assert dev.numIpus() == 2 and len(loopback_ipus(dev)) == 2
        with model_runtime.ModelRunner(m, model_runtime.ModelRunnerConfig(
                replica_to_device={0: dev})) as r:
            futures = [r.executeAsync({"x": x}) for x in xs]
            for x, fut in zip(xs, futures):
                np.testing.assert_allclose(fut.result(timeout=30)["y"], reference(chain, x),
                                           rtol=1e-5, atol=1e-5)


def test_shared_memory_inputs_are_read_in_place(tmp_path):
    """``empty_shared`` inputs: the loopback IPU maps the arrays' regions (HostMemory)."""
    import gc

    from host_runtime import popef
    from host_runtime.memory._shared import SHARED_MIN_BYTES, shared_location
    from tests._helpers import weights_of, write_example

    def mappings(arr: np.ndarray) -> int:
        """How many times this process maps the array's region (/proc/self/maps)."""
        loc = shared_location(arr)
        assert loc is not None
        with open("/proc/self/maps") as f:
            return sum(1 for line in f if line.rstrip().endswith(loc[0].lstrip("/")))

    shape = (16, 256)
    assert shape[0] * shape[1] * 4 >= SHARED_MIN_BYTES
    m = popef.load_model([write_example(tmp_path, shape)])
    w = weights_of(m, shape)
    rng = np.random.default_rng(5)
    with offline():
        with loopback_device(m) as dev, model_runtime.ModelRunner(
                m, model_runtime.ModelRunnerConfig(replica_to_device={0: dev})) as r:
            a = model_runtime.empty_shared(shape, np.float32)
            b = model_runtime.empty_shared(shape, np.float32)
            assert mappings(a) == mappings(b) == 1
            for k in range(3):
                a[...] = rng.standard_normal(shape)
                b[...] = k
                out = r.execute({"tensor_A": a, "tensor_B": b})["tensor_C"]
                np.testing.assert_allclose(out, a * w + b, rtol=1e-6)
            # the device side mapped the arrays' regions too (in place, not copies)
            assert mappings(a) == mappings(b) == 2
        del a, b
        gc.collect()
