"""Dynamic batch sizing, partial-batch timeouts and flush_callback (seed 001, 3.6-3.7), on
both kinds of IPU (tests/devices/conftest.py).

The model's batch is 4 samples of 3 floats. Timeouts are short (tens of ms)
but nothing here depends on timing beyond "a flush eventually happens":
every wait has a generous bound so a slow machine cannot turn into a hang.
"""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest

import host_runtime as model_runtime
from host_runtime import popef
from host_runtime.errors import BadRequestError
from tools.generate_simple_popef import write_simple_popef
from tests._helpers import run_in_threads

SHAPE = (4, 3)
WAIT = 60.0     # generous bound for any single wait


def rows(n, seed):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((n, 3)).astype(np.float32),
            rng.standard_normal((n, 3)).astype(np.float32))


@pytest.fixture(scope="module")
def dyn(kind, model_path):
    cfg = model_runtime.ModelRunnerConfig()
    cfg.batching_dim = 0
    cfg.is_batch_size_timeout_enabled = True
    cfg.batch_size_timeout_ns = timedelta(milliseconds=20)
    with kind.runner(model_path, cfg) as r:
        yield r


def packed_expectation(a, b, weights, start_row):
    """Expected outputs when sample i of the request sits at transfer row (start_row + i) % 4."""
    idx = (start_row + np.arange(len(a))) % SHAPE[0]
    return a * weights[idx] + b


@pytest.mark.parametrize("n", [1, 4, 7])
def test_any_batch_size(dyn, weights, n):
    a, b = rows(n, n)
    out = dyn.execute({"tensor_A": a, "tensor_B": b})
    assert out["tensor_C"].shape == (n, 3)
    np.testing.assert_allclose(out["tensor_C"], packed_expectation(a, b, weights, 0), rtol=1e-6)


def test_user_allocated_output_with_dynamic_batch(dyn, weights):
    a, b = rows(6, 11)
    out = np.zeros((6, 3), np.float32)
    dyn.execute({"tensor_A": a, "tensor_B": b}, {"tensor_C": out})
    np.testing.assert_allclose(out, packed_expectation(a, b, weights, 0), rtol=1e-6)
    with pytest.raises(BadRequestError, match=r"output 'tensor_C': expected shape \[6, 3\]"):
        dyn.execute({"tensor_A": a, "tensor_B": b}, {"tensor_C": np.zeros((4, 3), np.float32)})


def test_dynamic_shape_errors(dyn, weights):
    with pytest.raises(BadRequestError, match=r"expected shape \[N, 3\] \(any N >= 1 on dimension 0\)"
                                              r", got shape \[2, 2\]"):
        dyn.execute({"tensor_A": np.zeros((2, 2), np.float32), "tensor_B": np.zeros((2, 2), np.float32)})
    with pytest.raises(BadRequestError, match="disagree on the batch size.*tensor_A has 2, tensor_B has 3"):
        dyn.execute({"tensor_A": np.zeros((2, 3), np.float32), "tensor_B": np.zeros((3, 3), np.float32)})
    a, b = rows(2, 1)
    np.testing.assert_allclose(dyn.execute({"tensor_A": a, "tensor_B": b})["tensor_C"],
                               packed_expectation(a, b, weights, 0), rtol=1e-6)


def test_requests_are_packed_into_one_transfer(make_runner, model_path, weights):
    """With no timer at all, a batch-1 request completes only if the next request's samples
    fill the rest of its transfer: proof that samples of different requests are packed."""
    cfg = model_runtime.ModelRunnerConfig(batching_dim=0, timeout_ns=0)
    with make_runner(model_path, cfg) as r:
        a1, b1 = rows(1, 1)
        f1 = r.executeAsync({"tensor_A": a1, "tensor_B": b1})
        assert f1.wait(0.05) is False          # 1 of 4 samples: waits for more data
        a3, b3 = rows(3, 2)
        f3 = r.executeAsync({"tensor_A": a3, "tensor_B": b3})
        assert f1.wait(WAIT) and f3.wait(WAIT)
        np.testing.assert_allclose(f1["tensor_C"], packed_expectation(a1, b1, weights, 0), rtol=1e-6)
        np.testing.assert_allclose(f3["tensor_C"], packed_expectation(a3, b3, weights, 1), rtol=1e-6)
        # a 6-sample request leaves 2 in a partial transfer that a 2-sample request fills
        a6, b6 = rows(6, 3)
        a2, b2 = rows(2, 4)
        f6 = r.executeAsync({"tensor_A": a6, "tensor_B": b6})
        f2 = r.executeAsync({"tensor_A": a2, "tensor_B": b2})
        np.testing.assert_allclose(f6["tensor_C"], packed_expectation(a6, b6, weights, 0), rtol=1e-6)
        np.testing.assert_allclose(f2["tensor_C"], packed_expectation(a2, b2, weights, 2), rtol=1e-6)


