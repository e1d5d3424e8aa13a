"""Crafted PopEF files (valid checksums, broken semantics) through ModelRunner and Session.

The runtime refuses each at load with ``ModelRuleError`` naming the rule; with the
host's check switched off, the IPU process refuses the executables it can judge alone
(at LOAD and LOOP) and ``execute()`` raises ``DeviceExecutionError`` instead of hanging
or answering wrongly. Every call runs under a timeout so that a regression fails.
"""

from __future__ import annotations

import concurrent.futures as cf
from typing import Any, Callable

import numpy as np
import pytest

import host_runtime as model_runtime
import host_runtime.popef._check as popef_check
from host_runtime.errors import DeviceExecutionError, ModelRuleError
from tests.crafted import CASES, craft
from tools.generate_simple_popef import write_simple_popef

pytestmark = pytest.mark.usefixtures("private_machine")

_LIMIT = 60.0   # seconds: far more than any of these takes; a hang fails the test


def within(fn: Callable[[], Any]) -> Any:
    """``fn()`` on a thread; its result or exception, or a failure after _LIMIT s."""
    ex = cf.ThreadPoolExecutor(1)
    try:
        fut = ex.submit(fn)
        try:
            return fut.result(timeout=_LIMIT)
        except cf.TimeoutError:
            pytest.fail(f"no answer within {_LIMIT} s (hang)")
    finally:
        ex.shutdown(wait=False)


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    return write_simple_popef(tmp_path_factory.mktemp("malformed") / "simple.popef")


def run_once(path: Any) -> dict[str, np.ndarray]:
    runner = model_runtime.ModelRunner(model_runtime.PopefPaths([str(path)]))
    try:
        a = np.arange(4, dtype=np.float32).reshape(1, 4)
        return runner.execute({"tensor_A": a, "tensor_B": a})
    finally:
        runner.close()


@pytest.mark.parametrize("case", sorted(CASES))
def test_model_runner_refuses_the_file(case, example, tmp_path):
    edits, rule, words = CASES[case]
    path = craft(example, tmp_path / f"{case}.popef", **edits)
    with pytest.raises(ModelRuleError) as info:
        within(lambda: run_once(path))
    assert info.value.rule == rule
    assert all(w in str(info.value) for w in words), str(info.value)


def test_session_refuses_a_model_object(example, tmp_path, monkeypatch):
    edits, _, _ = CASES["streams_output_twice"]
    path = craft(example, tmp_path / "twice.popef", **edits)
    from host_runtime import popef
    with monkeypatch.context() as m:   # a Model that skipped the builder's check
        m.setattr(popef_check, "_check_rules", lambda *a, **k: None)
        model = popef.load_model([path])
        object.__delattr__(model, "_rules_checked")
    with pytest.raises(ModelRuleError, match="rule stream-count"):
        within(lambda: model_runtime.Session(model))


# the IPU process's own checks: what it refuses when a host did not check the file
# (no_output_anchor is refused too, but a runner that expects no output may return
# before the refusal arrives: tests/unit/test_model_rules.py checks that rule alone)
DEVICE_CASES = {
    "repeat_zero": "rule repeat-count: program 1 has a Repeat of count 0",
    "empty_main": "rule anchor-stream: the host connected in stream 'tensor_A', which is "
                  "never streamed in",
    "never_streams_out_C": "the host connected out stream 'tensor_C', which is never streamed out",
    "streams_input_twice": "streams 'tensor_A' in 2 times per iteration",
    "streams_output_twice": "streams 'tensor_C' out 2 times per iteration",
    "streams_out_before_execute": "rule stream-order",
}


@pytest.mark.parametrize("case", sorted(DEVICE_CASES))
def test_device_reports_instead_of_hanging(case, example, tmp_path, monkeypatch):
    monkeypatch.setattr(popef_check, "_check_rules", lambda *a, **k: None)
    edits, _, _ = CASES[case]
    path = craft(example, tmp_path / f"{case}.popef", **edits)
    with pytest.raises(DeviceExecutionError) as info:
        within(lambda: run_once(path))
    assert "DeviceProgramError" in str(info.value)
    assert DEVICE_CASES[case] in str(info.value)


def test_the_example_still_runs(example, tmp_path):
    out = within(lambda: run_once(example))
    assert set(out) == {"tensor_C"} and out["tensor_C"].shape == (1, 4)


def test_a_loop_refused_before_the_first_request_is_that_requests_error(example, tmp_path,
                                                                         monkeypatch):
    """The device refuses the Main loop before any request was made: the first request gets
    the device's error itself (not a lost device), later ones "unusable after an earlier
    failure"."""
    monkeypatch.setattr(popef_check, "_check_rules", lambda *a, **k: None)
    edits, _, _ = CASES["streams_out_before_execute"]
    path = craft(example, tmp_path / "order.popef", **edits)
    runner = model_runtime.ModelRunner(model_runtime.PopefPaths([str(path)]))
    try:
        loop = runner._replicas[0]._loop          # the device's answer to LOOP
        assert loop is not None
        with pytest.raises(DeviceExecutionError):
            loop.result(timeout=_LIMIT)
        a = np.arange(4, dtype=np.float32).reshape(1, 4)
        with pytest.raises(DeviceExecutionError, match="rule stream-order"):
            runner.execute({"tensor_A": a, "tensor_B": a})
        with pytest.raises(model_runtime.DeviceLostError,
                           match="unusable after an earlier failure.*rule stream-order"):
            runner.execute({"tensor_A": a, "tensor_B": a})
    finally:
        runner.close()
