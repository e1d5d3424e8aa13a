"""UNLOAD when a session lets go of a device it shares: sent only for an executable the
device may cache (one it was sent); waited for, unless another session's main loop runs
on the device (the device takes it once that loop ends). Loopback device, no process."""

from __future__ import annotations

import numpy as np
import pytest

import host_runtime as model_runtime
from host_runtime.devices import _link
from host_runtime.errors import InvalidStateError
from ipu_emulator.ipu_protocol import Op
from tests.unit._loopback import model, model_path, weights  # noqa: F401  (fixtures)

SHAPE = (1, 4)


@pytest.fixture
def ops(loopback_device, monkeypatch):
    """The ops the device's link is sent, and ``"waited"`` after each the host waited for."""
    sent: list[object] = []
    link = loopback_device.link
    real_request = link.request

    def request(op, *args, **kwargs):
        sent.append(op)
        return real_request(op, *args, **kwargs)
    monkeypatch.setattr(link, "request", request)
    real_wait = _link.wait

    def wait(fut, timeout, what, *args, **kwargs):
        if what.startswith("UNLOAD"):
            sent.append("waited")
        return real_wait(fut, timeout, what, *args, **kwargs)
    monkeypatch.setattr(_link, "wait", wait)
    return sent


def test_a_runner_refused_a_device_busy_with_another_loop_sends_no_unload(
        model_path, weights, loopback_device, ops):
    cfg = model_runtime.ModelRunnerConfig(replica_to_device={0: loopback_device})
    with model_runtime.ModelRunner(model_path, cfg) as first:
        ops.clear()
        with pytest.raises(InvalidStateError, match="running the main loop of another session"):
            model_runtime.ModelRunner(model_path, cfg)
        assert Op.UNLOAD not in ops and Op.LOAD not in ops
        a = np.arange(4, dtype=np.float32).reshape(SHAPE)
        b = np.ones(SHAPE, np.float32)
        np.testing.assert_allclose(first.execute({"tensor_A": a, "tensor_B": b})["tensor_C"],
                                   a * weights + b, rtol=1e-6)


def test_unload_is_waited_for_unless_another_session_loops(model_path, weights,
                                                            loopback_device, ops):
    one = model_runtime.Session(model_path)
    two = model_runtime.Session(model_path)
    three = model_runtime.Session(model_path)
    try:
        one.bindToDevice(loopback_device)
        one.runLoadPrograms()
        two.bindToDevice(loopback_device)   # takes the device: one's executable is cached
        two.runLoadPrograms()
        ops.clear()
        one.close()
        assert ops == [Op.UNLOAD, "waited"]   # the device let go of it when close returned
        three.bindToDevice(loopback_device)
        three.runLoadPrograms()
        cfg = model_runtime.ModelRunnerConfig(replica_to_device={0: loopback_device})
        with model_runtime.ModelRunner(model_path, cfg) as runner:   # its main loop runs
            ops.clear()
            three.close()   # the device takes the UNLOAD once the runner's loop ends
            assert ops == [Op.UNLOAD]
            a = np.arange(4, dtype=np.float32).reshape(SHAPE)
            b = np.ones(SHAPE, np.float32)
            np.testing.assert_allclose(
                runner.execute({"tensor_A": a, "tensor_B": b})["tensor_C"], a * weights + b,
                rtol=1e-6)
    finally:
        three.close()
        two.close()
        one.close()
