"""ModelRunner when an IPU process dies or a program fails on the device.

- with ``auto_reset`` the device is restarted and reloaded and the next request succeeds;
- without it, a clear ``DeviceLostError``;
- requests in flight fail with the error at once; none hangs.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import host_runtime as model_runtime
from host_runtime.errors import DeviceExecutionError, DeviceLostError
from tests._helpers import kill_and_wait

SHAPE = (4, 3)
WAIT = 60.0


# This module's own emulated machine, so that module-scoped runners of other test processes
# cannot starve it; devices are waited for as the seeds' examples do (tests/_helpers.py).
pytestmark = pytest.mark.usefixtures("private_machine")


def rand(seed):
    rng = np.random.default_rng(seed)
    return {"tensor_A": rng.standard_normal(SHAPE).astype(np.float32),
            "tensor_B": rng.standard_normal(SHAPE).astype(np.float32)}


def device_pid(runner, replica=0):
    return runner._replicas[replica].session.device().pids()[0]




def test_auto_reset_after_killed_ipu(model_path, weights):
    cfg = model_runtime.ModelRunnerConfig(auto_reset=True)
    with model_runtime.ModelRunner(model_path, config=cfg) as r:
        x = rand(0)
        np.testing.assert_allclose(r.execute(x)["tensor_C"], x["tensor_A"] * weights + x["tensor_B"],
                                   rtol=1e-6)
        old = device_pid(r)
        kill_and_wait(old)
        x = rand(1)
        out = r.execute(x)["tensor_C"]            # restarted and reloaded first
        np.testing.assert_allclose(out, x["tensor_A"] * weights + x["tensor_B"], rtol=1e-6)
        assert device_pid(r) != old
        futs = [(x, r.executeAsync(x)) for x in (rand(i) for i in range(2, 6))]
        for x, f in futs:
            np.testing.assert_allclose(f["tensor_C"], x["tensor_A"] * weights + x["tensor_B"],
                                       rtol=1e-6)


def test_without_auto_reset_a_clear_device_lost_error(model_path, weights):
    with model_runtime.ModelRunner(model_path) as r:
        pid = device_pid(r)
        kill_and_wait(pid)
        with pytest.raises(DeviceLostError, match=f"pid {pid}|IPU process {pid}"):
            r.execute(rand(0))
        with pytest.raises(DeviceLostError, match="replica 0 is unusable.*auto_reset"):
            r.execute(rand(1))
        with pytest.raises(DeviceLostError):
            r.executeAsync(rand(2))


def test_requests_in_flight_fail_at_once_and_none_hangs(model_path, weights):
    """Queued requests and a partial dynamic batch that can never complete: all fail."""
    cfg = model_runtime.ModelRunnerConfig(batching_dim=0, timeout_ns=0)   # never flush
    with model_runtime.ModelRunner(model_path, config=cfg) as r:
        futs = [(x, r.executeAsync(x)) for x in (rand(i) for i in range(12))]
        rng = np.random.default_rng(9)
        partial = r.executeAsync({"tensor_A": rng.standard_normal((2, 3)).astype(np.float32),
                                  "tensor_B": rng.standard_normal((2, 3)).astype(np.float32)})
        errors = []
        blocked = threading.Thread(target=lambda: errors.append(_capture(
            lambda: r.execute({"tensor_A": np.zeros((1, 3), np.float32),
                               "tensor_B": np.zeros((1, 3), np.float32)}))))
        blocked.start()
        kill_and_wait(device_pid(r))
        assert partial.wait(WAIT)
        with pytest.raises(DeviceLostError):
            partial.result()
        for x, f in futs:   # completed before the kill, or failed with the device's error
            assert f.wait(WAIT)
            if f.exception() is None:
                np.testing.assert_allclose(f["tensor_C"], x["tensor_A"] * weights + x["tensor_B"],
                                           rtol=1e-6)
            else:
                assert isinstance(f.exception(), DeviceLostError)
        blocked.join(WAIT)
        assert not blocked.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], DeviceLostError)


def _capture(fn):
    try:
        fn()
    except Exception as exc:
        return exc
    return None


@pytest.mark.parametrize("auto_reset", [True, False])
def test_program_error_on_device(gather_path, auto_reset):
    cfg = model_runtime.ModelRunnerConfig(auto_reset=auto_reset)
    with model_runtime.ModelRunner(gather_path, config=cfg) as r:
        assert r.execute({"idx": np.array([2], np.int64)})["out"].tolist() == [20.0]
        with pytest.raises(DeviceExecutionError, match="onnxruntime") as info:
            r.execute({"idx": np.array([7], np.int64)})
        assert "Traceback" in str(info.value.__cause__)
        if auto_reset:
            assert r.execute({"idx": np.array([3], np.int64)})["out"].tolist() == [30.0]
        else:
            with pytest.raises(DeviceLostError, match="unusable after an earlier failure"):
                r.execute({"idx": np.array([3], np.int64)})
