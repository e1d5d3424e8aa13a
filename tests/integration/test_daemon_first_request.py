"""A runner's LOAD through a daemon is the device's first request: sent the moment the
IPU's control ring is open, before the host builds the rest of the device
(host_runtime.devices._first), and taken as the session's LOAD; one that differs from
the session's LOAD is waited for and replaced."""

from __future__ import annotations

import numpy as np

import host_runtime as model_runtime
from host_runtime.devices._link import ProcessLink
from host_runtime.session._loading import Loader
from ipu_emulator.daemon import socket_protocol as wire
from ipu_emulator.ipu_protocol import Op


def _requests(monkeypatch) -> list[Op]:
    """The ops this process's device links send from now on (not a first request)."""
    sent: list[Op] = []
    real = ProcessLink.request

    def counting(self, op, *args, **kwargs):
        sent.append(op)
        return real(self, op, *args, **kwargs)
    monkeypatch.setattr(ProcessLink, "request", counting)
    return sent


def _check(runner, weights) -> None:
    rng = np.random.default_rng(3)
    a = rng.standard_normal((1, 4)).astype(np.float32)
    b = rng.standard_normal((1, 4)).astype(np.float32)
    out = runner.execute({"tensor_A": a, "tensor_B": b})["tensor_C"]
    np.testing.assert_allclose(out, a * weights + b, rtol=1e-6)


def test_a_runners_load_is_its_devices_first_request(daemon, model_path, weights,
                                                     monkeypatch) -> None:
    monkeypatch.setenv(wire.ENV_VAR, daemon.socket)
    sent = _requests(monkeypatch)
    for _ in range(2):
        with model_runtime.ModelRunner(model_runtime.PopefPaths([model_path])) as runner:
            dev = runner._replicas[0].session.device()
            assert dev._processes[0].first[1] is Op.LOAD   # sent with the attach
            _check(runner, weights)
    assert Op.LOAD not in sent and Op.RUN in sent   # no LOAD of the link's own


def test_a_first_load_that_differs_is_waited_for_and_replaced(daemon, model_path, weights,
                                                              monkeypatch) -> None:
    monkeypatch.setenv(wire.ENV_VAR, daemon.socket)
    real = Loader.first_load

    def other(self):   # a body the session's LOAD will not match
        body = real(self)
        return None if body is None else dict(body, faults=[])
    monkeypatch.setattr(Loader, "first_load", other)
    sent = _requests(monkeypatch)
    with model_runtime.ModelRunner(model_runtime.PopefPaths([model_path])) as runner:
        assert runner._replicas[0].session.device()._processes[0].first is not None
        _check(runner, weights)
    assert sent.count(Op.LOAD) == 1
