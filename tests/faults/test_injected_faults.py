"""Faults injected on purpose (ipu_emulator.faults): Poplar's error classes and auto_reset.

For each kind, with and without ``auto_reset``: the class of the error the affected
request gets, its ``recovery_action``, the IPU, replica and program its message names,
what the next requests get (an answer after a reset; else the same class again, the
first error as its cause), the recovery the README gives (a new runner) working, and
nothing left running after close (the per-test probe checks /dev/shm). Replicated and
pipelined models, a live injection into a running runner, a Session, and a stopped
(SIGSTOP) IPU process. The path matrix runs this module again through a daemon.
"""

from __future__ import annotations

import os
import re
import signal
import time

import numpy as np
import onnx
import psutil
import pytest
from prometheus_client import generate_latest

import host_runtime as model_runtime
from host_runtime import settings
from host_runtime.errors import (ApplicationRuntimeError, DeviceLostError, DeviceTimeoutError,
                                 RecoverableRuntimeError, RecoveryAction,
                                 UnrecoverableRuntimeError)
from ipu_emulator import faults
from tools import poprt
from tools._chain_model import chain_model, reference, write_shard_yaml

SHAPE = (4, 3)
SYNC = 0.3       # the host sync timeout of the hang tests (s)

pytestmark = pytest.mark.usefixtures("private_machine")


def collector_registry(runner):
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    registry.register(runner.metrics_collector())
    return registry


def rand(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"tensor_A": rng.standard_normal(SHAPE).astype(np.float32),
            "tensor_B": rng.standard_normal(SHAPE).astype(np.float32)}


def check(runner, weights, seed: int, **kw) -> None:
    x = rand(seed)
    np.testing.assert_allclose(runner.execute(x, **kw)["tensor_C"],
                               x["tensor_A"] * weights + x["tensor_B"], rtol=1e-6)


def device_of(runner, replica: int = 0):
    return runner._replicas[replica].session.device()


def ipu_processes(runner) -> list[int]:
    return [pid for r in range(len(runner._replicas)) for pid in device_of(runner, r).pids()]


