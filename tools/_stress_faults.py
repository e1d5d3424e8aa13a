"""The ``faults`` scenario of ``ipu-emulator stress``, inside one host (``tools._stress_host``).

The host runs the example model under a seeded schedule of injected faults of every
kind (``ipu_emulator.faults``), one request at a time so that the schedule is
replayed exactly, twice: with ``auto_reset`` on, then off; then the pipelined model
(2 IPUs) with ``link_down`` and application errors on one of its IPUs at random runs. With ``--duration`` such rounds (each with a schedule of
its own) repeat until it ends; with ``--requests`` one round runs. Each answer is
counted:

- *right*: no fault (other than ``slow``) fired on it, and its value is numpy's;
- *failed as expected*: it failed with the class the fault that fired on it must
  give (``application_error`` -> ApplicationRuntimeError, ``recoverable_error`` ->
  RecoverableRuntimeError with the fault's action, ``unrecoverable_error`` ->
  UnrecoverableRuntimeError, ``hang`` -> DeviceTimeoutError, ``crash`` ->
  DeviceLostError, ``link_down`` -> RecoverableRuntimeError LINK_RESET); or, on a
  replica that failed and that nothing reset, with that failure's class again (its
  cause the failure): the host then recovers as the README says (closes the runner
  and makes a new one);
- *wrong*: anything else (a value, a class, a request that succeeded though an error
  fault fired on it, a replica ``auto_reset`` should have reset that failed again);
- *hung*: it took longer than the hang timeout.

It reports (``extra``) the faults injected, the replicas' resets and each recovery
time: from the failed request to the next right answer on that runner.
"""

from __future__ import annotations

import random
import time
from datetime import timedelta
from typing import Any, Callable

import numpy as np

from tools._stress_spec import HostSpec

__all__ = ["run_faults"]

_SYNC = 1.0        # the host sync timeout of the scenario's runners (hangs end after it;
                   # a loaded machine can leave a working IPU process unscheduled for 0.3 s)
_SINGLE_KINDS = ("application_error", "recoverable_error", "unrecoverable_error", "hang",
                 "slow", "crash")


def _schedule(rng: random.Random, requests: int) -> list[dict[str, Any]]:
    """Every single-IPU kind once, in a random order, at random runs; plus a random slow."""
    kinds = list(_SINGLE_KINDS)
    rng.shuffle(kinds)
    faults: list[dict[str, Any]] = []
    run = rng.randrange(1, 3)
    for kind in kinds:
        f: dict[str, Any] = {"kind": kind, "after": run}
        if kind == "recoverable_error":
            f["action"] = rng.choice(["IPU_RESET", "LINK_RESET", "PARTITION_RESET",
                                      "FULL_RESET"])
        if kind == "slow":
            f["delay_ms"] = rng.choice([5, 20, 50])
        faults.append(f)
        run += rng.randrange(2, 4)
    faults.append({"kind": "slow", "delay_ms": 10, "probability": 0.2,
                   "seed": rng.randrange(1 << 20), "times": 2})
    return faults


def _expected(fault: dict[str, Any], err: BaseException) -> bool:
    import host_runtime as mr

    kind = fault["kind"]
    if kind == "application_error":
        return isinstance(err, mr.ApplicationRuntimeError)
    if kind in ("recoverable_error", "link_down"):
        action = "LINK_RESET" if kind == "link_down" else fault.get("action", "IPU_RESET")
        return bool(isinstance(err, mr.RecoverableRuntimeError)
                    and err.recovery_action.name == action)
    if kind == "unrecoverable_error":
        return isinstance(err, mr.UnrecoverableRuntimeError)
    if kind == "hang":
        return isinstance(err, mr.DeviceTimeoutError)
    if kind == "crash":
        return isinstance(err, mr.DeviceLostError)
    return False


def _resets(fault: dict[str, Any]) -> bool:
    """Whether auto_reset resets the replica after this fault's error."""
    if fault["kind"] == "recoverable_error":
        return bool(fault.get("action", "IPU_RESET") == "IPU_RESET")
    return fault["kind"] in ("application_error", "hang", "crash")


