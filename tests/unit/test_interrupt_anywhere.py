"""A KeyboardInterrupt wherever it can land in the runner's code never gives a wrong answer,
never hangs and never leaves the runner unusable. Loopback device, no process.

:class:`tests._interrupts.Interrupts` schedules a KeyboardInterrupt exactly where a
signal's handler would run it, at a chosen place of the runner's code (and of the
standard library's ``threading.Condition`` and ``concurrent.futures.Future`` it calls);
with ``SESSION_DIRS``, of the session layer and the device link too. The tests sweep the
places of ``execute``, ``executeAsync`` + ``wait``/``get``, requests queued behind each
other, dynamic batching and ``update_load_inputs`` with an abandoned request left over,
once and twice in a row (an interrupt that lands while the first one is being handled),
and after each assert: the interrupted call raised KeyboardInterrupt (or answered right),
every interrupted request got its own answer or the named error, and the next requests
are right (C = A * weights + B, compared to numpy); those checks run in another thread,
so that a lock the interrupted thread left held shows (and a hang is bounded). The
session layer's own sweeps (construction, close, a Session's main loop) are
tests/devices/test_interrupt_session.py.
"""

from __future__ import annotations

import re
import sys
from typing import Any, Callable, Iterable

import numpy as np
import pytest

import host_runtime as model_runtime
from tests._interrupts import RUNNER_DIR, SESSION_DIRS, Interrupts, sweep_places
from tests.unit._loopback import model, model_path, weights  # noqa: F401  (fixtures)

SHAPE = (1, 4)   # small: execute takes the fused path on an idle replica
BIG = (4, 256)   # 4 KiB: the general path (slots, copy_bytes), every output a Take.SLOT
PACKED = (4, 8)  # dynamic batching: a batch of 4 samples

ALLOWED = re.compile(r"InvalidStateError: replica 0: (output 'tensor_C' of the request was lost: "
                     r"the thread reading it was interrupted by KeyboardInterrupt|the request "
                     r"was abandoned: KeyboardInterrupt interrupted it( while it was sent)?)")
"""What an interrupted request may get instead of its answer (never another's answer)."""

pytestmark = pytest.mark.skipif(sys.version_info[:2] != (3, 11),
                                reason="the places are CPython 3.11's instructions")


