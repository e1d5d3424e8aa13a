"""A KeyboardInterrupt wherever it can land in the runner's code never gives a wrong answer,
never hangs and never leaves the runner unusable. Loopback device, no process.

A signal's handler runs (and raises KeyboardInterrupt) only where CPython 3.11 checks
for pending work: at a function's entry, after a call returns and at a loop's backward
jump (a conditional one only when it jumps). :class:`Interrupts` counts those places in
the main thread's frames of ``host_runtime/runner/`` (and of ``threading.Condition``
called from there) with a trace function (every function entry, every ``CALL`` and
backward-jump instruction) and, at the chosen counts, schedules a KeyboardInterrupt
with ``PyThreadState_SetAsyncExc``: CPython raises it at its next check, exactly where a
signal's handler would run. (The trace function's own entry is a check too: an
interrupt is scheduled so that it never comes there first; for a call of a Python
function, at that function's entry.) The test sweeps the places of ``execute``,
``executeAsync`` + ``wait``/``get``, requests queued behind each other, dynamic
batching and ``update_load_inputs`` with an abandoned request left over, once and twice
in a row (an interrupt that lands while the first one is being handled), and after each
asserts: the interrupted call raised KeyboardInterrupt (or answered right), every
interrupted request got its own answer or the named error, and the next requests are
right (C = A * weights + B, compared to numpy); those checks run in another thread, so
that a lock the interrupted thread left held shows (and a hang is bounded).
"""

from __future__ import annotations

import ctypes
import dis
import functools
import os
import re
import sys
import threading
import traceback
import types
from typing import Any, Callable, Iterable

import numpy as np
import pytest

import host_runtime as model_runtime
import host_runtime.runner as runner_package
from tests.unit._loopback import model, model_path, weights  # noqa: F401  (fixtures)

SHAPE = (1, 4)   # small: execute takes the fused path on an idle replica
BIG = (4, 256)   # 4 KiB: the general path (slots, copy_bytes), every output a Take.SLOT
PACKED = (4, 8)  # dynamic batching: a batch of 4 samples

RUNNER_DIR = os.path.dirname(os.path.abspath(runner_package.__file__)) + os.sep
_ALWAYS: Callable[[Any], bool] = lambda top: True   # noqa: E731
_CALL: Callable[[Any], bool] = lambda top: True   # noqa: E731
_CHECKS: dict[str, Callable[[Any], bool]] = {
    # instruction -> whether, given the value on top of the stack, it checks
    "CALL": _CALL, "JUMP_BACKWARD": _ALWAYS,
    # a conditional backward jump checks only when it jumps
    "POP_JUMP_BACKWARD_IF_TRUE": bool, "POP_JUMP_BACKWARD_IF_FALSE": lambda top: not top,
    "POP_JUMP_BACKWARD_IF_NONE": lambda top: top is None,
    "POP_JUMP_BACKWARD_IF_NOT_NONE": lambda top: top is not None}
_ALSO = frozenset(getattr(threading.Condition, name).__code__ for name in (
    "wait", "notify", "notify_all", "_release_save", "_acquire_restore", "_is_owned"))
"""Code of the standard library whose places count too when the runner's code calls it
(``Condition.wait`` is not safe from an interrupt: the runner has its own, _sleepers)."""
_SET_ASYNC_EXC = ctypes.pythonapi.PyThreadState_SetAsyncExc
ALLOWED = re.compile(r"InvalidStateError: replica 0: (output 'tensor_C' of the request was lost: "
                     r"the thread reading it was interrupted by KeyboardInterrupt|the request "
                     r"was abandoned: KeyboardInterrupt interrupted it( while it was sent)?)")
"""What an interrupted request may get instead of its answer (never another's answer)."""

pytestmark = pytest.mark.skipif(sys.version_info[:2] != (3, 11),
                                reason="the places are CPython 3.11's instructions")


@functools.lru_cache(maxsize=None)
def _places(code: types.CodeType) -> dict[int, Callable[[Any], bool]]:
    """Offsets of the instructions of ``code`` after which CPython may check for a signal:
    whether it does, given the value on top of the stack."""
    return {i.offset: _CHECKS[i.opname] for i in dis.get_instructions(code)
            if i.opname in _CHECKS}