class _Phase:
    """One runner (re-made after each failure nothing reset) under one schedule."""

    def __init__(self, tally: Any, make: Callable[[], Any], plan: Any, request: Callable[[Any], None],
                 hang: float, extra: dict[str, Any]) -> None:
        self.tally, self.make, self.plan, self.request = tally, make, plan, request
        self.hang, self.extra = hang, extra
        self.runner = make()
        self.failed: BaseException | None = None   # the failure nothing reset
        self.fault_at: float | None = None         # when the last fault failed a request

    def _count(self, kind: str, text: str = "") -> None:
        if kind == "ok":
            with self.tally.lock:
                self.tally.ok += 1
        elif kind == "expected":
            with self.tally.lock:
                self.tally.expected += 1
        else:
            self.tally.problem(kind, text)

    def _recover(self) -> None:
        """What the README says for a failure nothing reset: a new runner."""
        self._close()
        with self.plan:
            self.runner = self.make()
        self.failed = None

    def _close(self) -> None:
        snap = self.runner.request_monitors()
        self.extra["resets"] += sum(sum(m.snapshot().resets.values()) for m in snap)
        self.runner.close()

    def step(self, auto_reset: bool) -> None:
        before = [fired for _, _, fired in self.plan.counts()]
        t0 = time.monotonic()
        err: BaseException | None = None
        try:
            self.request(self.runner)
        except Exception as exc:  # noqa: BLE001 - classified below
            err = exc
        took = time.monotonic() - t0
        counts = self.plan.counts()
        fired = [f.to_dict() for (f, _, n), m in zip(counts, before) if n > m]
        errors = [f for f in fired if f["kind"] != "slow"]
        self.extra["injected"] += len(fired)
        if took > self.hang:
            self._count("hung", f"a request took {took:.1f} s (faults {fired})")
            return
        if err is None:
            if errors:
                self._count("wrong", f"a request succeeded though {errors[0]} fired on it")
            elif self.failed is not None:
                self._count("wrong", f"a request succeeded on a replica that failed with "
                            f"{type(self.failed).__name__} and was not recovered")
            else:
                self._count("ok")
                with self.tally.lock:
                    self.tally.latencies.append(took)
                    self.tally.latency_sum += took
                if self.fault_at is not None:
                    self.extra["recovery_ms"].append(round((time.monotonic() - self.fault_at)
                                                           * 1e3, 2))
                    self.fault_at = None
            return
        if type(err).__name__ == "WrongResult":
            self._count("wrong", str(err))
            return
        if errors:
            fault = errors[0]
            if not _expected(fault, err):
                self._count("wrong", f"fault {fault} gave {type(err).__name__}: {err}")
                return
            self._count("expected")
            self.fault_at = t0
            if not (auto_reset and _resets(fault)):
                self.failed = err
            return
        prev = self.failed
        if prev is not None and isinstance(err, type(prev)) and (
                (type(err.__cause__) is type(prev) and str(err.__cause__) == str(prev))
                or type(prev).__name__ == "DeviceTimeoutError"):
            self._count("expected")
            self._recover()
            return
        self._count("wrong", f"unexpected {type(err).__name__}: {err}")

    def close(self) -> None:
        self._close()


def run_faults(spec: HostSpec, tally: Any, check: Callable[[Any, np.ndarray, str], None],
               deadline: float, budget: int | None) -> dict[str, Any]:
    """The scenario's workload (module docstring); returns its ``extra`` figures."""
    import host_runtime as mr
    from host_runtime import popef, settings
    from ipu_emulator import faults

    seed = spec.seed
    rng = random.Random(seed)
    nrng = np.random.default_rng(seed)
    hang = spec.hang_timeout
    extra: dict[str, Any] = {"injected": 0, "resets": 0, "recovery_ms": []}
    model = popef.load_model([spec.models.model])
    anchor, td = model.metadata.anchor("tensor_A"), model.tensorData("weights")
    if anchor is None or td is None:
        raise ValueError(f"{spec.models.model}: not the example model (tensor_A, weights)")
    shape = tuple(anchor.tensorInfo().shape())
    weights = np.frombuffer(td.data, np.float32).reshape(shape)
    wait = mr.DeviceWaitConfig(mr.DeviceWaitStrategy.WAIT_WITH_TIMEOUT,
                               timeout=timedelta(seconds=120), sleepTime=timedelta(seconds=0.05))
    per_phase = max(6, (budget or 24) // 2)

    def simple(runner: Any) -> None:
        a = nrng.standard_normal(shape).astype(np.float32)
        b = nrng.standard_normal(shape).astype(np.float32)
        got = runner.execute({"tensor_A": a, "tensor_B": b})["tensor_C"]
        check(got, a * weights + b, "faults")

    while True:   # rounds until --duration ends (one round with --requests)
        for auto_reset in (True, False):
            schedule = _schedule(rng, per_phase)

            def make(auto_reset: bool = auto_reset) -> Any:
                cfg = mr.ModelRunnerConfig()
                cfg.auto_reset = auto_reset
                cfg.device_wait_config = wait
                with settings.override(host_sync_timeout=_SYNC):
                    return mr.ModelRunner(spec.models.model, config=cfg)
            plan = faults.FaultPlan(schedule)
            with plan:
                phase = _Phase(tally, make, plan, simple, hang, extra)
            try:
                n = max(per_phase, max(f.get("after", 0) for f in schedule) + 4)
                for _ in range(n):
                    if time.time() >= deadline:
                        break
                    phase.step(auto_reset)
            finally:
                phase.close()
                plan.close()
        if spec.models.pipeline_model and time.time() < deadline:
            import onnx
            import onnxruntime as ort

            ref = ort.InferenceSession(onnx.load(spec.models.pipeline_onnx).SerializeToString(),
                                       providers=["CPUExecutionProvider"])

            def pipelined(runner: Any) -> None:
                x = nrng.standard_normal((4, 64)).astype(np.float32)
                got = runner.execute({"x": x})["y"]
                check(got, np.asarray(ref.run(None, {"x": x})[0]), "faults pipeline")

            def make_pipeline() -> Any:
                cfg = mr.ModelRunnerConfig()
                cfg.auto_reset = True
                cfg.device_wait_config = wait
                with settings.override(host_sync_timeout=_SYNC):
                    return mr.ModelRunner(spec.models.pipeline_model, config=cfg)
            # an IPU-Link down, and errors of one IPU's part (the other IPU is stopped
            # for it): the request after each must be right
            plan = faults.FaultPlan([
                {"kind": "link_down", "after": rng.randrange(1, 3)},
                {"kind": "application_error", "probability": 0.2,
                 "seed": rng.randrange(1 << 20), "times": 3}])
            with plan:
                phase = _Phase(tally, make_pipeline, plan, pipelined, hang, extra)
            try:
                for _ in range(16):
                    if time.time() >= deadline:
                        break
                    phase.step(True)
            finally:
                phase.close()
                plan.close()
        if spec.duration is None or time.time() >= deadline:
            break
    with tally.lock:
        tally.cycles += extra["injected"]
    return extra
