"""A request abandoned by an exception (KeyboardInterrupt) never gives its outputs to the
next request, and the runner stays usable. Loopback device, no process.

The interrupts are placed deterministically: a function the runner calls at the point to
test raises KeyboardInterrupt once (what a signal handler's exception does there).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest

import host_runtime as model_runtime
from host_runtime.errors import InvalidStateError
from host_runtime.runner import _completion, _transfer
from tests.unit._loopback import model, model_path, weights  # noqa: F401  (fixtures)

SHAPE = (4, 256)   # 4 KiB tensors: the general path (not run_idle's), copied by copy_bytes


def interrupt_on_call(n: int, real: Callable[..., Any]) -> Callable[..., Any]:
    """``real``, except that call number ``n`` raises KeyboardInterrupt instead."""
    calls = [0]

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == n:
            raise KeyboardInterrupt
        return real(*args, **kwargs)
    return wrapped


def request(i: int, shape: tuple[int, ...] = SHAPE) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(i)
    return {"tensor_A": rng.standard_normal(shape).astype(np.float32),
            "tensor_B": rng.standard_normal(shape).astype(np.float32)}


def want(inputs: dict[str, np.ndarray], w: np.ndarray) -> np.ndarray:
    return inputs["tensor_A"] * w + inputs["tensor_B"]


@pytest.fixture
def runner(loopback_device, model):
    r = model_runtime.ModelRunner(model, model_runtime.ModelRunnerConfig(
        replica_to_device={0: loopback_device}))
    yield r
    r.close()


def check_next_requests(runner: Any, w: np.ndarray, first: int = 100) -> None:
    for i in range(first, first + 6):
        x = request(i, w.shape)
        np.testing.assert_allclose(runner.execute(x)["tensor_C"], want(x, w), rtol=1e-6)
    futures = [(x, runner.executeAsync(x)) for x in map(request, range(first + 10, first + 14),
                                                        [w.shape] * 4)]
    for x, fut in futures:
        np.testing.assert_allclose(fut["tensor_C"], want(x, w), rtol=1e-6)


def test_a_transfer_half_written_when_interrupted_is_completed(runner, weights, monkeypatch):
    """The second input's copy into its slot is interrupted: the first input is published,
    the second slot held. The transfer is completed with the request's own data and
    drained; the next requests get their own outputs."""
    monkeypatch.setattr(_transfer, "copy_bytes", interrupt_on_call(2, _transfer.copy_bytes))
    with pytest.raises(KeyboardInterrupt):
        runner.execute(request(1))
    check_next_requests(runner, weights)


def test_an_interrupted_wait_leaves_the_future_its_own_answer(runner, weights, monkeypatch):
    """The interrupt comes as the future's waiter starts to drain, before it reads: the
    future is answered by the next wait, right."""
    monkeypatch.setattr(_completion.Completion, "_drain",
                        interrupt_on_call(1, _completion.Completion._drain))
    x = request(2)
    fut = runner.executeAsync(x)
    with pytest.raises(KeyboardInterrupt):
        fut.wait()
    np.testing.assert_allclose(fut["tensor_C"], want(x, weights), rtol=1e-6)
    check_next_requests(runner, weights)


def test_an_output_consumed_as_the_interrupt_came_fails_its_request_by_name(
        runner, weights, monkeypatch):
    """The interrupt lands as the output is being copied out of its slot: that output is
    lost, so its request fails with the named error; the next requests are right."""
    monkeypatch.setattr(_transfer.TransferPath, "copy_out",
                        staticmethod(interrupt_on_call(1, _transfer.TransferPath.copy_out)))
    fut = runner.executeAsync(request(3))
    with pytest.raises(KeyboardInterrupt):
        fut.wait()
    with pytest.raises(InvalidStateError) as info:
        fut.result()
    assert str(info.value) == ("replica 0: output 'tensor_C' of the request was lost: the "
                               "thread reading it was interrupted by KeyboardInterrupt")
    check_next_requests(runner, weights)


@pytest.mark.parametrize("where", ["writing", "reading"])
def test_the_fused_path_interrupted_gives_the_next_request_its_own_outputs(
        loopback_device, monkeypatch, tmp_path, where):
    """``execute`` on an idle replica with small tensors (the fused path), interrupted after its
    first input is written (non-contiguous inputs are made contiguous one by one: the
    second call raises), or before its output is read: the transfer is completed and
    drained, and every later request gets its own outputs."""
    from tests._helpers import weights_of, write_example
    small = write_example(tmp_path, (1, 4))
    w = weights_of(model_runtime.popef.load_model([small]), (1, 4))
    runner = model_runtime.ModelRunner(small, model_runtime.ModelRunnerConfig(
        replica_to_device={0: loopback_device}))
    try:
        x = request(5, (1, 4))
        np.testing.assert_allclose(runner.execute(x)["tensor_C"], want(x, w), rtol=1e-6)
        x = {k: np.repeat(v, 2, axis=1)[:, ::2] for k, v in request(4, (1, 4)).items()}
        assert not any(v.flags.c_contiguous for v in x.values())
        if where == "writing":
            monkeypatch.setattr(np, "ascontiguousarray",
                                interrupt_on_call(2, np.ascontiguousarray))
        else:
            monkeypatch.setattr(_transfer.TransferPath, "take_fused",
                                interrupt_on_call(1, _transfer.TransferPath.take_fused))
        with pytest.raises(KeyboardInterrupt):
            runner.execute(x)
        monkeypatch.undo()
        check_next_requests(runner, w)
    finally:
        runner.close()
