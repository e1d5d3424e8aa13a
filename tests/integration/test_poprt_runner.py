"""Seed 004 end to end: fuse two ONNX models with ``poprt --config_yaml``, then run the fused
PopEF with the PopRT ``Runner`` (index filled from the names) and with ``ModelRunner``
directly (conditional execution with ``validate_io_params`` off, seed 001 section 3.5)."""

from __future__ import annotations

import os
from datetime import timedelta

import numpy as np
import numpy.testing as npt
import onnx
import pytest

import host_runtime as model_runtime
from host_runtime.errors import BadRequestError, DeviceTimeoutError
from host_runtime.poprt import Runner, RuntimeConfig
from tests.models import SEED_FUSION_CONFIG as CONFIG_YAML
from tests.models import seed_model0, seed_model1


# This module's own emulated machine, so that module-scoped runners of other test processes
# cannot starve it; devices are waited for as the seeds' examples do (tests/_helpers.py).
pytestmark = pytest.mark.usefixtures("private_machine")


@pytest.fixture(scope="module")
def fused_popef(tmp_path_factory):
    from tools.poprt import main as poprt_main

    d = tmp_path_factory.mktemp("fusion")
    onnx.save(seed_model0(), str(d / "model0.onnx"))
    onnx.save(seed_model1(), str(d / "model1.onnx"))
    (d / "config.yaml").write_text(CONFIG_YAML)
    assert poprt_main(["--config_yaml", str(d / "config.yaml")]) == 0
    path = d / "executable.popef"
    assert path.exists()
    return str(path)


@pytest.fixture(scope="module")
def runner(fused_popef):
    config = RuntimeConfig()
    config.timeout_ns = 0
    config.validate_io_params = False
    r = Runner(fused_popef, config)
    yield r
    r.close()


def test_seed_run_py(runner):
    """Listing 5.7 (run.py), unchanged apart from its import."""
    g0_X = np.ones([1, 2], dtype=np.float32)
    g0_Y = np.ones([1, 2], dtype=np.float32) * 2
    g0_O = np.zeros([2], dtype=np.float32)
    runner.execute({"graph0/X": g0_X, "graph0/Y": g0_Y}, {"graph0/O": g0_O})
    npt.assert_array_equal(g0_O, np.ones([2], dtype=np.float32) * 3)

    g1_X = np.zeros([1, 1], dtype=np.float16)
    g1_O = np.zeros([1, 3], dtype=np.float16)
    runner.execute({"graph1/X": g1_X}, {"graph1/O": g1_O})
    npt.assert_array_equal(g1_O, np.array([[0.0, 1.5, 2.0]], dtype=np.float16))


def test_alternating_branches_async(runner):
    rng = np.random.default_rng(0)
    pending = []
    for i in range(10):
        if i % 2 == 0:
            x = rng.standard_normal((1, 2)).astype(np.float32)
            y = rng.standard_normal((1, 2)).astype(np.float32)
            out = np.zeros(2, np.float32)
            fut = runner.execute_async({"graph0/X": x, "graph0/Y": y}, {"graph0/O": out})
            pending.append((fut, out, (x + y).reshape(2)))
        else:
            x = rng.standard_normal((1, 1)).astype(np.float16)
            out = np.zeros((1, 3), np.float16)
            fut = runner.execute_async({"graph1/X": x}, {"graph1/O": out})
            pending.append((fut, out, np.concatenate([x, [[1.5, 2.0]]], axis=1).astype(np.float16)))
    for fut, out, want in pending:
        fut.wait()
        npt.assert_allclose(out, want, rtol=1e-6)


def test_descriptions_and_explicit_index(runner):
    names = [d.name for d in runner.get_execute_inputs()]
    assert names[0] == "index" and set(names) == {"index", "graph0/X", "graph0/Y", "graph1/X"}
    assert {d.name for d in runner.get_execute_outputs()} == {"graph0/O", "graph1/O"}
    out = np.zeros(2, np.float32)
    runner.execute({"index": np.array([0], np.int32), "graph0/X": np.ones((1, 2), np.float32),
                    "graph0/Y": np.ones((1, 2), np.float32)}, {"graph0/O": out})
    npt.assert_array_equal(out, [2, 2])


