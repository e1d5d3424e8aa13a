"""One host process of ``ipu-emulator stress``: ``python -m tools._stress_host SPEC RESULT``.

The orchestrator (``tools.stress``) starts each host as a fresh Python
(subprocess, never fork) with the run's IPU_EMULATOR_HOME and shm tag. A host
reads its spec (``tools._stress_spec``), opens the scenario's runner, prints ``READY`` on stdout,
runs ``threads`` worker threads until the deadline or its request budget, checks
every result against numpy, and writes a JSON result file:

``{"ok": n, "expected": n, "wrong": n, "hung": n, "errors": n, "latencies_ms": [...],
"problems": ["..."], "cycles": n}``

A request still running ``hang_timeout`` seconds after it should have finished
counts as hung; the host then writes its result and leaves with ``os._exit``.

The ``fork`` scenario adds a thread that forks the host again and again while the
workers execute (``_Forks``): each child must get ForkedProcessError from the
parent's runner (counted as failed as expected), gets right answers from a runner
of its own, lets go of everything (its exit hooks, ``close()`` of the parent's
runner, or ``del``), and leaves nothing of its own behind; the parent checks that
its /dev/shm objects are all still there, and its workers go on checking answers.

The ``interrupt`` scenario (``tools._stress_interrupt``): the main thread is a worker
too; KeyboardInterrupts land in the workers while they are inside a runtime call (a
real SIGINT whose handler raises in the main thread, asynchronous exceptions in the
others), and a thread of its own runs a Session's queues whose callbacks raise now and
then. An interrupted request, or a run a callback made fail, is failed as expected;
every other answer is checked. ``cycles`` counts the interrupts delivered.
"""

from __future__ import annotations

import atexit
import faulthandler
import gc
import json
import logging
import os
import random
import select
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import numpy as np

from tools._stress_spec import HostSpec, decode

_log = logging.getLogger("tools.stress.host")

_MAX_PROBLEMS = 20


class WrongResult(Exception):
    """A result differs from numpy's."""


class Hung(Exception):
    """A request did not finish within the hang timeout."""