def request(i: int, shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    return {"tensor_A": np.full(shape, float(i % 1000), np.float32),
            "tensor_B": np.full(shape, 0.5, np.float32)}


def right(i: int, out: Any, w: np.ndarray) -> bool:
    return bool(np.allclose(np.asarray(out), float(i % 1000) * w + 0.5, rtol=1e-6))


Scenario = Callable[[Any, tuple[int, ...], int, list[tuple[int, Any]]], None]


def sync(runner: Any, shape: tuple[int, ...], i: int,
         futures: list[tuple[int, Any]]) -> None:
    """One ``execute`` (the fused path, when the replica is idle and the tensors small)."""
    futures.append((i, runner.execute(request(i, shape))["tensor_C"]))


def waited(runner: Any, shape: tuple[int, ...], i: int,
           futures: list[tuple[int, Any]]) -> None:
    """``executeAsync`` and ``wait``."""
    fut = runner.executeAsync(request(i, shape))
    futures.append((i, fut))
    fut.wait()


def got(runner: Any, shape: tuple[int, ...], i: int,
        futures: list[tuple[int, Any]]) -> None:
    """``executeAsync``, a timed ``wait`` (a drive step with a deadline), then ``get``."""
    fut = runner.executeAsync(request(i, shape))
    futures.append((i, fut))
    fut.wait(60.0)
    fut.get("tensor_C")


def crowded(runner: Any, shape: tuple[int, ...], i: int,
            futures: list[tuple[int, Any]]) -> None:
    """Two in flight, an ``execute`` behind them (drains them), then their waits."""
    for k in (i, i + 300):
        futures.append((k, runner.executeAsync(request(k, shape))))
    futures.append((i + 600, runner.execute(request(i + 600, shape))["tensor_C"]))
    for _, fut in futures[:2]:
        fut.wait()


def packed(runner: Any, shape: tuple[int, ...], i: int,
           futures: list[tuple[int, Any]]) -> None:
    """Dynamic batching (a batch of 4): requests of 1, 2 and 3 samples packed into two
    transfers (the second flushed by its waiter when the partial batch's time is up),
    then their waits."""
    for k, samples in enumerate((1, 2, 3)):
        futures.append((i + 300 * k,
                        runner.executeAsync(request(i + 300 * k, (samples,) + shape[1:]))))
    for _, fut in list(futures):
        fut.wait()


def abandon(runner: Any, shape: tuple[int, ...], i: int) -> None:
    """Leave an abandoned request in flight, untraced by the sweep: an ``executeAsync``
    interrupted once its inputs are laid (at the entry of ``Completion.published``)."""
    tracer = sys.gettrace()
    sys.settrace(None)
    try:
        with Interrupts(entry="published"):
            try:
                runner.executeAsync(request(i, shape))
            except KeyboardInterrupt:
                pass
    finally:
        sys.settrace(tracer)


def reloaded(runner: Any, shape: tuple[int, ...], i: int,
             futures: list[tuple[int, Any]]) -> None:
    """``update_load_inputs`` (the model's own weights again) with a request in flight and
    an abandoned one left over, then the request's wait."""
    futures.append((i, runner.executeAsync(request(i, shape))))
    abandon(runner, shape, i + 300)
    runner.update_load_inputs({"weights": runner.weights})
    futures[0][1].wait()


def answers(futures: list[tuple[int, Any]], w: np.ndarray) -> list[str]:
    """What is wrong with the answers of the interrupted requests (nothing: [])."""
    bad = []
    for i, fut in futures:
        try:
            out = fut if isinstance(fut, np.ndarray) else fut["tensor_C"]
        except model_runtime.ModelRuntimeError as exc:
            text = f"{type(exc).__name__}: {exc}"
            if not ALLOWED.fullmatch(text):
                bad.append(f"request {i}: {text}")
            continue
        if not right(i, out, w):
            bad.append(f"request {i}: a wrong answer")
    return bad


def next_requests(runner: Any, shape: tuple[int, ...], w: np.ndarray) -> list[str]:
    """What is wrong with the runner's next answers (nothing: [])."""
    try:
        for k in range(2):
            if not right(900 + k, runner.execute(request(900 + k, shape))["tensor_C"], w):
                return [f"execute {900 + k} after: a wrong answer"]
        futs = [(910 + k, runner.executeAsync(request(910 + k, shape))) for k in range(2)]
        return [f"{i} after: a wrong answer" for i, f in futs if not right(i, f["tensor_C"], w)]
    except Exception as exc:
        return [f"after: {type(exc).__name__}: {exc}"]


def sweep(make: Callable[[], Any], shape: tuple[int, ...], scenario: Scenario, w: np.ndarray,
          gaps: Iterable[int], every: int = 1, focus: Iterable[str] = (),
          dirs: tuple[str, ...] = (RUNNER_DIR,)) -> list[str]:
    """Run ``scenario`` interrupted at every place of ``dirs`` (``gaps``: 0, once; d, a
    second interrupt d places after the first); what went wrong, by place. ``every``: only
    every k-th place, and every place in the functions named in ``focus`` (as a first run
    counted them). After each: the interrupted requests' answers, the next requests'."""
    runner = [make()]
    futures: list[tuple[int, Any]] = []

    def run(n: int) -> None:
        futures.clear()
        scenario(runner[0], shape, n or 1, futures)

    def replace() -> None:
        old, runner[0] = runner[0], None
        old.close()
        runner[0] = make()
    try:
        return sweep_places(run, lambda: answers(futures, w) + next_requests(runner[0], shape, w),
                            gaps, every, focus, dirs, replace)
    finally:
        if runner[0] is not None:
            runner[0].close()


@pytest.fixture
def make_runner(loopback_device, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Any]:
    # a runner made unusable fails the next request in 2 s, not the default 60
    monkeypatch.setenv("IPU_EMULATOR_HOST_SYNC_TIMEOUT", "2")

    def make(path: str, **config: Any) -> Any:
        return model_runtime.ModelRunner(path, model_runtime.ModelRunnerConfig(
            replica_to_device={0: loopback_device}, **config))
    return make


@pytest.fixture(scope="module")
def big_path(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, np.ndarray]:
    from tests._helpers import weights_of, write_example
    path = write_example(tmp_path_factory.mktemp("big"), BIG)
    return path, weights_of(model_runtime.popef.load_model([path]), BIG)


@pytest.fixture(scope="module")
def packed_path(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, np.ndarray]:
    """The example model for a batch of 4 samples of 8, and weights whose rows are all the
    first one (loaded by update_load_inputs): a sample's answer is the same wherever it
    is packed."""
    from tests._helpers import weights_of, write_example
    path = write_example(tmp_path_factory.mktemp("packed"), PACKED)
    w = weights_of(model_runtime.popef.load_model([path]), PACKED)
    return path, np.repeat(w[:1], PACKED[0], axis=0)


def test_an_interrupt_anywhere_in_execute_gives_no_wrong_answer_and_the_runner_stays_usable(
        make_runner, model_path, weights):
    """``execute`` on the fused path, interrupted once at every place and twice (the
    second while the first is handled: the fused path's abandon, the drain's)."""
    failures = sweep(lambda: make_runner(model_path), SHAPE, sync, weights, (0, 1, 2, 3, 5, 8))
    assert failures == [], "\n".join(failures[:10])



@pytest.mark.parametrize("scenario", [waited, got], ids=["wait", "get"])
def test_an_interrupt_anywhere_in_execute_async_and_its_wait_never_hangs(
        make_runner, model_path, weights, scenario):
    """``executeAsync``, then its future's ``wait()`` (the drainer's inline path) or a
    timed ``wait`` and ``get`` (its drive step), interrupted once at every place and
    twice (the second while the first is handled: the abandon, the drain's count-down)."""
    failures = sweep(lambda: make_runner(model_path), SHAPE, scenario, weights, (0, 1, 2, 3, 5))
    assert failures == [], "\n".join(failures[:10])


def test_an_interrupt_anywhere_with_requests_queued_gives_no_wrong_answer(
        make_runner, model_path, big_path, weights):
    """Two requests in flight and an ``execute`` behind them that drains them, then their
    waits, small and 4 KiB (slots, copies), interrupted once and twice in a row at every
    other place, and at every place of the drain."""
    failures = sweep(lambda: make_runner(model_path), SHAPE, crowded, weights, (0, 1, 3),
                     every=2, focus={"_drain", "take", "wait_for", "_drive_step"})
    path, w = big_path
    failures += sweep(lambda: make_runner(path), BIG, crowded, w, (0, 2), every=3,
                      focus={"_drain", "take", "copy_out", "lay_whole", "lay_input"})
    assert failures == [], "\n".join(failures[:10])


def test_an_interrupt_anywhere_in_dynamic_batching_gives_no_wrong_answer(
        make_runner, packed_path):
    """Dynamic batching: requests packed into open transfers (``_pack``, ``pack``,
    ``open_partial``, ``seal``) and a partial batch flushed by its waiter, interrupted once
    at every place and twice in a row at every third one and every place of the packing."""
    path, w = packed_path

    def make() -> Any:
        runner = make_runner(path, batching_dim=0, timeout_ns=1_000_000,
                             flush_on_waiting_outputs=True)   # no watchdog thread
        runner.update_load_inputs({"weights": w})
        return runner
    failures = sweep(make, PACKED, packed, w[0], (0,))
    failures += sweep(make, PACKED, packed, w[0], (1, 3), every=3,
                      focus={"_pack", "pack", "open_partial", "_seal", "seal"})
    assert failures == [], "\n".join(failures[:10])


def test_an_interrupt_anywhere_in_update_load_inputs_leaves_the_runner_usable(
        make_runner, model_path, weights):
    """``update_load_inputs`` (``rerun_load``) with a request in flight and an abandoned one
    left over, interrupted once at every place and twice in a row at every other one: the
    request gets its answer, the next requests theirs (a reload cut short is finished
    before the next request is sent)."""
    def make() -> Any:
        runner = make_runner(model_path)
        runner.weights = weights   # (what the scenario loads)
        return runner
    failures = sweep(make, SHAPE, reloaded, weights, (0,))
    failures += sweep(make, SHAPE, reloaded, weights, (1, 3), every=2,
                      focus={"rerun_load", "reload", "_forget", "_usable"})
    assert failures == [], "\n".join(failures[:10])


def test_update_load_inputs_with_an_abandoned_request_left_over(make_runner, model_path,
                                                                 weights):
    """An abandoned request's transfer left in flight does not stop ``update_load_inputs``:
    the request in flight gets the old weights' answer, the next ones the new."""
    runner = make_runner(model_path)
    try:
        fut = runner.executeAsync(request(7, SHAPE))
        abandon(runner, SHAPE, 8)
        runner.update_load_inputs({"weights": 2 * weights})
        assert right(7, fut["tensor_C"], weights)
        assert right(9, runner.execute(request(9, SHAPE))["tensor_C"], 2 * weights)
        assert right(10, runner.executeAsync(request(10, SHAPE))["tensor_C"], 2 * weights)
    finally:
        runner.close()


def test_an_interrupted_update_load_inputs_leaves_no_replica_on_the_old_weights(
        model_path, weights, monkeypatch):
    """2 replicas: ``update_load_inputs`` interrupted anywhere (once, and twice in a row at
    every third place) leaves both replicas answering with the same weights on their next
    request: the new ones as soon as any replica was given them (a replica it did not
    reach yet loads them before its next request), else the old."""
    from host_runtime.devices.loopback import loopback_device

    monkeypatch.setenv("IPU_EMULATOR_HOST_SYNC_TIMEOUT", "2")
    devices = [loopback_device(1), loopback_device(1)]
    scale = [1.0]   # the weights the replicas answer with now (a multiple of weights)

    def make() -> Any:
        return model_runtime.ModelRunner(model_path, model_runtime.ModelRunnerConfig(
            replication_factor=2, replica_to_device={0: devices[0], 1: devices[1]}))
    runner = [make()]

    def run(n: int) -> None:
        new = float(n % 3 + 2) if n else 5.0   # never the weights loaded now
        runner[0].update_load_inputs({"weights": new * weights})
        scale[0] = new

    def check() -> list[str]:
        got = []
        for rid in (0, 1):
            out = runner[0].execute(request(7, SHAPE), replica_id=rid)["tensor_C"]
            found = [s for s in {scale[0], *range(1, 6)} if right(7, out, s * weights)]
            got.append(found[0] if found else None)
        if got[0] is None or got[0] != got[1]:
            return [f"replicas 0 and 1 answer with weights x {got[0]} and x {got[1]}"]
        scale[0] = got[0]   # (the interrupted call's, or the old ones)
        return []

    def replace() -> None:
        old, runner[0] = runner[0], None
        old.close()
        runner[0] = make()
        scale[0] = 1.0
    try:
        failures = sweep_places(run, check, (0,), replace=replace)
        failures += sweep_places(run, check, (1,), every=3, replace=replace)
    finally:
        if runner[0] is not None:
            runner[0].close()
        for dev in devices:
            dev.close()
    assert failures == [], "\n".join(failures[:10])


@pytest.mark.parametrize("config", [{"thread_safe": True}, {"auto_reset": True}],
                         ids=["thread_safe", "auto_reset"])
def test_an_interrupt_anywhere_with_thread_safe_or_auto_reset_gives_no_wrong_answer(
        make_runner, model_path, weights, config):
    """``thread_safe`` (a call lock per replica) and ``auto_reset``: ``execute`` and
    ``executeAsync`` + ``wait``/``get`` interrupted once at every place, ``execute`` twice
    in a row at every other one."""
    def make() -> Any:
        return make_runner(model_path, **config)
    failures = sweep(make, SHAPE, sync, weights, (0,))
    failures += sweep(make, SHAPE, sync, weights, (1,), every=2)
    failures += sweep(make, SHAPE, got, weights, (0,))
    assert failures == [], "\n".join(failures[:10])


def test_an_interrupt_anywhere_in_a_flush_by_the_flush_callback_gives_no_wrong_answer(
        make_runner, packed_path):
    """Dynamic batching with a ``flush_callback`` the waiter calls (``flush_on_waiting_
    outputs``): a partial batch flushed with the callback's padding (it returns None),
    interrupted once at every place and twice in a row at every third one."""
    path, w = packed_path
    calls: list[str] = []

    def on_flush(tensor_id: str, inputs: Any, outputs: Any) -> None:
        calls.append(tensor_id)
        return None

    def make() -> Any:
        runner = make_runner(path, batching_dim=0, timeout_ns=1_000_000,
                             flush_on_waiting_outputs=True, flush_callback=on_flush)
        runner.update_load_inputs({"weights": w})
        return runner
    failures = sweep(make, PACKED, packed, w[0], (0,))
    assert calls   # (the sweep flushed through the callback)
    failures += sweep(make, PACKED, packed, w[0], (1,), every=3)
    assert failures == [], "\n".join(failures[:10])
