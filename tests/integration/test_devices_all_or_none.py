"""A ModelRunner's replicas attach their devices all at once, or none.

Holding some replicas' IPUs while waiting for the others lets two runners
deadlock each other (each holds one IPU and waits for the other's). The
runner therefore reserves every replica's device in one attempt and releases
what it holds before it waits again.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import numpy as np
import pytest

import host_runtime as model_runtime
from host_runtime.devices._manager import DeviceManager, DeviceWaitConfig, DeviceWaitStrategy
from host_runtime.errors import DeviceUnavailableError
from tests._helpers import run_in_threads

NO_WAIT = DeviceWaitConfig()


@pytest.fixture
def three_ipus(tmp_path, monkeypatch):
    monkeypatch.setenv("IPU_EMULATOR_HOME", str(tmp_path / "machine"))
    monkeypatch.setenv("IPU_EMULATOR_NUM_IPUS", "3")


def test_short_of_devices_nothing_stays_held(three_ipus, model):
    dm = DeviceManager()
    held = [dm.getDevice(1), dm.getDevice(1)]
    try:
        with pytest.raises(DeviceUnavailableError, match=r"asked for 2 devices of 1 IPU\(s\)"):
            dm.get_devices_all_or_none(model, 2, NO_WAIT)
        # The one free IPU was reserved during the attempt and must be free again.
        free = dm.getDevice(1)
        free.close()
    finally:
        for dev in held:
            dev.close()


def test_a_runner_short_of_devices_releases_what_it_reserved(three_ipus, model_path):
    dm = DeviceManager()
    held = dm.getDevice(1)
    other = dm.getDevice(1)
    try:
        config = model_runtime.ModelRunnerConfig()
        config.replication_factor = 2
        config.device_wait_config = DeviceWaitConfig(
            DeviceWaitStrategy.WAIT_WITH_TIMEOUT, timeout=timedelta(milliseconds=200),
            sleepTime=timedelta(milliseconds=20))
        with pytest.raises(DeviceUnavailableError, match=r"busy: ipu \d by pid \d+"):
            model_runtime.ModelRunner(model_path, config=config)
        dm.getDevice(1).close()
    finally:
        held.close()
        other.close()


def test_more_devices_than_the_machine_has_fails_at_once(three_ipus, model):
    wait_forever = DeviceWaitConfig(DeviceWaitStrategy.WAIT_FOREVER,
                                    sleepTime=timedelta(seconds=1))
    with pytest.raises(DeviceUnavailableError,
                       match=r"asked for 4 devices of 1 IPU\(s\) with WAIT_FOREVER, but this machine "
                             r"has 3 IPU\(s\)"):
        DeviceManager().get_devices_all_or_none(model, 4, wait_forever)


def test_replicas_get_their_devices_together_and_release_them_on_close(three_ipus, model_path,
                                                                     weights):
    config = model_runtime.ModelRunnerConfig()
    config.replication_factor = 3
    with model_runtime.ModelRunner(model_path, config=config) as runner:
        # All three IPUs are the runner's now.
        with pytest.raises(DeviceUnavailableError):
            DeviceManager().getDevice(1)
        rng = np.random.default_rng(3)
        for rid in range(3):
            a = rng.standard_normal((1, 4)).astype(np.float32)
            b = rng.standard_normal((1, 4)).astype(np.float32)
            out = runner.execute({"tensor_A": a, "tensor_B": b}, replica_id=rid)
            np.testing.assert_allclose(out["tensor_C"], a * weights + b, rtol=1e-6)
    dm = DeviceManager()
    dm.getDevice(2).close()
    dm.getDevice(1).close()


def test_two_runners_racing_for_two_ipus_both_finish(tmp_path, monkeypatch, model_path, weights):
    # Attaching replica by replica, each runner could take one IPU and wait for the
    # other's forever; all-or-none, one runs while the other waits, then the other.
    monkeypatch.setenv("IPU_EMULATOR_HOME", str(tmp_path / "machine"))
    monkeypatch.setenv("IPU_EMULATOR_NUM_IPUS", "2")
    start = threading.Barrier(2)
    results: dict[int, object] = {}

    def run(k: int) -> None:
        config = model_runtime.ModelRunnerConfig()
        config.replication_factor = 2
        config.device_wait_config = DeviceWaitConfig(
            DeviceWaitStrategy.WAIT_WITH_TIMEOUT, timeout=timedelta(seconds=60),
            sleepTime=timedelta(milliseconds=10))
        a = np.full((1, 4), k + 1, np.float32)
        b = np.ones((1, 4), np.float32)
        try:
            start.wait()
            with model_runtime.ModelRunner(model_path, config=config) as runner:
                results[k] = [runner.execute({"tensor_A": a, "tensor_B": b}, replica_id=r)
                              ["tensor_C"].copy() for r in range(2)]
        except BaseException as exc:   # reported below
            results[k] = exc

    run_in_threads(run, range(2))
    for k in range(2):
        assert not isinstance(results[k], BaseException), results[k]
        for out in results[k]:  # type: ignore[union-attr]
            np.testing.assert_allclose(out, (k + 1) * weights + 1, rtol=1e-6)
