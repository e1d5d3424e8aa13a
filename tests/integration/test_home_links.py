"""A runner never writes through a link planted in its home: the planted lock or log is
refused with ``UnsafePathError`` naming it, the link's target is untouched, no IPU stays
held and nothing is left in /dev/shm (the suite's leak probe). Settings at their bounds
still give a working runner."""

from __future__ import annotations

import stat
import time

import numpy as np
import pytest

import host_runtime as model_runtime
from host_runtime import settings
from ipu_emulator.errors import UnsafePathError
from shm.settings import MAX_SPIN_US

SHAPE = (1, 4)


def _inputs():
    a = np.arange(4, dtype=np.float32).reshape(SHAPE)
    return {"tensor_A": a, "tensor_B": a + 1}


def _expected(model):
    """The example model's answer: tensor_A * weights + tensor_B."""
    weights = np.frombuffer(model.tensorData("weights").data, np.float32).reshape(SHAPE)
    return _inputs()["tensor_A"] * weights + _inputs()["tensor_B"]


@pytest.fixture
def home(tmp_path, monkeypatch):
    h = tmp_path / "home"
    for sub in ("locks", "logs"):
        (h / sub).mkdir(parents=True, mode=0o700)
    h.chmod(0o700)
    monkeypatch.setenv("IPU_EMULATOR_HOME", str(h))
    return h


@pytest.fixture
def precious(tmp_path):
    p = tmp_path / "precious"
    p.write_bytes(b"keep me")
    p.chmod(0o600)
    return p


@pytest.mark.parametrize("planted", ["locks/ipu0.lock", "logs/ipu0.log"])
def test_a_runner_refuses_a_planted_link_in_its_home(model_path, model, home, precious,
                                                     planted):
    (home / planted).symlink_to(precious)
    with pytest.raises(UnsafePathError, match=rf"{home}/{planted} is a symlink; refusing to "
                                              r"write through it"):
        model_runtime.ModelRunner(model_path)
    assert precious.read_bytes() == b"keep me"
    assert stat.S_IMODE(precious.stat().st_mode) == 0o600
    (home / planted).unlink()   # gone: the machine works, every IPU free
    with model_runtime.ModelRunner(model_path) as runner:
        np.testing.assert_allclose(runner.execute(_inputs())["tensor_C"], _expected(model))
    st = (home / "logs" / "ipu0.log").lstat()
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600


def test_settings_at_their_bounds_give_a_working_runner_that_closes_promptly(model_path, model,
                                                                            home):
    with settings.override(ring_spin_us=MAX_SPIN_US, device_spin_us=MAX_SPIN_US,
                           runner_spin_us=MAX_SPIN_US, yielded_us=MAX_SPIN_US):
        runner = model_runtime.ModelRunner(model_path)
    try:
        for _ in range(5):
            np.testing.assert_allclose(runner.execute(_inputs())["tensor_C"], _expected(model))
    finally:
        t0 = time.monotonic()
        runner.close()
    assert time.monotonic() - t0 < 10