@functools.lru_cache(maxsize=None)
def _argc(code: types.CodeType, offset: int) -> int:
    return next(i.arg for i in dis.get_instructions(code) if i.offset == offset)


def _peek(frame: types.FrameType, k: int = 1) -> Any:
    """The ``k``-th value from the top of the stack of ``frame`` (stopped at an opcode
    event; None for a NULL).

    CPython 3.11's layout: ``PyFrameObject.f_frame`` (after the object's head and
    ``f_back``) points to the ``_PyInterpreterFrame``, whose ``stacktop`` (after 8
    pointers) counts the values of ``localsplus`` (after it, aligned) up to the top."""
    data = ctypes.c_void_p.from_address(id(frame) + 24).value
    assert data is not None
    depth = ctypes.c_int.from_address(data + 64).value
    assert depth >= k, (depth, k)
    value = ctypes.c_void_p.from_address(data + 72 + 8 * (depth - k)).value
    return None if value is None else ctypes.cast(value, ctypes.py_object).value


def _enters_python(frame: types.FrameType, argc: int) -> bool:
    """Whether the ``CALL argc`` ``frame`` is stopped at calls a Python function (whose
    entry is then the place: the trace function's own entry, a check, must not get the
    interrupt first, or the trace ends with it)."""
    method = _peek(frame, argc + 2)      # (a NULL unless a method is called on an object)
    func = method if method is not None else _peek(frame, argc + 1)
    if isinstance(func, types.MethodType):
        func = func.__func__
    return isinstance(func, types.FunctionType)


def _arming(tid: int) -> Any:
    """An object whose attribute assignment schedules KeyboardInterrupt in thread ``tid``.

    A trace function that called ``PyThreadState_SetAsyncExc`` itself would get the
    interrupt at once (a call's return is a check); a STORE_ATTR through a C callable
    ``__setattr__`` is none, so the trace function returns first."""
    arm = functools.partial(_SET_ASYNC_EXC, ctypes.c_ulong(tid),
                            ctypes.py_object(KeyboardInterrupt))
    return type("Arm", (), {"__slots__": (), "__setattr__": arm})()


def _nothing() -> None:
    pass