def assert_gone(pids: list[int]) -> None:
    """The IPU processes ended (embedded) or went back to the daemon's pool (not ours)."""
    me = psutil.Process()
    ours = {p.pid for p in me.children(recursive=True)}
    left = [p for p in pids if p in ours and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not left, f"IPU processes {left} still run after close"


POPLAR = [
    ("application_error", {}, ApplicationRuntimeError, None, True),
    ("recoverable_error", {}, RecoverableRuntimeError, RecoveryAction.IPU_RESET, True),
    ("recoverable_error", {"action": "LINK_RESET"}, RecoverableRuntimeError,
     RecoveryAction.LINK_RESET, False),
    ("recoverable_error", {"action": "FULL_RESET"}, RecoverableRuntimeError,
     RecoveryAction.FULL_RESET, False),
    ("unrecoverable_error", {}, UnrecoverableRuntimeError, None, False),
]


@pytest.mark.parametrize("auto_reset", [True, False], ids=["auto_reset", "no_reset"])
@pytest.mark.parametrize("kind,fields,cls,action,resets", POPLAR,
                         ids=["application", "recoverable-ipu", "recoverable-link",
                              "recoverable-full", "unrecoverable"])
def test_poplar_error_classes_and_auto_reset(model_path, weights, kind, fields, cls, action,
                                             resets, auto_reset):
    cfg = model_runtime.ModelRunnerConfig(auto_reset=auto_reset)
    with faults.inject(kind=kind, after=1, **fields) as plan:
        r = model_runtime.ModelRunner(model_path, config=cfg)
    try:
        where = device_of(r).describe()
        check(r, weights, 0)                              # run 0: before the fault
        with pytest.raises(cls) as info:
            r.execute(rand(1))                            # run 1: the fault
        err = info.value
        assert type(err) is cls
        if action is not None:
            assert err.recovery_action is action
        assert err.ipu == where and err.replica == 0 and err.program == 1
        assert f"replica 0: {where}: " in str(err) and "program 1 (main)" in str(err), str(err)
        text = generate_latest(collector_registry(r)).decode()   # Prometheus, by class
        assert re.search(rf'_faults_injected_total{{[^}}]*kind="{kind}"[^}}]*}} 1\.0', text), text
        assert re.search(rf'_request_errors_total{{[^}}]*error="{cls.__name__}"[^}}]*}} 1\.0', text)
        if resets and auto_reset:
            check(r, weights, 2)                          # reset before this inference
            assert r.request_monitors()[0].snapshot().resets == {cls.__name__: 1}
            assert re.search(rf'_resets_total{{[^}}]*error="{cls.__name__}"[^}}]*}} 1\.0',
                             generate_latest(collector_registry(r)).decode())
        else:
            for seed in (2, 3):                           # no action taken: fails again
                with pytest.raises(cls, match="replica 0 is unusable after an earlier") as later:
                    r.execute(rand(seed))
                assert type(later.value.__cause__) is cls
                assert str(later.value.__cause__) == str(err)
                if action is not None:
                    assert later.value.recovery_action is action
            with pytest.raises(cls):
                r.executeAsync(rand(4)).wait()
            assert r.request_monitors()[0].snapshot().resets == {}
            pids = ipu_processes(r)
            r.close()                                     # the README's recovery: a new runner
            assert_gone(pids)
            with plan:
                r = model_runtime.ModelRunner(model_path, config=cfg)
            check(r, weights, 5)                          # fired `times` (1) in all
        assert r.faults_injected() == {kind: 1}
        assert [fired for _, _, fired in plan.counts()] == [1]
    finally:
        pids = ipu_processes(r)
        r.close()
        plan.close()
    assert_gone(pids)


@pytest.mark.parametrize("auto_reset", [True, False], ids=["auto_reset", "no_reset"])
def test_hang_is_bounded_by_the_host_sync_timeout(model_path, weights, auto_reset):
    cfg = model_runtime.ModelRunnerConfig(auto_reset=auto_reset)
    with faults.inject(kind="hang", after=1), settings.override(host_sync_timeout=SYNC):
        r = model_runtime.ModelRunner(model_path, config=cfg)
    with r:
        pids = ipu_processes(r)
        where = device_of(r).describe()
        check(r, weights, 0)
        with pytest.raises(DeviceTimeoutError, match="IPU_EMULATOR_HOST_SYNC_TIMEOUT") as info:
            r.execute(rand(1))
        assert str(info.value).startswith(f"replica 0: {where}: waiting for the outputs")
        if auto_reset:
            check(r, weights, 2)           # the IPU was restarted: the next one succeeds
            assert r.request_monitors()[0].snapshot().resets == {"DeviceTimeoutError": 1}
        else:                              # no action: the IPU still hangs
            with pytest.raises(DeviceTimeoutError, match="earlier requests"):
                r.execute(rand(2))
    assert_gone(pids)


@pytest.mark.parametrize("auto_reset", [True, False], ids=["auto_reset", "no_reset"])
def test_crash_loses_the_device(model_path, weights, auto_reset):
    cfg = model_runtime.ModelRunnerConfig(auto_reset=auto_reset)
    with faults.inject(kind="crash", after=1):
        r = model_runtime.ModelRunner(model_path, config=cfg)
    with r:
        where = device_of(r).describe()
        check(r, weights, 0)
        with pytest.raises(DeviceLostError, match=re.escape(where) + ": IPU process .* SIGKILL"):
            r.execute(rand(1))
        if auto_reset:
            check(r, weights, 2)
        else:
            with pytest.raises(DeviceLostError, match="unusable") as later:
                r.execute(rand(2))
            assert isinstance(later.value.__cause__, DeviceLostError)
        pids = ipu_processes(r)
    assert_gone(pids)


def test_slow_runs_take_longer_and_answer_right(model_path, weights):
    with faults.inject(kind="slow", delay_ms=150, after=1, times=2) as plan:
        r = model_runtime.ModelRunner(model_path)
    with r:
        check(r, weights, 0)
        for seed in (1, 2):
            t0 = time.monotonic()
            check(r, weights, seed)
            assert time.monotonic() - t0 >= 0.15        # at least delay_ms longer
        check(r, weights, 3)
    assert [(seen, fired) for _, seen, fired in plan.counts()] == [(4, 2)]
    plan.close()


def test_replicated_the_fault_hits_the_replica_that_runs(model_path, weights):
    """A fault for every IPU fires on the first Main run: only replica 1 runs, so only
    replica 1 fails, with its IPU named; replica 0 answers throughout."""
    cfg = model_runtime.ModelRunnerConfig(replication_factor=2)
    with faults.inject(kind="unrecoverable_error"):
        r = model_runtime.ModelRunner(model_path, config=cfg)
    with r:
        where = device_of(r, 1).describe()
        with pytest.raises(UnrecoverableRuntimeError) as info:
            r.execute(rand(0), replica_id=1)
        assert info.value.replica == 1 and info.value.ipu == where
        assert str(info.value).startswith(f"replica 1: {where}: ")
        check(r, weights, 1, replica_id=0)
        with pytest.raises(UnrecoverableRuntimeError, match="replica 1 is unusable"):
            r.execute(rand(2), replica_id=1)
        check(r, weights, 3, replica_id=0)


def test_live_injection_into_a_running_runner(model_path, weights):
    with faults.inject() as plan:
        r = model_runtime.ModelRunner(model_path, config=model_runtime.ModelRunnerConfig(
            auto_reset=True))
    with r:
        check(r, weights, 0)
        plan.add(kind="application_error")           # seen by the IPU at its next run
        with pytest.raises(ApplicationRuntimeError):
            r.execute(rand(1))
        check(r, weights, 2)
        plan.clear()
        check(r, weights, 3)
    plan.close()


def test_a_session_gets_the_class_too(model_path, weights):
    with faults.inject(kind="recoverable_error", action="PARTITION_RESET"):
        s = model_runtime.Session(model_path)
    with s:
        s.bindToDevice(model_runtime.DeviceManager().getDevice(s.model(), wait_config=model_runtime
                                                                .DeviceWaitConfig(60, 0.05)))
        qm = s.createQueueManager()
        x = rand(0)
        c = np.zeros(SHAPE, np.float32)
        qm.inputs["tensor_A"].enqueue(x["tensor_A"], x["tensor_A"].nbytes)
        qm.inputs["tensor_B"].enqueue(x["tensor_B"], x["tensor_B"].nbytes)
        qm.outputs["tensor_C"].enqueue(c, c.nbytes)
        with pytest.raises(RecoverableRuntimeError) as info:
            s.runMainPrograms()
        assert info.value.recovery_action is RecoveryAction.PARTITION_RESET
        assert info.value.replica is None and info.value.program == 1
        s.reload()                                   # recovered: the fault fired its 1 time
        qm = s.createQueueManager()
        x = rand(1)
        qm.inputs["tensor_A"].enqueue(x["tensor_A"], x["tensor_A"].nbytes)
        qm.inputs["tensor_B"].enqueue(x["tensor_B"], x["tensor_B"].nbytes)
        qm.outputs["tensor_C"].enqueue(c, c.nbytes)
        s.runMainPrograms()
        np.testing.assert_allclose(c, x["tensor_A"] * weights + x["tensor_B"], rtol=1e-6)


@pytest.mark.embedded_only
def test_stopped_ipu_process_with_auto_reset_is_replaced(model_path, weights):
    cfg = model_runtime.ModelRunnerConfig(auto_reset=True)
    with settings.override(host_sync_timeout=SYNC):
        r = model_runtime.ModelRunner(model_path, config=cfg)
    with r:
        check(r, weights, 0)
        (pid,) = ipu_processes(r)
        os.kill(pid, signal.SIGSTOP)
        try:
            with pytest.raises(DeviceTimeoutError, match=f"{pid}"):
                r.execute(rand(1))
            check(r, weights, 2)             # a new IPU process, the stopped one killed
            assert ipu_processes(r) != [pid]
        finally:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


# -- models over several IPUs ---------------------------------------------------------------

@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pipelined")
    model = chain_model(2, width=8, batch=2, seed=3)
    onnx.save(model, str(tmp / "chain.onnx"))
    write_shard_yaml(tmp / "shard.yaml", 2, 2, pipelined=True)
    assert poprt.main(["--input_model", str(tmp / "chain.onnx"), "--num_ipus", "2",
                       "--manual_sharding_config", str(tmp / "shard.yaml"),
                       "--enable_pipelining", "--batches_per_step", "2", "--export_popef",
                       "--output_dir", str(tmp / "out")]) == 0
    return str(tmp / "out" / "executable.popef"), model


def test_link_down_on_a_pipelined_model_needs_a_link_reset(pipeline):
    """``after`` counts Main runs; a pipelined Main run here is 2 requests."""
    path, model = pipeline
    x = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)
    cfg = model_runtime.ModelRunnerConfig(auto_reset=True)
    with faults.inject(kind="link_down", after=1) as plan:
        r = model_runtime.ModelRunner(path, config=cfg)
    try:
        for _ in range(2):   # Main run 0: its 2 device iterations (batches_per_step 2)
            np.testing.assert_allclose(r.execute({"x": x})["y"], reference(model, x),
                                       rtol=1e-5)
        with pytest.raises(RecoverableRuntimeError) as info:
            r.execute({"x": x})
        err = info.value
        assert err.recovery_action is RecoveryAction.LINK_RESET     # not auto_reset's to do
        assert "IPU 0 of the device (ipu " in err.ipu and "IPU-Link" in str(err)
        with pytest.raises(RecoverableRuntimeError, match="unusable") as later:
            r.execute({"x": x})
        assert later.value.recovery_action is RecoveryAction.LINK_RESET
        pids = ipu_processes(r)
        r.close()
        assert_gone(pids)
        with plan:
            r = model_runtime.ModelRunner(path, config=cfg)   # recovered: a new runner
        np.testing.assert_allclose(r.execute({"x": x})["y"], reference(model, x), rtol=1e-5)
    finally:
        r.close()
        plan.close()


def test_an_application_error_on_one_ipu_of_a_pipeline_is_reset(pipeline):
    path, model = pipeline
    x = np.random.default_rng(1).standard_normal((2, 8)).astype(np.float32)
    # every IPU: the first Main run of either IPU of the device fires it (once in all)
    with faults.inject(kind="application_error") as plan:
        r = model_runtime.ModelRunner(path, config=model_runtime.ModelRunnerConfig(
            auto_reset=True))
    with r:
        with pytest.raises(ApplicationRuntimeError, match=r"IPU \d of the device \(ipu \d+\)"):
            r.execute({"x": x})
        np.testing.assert_allclose(r.execute({"x": x})["y"], reference(model, x), rtol=1e-5)
    assert plan.fired() == 1
    plan.close()