class _Tally:
    """Counts of one host, shared by its threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ok = self.expected = self.wrong = self.hung = self.errors = self.cycles = 0
        self.latencies: list[float] = []
        self.latency_sum = 0.0
        self.problems: list[str] = []
        self.inject = 0        # internal hook: the next N checks expect a wrong value
        self.extra: dict[str, Any] = {}   # a scenario's own figures (faults: tools._stress_faults)

    def problem(self, kind: str, text: str) -> None:
        with self.lock:
            setattr(self, kind, getattr(self, kind) + 1)
            if len(self.problems) < _MAX_PROBLEMS:
                self.problems.append(f"{kind}: {text}")

    def take_injection(self) -> bool:
        with self.lock:
            if self.inject > 0:
                self.inject -= 1
                return True
            return False

    def progress_line(self) -> str:
        """``PROGRESS`` and the running totals (tools._stress_live.FIELDS)."""
        with self.lock:
            return (f"PROGRESS {self.ok} {self.expected} {self.wrong} {self.hung} {self.errors} "
                    f"{self.cycles} {self.latency_sum:.6f}")

    def as_dict(self) -> dict[str, Any]:
        with self.lock:
            return {"ok": self.ok, "expected": self.expected, "wrong": self.wrong,
                    "hung": self.hung, "errors": self.errors, "cycles": self.cycles,
                    "latencies_ms": [round(x * 1e3, 3) for x in self.latencies],
                    "problems": list(self.problems), "extra": dict(self.extra)}


def _weights(path: str) -> np.ndarray:
    from host_runtime import popef

    model = popef.load_model([path])
    td = model.tensorData("weights")
    if td is None:
        raise ValueError(f"{path}: the example model has no 'weights' tensor data")
    anchor = model.metadata.anchor("tensor_A")
    if anchor is None:
        raise ValueError(f"{path}: the example model has no 'tensor_A' input")
    shape = tuple(anchor.tensorInfo().shape())
    return np.frombuffer(td.data, np.float32).reshape(shape).copy()


_KILLS = ("kill-ipu", "kill-pipeline")   # scenarios that kill IPU processes (auto_reset)


class _Check:
    """Compares results with numpy; the internal hook shifts the expectation."""

    def __init__(self, tally: _Tally) -> None:
        self.tally = tally

    def __call__(self, got: Any, want: np.ndarray, what: str) -> None:
        if self.tally.take_injection():
            want = want + 1.0
        arr = np.asarray(got).reshape(want.shape)
        if not np.allclose(arr, want, rtol=1e-5, atol=1e-5):
            bad = int(np.sum(~np.isclose(arr, want, rtol=1e-5, atol=1e-5)))
            raise WrongResult(f"{what}: {bad} of {want.size} values differ from numpy "
                              f"(first got {arr.ravel()[:3].tolist()}, "
                              f"want {want.ravel()[:3].tolist()})")


def _wait(future: Any, timeout: float, what: str) -> None:
    if not future.wait(timeout):
        raise Hung(f"{what}: no result within {timeout:g} s")


# ----------------------------------------------------------------------------- workloads
class _Simple:
    """The example model through ModelRunner: every execution mode, random replicas."""

    def __init__(self, spec: HostSpec, check: _Check, batching: bool = False) -> None:
        import host_runtime as mr

        self.mr = mr
        self.spec = spec
        self.check = check
        self.batching = batching
        path = (spec.models.batch_model if batching else spec.models.model)
        self.w = _weights(path)
        cfg = mr.ModelRunnerConfig()
        cfg.replication_factor = spec.replicas
        cfg.thread_safe = True
        cfg.auto_reset = spec.scenario in _KILLS
        cfg.device_wait_config = mr.DeviceWaitConfig(timedelta(seconds=120),
                                                     timedelta(seconds=0.05))
        if batching:
            cfg.batching_dim = 0
            cfg.is_batch_size_timeout_enabled = True
            cfg.batch_size_timeout_ns = 2_000_000     # 2 ms
        self.runner = mr.ModelRunner(path, config=cfg)

    def close(self) -> None:
        self.runner.close()

    def request(self, rng: np.random.Generator, r: random.Random, hang: float) -> Callable[[], None]:
        """Submit one request (or a small pipeline of async ones); return its checker."""
        mr, w = self.mr, self.w
        rows = r.randint(1, 9) if self.batching else w.shape[0]
        shape = (rows,) + w.shape[1:]
        a = rng.standard_normal(shape).astype(np.float32)
        b = rng.standard_normal(shape).astype(np.float32)
        want = a * (w[0] if self.batching else w) + b
        rep = r.randrange(self.spec.replicas)
        mode = r.randrange(9)
        what = f"mode {mode} replica {rep} rows {rows}"
        ins: Any = {"tensor_A": a, "tensor_B": b}
        if mode in (7, 8):   # inputs and output in shared memory, read and written in place
            ins = {name: mr.empty_shared(shape, np.float32) for name in ins}
            ins["tensor_A"][...], ins["tensor_B"][...] = a, b
            shared_out = mr.empty_shared(shape, np.float32)
            if mode == 7:
                self.runner.execute(ins, {"tensor_C": shared_out}, replica_id=rep)
                return lambda: self.check(shared_out, want, what)
            fut7 = self.runner.executeAsync(ins, {"tensor_C": shared_out}, replica_id=rep)

            def done8() -> None:
                _wait(fut7, hang, what)
                fut7.result()
                self.check(shared_out, want, what)
            return done8
        if mode in (2, 3, 6):
            view = mr.InputMemoryView()
            view["tensor_A"], view["tensor_B"] = a, b
            ins = view
        out = np.zeros(shape, np.float32)
        if mode == 0:
            res = self.runner.execute(ins, replica_id=rep)
            return lambda: self.check(res["tensor_C"], want, what)
        if mode == 1:
            self.runner.execute(ins, {"tensor_C": out}, replica_id=rep)
            return lambda: self.check(out, want, what)
        if mode == 2:
            mem = self.runner.execute(ins, replica_id=rep)
            return lambda: self.check(np.frombuffer(mem["tensor_C"], np.float32), want, what)
        if mode == 3:
            ov = mr.OutputMemoryView()
            ov["tensor_C"] = out
            self.runner.execute(ins, ov, replica_id=rep)
            return lambda: self.check(out, want, what)
        if mode == 4:
            fut = self.runner.executeAsync(ins, replica_id=rep)

            def done4() -> None:
                _wait(fut, hang, what)
                self.check(np.asarray(fut["tensor_C"]), want, what)
            return done4
        ov = mr.OutputMemoryView() if mode == 6 else {}
        ov["tensor_C"] = out
        fut = self.runner.executeAsync(ins, ov, replica_id=rep)

        def done() -> None:
            _wait(fut, hang, what)
            fut.result()          # raises the request's error
            self.check(out, want, what)
        return done


class _Fused:
    """Two fused models through the PopRT Runner: random branches."""

    def __init__(self, spec: HostSpec, check: _Check) -> None:
        from host_runtime.poprt import Runner, RuntimeConfig

        cfg = RuntimeConfig()
        cfg.replication_factor = spec.replicas
        cfg.thread_safe = True
        cfg.timeout_ns = 0
        cfg.validate_io_params = False
        import host_runtime as mr
        cfg.device_wait_config = mr.DeviceWaitConfig(timedelta(seconds=120),
                                                     timedelta(seconds=0.05))
        self.runner = Runner(spec.models.fused_model, cfg)
        self.check = check

    def close(self) -> None:
        self.runner.close()

    def request(self, rng: np.random.Generator, r: random.Random, hang: float) -> Callable[[], None]:
        branch, use_async = r.randrange(2), r.random() < 0.5
        ins: dict[str, np.ndarray]
        want: np.ndarray
        what = f"graph{branch} {'execute_async' if use_async else 'execute'}"
        if branch == 0:
            x = rng.standard_normal((1, 2)).astype(np.float32)
            y = rng.standard_normal((1, 2)).astype(np.float32)
            ins, want = {"graph0/X": x, "graph0/Y": y}, (x + y).reshape(2)
            out = np.zeros(2, np.float32)
            outs = {"graph0/O": out}
        else:
            x1 = rng.standard_normal((1, 1)).astype(np.float16)
            ins = {"graph1/X": x1}
            want = np.concatenate([x1, np.array([[1.5, 2.0]], np.float16)], axis=1)
            out = np.zeros((1, 3), np.float16)
            outs = {"graph1/O": out}
        if not use_async:
            self.runner.execute(ins, outs)
            return lambda: self.check(out, want, what)
        fut = self.runner.execute_async(ins, outs)

        def done() -> None:
            _wait(fut, hang, what)
            fut.result()
            self.check(out, want, what)
        return done


class _Pipeline:
    """A MatMul/Relu chain pipelined over 2 IPU processes (kill-pipeline): sync and async
    requests, random replicas, compared with onnxruntime in this process."""

    def __init__(self, spec: HostSpec, check: _Check) -> None:
        import onnx
        import onnxruntime as ort

        import host_runtime as mr

        cfg = mr.ModelRunnerConfig()
        cfg.replication_factor = spec.replicas
        cfg.thread_safe = True
        cfg.auto_reset = True
        cfg.device_wait_config = mr.DeviceWaitConfig(timedelta(seconds=120),
                                                     timedelta(seconds=0.05))
        self.spec = spec
        self.check = check
        self.ref = ort.InferenceSession(onnx.load(spec.models.pipeline_onnx).SerializeToString(),
                                        providers=["CPUExecutionProvider"])
        self.ref_lock = threading.Lock()
        self.runner = mr.ModelRunner(spec.models.pipeline_model, config=cfg)

    def close(self) -> None:
        self.runner.close()

    def request(self, rng: np.random.Generator, r: random.Random, hang: float) -> Callable[[], None]:
        x = rng.standard_normal((4, 64)).astype(np.float32)
        with self.ref_lock:
            want = np.asarray(self.ref.run(None, {"x": x})[0])
        rep = r.randrange(self.spec.replicas)
        what = f"pipeline replica {rep}"
        if r.random() < 0.5:
            got = self.runner.execute({"x": x}, replica_id=rep)["y"]
            return lambda: self.check(got, want, what)
        fut = self.runner.executeAsync({"x": x}, replica_id=rep)

        def done() -> None:
            _wait(fut, hang, what)
            fut.result()
            self.check(np.asarray(fut["y"]), want, what)
        return done


def _open(spec: HostSpec, check: _Check) -> Any:
    scenario = spec.scenario
    if scenario == "fused":
        return _Fused(spec, check)
    if scenario == "kill-pipeline":
        return _Pipeline(spec, check)
    return _Simple(spec, check, batching=spec.batching)


# ----------------------------------------------------------------------------- fork
_CHILD_EXITS = ("os_exit", "exit_hooks", "close", "del")


def _objects_of(pid: int, skip_kind: str = "hostmem") -> set[str]:
    """/dev/shm objects of this run's tag made by ``pid`` (not of kind ``skip_kind``:
    the workers make and free empty_shared arrays all the time)."""
    from shm.cleanup import list_objects

    return {o.entry for o in list_objects() if o.pid == pid and o.kind != skip_kind}


class _Forks:
    """The fork scenario's forking thread (see the module docstring)."""

    def __init__(self, host: "_Host", work: "_Simple") -> None:
        self.host = host
        self.work = work
        # A module a thread of the host is importing at the fork stays locked in the child
        # for good: what the child uses is imported here, before any thread starts.
        import numpy.random  # noqa: F401
        import shm.cleanup  # noqa: F401

    def run(self) -> None:
        r = random.Random(int(self.host.spec.seed) * 1000 + 999)
        # leave a child the time to make its runner before the host's deadline
        while not self.host.over(margin=1.0):
            self.host.in_flight[-2] = (time.time(), "forking")
            try:
                if not self._one(r.choice(_CHILD_EXITS), r.randrange(1 << 30)):
                    return
            except Exception as exc:  # noqa: BLE001 - a finding, not a crash of the host
                self.host.tally.problem("errors", f"fork: {type(exc).__name__}: {exc}")
                return
            finally:
                self.host.in_flight.pop(-2, None)

    def _one(self, how: str, seed: int) -> bool:
        tally, parent = self.host.tally, os.getpid()
        before = _objects_of(parent)
        rd, wr = os.pipe()
        pid = os.fork()
        if pid == 0:   # the child: one thread; it reports through the pipe, never stdout
            code = 70
            try:
                os.close(rd)
                report = _child(self.work, how, seed, self.host.hang)
                os.write(wr, json.dumps(report).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(wr)
        chunks: list[bytes] = []
        limit = time.monotonic() + 60.0 + 2 * self.host.hang   # a new runner: IPU start-up
        try:
            while True:
                ready, _, _ = select.select([rd], [], [], max(0.0, limit - time.monotonic()))
                if not ready:
                    os.kill(pid, 9)
                    tally.problem("hung", f"forked child {pid} ({how}) did not finish")
                    return False
                chunk = os.read(rd, 1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
        finally:
            os.close(rd)
            _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 or not chunks:
            tally.problem("errors", f"forked child {pid} ({how}) exited with code {code}")
            return True
        report = json.loads(b"".join(chunks).decode())
        with tally.lock:
            tally.ok += report["ok"]
            tally.expected += report["expected"]
            tally.cycles += 1
            tally.latencies.extend(report["latencies"])
            tally.latency_sum += sum(report["latencies"])
        for kind in ("wrong", "errors"):
            for text in report[kind]:
                tally.problem(kind, f"forked child {pid} ({how}): {text}")
        missing = before - _objects_of(parent)
        if missing:
            tally.problem("errors", f"forked child {pid} ({how}) took the host's /dev/shm "
                          f"objects {sorted(missing)[:4]} ({len(missing)})")
        left = _objects_of(pid, skip_kind="")
        if left:
            tally.problem("errors", f"forked child {pid} ({how}) left {sorted(left)[:4]} "
                          f"({len(left)}) in /dev/shm")
        return True


def _child(work: "_Simple", how: str, seed: int, hang: float) -> dict[str, Any]:
    """In a forked child of a host: the parent's runner must refuse, a runner of the
    child's own must answer right; then let go as ``how`` says."""
    import host_runtime as mr

    report: dict[str, Any] = {"ok": 0, "expected": 0, "latencies": [], "wrong": [],
                              "errors": []}
    rng = np.random.default_rng(seed)
    w = work.w
    x = {"tensor_A": np.ones(w.shape, np.float32), "tensor_B": np.zeros(w.shape, np.float32)}
    calls: list[tuple[str, Callable[[], Any]]] = [
        ("execute", lambda: work.runner.execute(x)),
        ("executeAsync", lambda: work.runner.executeAsync(x))]
    for what, call in calls:
        try:
            call()
            report["wrong"].append(f"{what} on the host's runner answered in the child")
        except mr.ForkedProcessError as exc:
            if exc.owner_pid == os.getppid() and "after fork()" in str(exc):
                report["expected"] += 1
            else:
                report["errors"].append(f"{what}: the wrong ForkedProcessError: {exc}")
        except Exception as exc:  # noqa: BLE001 - reported
            report["errors"].append(f"{what} on the host's runner: {type(exc).__name__}: {exc}")
    cfg = mr.ModelRunnerConfig()
    cfg.device_wait_config = mr.DeviceWaitConfig(timedelta(seconds=60), timedelta(seconds=0.05))
    own: Any = mr.ModelRunner(work.spec.models.model, config=cfg)
    for i in range(5):
        a = rng.standard_normal(w.shape).astype(np.float32)
        b = rng.standard_normal(w.shape).astype(np.float32)
        t0 = time.perf_counter()
        got = own.execute({"tensor_A": a, "tensor_B": b})["tensor_C"]
        took = time.perf_counter() - t0
        if np.allclose(got, a * w + b, rtol=1e-5, atol=1e-5):
            report["ok"] += 1
            report["latencies"].append(round(took * 1e3, 3))
        else:
            report["wrong"].append(f"request {i} on the child's own runner: got "
                                   f"{np.asarray(got).ravel()[:3].tolist()}")
    if how == "close":
        work.runner.close()      # the child's copy only
        own.close()
    elif how == "del":
        del work.runner          # the child's copy of the host's runner goes
        del own
        gc.collect()
    elif how == "exit_hooks":   # what a normal exit runs (closes the child's own runner)
        atexit._run_exitfuncs()
        gc.collect()
    else:
        own.close()
    return report


def _lost_to_an_interrupt(exc: BaseException) -> bool:
    """The named error of a request whose output a thread was reading (for whichever
    request) when an interrupt landed just as the output was consumed."""
    from host_runtime.errors import InvalidStateError

    return (isinstance(exc, InvalidStateError) and "of the request was lost: the thread "
            "reading it was interrupted by KeyboardInterrupt" in str(exc))


# ----------------------------------------------------------------------------- running
_PROGRESS_INTERVAL = 0.25   # seconds between PROGRESS lines
_MIN_INTERRUPTS = 3         # the interrupt scenario delivers at least this many (_spent)
_say_lock = threading.Lock()


def _say(line: str) -> None:
    """One whole line on stdout (the orchestrator reads them; threads must not interleave)."""
    with _say_lock:
        try:
            sys.stdout.write(line + "\n")
            sys.stdout.flush()
        except (OSError, ValueError):   # the orchestrator is gone
            pass


class _Host:
    def __init__(self, spec: HostSpec) -> None:
        self.spec = spec
        self.tally = _Tally()
        self.tally.inject = spec.inject_wrong
        self.check = _Check(self.tally)
        self.deadline = time.time() + float(spec.duration or spec.max_seconds)
        self.hang = float(spec.hang_timeout)
        budget = spec.requests
        self.budget = None if budget is None else int(budget)
        self.issued = 0
        self.issue_lock = threading.Lock()
        self.in_flight: dict[int, tuple[float, str]] = {}
        self.interrupts: Any = None   # the interrupt scenario's Interrupter
        from host_runtime.errors import DeviceLostError, DeviceTimeoutError
        self.allowed: tuple[type[BaseException], ...] = (
            (DeviceLostError, DeviceTimeoutError) if spec.scenario in _KILLS else ())

    def over(self, margin: float = 0.0) -> bool:
        """The load is over: the deadline (less ``margin`` seconds) has passed, or the
        request budget is spent. The scenario's side threads (forks, interrupts, the
        queue session) end with it."""
        if time.time() >= self.deadline - margin:
            return True
        return self._spent()

    def _spent(self) -> bool:
        """The request budget is spent; in the interrupt scenario, only once at least
        ``_MIN_INTERRUPTS`` were delivered too (a budget run through between two of them,
        on a fast machine, would test nothing: the deadline still bounds it)."""
        if self.budget is None or self.issued < self.budget:
            return False
        return self.interrupts is None or self.interrupts.delivered >= _MIN_INTERRUPTS

    def _take(self) -> bool:
        if time.time() >= self.deadline:
            return False
        with self.issue_lock:
            if self._spent():
                return False
            self.issued += 1
            return True

    def _outcome(self, action: Callable[[], Any], t0: float, strict: bool) -> tuple[bool, Any]:
        """Run ``action`` (submit or check a request) and count its outcome; return
        (go on, its value or None). A hang stops the thread."""
        try:
            value = action()
        except WrongResult as exc:
            self.tally.problem("wrong", str(exc))
        except Hung as exc:
            self.tally.problem("hung", str(exc))
            return False, None
        except KeyboardInterrupt:   # the interrupt scenario: the request is abandoned
            with self.tally.lock:
                self.tally.expected += 1
        except self.allowed as exc:
            if strict:
                self.tally.problem("errors", f"request after the faults failed: {exc!r}")
            else:
                with self.tally.lock:
                    self.tally.expected += 1
        except Exception as exc:   # noqa: BLE001 - every other failure is a finding
            if self.interrupts is not None and _lost_to_an_interrupt(exc):
                with self.tally.lock:
                    self.tally.expected += 1
            else:
                self.tally.problem("errors", f"{type(exc).__name__}: {exc}")
        else:
            return True, value
        return True, None

    def _one(self, work: Any, rng: np.random.Generator, r: random.Random, tid: int,
             strict: bool = False, depth: int = 1) -> bool:
        """``depth`` requests submitted back to back (async ones stay in flight together),
        then each checked in order; False when the thread must stop (a hang)."""
        self.in_flight[tid] = (time.time(), f"submitting {depth} request(s)")
        pending = []
        armed = self._armed(tid)
        try:
            for _ in range(depth):
                t0 = time.perf_counter()
                go, done = self._outcome(lambda: armed(lambda: work.request(rng, r, self.hang)),
                                         t0, strict)
                if not go:
                    return False
                if done is not None:
                    pending.append((t0, done))
            self.in_flight[tid] = (time.time(), f"checking {len(pending)} request(s)")
            for t0, done in pending:
                go, _ = self._outcome(lambda: armed(lambda: (done(), True)[1]), t0, strict)
                if not go:
                    return False
                if _ is not None:
                    with self.tally.lock:
                        self.tally.ok += 1
                        took = time.perf_counter() - t0
                        self.tally.latencies.append(took)
                        self.tally.latency_sum += took
        finally:
            self.in_flight.pop(tid, None)
        return True

    def _armed(self, tid: int) -> Callable[[Callable[[], Any]], Any]:
        """``armed(action)``: ``action()``, open to the interrupt scenario's interrupts."""
        interrupts = self.interrupts
        if interrupts is None:
            return lambda action: action()

        return lambda action: interrupts.call(tid, action)

    def _worker(self, work: Any, tid: int) -> None:
        seed = int(self.spec.seed) * 1000 + tid
        rng, r = np.random.default_rng(seed), random.Random(seed)
        while self._take():
            depth = 1 if r.random() < 0.6 else r.randint(2, 4)
            with self.issue_lock:      # the pipeline's extra requests count in the budget too
                if self.budget is not None:
                    depth = max(1, min(depth, self.budget - self.issued + 1))
                self.issued += depth - 1
            try:
                if not self._one(work, rng, r, tid, depth=depth):
                    return
            except KeyboardInterrupt:   # landed as an armed block ended: nothing lost
                pass

    def _daemon_worker(self, tid: int) -> None:
        """daemon scenario: attach, run a few requests, detach, again."""
        seed = int(self.spec.seed) * 1000 + tid
        rng, r = np.random.default_rng(seed), random.Random(seed)
        while time.time() < self.deadline:
            self.in_flight[tid] = (time.time(), "attaching")
            try:
                work = _open(self.spec, self.check)
            except Exception as exc:  # noqa: BLE001
                self.tally.problem("errors", f"attach: {type(exc).__name__}: {exc}")
                return
            finally:
                self.in_flight.pop(tid, None)
            try:
                for _ in range(r.randint(1, 5)):
                    if not self._take() or not self._one(work, rng, r, tid):
                        break
            finally:
                work.close()
            with self.tally.lock:
                self.tally.cycles += 1
            if self.budget is not None and self.issued >= self.budget:
                return

    def run(self) -> bool:
        """Run the workload; False if a thread hung (the caller must not close the runner)."""
        if self.spec.scenario == "faults":
            return self._run_faults()
        if self.spec.scenario == "shared-machine":
            return self._run_shared()
        threads_n = int(self.spec.threads)
        daemon_loop = self.spec.scenario == "daemon"
        work = None if daemon_loop else _open(self.spec, self.check)
        if self.spec.duration is not None:
            self.deadline = time.time() + float(self.spec.duration)
        _say(f"READY {self.deadline}")
        reporting = threading.Event()
        reporter = threading.Thread(target=self._report, args=(reporting,), daemon=True,
                                    name="stress-progress")
        reporter.start()
        # a host still running well past its deadline (a hang, in a thread or the main
        # one) writes every thread's stack to its stderr (kept with --keep)
        faulthandler.dump_traceback_later(
            max(0.0, self.deadline - time.time()) + self.hang + 5.0, file=sys.stderr)
        try:
            return self._run(work, daemon_loop, threads_n)
        finally:
            faulthandler.cancel_dump_traceback_later()
            reporting.set()
            reporter.join(5)
            _say(self.tally.progress_line())

    def _run_faults(self) -> bool:
        """The faults scenario (tools._stress_faults): one thread, the schedule replayed."""
        from tools._stress_faults import run_faults

        # --duration: rounds of schedules until it ends; else one round, capped
        duration = self.spec.duration
        self.deadline = time.time() + float(duration if duration is not None
                                            else self.spec.max_seconds)
        _say(f"READY {self.deadline}")
        faulthandler.dump_traceback_later(
            max(0.0, self.deadline - time.time()) + self.hang + 60.0, file=sys.stderr)
        try:
            extra = run_faults(self.spec, self.tally, self.check, self.deadline, self.budget)
        finally:
            faulthandler.cancel_dump_traceback_later()
        with self.tally.lock:
            self.tally.extra = extra
        _say(self.tally.progress_line())
        return True

    def _run_shared(self) -> bool:
        """The shared-machine scenario (tools._stress_shared): one worker, a thread that
        changes the PopEF file and /dev/shm under it."""
        from tools._stress_shared import run_shared

        seconds = float(self.spec.duration or self.spec.max_seconds)
        self.deadline = time.time() + float(self.spec.max_seconds)   # a cap only
        _say(f"READY {self.deadline}")
        extra = run_shared(self.spec, self.tally, seconds, self.budget)
        with self.tally.lock:
            self.tally.extra = extra
        _say(self.tally.progress_line())
        return True

    def _interrupt_threads(self, work: Any, threads: list[threading.Thread]
                           ) -> Callable[[], None]:
        """The interrupt scenario: worker 0 becomes the main thread's (returned, to call
        once the others started), plus the interrupter and the queue session's thread."""
        from tools._stress_interrupt import CallbackSession, Interrupter

        seed = int(self.spec.seed)
        interrupts = self.interrupts = Interrupter(seed)
        threads.pop(0)   # worker 0: the main thread's
        queues = CallbackSession(self.spec)
        qtid = int(self.spec.threads)

        def run_queues() -> None:
            self.in_flight[qtid] = (time.time(), "running the queue session")
            try:
                queues.run(self.tally, interrupts, qtid, self.over, seed + 7)
                self.in_flight.pop(qtid, None)
            except Exception as exc:  # noqa: BLE001 - a finding, not a crash of the host
                self.tally.problem("errors", f"queue session: {type(exc).__name__}: {exc}")
                self.in_flight.pop(qtid, None)
            finally:
                queues.close()
        threads.append(threading.Thread(target=run_queues, daemon=True, name="stress-queues"))
        threads.append(threading.Thread(target=interrupts.run, args=(self.over,),
                                        daemon=True, name="stress-interrupter"))
        return lambda: self._worker(work, 0)

    def _report(self, stop: threading.Event) -> None:
        """Print the running totals a few times a second (the orchestrator's live view)."""
        while not stop.wait(_PROGRESS_INTERVAL):
            _say(self.tally.progress_line())

    def _run(self, work: Any, daemon_loop: bool, threads_n: int) -> bool:
        target: Callable[..., None] = self._daemon_worker if daemon_loop else self._worker
        args = [(tid,) if daemon_loop else (work, tid) for tid in range(threads_n)]
        threads = [threading.Thread(target=target, args=a, daemon=True, name=f"stress-{a[-1]}")
                   for a in args]
        if self.spec.scenario == "fork":
            threads.append(threading.Thread(target=_Forks(self, work).run, daemon=True,
                                            name="stress-fork"))   # imports before threads
        main_worker = None
        if self.spec.scenario == "interrupt":
            main_worker = self._interrupt_threads(work, threads)
        for t in threads:
            t.start()
        if main_worker is not None:
            main_worker()
        for t in threads:
            t.join(max(0.0, self.deadline - time.time()) + self.hang)
        if self.interrupts is not None:
            self.interrupts.close()
            with self.tally.lock:
                self.tally.cycles = self.interrupts.delivered
        stuck = [t for t in threads if t.is_alive()]
        for tid, (since, stage) in list(self.in_flight.items()):
            self.tally.problem("hung", f"thread {tid} stuck {time.time() - since:.1f} s "
                               f"while {stage} (threads' stacks in the host's stderr)")
        if stuck:
            return False
        if work is not None and self.spec.scenario in _KILLS:
            # Ask the orchestrator to stop the faults; once it has, every request must succeed.
            _say("QUIESCE")
            sys.stdin.readline()      # "GO" (or EOF if the orchestrator is gone)
            r = random.Random(self.spec.seed)
            rng = np.random.default_rng(self.spec.seed)
            for _ in range(3 * int(self.spec.replicas)):
                self._one(work, rng, r, -1, strict=True)
        if work is not None:
            work.close()
        return True


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    spec_path, result_path = argv
    with open(spec_path) as f:
        spec = decode(f.read())
    host = _Host(spec)
    clean = False
    try:
        clean = host.run()
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        host.tally.problem("errors", f"host: {type(exc).__name__}: {exc}")
    tmp = result_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(host.tally.as_dict(), f)
    os.replace(tmp, result_path)
    sys.stdout.flush()
    if not clean:
        os._exit(3)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
