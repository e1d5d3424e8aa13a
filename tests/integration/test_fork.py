"""fork() after a runner exists: the child may not use the parent's objects, and nothing
the child does (use, close, drop, exit) touches the parent's rings, shared memory, IPU
processes or IPUs; a runner the child makes for itself works. Embedded and through a
daemon.

Each test forks this test process with ``os.fork()``; the child reports a JSON dict
through a pipe and leaves with ``os._exit`` (never through pytest). A child that exits
"normally" runs the runtime's exit hooks and the collector itself first (not every
``atexit`` hook of the worker: onnxruntime's crashes in a forked child); a whole
interpreter's exit (module teardown) is ``fork_program.py``'s, in a fresh interpreter.
"""

from __future__ import annotations

import faulthandler
import gc
import json
import os
import re
import select
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

import numpy as np
import pytest

import host_runtime as model_runtime
from host_runtime.errors import ForkedProcessError
from ipu_emulator.daemon import socket_protocol as wire
from shm.cleanup import list_objects

from tests._paths import child_pythonpath

pytestmark = pytest.mark.usefixtures("private_machine")

SHAPE = (1, 4)
FORK_HINT = "after fork(): "
FIX_HINT = "create runners after fork (in the process that uses them), or use the 'spawn' start method"


def start_child(body: Callable[[], dict[str, Any]]) -> tuple[int, int]:
    """Fork; the child runs ``body()`` and reports its dict (or the exception it raised)
    through a pipe, then ``os._exit(0)``. (pid, the parent's end of the pipe)."""
    rd, wr = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: never return into pytest
        try:
            # a crash of the child (SIGSEGV, SIGBUS) is reported with its traceback
            faulthandler.enable(open(_crash_log(os.getpid()), "w"))
            os.close(rd)
            try:
                report = body()
            except BaseException as exc:   # noqa: BLE001 - reported to the parent
                import traceback
                report = {"crash": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
            os.write(wr, json.dumps(report).encode())
            os.close(wr)
        finally:
            os._exit(0)
    os.close(wr)
    return pid, rd


def _runtime_exit_hooks() -> list[Callable[[], Any]]:
    from host_runtime.devices import _device
    from host_runtime.runner import _model_runner
    from ipu_emulator.ipu import forkserver
    from shm import _registry

    # atexit runs them last registered first: runners, devices, the template, the registry
    return [_model_runner._close_live_runners, _device._close_live_devices,
            forkserver.stop, _registry.unlink_all_created]


_RUNTIME_EXIT_HOOKS = _runtime_exit_hooks()


def _crash_log(pid: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"test_fork_child_{pid}.txt")


def finish_child(pid: int, rd: int, timeout: float = 60.0) -> dict[str, Any]:
    """The report of the child ``start_child`` made, with its pid, once it exited 0."""
    chunks = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([rd], [], [], max(0.0, left))
            if not ready:
                os.kill(pid, 9)
                pytest.fail(f"the forked child {pid} did not report within {timeout:g} s")
            chunk = os.read(rd, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(rd)
        _, status = os.waitpid(pid, 0)
    crash = _crash_log(pid)
    with open(crash) as f:
        tail = f.read()
    os.unlink(crash)
    assert os.waitstatus_to_exitcode(status) == 0, f"the forked child crashed:\n{tail}"
    report = json.loads(b"".join(chunks).decode() or "{}")
    assert "crash" not in report, report["crash"]
    report["pid"] = pid
    return report


def run_child(body: Callable[[], dict[str, Any]], timeout: float = 60.0) -> dict[str, Any]:
    """Fork, run ``body()`` in the child, return its report (see start_child)."""
    return finish_child(*start_child(body), timeout=timeout)


def forked_message(what: str, owner: int, child: int) -> str:
    return (f"{what} created in process {owner}, used in process {child} after fork(): its "
            "rings, IPU processes and attachments belong to the creating process; create "
            "runners after fork (in the process that uses them), or use the 'spawn' start "
            "method (multiprocessing.get_context('spawn'))")


def error_of(call: Callable[[], Any]) -> dict[str, Any]:
    """What ``call()`` raised, as the child reports it (None if it returned)."""
    try:
        call()
    except BaseException as exc:   # noqa: BLE001 - reported
        return {"type": type(exc).__name__, "message": str(exc),
                "forked": isinstance(exc, ForkedProcessError),
                "owner_pid": getattr(exc, "owner_pid", None)}
    return {"type": None}


def mine(pid: int | None = None) -> set[str]:
    """/dev/shm entries of this test process's tag made by ``pid`` (default: this one)."""
    want = os.getpid() if pid is None else pid
    return {o.entry for o in list_objects() if o.pid == want}


def inputs(a: float, b: float = 0.5) -> dict[str, np.ndarray]:
    return {"tensor_A": np.full(SHAPE, a, np.float32), "tensor_B": np.full(SHAPE, b, np.float32)}


def wrong_answers(runner: Any, weights: np.ndarray, n: int, base: float) -> int:
    wrong = 0
    for i in range(n):
        out = runner.execute(inputs(base + i))["tensor_C"]
        if not np.allclose(out, (base + i) * weights + 0.5, rtol=1e-6):
            wrong += 1
    return wrong


@pytest.fixture(params=["embedded", "daemon"])
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "daemon":
        rig = request.getfixturevalue("daemon")
        monkeypatch.setenv(wire.ENV_VAR, rig.socket)
    else:
        monkeypatch.delenv(wire.ENV_VAR, raising=False)
    return str(request.param)


@pytest.fixture
def runner(mode: str, model_path: str):
    r = model_runtime.ModelRunner(model_path)
    yield r
    r.close()


def held_by(daemon: Any, pid: int) -> list[int]:
    return sorted(ipu["ipu"] for ipu in daemon.status()["ipus"] if ipu.get("holder") == pid)


def test_a_child_using_the_parents_runner_gets_the_named_error_and_both_stay_right(
        runner, weights, mode):
    """Both processes execute: the child's every call on the parent's runner raises
    ForkedProcessError before touching a ring; the parent gets 0 wrong answers."""
    parent = os.getpid()
    future = runner.executeAsync(inputs(3.0))
    assert np.allclose(future["tensor_C"], 3.0 * weights + 0.5, rtol=1e-6)

    def child() -> dict[str, Any]:
        return {
            "execute": [error_of(lambda: runner.execute(inputs(float(i)))) for i in range(50)],
            "async": error_of(lambda: runner.executeAsync(inputs(1.0))),
            "future": error_of(lambda: future.wait()),
            "result": error_of(lambda: future["tensor_C"]),
            "mine": wrong_answers_in_child(runner, weights),
        }

    child_pid, rd = start_child(child)   # the parent keeps executing while the child runs
    wrong = wrong_answers(runner, weights, 200, 100.0)
    report = finish_child(child_pid, rd)
    assert wrong == 0
    c = report["pid"]
    for err in [*report["execute"], report["async"]]:
        assert err == {"type": "ForkedProcessError", "message": forked_message("ModelRunner", parent, c),
                       "forked": True, "owner_pid": parent}
    for key in ("future", "result"):
        assert report[key]["message"] == forked_message("OutputFuture", parent, c)
    assert report["mine"] == 0
    assert wrong_answers(runner, weights, 20, 9.0) == 0


def wrong_answers_in_child(runner: Any, weights: np.ndarray) -> int:
    """In the child: the parent's runner refuses; a runner of the child's own is right."""
    path = runner.model  # a popef.Model: the child loads the same model
    mine_ = model_runtime.ModelRunner(path)
    try:
        return wrong_answers(mine_, weights, 30, 50.0)
    finally:
        mine_.close()


@pytest.mark.parametrize("how", ["os_exit", "exit_hooks", "close", "del"])
def test_a_child_that_lets_go_leaves_the_parents_objects_and_runner_intact(
        runner, weights, mode, how, request):
    """Whatever the child does with its copy (nothing, its exit hooks with the collector on,
    close(), del), the parent's /dev/shm objects, IPU processes and IPUs are untouched and
    the parent's runner still answers right."""
    assert wrong_answers(runner, weights, 3, 1.0) == 0
    before = mine()
    assert before, "the runner's rings carry this process's pid"
    pids = {p for rep in runner._replicas for p in rep.session.device().pids()}
    daemon = request.getfixturevalue("daemon") if mode == "daemon" else None
    held = held_by(daemon, os.getpid()) if daemon is not None else None

    def child() -> dict[str, Any]:
        nonlocal runner
        gc.enable()
        if how == "close":
            runner.close()
            runner.close()
        elif how == "del":
            del runner
            gc.collect()
        elif how == "exit_hooks":
            # what a normal exit runs of the runtime: its exit hooks, in their order (not
            # every hook of this process: onnxruntime's, registered in a worker that
            # compiled a model, crashes in a forked child, as README says)
            for hook in _RUNTIME_EXIT_HOOKS:
                hook()
            gc.collect()
        return {}

    run_child(child)
    assert mine() == before
    assert all(os.path.exists(f"/proc/{p}") for p in pids)
    if daemon is not None:
        assert held_by(daemon, os.getpid()) == held
    assert wrong_answers(runner, weights, 20, 2.0) == 0


def test_a_runner_made_in_the_child_works_and_is_freed_at_its_exit(runner, weights, mode):
    def child() -> dict[str, Any]:
        own = model_runtime.ModelRunner(runner.model)
        wrong = wrong_answers(own, weights, 20, 5.0)
        made = len(mine(os.getpid()))
        del own           # freed by reference counting, as in any process
        return {"wrong": wrong, "made": made, "left": sorted(mine(os.getpid()))}

    report = run_child(child)
    assert report["wrong"] == 0 and report["made"] > 0
    assert report["left"] == []
    assert mine(report["pid"]) == set()
    assert wrong_answers(runner, weights, 10, 3.0) == 0


def test_sessions_devices_queues_and_shared_arrays_refuse_in_a_child(model_path, weights, mode):
    parent = os.getpid()
    session = model_runtime.Session(model_path)
    dm = model_runtime.DeviceManager()
    device = dm.getDevice(1)
    session.bindToDevice(device)
    qm = session.createQueueManager()
    shared = model_runtime.empty_shared(SHAPE, np.float32)
    shared[...] = 2.0
    before = mine()
    try:
        def child() -> dict[str, Any]:
            own = model_runtime.ModelRunner(model_path)
            try:
                return {
                    "session": error_of(session.runMainPrograms),
                    "stop": error_of(session.stop),
                    "queue": error_of(lambda: qm.inputQueue("tensor_A")),
                    "enqueue": error_of(lambda: qm.inputs["tensor_A"].enqueue(np.ones(SHAPE, np.float32))),
                    "device": error_of(lambda: device.unbindSession()),
                    "shared": error_of(lambda: own.execute({"tensor_A": shared, "tensor_B": shared})),
                    "is_shared": model_runtime.is_shared(shared),
                    "close": error_of(lambda: (session.close(), device.close())),
                    "own": wrong_answers(own, weights, 5, 1.0),
                }
            finally:
                own.close()

        report = run_child(child)
        c = report["pid"]
        assert report["session"]["message"] == forked_message("Session", parent, c)
        assert report["stop"]["message"] == forked_message("Session", parent, c)
        assert report["queue"]["message"] == forked_message("QueueManager", parent, c)
        assert report["enqueue"]["message"] == forked_message("input queue 'tensor_A'", parent, c)
        assert report["device"]["message"] == forked_message("Device", parent, c)
        name = [n for n in before if n.endswith("_hostmem")]
        assert len(name) == 1
        assert report["shared"]["message"] == forked_message(
            f"the empty_shared array in /{name[0]}", parent, c)
        assert report["is_shared"] is False     # not shared memory of the child's
        assert report["close"] == {"type": None}   # a child's close() only forgets its copy
        assert report["own"] == 0
        assert mine() == before
        assert device.isAttached()
        session.runLoadPrograms()   # the parent's session still works
    finally:
        qm.disconnectAll()
        session.close()
        device.close()
    del shared


def test_a_child_exiting_the_whole_interpreter_leaves_the_parent_intact(model_path, mode):
    """A fresh interpreter with a runner forks; the child leaves through sys.exit (exit
    hooks, then module teardown runs the dropped objects' __del__, collector on) or with
    the runner closed, dropped or used; the parent compares its /dev/shm objects and
    executes (tests/integration/fork_program.py)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, "-m", "tests.integration.fork_program", model_path],
                          env=env, capture_output=True, text=True, timeout=240,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(
                              os.path.abspath(__file__)))))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert result["cases"] == ["sys_exit", "sys_exit_closed", "sys_exit_used"]
    for case in result["cases"]:
        assert result[case] == {"missing": [], "wrong": 0, "child": 0}, (case, result[case])
    assert result["left"] == []


def test_a_poprt_runner_refuses_in_a_child_and_keeps_serving_the_parent(model_path, weights, mode):
    from host_runtime.poprt import Runner

    parent = os.getpid()
    r = Runner(model_path)
    try:
        def child() -> dict[str, Any]:
            return {"execute": error_of(lambda: r.execute(inputs(1.0),
                                                          {"tensor_C": np.zeros(SHAPE, np.float32)})),
                    "close": error_of(r.close)}

        report = run_child(child)
        assert report["execute"]["message"] == forked_message("ModelRunner", parent, report["pid"])
        assert report["close"] == {"type": None}
        out = np.zeros(SHAPE, np.float32)
        r.execute(inputs(2.0), {"tensor_C": out})
        np.testing.assert_allclose(out, 2.0 * weights + 0.5, rtol=1e-6)
    finally:
        r.close()


def test_forking_while_another_thread_executes_neither_deadlocks_nor_mixes_answers(
        model_path, weights, mode):
    """A thread of the parent is inside execute (holding the thread_safe runner's call lock,
    its ring slots, maybe the module locks) at each fork: the child's call on the runner
    still raises at once, and its own runner works; the parent's thread gets 0 wrong."""
    import threading

    cfg = model_runtime.ModelRunnerConfig()
    cfg.thread_safe = True
    runner = model_runtime.ModelRunner(model_path, config=cfg)
    stop = threading.Event()
    counts = {"n": 0, "wrong": 0}
    started = threading.Event()

    def work() -> None:
        i = 0
        while not stop.is_set():
            out = runner.execute(inputs(float(i)))["tensor_C"]
            if not np.allclose(out, i * weights + 0.5, rtol=1e-6):
                counts["wrong"] += 1
            counts["n"] += 1
            started.set()
            i += 1

    t = threading.Thread(target=work, daemon=True)
    t.start()
    try:
        assert started.wait(60)
        parent = os.getpid()
        for _ in range(3):
            def child() -> dict[str, Any]:
                own = model_runtime.ModelRunner(model_path)
                try:
                    return {"parents": error_of(lambda: runner.execute(inputs(1.0))),
                            "own": wrong_answers(own, weights, 5, 1.0)}
                finally:
                    own.close()

            report = run_child(child, timeout=60)
            assert report["parents"]["message"] == forked_message("ModelRunner", parent,
                                                                   report["pid"])
            assert report["own"] == 0
    finally:
        stop.set()
        t.join(60)
        runner.close()
    assert not t.is_alive()
    assert counts["wrong"] == 0 and counts["n"] > 0


def test_a_multiprocessing_fork_pool_gets_the_named_error_and_the_parent_stays_right(
        model_path, mode):
    """multiprocessing's 'fork' Pool and Process in a fresh interpreter
    (tests/integration/fork_pool_program.py): the workers' calls on the parent's runner
    raise ForkedProcessError, which reaches the parent intact; workers' own runners are
    right; a worker closing the parent's runner, or just exiting, leaves the parent's
    objects; the parent gets 0 wrong answers throughout and leaves nothing."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=child_pythonpath())
    proc = subprocess.run([sys.executable, "-m", "tests.integration.fork_pool_program", model_path],
                          env=env, capture_output=True, text=True, timeout=240, cwd=root)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT "):])
    parent = result["parent"]
    assert result["parents"]["type"] == "ForkedProcessError"
    assert result["parents"]["owner_pid"] == parent
    expected = re.escape(forked_message("ModelRunner", parent, 999999)).replace("999999", r"\d+")
    assert re.fullmatch(expected, result["parents"]["message"]), result["parents"]["message"]
    assert result["own"] == [True, True]
    assert result["close_exitcode"] == 0 and result["exit_exitcode"] == 0
    assert result["wrong_while_pool"] == 0 and result["wrong_after"] == 0
    assert result["missing"] == [] and result["left"] == []
