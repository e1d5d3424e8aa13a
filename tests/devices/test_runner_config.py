"""ModelRunner options on both kinds of IPU (tests/devices/conftest.py): replicas, thread
safety, frozen inputs, save programs, closing, ring depths, device iterations; and the
checks of a configuration that refuse it before any device is attached (run once).

The seeds' example model with a batch of 4 samples of 3 floats:
``tensor_C = tensor_A * weights + tensor_B``.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import host_runtime as model_runtime
from host_runtime import popef
from host_runtime.errors import BadRequestError, InvalidStateError
from tools.generate_simple_popef import write_simple_popef
from tests._helpers import run_in_threads, running

from tests.devices._example import SHAPE, check_healthy, pair, rand


# ------------------------------------------------------------------ replicas
@pytest.mark.embedded_only
def test_replication_two_replicas(kind, make_runner, model_path, weights):
    r = make_runner(model_runtime.PopefPaths([model_path]), replication_factor=2)
    devices = [rep.session.device() for rep in r._replicas]
    pids = [d.pids()[0] for d in devices]
    if kind.in_thread:
        assert pids == [os.getpid()] * 2, "loopback IPUs run in this process"
    else:
        assert len(set(pids)) == 2, "each replica runs on its own IPU process"
    assert len({id(d) for d in devices}) == 2, "each replica has a device of its own"
    for replica_id in range(2):
        a, b = pair()
        iv = model_runtime.InputMemoryView()
        iv.update(tensor_A=a, tensor_B=b)
        result = r.execute(iv, replica_id=replica_id)
        got = np.frombuffer(result["tensor_C"], np.float32).reshape(SHAPE)
        np.testing.assert_allclose(got, a * weights + b, rtol=1e-6)
    futs = [(pair(), rid) for rid in (0, 1, 1, 0)]
    pending = [(a, b, r.executeAsync({"tensor_A": a, "tensor_B": b}, replica_id=rid))
               for (a, b), rid in futs]
    for a, b, fut in pending:
        np.testing.assert_allclose(fut["tensor_C"], a * weights + b, rtol=1e-6)
    counts = [r.getMonitoringStatisticsTotalCount({}, replica_id=i)[
        "request_monitoring_statistics_count"] for i in range(2)]
    assert counts == [3.0, 3.0]
    with pytest.raises(BadRequestError, match="replica_id 2 is out of range; expected 0..1"):
        r.execute({"tensor_A": a, "tensor_B": b}, replica_id=2)
    r.close()
    with pytest.raises(InvalidStateError, match="the ModelRunner is closed"):
        r.execute({"tensor_A": a, "tensor_B": b})
    if kind.in_thread:   # the runner does not close devices it was given
        assert all(d.isAttached() for d in devices)
    else:
        assert not any(running(p) for p in pids), "close() stops the replicas' IPU processes"


@pytest.mark.ipu_kinds("thread", reason="IPU processes: tests/integration/test_sharding.py")
@pytest.mark.parametrize("pipelined,bps", [(False, 1), (True, 2)], ids=["sharded", "pipelined"])
def test_a_model_over_a_two_ipu_device_matches_onnxruntime(kind, tmp_path, pipelined, bps):
    """A 2-IPU device (a GroupLink): two IPUs, the IPU-Link rings between them."""
    import onnx

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
    with kind.device(m) as dev:
        assert dev.numIpus() == 2 and len(dev.processes) == 2
        with model_runtime.ModelRunner(m, model_runtime.ModelRunnerConfig(
                replica_to_device={0: dev})) as r:
            futures = [r.executeAsync({"x": x}) for x in xs]
            for x, fut in zip(xs, futures):
                np.testing.assert_allclose(fut.result(timeout=30)["y"], reference(chain, x),
                                           rtol=1e-5, atol=1e-5)


def test_multithreading_thread_safe(make_runner, model_path, weights):
    cfg = model_runtime.ModelRunnerConfig()
    cfg.thread_safe = True
    errors: list[str] = []
    done = []
    with make_runner(model_path, cfg) as r:
        def worker(wid):
            rng = np.random.default_rng(wid)
            try:
                reqs = [(rng.standard_normal(SHAPE).astype(np.float32),
                         rng.standard_normal(SHAPE).astype(np.float32)) for _ in range(5)]
                futs = []
                for a, b in reqs:
                    iv = model_runtime.InputMemoryView()
                    iv.update(tensor_A=a, tensor_B=b)
                    futs.append(r.executeAsync(iv))
                for (a, b), f in zip(reqs, futs):
                    f.wait()
                    got = np.frombuffer(f["tensor_C"], np.float32).reshape(SHAPE)
                    np.testing.assert_allclose(got, a * weights + b, rtol=1e-6)
                    done.append(wid)
            except Exception as exc:
                errors.append(f"worker {wid}: {exc!r}")
        run_in_threads(worker, range(4))
        assert errors == []
        assert len(done) == 20
        assert r.getMonitoringStatisticsTotalCount({})["request_monitoring_statistics_count"] == 20


# ------------------------------------------------------------------ frozen inputs, save
def test_frozen_inputs_main_and_load(make_runner, model_path, weights):
    model = popef.load_model([model_path])
    frozen_b = rand(seed=5)
    frozen_w = rand(seed=6)
    cfg = model_runtime.ModelRunnerConfig()
    frozen = model_runtime.InputMemoryView()
    frozen["tensor_B"] = frozen_b
    cfg.frozen_inputs = frozen
    with make_runner(model, cfg) as r:
        assert [d.name for d in r.getExecuteInputs()] == ["tensor_A"]
        for seed in range(3):
            a = rand(seed=seed)
            result = r.execute({"tensor_A": a})
            np.testing.assert_allclose(result["tensor_C"], a * weights + frozen_b, rtol=1e-6)
        # seed: a frozen input is no longer required; given anyway, it is ignored
        given_b = rand(seed=7)
        for inputs in ({"tensor_A": a, "tensor_B": given_b},
                       model_runtime.InputMemoryView({"tensor_A": a, "tensor_B": given_b})):
            result = r.execute(inputs)
            np.testing.assert_allclose(np.frombuffer(result["tensor_C"], np.float32).reshape(SHAPE),
                                       a * weights + frozen_b, rtol=1e-6)
            fut = r.executeAsync(inputs)
            np.testing.assert_allclose(np.asarray(fut["tensor_C"]), a * weights + frozen_b,
                                       rtol=1e-6)
        out = np.zeros(SHAPE, np.float32)
        r.execute({"tensor_A": a, "tensor_B": given_b}, {"tensor_C": out})
        np.testing.assert_allclose(out, a * weights + frozen_b, rtol=1e-6)
    # a frozen PopEF tensor-data anchor overrides the file's weights
    with make_runner(model, frozen_inputs={"weights": frozen_w}) as r:
        a, b = pair()
        np.testing.assert_allclose(r.execute({"tensor_A": a, "tensor_B": b})["tensor_C"],
                                   a * frozen_w + b, rtol=1e-6)
        # the frozen weights given to execute anyway: ignored too
        np.testing.assert_allclose(r.execute({"tensor_A": a, "tensor_B": b,
                                              "weights": rand(seed=8)})["tensor_C"],
                                   a * frozen_w + b, rtol=1e-6)


def test_frozen_inputs_checked(model_path):
    cfg = model_runtime.ModelRunnerConfig(frozen_inputs={"nope": np.zeros(3)})
    with pytest.raises(BadRequestError, match="frozen_inputs: the model has no input 'nope'"):
        model_runtime.ModelRunner(model_path, config=cfg)
    cfg = model_runtime.ModelRunnerConfig(frozen_inputs={"tensor_B": np.zeros((2, 3), np.float32)})
    with pytest.raises(BadRequestError, match=r"input 'tensor_B': expected shape \[4, 3\]"):
        model_runtime.ModelRunner(model_path, config=cfg)


def test_save_programs_on_close_fill_outputs(make_runner, model_path, weights):
    cfg = model_runtime.ModelRunnerConfig()
    cfg.run_save_programs = True
    mine = np.zeros(SHAPE, np.float32)
    cfg.replica_to_save_programs_outputs = {0: {"weights_saved": mine}}
    r = make_runner(model_path, cfg)
    check_healthy(r, weights)
    assert not mine.any()
    r.close()
    np.testing.assert_array_equal(mine, weights)
    # without user memory the runner allocates it and fills the config's dict
    cfg2 = model_runtime.ModelRunnerConfig(run_save_programs=True)
    with make_runner(model_path, cfg2):
        pass
    np.testing.assert_array_equal(
        np.asarray(cfg2.replica_to_save_programs_outputs[0]["weights_saved"]), weights)


# ------------------------------------------------------------------ closing, devices
@pytest.mark.embedded_only
def test_close_is_idempotent(kind, make_runner, model_path, weights):
    r = make_runner(model_path)
    dev = r._replicas[0].session.device()
    pid = dev.pids()[0]
    check_healthy(r, weights)
    r.close()
    r.close()
    with pytest.raises(InvalidStateError, match="the ModelRunner is closed"):
        r.execute({"tensor_A": rand(), "tensor_B": rand()})
    if kind.in_thread:   # a given device stays attached
        assert dev.isAttached()
    else:                # the runner's own device is released: its IPU process ends
        assert not dev.isAttached() and not running(pid)


def test_replica_to_device_uses_the_given_device(device, model_path, weights):
    cfg = model_runtime.ModelRunnerConfig(replica_to_device={0: device})
    with model_runtime.ModelRunner(model_path, config=cfg) as r:
        assert r._replicas[0].session.device() is device
        check_healthy(r, weights)
    assert device.isAttached(), "the caller's device stays attached after close()"


@pytest.mark.embedded_only
@pytest.mark.ipu_kinds("process", reason="a machine's IPU count bounds the IPU processes only")
def test_no_device_available_fails_cleanly(kind, model_path, monkeypatch, tmp_path):
    monkeypatch.setenv("IPU_EMULATOR_HOME", str(tmp_path / "machine"))   # a 1-IPU machine
    monkeypatch.setenv("IPU_EMULATOR_NUM_IPUS", "1")
    cfg = model_runtime.ModelRunnerConfig(replication_factor=2,
                                          device_wait_config=model_runtime.DeviceWaitConfig())
    with pytest.raises(model_runtime.DeviceUnavailableError, match="NO_WAIT"):
        model_runtime.ModelRunner(model_path, config=cfg)
    with model_runtime.ModelRunner(model_path) as r:   # the first replica's IPU was released
        assert r.getExecuteInputs()


@pytest.mark.embedded_only
@pytest.mark.ipu_kinds("process", reason="only a runner's own devices are released with it")
def test_garbage_collection_releases_the_device(kind, model_path):
    import gc

    r = model_runtime.ModelRunner(model_path)
    pid = r._replicas[0].session.device().pids()[0]
    del r
    gc.collect()
    assert not running(pid)


def test_bad_config_refused(model_path):
    cfg = model_runtime.ModelRunnerConfig()
    cfg.replication_factor = 0
    with pytest.raises(BadRequestError, match=r"ModelRunnerConfig.replication_factor: expected "
                                              r"an int in 1\.\.64 .*, got 0"):
        model_runtime.ModelRunner(model_path, config=cfg)
    with pytest.raises(BadRequestError, match="expects a PopEF path"):
        model_runtime.ModelRunner(42)


def test_check_package_hash(make_runner, tmp_path, monkeypatch, weights):
    import ipu_emulator

    monkeypatch.setattr(ipu_emulator, "package_hash", lambda: "0" * 64)
    path = tmp_path / "other_build.popef"
    write_simple_popef(path, shape=SHAPE)
    monkeypatch.undo()
    with pytest.raises(model_runtime.PackageHashMismatchError,
                       match="package hash 0{64} differs from runtime hash"):
        make_runner(str(path))
    with make_runner(str(path), check_package_hash=False) as r:
        check_healthy(r, weights)


# ------------------------------------------------------------------ rings, iterations
def test_max_look_ahead_zero_still_runs_many_in_flight(make_runner, model_path, weights):
    """One slot per stream ring: submitting more requests drains the earlier ones."""
    with make_runner(model_path, max_look_ahead="0") as r:
        assert r._replicas[0].input_rings()["tensor_A"].num_slots == 1
        reqs = [pair() for _ in range(6)]
        futs = [r.executeAsync({"tensor_A": a, "tensor_B": b}) for a, b in reqs]
        for (a, b), f in zip(reqs, futs):
            np.testing.assert_allclose(f["tensor_C"], a * weights + b, rtol=1e-6)


@pytest.mark.parametrize("multiplier, depth", [(1, 8), (3, 8), (12, 12)])
def test_ring_buffer_size_multiplier_sets_the_main_ring_depth(make_runner, model_path, weights,
                                                               multiplier, depth):
    """Seed: ring size = ring_buffer_size_multiplier x batch size (a slot holds one transfer
    of the model's batch); small transfers get up to 8 slots; load/save rings keep 2. The
    multiplier alone where slots are large: test_seed_deviations.py."""
    with make_runner(model_path, ring_buffer_size_multiplier=multiplier) as r:
        rep = r._replicas[0]
        assert rep.input_rings()["tensor_A"].num_slots == depth
        assert rep.input_rings()["tensor_B"].num_slots == depth
        s = rep.session
        assert s.direct.output_ring("tensor_C").num_slots == depth
        assert s.direct.input_ring("weights").num_slots == 2
        check_healthy(r, weights)
        reqs = [pair() for _ in range(3 * depth)]
        futs = [r.executeAsync({"tensor_A": a, "tensor_B": b}) for a, b in reqs]
        for (a, b), f in zip(reqs, futs):
            np.testing.assert_allclose(f["tensor_C"], a * weights + b, rtol=1e-6)


def test_max_look_ahead_caps_the_ring_buffer_size_multiplier(make_runner, model_path):
    with make_runner(model_path, ring_buffer_size_multiplier=6, max_look_ahead="2") as r:
        assert r._replicas[0].input_rings()["tensor_A"].num_slots == 3


def test_device_iterations_are_transparent(make_runner, tmp_path):
    """batches_per_step 3: Main reads 3 transfers per run; requests still map 1:1 to transfers."""
    path = tmp_path / "bps3.popef"
    write_simple_popef(path, shape=SHAPE, batches_per_step=3)
    w = np.frombuffer(popef.load_model([str(path)]).tensorData("weights").data,
                      np.float32).reshape(SHAPE)
    with make_runner(str(path)) as r:
        for n in (1, 2, 5):
            a, b = pair((4 * n, 3))
            out = r.execute({"tensor_A": a, "tensor_B": b})["tensor_C"]
            np.testing.assert_allclose(out, a * np.tile(w, (n, 1)) + b, rtol=1e-6)


@pytest.mark.ipu_kinds("process", reason="a fresh interpreter exits with its IPU processes")
def test_runner_never_closed_exits_cleanly(kind, model_path, tmp_path):
    """The seeds' listings never close their runner: exiting must still release everything."""
    import subprocess
    import sys

    script = tmp_path / "listing.py"
    script.write_text(
        "import numpy as np\n"
        "import host_runtime as model_runtime\n"
        f"r = model_runtime.ModelRunner(model_runtime.PopefPaths([{model_path!r}]))\n"
        "x = {d.name: np.ones(d.shape, d.numpy_data_type()) for d in r.getExecuteInputs()}\n"
        "print('shape', r.execute(x)['tensor_C'].shape)\n")
    env = dict(os.environ, IPU_EMULATOR_HOME=str(tmp_path / "machine"))
    proc = subprocess.run([sys.executable, "-X", "faulthandler", str(script)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "shape (4, 3)" in proc.stdout