def test_names_of_two_subgraphs_refused(runner):
    with pytest.raises(BadRequestError, match="cannot fill the 'index' input.*graph0: graph0/X; "
                                              "graph1: graph1/X"):
        runner.execute({"graph0/X": np.ones((1, 2), np.float32),
                        "graph1/X": np.ones((1, 1), np.float16)}, {})


# ------------------------------------------------------------------ ModelRunner directly
@pytest.fixture(scope="module")
def model_runner(fused_popef):
    cfg = model_runtime.ModelRunnerConfig()
    cfg.validate_io_params = False
    cfg.timeout_ns = timedelta(milliseconds=200)
    r = model_runtime.ModelRunner(fused_popef, config=cfg)
    yield r
    r.close()


def g0(r, x=1.0, y=2.0):
    return r.execute({"index": np.array([0], np.int32),
                      "graph0/X": np.full((1, 2), x, np.float32),
                      "graph0/Y": np.full((1, 2), y, np.float32)})


def test_conditional_execution_runner_allocated(model_runner):
    out = g0(model_runner)
    assert set(out) == {"graph0/O"}
    npt.assert_array_equal(out["graph0/O"], [3, 3])
    out = model_runner.execute({"index": np.array([1], np.int32),
                                "graph1/X": np.full((1, 1), 4, np.float16)})
    assert set(out) == {"graph1/O"}
    npt.assert_array_equal(out["graph1/O"], np.array([[4, 1.5, 2]], np.float16))


def test_wrong_branch_times_out_and_runner_recovers(model_runner):
    """Inputs for graph0 but index 1: the device waits for graph1/X -> timeout."""
    with pytest.raises(DeviceTimeoutError, match="timed out after 200 ms waiting for input "
                                                 "'graph1/X'"):
        model_runner.execute({"index": np.array([1], np.int32),
                              "graph0/X": np.ones((1, 2), np.float32),
                              "graph0/Y": np.ones((1, 2), np.float32)})
    npt.assert_array_equal(g0(model_runner, 5, 6)["graph0/O"], [11, 11])


def test_missing_index_times_out(model_runner):
    fut = model_runner.executeAsync({"graph0/X": np.ones((1, 2), np.float32),
                                     "graph0/Y": np.ones((1, 2), np.float32)})
    later = model_runner.executeAsync({"index": np.array([1], np.int32),
                                       "graph1/X": np.full((1, 1), 2, np.float16)})
    npt.assert_array_equal(later["graph1/O"], np.array([[2, 1.5, 2]], np.float16))
    with pytest.raises(DeviceTimeoutError, match="waiting for input 'index'"):
        fut.result()
    npt.assert_array_equal(g0(model_runner)["graph0/O"], [3, 3])


def test_flush_callback_supplies_the_missing_branch_input(fused_popef):
    calls = []

    def on_flush(tensor_id, inputs, outputs):
        calls.append(tensor_id)
        return {"graph1/X": np.full((1, 1), 7, np.float16)}, None

    cfg = model_runtime.ModelRunnerConfig(validate_io_params=False, flush_callback=on_flush,
                                          timeout_ns=timedelta(milliseconds=50))
    with model_runtime.ModelRunner(fused_popef, config=cfg) as r:
        out = r.execute({"index": np.array([1], np.int32)})
        assert calls == ["graph1/X"]
        npt.assert_array_equal(out["graph1/O"], np.array([[7, 1.5, 2]], np.float16))


def test_index_out_of_range_is_a_bad_request(model_runner):
    with pytest.raises(BadRequestError, match="input 'index': expected a sub-graph number 0..1, got 2"):
        model_runner.execute({"index": np.array([2], np.int32)})
    npt.assert_array_equal(g0(model_runner)["graph0/O"], [3, 3])


def test_validate_io_params_on_needs_every_input(fused_popef):
    with model_runtime.ModelRunner(fused_popef) as r:
        with pytest.raises(BadRequestError, match="missing input tensor\\(s\\) 'graph1/X'"):
            r.execute({"index": np.array([0], np.int32), "graph0/X": np.ones((1, 2), np.float32),
                       "graph0/Y": np.ones((1, 2), np.float32)})
        out = r.execute({"index": np.array([0], np.int32), "graph0/X": np.ones((1, 2), np.float32),
                         "graph0/Y": np.ones((1, 2), np.float32),
                         "graph1/X": np.ones((1, 1), np.float16)})
        npt.assert_array_equal(out["graph0/O"], [2, 2])
        assert os.path.exists(fused_popef)
