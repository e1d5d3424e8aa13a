"""Run by tests/faults/test_stopped_peer_program.py in a fresh process: a program written
as a user writes it (a device, a ModelRunner on it, public calls only) whose IPU process
is stopped with SIGSTOP, then one case of host calls. Each call must end within the host
sync timeout (``IPU_EMULATOR_HOST_SYNC_TIMEOUT``, set by the test) with a named error.

A watchdog counts a call that takes longer than ``HANG`` seconds as hung, and continues
the IPU process (SIGCONT) so that the call can unwind and the program still closes and
reports. Prints ``RESULT {json}``: per call its error (type, message), seconds and
whether it hung; the wrong answers the runner gave once the IPU process was continued;
and what this program left in /dev/shm.

    python -m tests.faults.stopped_peer_program CASE POPEF [DAEMON_PID]

The daemon cases stop the daemon (``IPU_EMULATOR_DAEMON``) instead of the IPU process.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from typing import Any, Callable

import numpy as np

HANG = float(os.environ.get("STOPPED_PEER_HANG", "12"))   # seconds: a call past this hung


class Watchdog:
    """Continues ``pid`` once a call has run ``HANG`` seconds, and says it hung."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.calls: list[dict[str, Any]] = []

    def call(self, name: str, fn: Callable[[], Any]) -> Any:
        fired = threading.Event()
        done = threading.Event()

        def watch() -> None:
            if not done.wait(HANG):
                fired.set()
                cont(self.pid)

        t = threading.Thread(target=watch, daemon=True)
        t.start()
        start = time.monotonic()
        result, entry = None, {"call": name, "error": None, "message": None}
        try:
            result = fn()
        except Exception as exc:   # reported: the test compares type and message
            entry.update(error=type(exc).__name__, message=str(exc))
        entry["seconds"] = round(time.monotonic() - start, 3)
        done.set()
        t.join()
        entry["hung"] = fired.is_set()
        self.calls.append(entry)
        return result


