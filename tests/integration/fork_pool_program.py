"""Run by tests/integration/test_fork.py in a fresh interpreter: the way a Python program
usually forks, ``multiprocessing`` with the 'fork' start method, after a runner exists.

- pool workers call the parent's runner: each call fails with ForkedProcessError, which
  crosses back to the parent (pickled) with its message;
- pool workers make runners of their own: right answers;
- a worker Process that closes the parent's runner, and one that just exits;
- the parent keeps executing throughout: wrong answers counted, its /dev/shm objects
  compared before and after.

Prints ``RESULT {json}``.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
from datetime import timedelta
from typing import Any

import numpy as np

import host_runtime as model_runtime
from shm.cleanup import list_objects

PATH = sys.argv[1] if __name__ == "__main__" else ""
RUNNER: Any = None
WEIGHTS: Any = None


def request(i: float) -> dict[str, np.ndarray]:
    return {"tensor_A": np.full((1, 4), i, np.float32), "tensor_B": np.ones((1, 4), np.float32)}


def right(out: np.ndarray, i: float) -> bool:
    return bool(np.allclose(out, i * WEIGHTS + 1.0, rtol=1e-6))


def use_parents(i: int) -> bool:
    return right(RUNNER.execute(request(float(i)))["tensor_C"], float(i))


def use_own(i: int) -> bool:
    cfg = model_runtime.ModelRunnerConfig()   # a daemon's small pool: wait for an IPU
    cfg.device_wait_config = model_runtime.DeviceWaitConfig(timedelta(seconds=120),
                                                            timedelta(seconds=0.01))
    with model_runtime.ModelRunner(PATH, config=cfg) as own:
        return all(right(own.execute(request(float(i + k)))["tensor_C"], float(i + k))
                   for k in range(10))


def wrong_in_parent(n: int) -> int:
    return sum(not right(RUNNER.execute(request(float(i)))["tensor_C"], float(i)) for i in range(n))


def mine() -> set[str]:
    return {o.entry for o in list_objects() if o.pid == os.getpid()}


def main() -> dict[str, Any]:
    global RUNNER, WEIGHTS
    RUNNER = model_runtime.ModelRunner(PATH)
    WEIGHTS = RUNNER.execute({"tensor_A": np.ones((1, 4), np.float32),
                              "tensor_B": np.zeros((1, 4), np.float32)})["tensor_C"]
    before = mine()
    ctx = mp.get_context("fork")
    result: dict[str, Any] = {}
    with ctx.Pool(2) as pool:
        calls = pool.map_async(use_parents, range(4), chunksize=1)
        result["wrong_while_pool"] = wrong_in_parent(100)
        try:
            calls.get(120)
            result["parents"] = None
        except model_runtime.ForkedProcessError as exc:
            result["parents"] = {"type": type(exc).__name__, "message": str(exc),
                                 "owner_pid": exc.owner_pid}
        result["own"] = pool.map(use_own, range(2))
    for name, target in (("close", RUNNER.close), ("exit", lambda: None)):
        p = ctx.Process(target=target)
        p.start()
        p.join(120)
        result[f"{name}_exitcode"] = p.exitcode
    result["wrong_after"] = wrong_in_parent(50)
    result["missing"] = sorted(before - mine())
    result["parent"] = os.getpid()
    RUNNER.close()
    RUNNER = None
    result["left"] = sorted(mine())
    return result


if __name__ == "__main__":
    print("RESULT " + json.dumps(main()), flush=True)