def test_batching_on_dimension_1(make_runner, tmp_path, weights):
    path = tmp_path / "dim1.popef"
    write_simple_popef(path, shape=(2, 3))    # batch of 3 along dimension 1
    w = np.frombuffer(popef.load_model([str(path)]).tensorData("weights").data,
                      np.float32).reshape(2, 3)
    cfg = model_runtime.ModelRunnerConfig(batching_dim=1, is_batch_size_timeout_enabled=True,
                                          batch_size_timeout_ns=timedelta(milliseconds=10))
    with make_runner(str(path), cfg) as r:
        rng = np.random.default_rng(0)
        a = rng.standard_normal((2, 5)).astype(np.float32)
        b = rng.standard_normal((2, 5)).astype(np.float32)
        out = r.execute({"tensor_A": a, "tensor_B": b})["tensor_C"]
        cols = np.arange(5) % 3
        np.testing.assert_allclose(out, a * w[:, cols] + b, rtol=1e-6)


def test_without_batching_dim_only_multiples(make_runner, model_path):
    with make_runner(model_path) as r:
        with pytest.raises(BadRequestError, match=r"expected shape \[N\*4, 3\] \(N >= 1\), got shape \[7, 3\]"):
            r.execute({"tensor_A": np.zeros((7, 3), np.float32),
                       "tensor_B": np.zeros((7, 3), np.float32)})


def test_batching_dim_out_of_range_refused(model_path):
    cfg = model_runtime.ModelRunnerConfig(batching_dim=2)
    with pytest.raises(BadRequestError, match="batching_dim=2: tensor 'tensor_A' has shape \\[4, 3\\], "
                                              "which has no dimension 2"):
        model_runtime.ModelRunner(model_path, config=cfg)


def test_flush_callback_called_once_on_timeout_then_padded(make_runner, model_path, weights):
    calls = []

    def on_flush(tensor_id, inputs, outputs):
        calls.append((tensor_id, inputs, outputs))
        return None

    cfg = model_runtime.ModelRunnerConfig(batching_dim=0, timeout_ns=timedelta(milliseconds=30),
                                          flush_callback=on_flush)
    with make_runner(model_path, cfg) as r:
        a, b = rows(3, 7)
        out = r.execute({"tensor_A": a, "tensor_B": b})
        np.testing.assert_allclose(out["tensor_C"], packed_expectation(a, b, weights, 0), rtol=1e-6)
        assert calls == [("tensor_A", {}, {})]    # empty views the callback may fill
        a4, b4 = rows(4, 8)              # a whole batch needs no flush
        r.execute({"tensor_A": a4, "tensor_B": b4})
        assert len(calls) == 1


def test_flush_callback_supplies_the_missing_samples(make_runner, model_path, weights):
    extra_a, extra_b = rows(1, 9)
    extra_out = np.zeros((1, 3), np.float32)
    calls = []

    def on_flush(tensor_id, inputs, outputs):
        calls.append(tensor_id)
        return ({"tensor_A": extra_a, "tensor_B": extra_b}, {"tensor_C": extra_out})

    cfg = model_runtime.ModelRunnerConfig(batching_dim=0, timeout_ns=timedelta(milliseconds=30),
                                          flush_callback=on_flush, flush_on_waiting_outputs=True)
    with make_runner(model_path, cfg) as r:
        a, b = rows(3, 10)
        out = r.execute({"tensor_A": a, "tensor_B": b})
        np.testing.assert_allclose(out["tensor_C"], packed_expectation(a, b, weights, 0), rtol=1e-6)
        np.testing.assert_allclose(extra_out, packed_expectation(extra_a, extra_b, weights, 3),
                                   rtol=1e-6)
        assert calls == ["tensor_A"]