def cont(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def stop(pid: int) -> None:
    """SIGSTOP ``pid`` and wait until it is stopped (the signal acts asynchronously)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        time.sleep(0.001)
    raise SystemExit(f"process {pid} did not stop")


def main(case: str, path: str, daemon_pid: str = "") -> dict[str, Any]:
    import host_runtime as model_runtime
    from shm.cleanup import list_objects

    if case == "template":
        return template_case(path)

    weights_in = {"tensor_A": np.ones((1, 4), np.float32),
                  "tensor_B": np.zeros((1, 4), np.float32)}
    dev = model_runtime.DeviceManager().getDevice(1)
    cfg = model_runtime.ModelRunnerConfig()
    cfg.thread_safe = True
    cfg.replica_to_device = {0: dev}
    runner = model_runtime.ModelRunner(path, config=cfg)
    weights = runner.execute(weights_in)["tensor_C"]

    def request(i: float) -> dict[str, np.ndarray]:
        return {"tensor_A": np.full((1, 4), i, np.float32), "tensor_B": np.ones((1, 4), np.float32)}

    def right(out: Any, i: float) -> bool:
        return bool(np.allclose(np.asarray(out), i * weights + 1.0, rtol=1e-6))

    # the IPU process, or (daemon cases) the daemon whose pid the test gives
    pid = int(daemon_pid) if case.startswith("daemon-") else dev.pids()[0]
    dog = Watchdog(pid)
    report: dict[str, Any] = {"case": case, "stopped_pid": pid}
    stop(pid)
    futures: list[Any] = []
    if case == "execute":
        dog.call("execute", lambda: runner.execute(request(1.0)))
    elif case == "wait":
        future = dog.call("executeAsync", lambda: runner.executeAsync(request(1.0)))
        if future is not None:
            dog.call("wait", future.wait)
    elif case in ("poll-wait", "poll-done"):
        report["polled"] = poll_case(case, runner, request, futures)
    elif case == "async-full":
        def submit_until_refused() -> int:
            for _ in range(64):   # far more than the rings hold
                futures.append(runner.executeAsync(request(2.0)))
            return len(futures)
        dog.call("executeAsync (rings full)", submit_until_refused)
        report["submitted"] = len(futures)
        if futures:
            dog.call("wait", futures[0].wait)
    elif case == "async-thread":
        inside = threading.Thread(target=lambda: dog.call("execute (thread)",
                                                          lambda: runner.execute(request(3.0))))
        inside.start()
        # the thread is inside execute once its request left: give it the device's time
        time.sleep(0.2)   # not synchronisation: either order must end within the bound
        dog.call("executeAsync (another thread inside execute)",
                 lambda: futures.append(runner.executeAsync(request(3.0))))
        inside.join(HANG * 3)
        report["thread_alive"] = inside.is_alive()
    elif case == "close":
        dog.call("runner.close", runner.close)
        dog.call("device.close", dev.close)
        report["ipu_alive"] = os.path.exists(f"/proc/{pid}")
    elif case == "daemon-close":
        dog.call("runner.close", runner.close)
        dog.call("device.close", dev.close)
        dog.call("attach", lambda: model_runtime.DeviceManager().getDevice(1))
    elif case == "daemon-execute":   # requests go to the IPU processes, not the daemon
        out = dog.call("execute", lambda: runner.execute(request(4.0)))
        report["right"] = out is not None and right(out["tensor_C"], 4.0)
    else:
        raise SystemExit(f"unknown case {case!r}")
    report["calls"] = dog.calls
    cont(pid)
    # once continued: the runner answers right, or says why it cannot
    wrong = errors = 0
    if case not in ("close", "daemon-close"):
        for i in range(5):
            try:
                wrong += not right(runner.execute(request(10.0 + i))["tensor_C"], 10.0 + i)
            except Exception:
                errors += 1
    report.update(wrong_after=wrong, errors_after=errors)
    runner.close()
    dev.close()
    del futures
    if case.startswith("daemon-"):   # the IPU was released, if only locally: it attaches
        again = model_runtime.ModelRunner(path)
        report["again_right"] = right(again.execute(request(5.0))["tensor_C"], 5.0)
        again.close()
    report["left"] = sorted(o.entry for o in list_objects() if o.pid == os.getpid())
    return report


def poll_case(case: str, runner: Any, request: Callable[[float], Any],
              futures: list[Any]) -> dict[str, Any]:
    """Six requests on the stopped IPU, polled (``wait(0.1)`` or ``done()``) round after
    round for at most ``HANG`` s: when each was seen done, and its error."""
    start = time.monotonic()
    for i in range(6):
        futures.append(runner.executeAsync(request(6.0 + i)))
    seen: dict[int, float] = {}
    raised: list[str] = []
    while len(seen) < len(futures) and time.monotonic() - start < HANG:
        for k, fut in enumerate(futures):
            if k in seen:
                continue
            try:
                done = fut.wait(0.1) if case == "poll-wait" else fut.done()
            except Exception as exc:   # the poll that found the device silent
                raised.append(type(exc).__name__)
                done = True
            if done:
                seen[k] = time.monotonic() - start
        if case == "poll-done":
            time.sleep(0.01)   # a user's polling loop; not synchronisation
    errors = []
    for fut in futures:
        exc = fut.exception(0) if fut.done() else None
        errors.append(None if exc is None else [type(exc).__name__, str(exc)])
    return {"seconds": [round(seen.get(k, -1.0), 3) for k in range(len(futures))],
            "errors": errors, "raised": raised}


def template_case(path: str) -> dict[str, Any]:
    """The template process IPU processes are forked from (``ps``: ``python -m
    ipu_emulator.ipu.forkserver``, a child of this one) stopped: attaching still works
    within the bound (the IPU process is started fresh, later ones from a new template);
    once the template is continued it forks nothing for requests given up on, so each
    device has one IPU process and answers right."""
    import psutil

    from ipu_emulator import titles

    import host_runtime as model_runtime
    from shm.cleanup import list_objects
    from shm.liveness import process_state

    first = model_runtime.ModelRunner(path)   # starts the template
    templates = [p.pid for p in psutil.Process().children()
                 if " ".join(p.cmdline()).startswith("ipu-emulator: fork server")
                 or "ipu_emulator.ipu.forkserver" in " ".join(p.cmdline())]
    assert len(templates) == 1, templates
    pid = templates[0]
    dog = Watchdog(pid)
    stop(pid)
    devices = [dog.call(f"attach {k}", lambda: model_runtime.DeviceManager().getDevice(1))
               for k in range(2)]
    cont(pid)
    while process_state(pid) not in ("S", None):   # it has read what was queued for it
        time.sleep(0.001)
    report: dict[str, Any] = {"case": "template", "stopped_pid": pid, "calls": dog.calls}
    wrong = errors = 0
    for dev in devices:
        if dev is None:
            continue
        cfg = model_runtime.ModelRunnerConfig()
        cfg.replica_to_device = {0: dev}
        try:
            with model_runtime.ModelRunner(path, config=cfg) as runner:
                one = np.ones((1, 4), np.float32)
                w = runner.execute({"tensor_A": one, "tensor_B": 0 * one})["tensor_C"]
                for i in range(100):
                    out = runner.execute({"tensor_A": one * i, "tensor_B": one})["tensor_C"]
                    wrong += not np.allclose(out, w * i + 1, rtol=1e-6)
        except Exception as exc:
            errors += 1
            report.setdefault("errors", []).append(f"{type(exc).__name__}: {exc}")
        dev.close()
    first.close()
    report.update(wrong_after=wrong, errors_after=errors,
                  ipu_processes=[c.pid for c in psutil.Process().children(recursive=True)
                                 if "--control" in c.cmdline()
                                 or titles.parse_ipu(" ".join(c.cmdline()).rstrip())],
                  left=sorted(o.entry for o in list_objects() if o.pid == os.getpid()))
    return report


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(*sys.argv[1:4])), flush=True)