class Interrupts:
    """``with Interrupts(at):`` KeyboardInterrupt at the places numbered ``at`` (1, 2, ...)
    of the runner's code run by this thread; ``count``: the places passed, ``where``: the
    functions and lines the interrupts were scheduled at."""

    def __init__(self, at: Iterable[int] = (), entry: str = "",
                 names: list[str] | None = None) -> None:
        self.at = frozenset(at)
        self.entry = entry     # also: at the entry of the first call of the function so named
        self.names = names     # given: the name of each place's function is appended
        self.count = 0
        self.where: list[str] = []
        self._at_entry = False   # the interrupt is due at the next function's entry
        self._arm = _arming(threading.get_ident())

    def _call(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        code, back = frame.f_code, frame.f_back
        runner = code.co_filename.startswith(RUNNER_DIR) or (
            code in _ALSO and back is not None
            and (back.f_code in _ALSO or back.f_code.co_filename.startswith(RUNNER_DIR)))
        due, self._at_entry = self._at_entry, False
        if runner:
            frame.f_trace_opcodes = True
            frame.f_trace_lines = False
            self.count += 1
            if self.names is not None:
                self.names.append(frame.f_code.co_name)
            if self.count in self.at or frame.f_code.co_name == self.entry:
                self.entry = ""
                self.where.append(f"{frame.f_code.co_name}:{frame.f_lineno} (entry)")
                due = True
        if due:
            self._arm.go = True   # last: nothing after it checks (the function's entry does)
        return self._opcode if runner else None

    def _opcode(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        if event != "opcode":
            return self._opcode
        checks = _places(frame.f_code).get(frame.f_lasti)
        # a place only if the instruction checks (else an interrupt scheduled here would be
        # raised by the next call of this trace function, where CPython never raises it:
        # e.g. after a loop's last test, before the ``with`` around it releases its lock)
        if self._at_entry:   # the call entered no Python function (it failed first)
            self._at_entry = False
            self._arm.go = True
            return self._opcode
        if checks is not None and (checks is _ALWAYS or checks is _CALL or checks(_peek(frame))):
            self.count += 1
            if self.names is not None:
                self.names.append(frame.f_code.co_name)
            if self.count in self.at:
                self.where.append(f"{frame.f_code.co_name}:{frame.f_lineno}")
                if checks is _CALL and _enters_python(frame, _argc(frame.f_code,
                                                                  frame.f_lasti)):
                    self._at_entry = True
                    return self._opcode
                self._arm.go = True   # last: nothing after it checks
        return self._opcode

    def __enter__(self) -> "Interrupts":
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            sys.settrace(None)
            _nothing()    # an interrupt scheduled but not yet raised is raised here
        except KeyboardInterrupt:
            pass


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


def elsewhere(check: Callable[[], list[str]]) -> list[str]:
    """``check()`` run by another thread: a lock the interrupted thread left held shows, and
    a hang is reported (after 30 s) instead of stopping the sweep."""
    found = ["the checks hung for 30 s"]

    def run() -> None:
        try:
            found[:] = check()
        except BaseException as exc:   # noqa: B036 (reported, not raised)
            found[:] = [f"the checks raised {type(exc).__name__}: {exc}"]
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(30.0)
    return found


def _unraisable(found: list[str], u: Any) -> None:
    """``sys.unraisablehook`` while sweeping: an exception a finalizer could not raise goes
    to ``found``, except an interrupt the trace function itself raised (a generator closed
    as a call returned runs it: CPython would raise the interrupt after the call)."""
    last = traceback.extract_tb(u.exc_traceback)[-1:] if u.exc_traceback else []
    if (isinstance(u.exc_value, KeyboardInterrupt) and last
            and last[0].filename == __file__ and last[0].name in ("_call", "_opcode")):
        return
    found.append(f"unraisable {u.exc_type.__name__}: {u.exc_value} in {u.object!r}")


def sweep(make: Callable[[], Any], shape: tuple[int, ...], scenario: Scenario, w: np.ndarray,
          gaps: Iterable[int], every: int = 1, focus: Iterable[str] = ()) -> list[str]:
    """Run ``scenario`` interrupted at every place (``gaps``: 0, once; d, a second interrupt
    d places after the first); what went wrong, by place. ``every``: only every k-th place,
    and every place in the functions named in ``focus`` (as a first run counted them)."""
    runner = make()
    names: list[str] = []
    with Interrupts(names=names) as counting:
        scenario(runner, shape, 1, [])
    assert counting.count > 20, counting.count   # the trace saw the runner's code
    focus = frozenset(focus)
    places = [n for n, name in enumerate(names, 1) if n % every == 0 or name in focus]
    assert not focus or len(places) > len(names) // every, "no place in the focus"
    failures = []
    unraisable: list[str] = []
    hook, sys.unraisablehook = sys.unraisablehook, functools.partial(_unraisable, unraisable)
    try:
        for gap in gaps:
            for n in places:
                at = {n} if gap == 0 else {n, n + gap}
                futures: list[tuple[int, Any]] = []
                bad = []
                interrupts = Interrupts(at)
                try:   # (a late one may come as the block ends, before __exit__ runs)
                    with interrupts:
                        try:
                            scenario(runner, shape, n, futures)
                        except KeyboardInterrupt:
                            pass
                        except BaseException as exc:   # noqa: B036 (reported, not raised)
                            bad.append(f"raised {type(exc).__name__}: {exc}")
                except KeyboardInterrupt:
                    pass
                bad += elsewhere(lambda: answers(futures, w) + next_requests(runner, shape, w))
                bad += unraisable
                unraisable.clear()
                if bad:
                    failures.append(f"{sorted(at)} at {interrupts.where}: {bad}")
                    runner.close()
                    runner = make()
    finally:
        sys.unraisablehook = hook
        runner.close()
    return failures


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
