"""A runner's life through a warm daemon, repeated quickly: every construct gets the IPU
clean (reset, held by nobody else), reuses what the warm IPU process kept of the same
model (its onnxruntime sessions), computes right, and leaves nothing in /dev/shm."""

from __future__ import annotations

import os

import numpy as np

import host_runtime as model_runtime
from ipu_emulator.daemon import socket_protocol as wire
from tests._helpers import tag_objects


def test_quick_construct_execute_close_churn_through_the_daemon(daemon, model_path, weights,
                                                                monkeypatch):
    monkeypatch.setenv(wire.ENV_VAR, daemon.socket)
    before = tag_objects()
    pids = set()
    for k in range(8):
        runner = model_runtime.ModelRunner(model_path)
        try:
            held = [i for i in daemon.status()["ipus"] if i["holder"] == os.getpid()]
            assert [i["state"] for i in held] == ["held"]   # exactly one IPU, ours alone
            pids.add(held[0]["pid"])
            rng = np.random.default_rng(k)
            a = rng.standard_normal((1, 4)).astype(np.float32)
            b = rng.standard_normal((1, 4)).astype(np.float32)
            out = runner.execute({"tensor_A": a, "tensor_B": b})["tensor_C"]
            np.testing.assert_allclose(out, a * weights + b, rtol=1e-6)
        finally:
            runner.close()
        states = {i["ipu"]: (i["state"], i["holder"]) for i in daemon.status()["ipus"]}
        assert set(states.values()) == {("free", None)}, states   # status answers once the resets are done
    assert pids <= set(daemon.pool_pids)   # the warm processes, never restarted
    assert tag_objects() == before