def test_partial_flushed_by_watchdog_when_nobody_waits(make_runner, model_path, weights):
    """flush_on_waiting_outputs off (default): the flush happens even before anyone waits."""
    flushed = []
    cfg = model_runtime.ModelRunnerConfig(
        batching_dim=0, timeout_ns=timedelta(milliseconds=20),
        flush_callback=lambda t, i, o: flushed.append(t))
    with make_runner(model_path, cfg) as r:
        a, b = rows(2, 12)
        fut = r.executeAsync({"tensor_A": a, "tensor_B": b})
        r._replicas[0]._timers._watchdog.join(WAIT)   # the watchdog exits once nothing is pending
        assert flushed == ["tensor_A"]
        np.testing.assert_allclose(fut["tensor_C"], packed_expectation(a, b, weights, 0), rtol=1e-6)


def test_close_fails_pending_requests_and_wakes_blocked_callers(make_runner, model_path):
    import threading

    from host_runtime.errors import DeviceTimeoutError, InvalidStateError

    cfg = model_runtime.ModelRunnerConfig(batching_dim=0, timeout_ns=0)   # never flush
    r = make_runner(model_path, cfg)
    a, b = rows(1, 1)
    fut = r.executeAsync({"tensor_A": a, "tensor_B": b})
    assert not fut.done()
    with pytest.raises(DeviceTimeoutError, match="not available within 0.01 s"):
        fut.result(timeout=0.01)
    caught = []
    t = threading.Thread(target=lambda: caught.append(_raised(
        lambda: r.execute({"tensor_A": a, "tensor_B": b}))))
    t.start()
    r.close()
    t.join(WAIT)
    assert not t.is_alive()
    assert fut.wait(WAIT)
    assert isinstance(fut.exception(), InvalidStateError)
    with pytest.raises(InvalidStateError, match="the ModelRunner was closed"):
        fut["tensor_C"]
    assert len(caught) == 1 and isinstance(caught[0], InvalidStateError)


def _raised(fn):
    try:
        fn()
    except Exception as exc:
        return exc
    return None


def test_concurrent_dynamic_batches(make_runner, model_path, weights):
    """Several threads, any batch sizes, packed across requests: every sample comes back
    computed with some row of the weights, never left unwritten (regression: a request
    completed when another thread drained its first transfer before the rest was packed)."""

    cfg = model_runtime.ModelRunnerConfig(batching_dim=0, is_batch_size_timeout_enabled=True,
                                          batch_size_timeout_ns=timedelta(milliseconds=2))
    errors: list[str] = []
    with make_runner(model_path, cfg) as r:
        def worker(seed):
            rng = np.random.default_rng(seed)
            try:
                for _ in range(15):
                    n = int(rng.integers(1, 10))
                    a, b = rows(n, int(rng.integers(1 << 30)))
                    out = np.full((n, 3), np.nan, np.float32)
                    r.executeAsync({"tensor_A": a, "tensor_B": b}, {"tensor_C": out}).wait()
                    every_row = a[:, None, :] * weights[None, :, :] + b[:, None, :]
                    hit = np.isclose(out[:, None, :], every_row, rtol=1e-5).all(axis=2).any(axis=1)
                    assert hit.all(), f"batch {n}: rows {np.flatnonzero(~hit)} are wrong"
            except Exception as exc:
                errors.append(f"worker {seed}: {exc!r}")
        run_in_threads(worker, range(5))
    assert errors == []


def test_thread_safe_callers_gather_in_one_batch(kind, model_path, weights):
    """thread_safe with dynamic batching: four callers of one sample each fill one batch
    together (with no timeout to pad it, each waiting while holding the replica would
    wait for ever)."""
    import contextlib
    import threading
    import time

    cfg = model_runtime.ModelRunnerConfig()
    cfg.batching_dim = 0
    cfg.thread_safe = True
    cfg.timeout_ns = 0                    # no padding by timeout: only the others fill it
    results: dict[int, np.ndarray] = {}
    with contextlib.ExitStack() as devices, kind.runner(model_path, cfg, closing=devices) as r:
        start = threading.Barrier(4)

        def call(k: int) -> None:
            a = np.full((1, 3), k + 1, np.float32)
            start.wait(WAIT)
            results[k] = r.execute({"tensor_A": a, "tensor_B": a})["tensor_C"]
        threads = [threading.Thread(target=call, args=(k,), daemon=True) for k in range(4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + WAIT
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert sorted(results) == [0, 1, 2, 3]   # (before close: close would free them)
    rows_used = set()
    for k, out in results.items():
        a = np.full((1, 3), k + 1, np.float32)
        row = [i for i in range(4) if np.allclose(out, a * weights[i] + a, rtol=1e-6)]
        assert len(row) == 1, (k, out)
        rows_used.add(row[0])
    assert rows_used == {0, 1, 2, 3}              # one transfer of the four samples
