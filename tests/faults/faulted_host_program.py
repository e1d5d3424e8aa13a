"""A host program that knows nothing of fault injection (tests/faults/test_faults_from_outside.py
runs it in a fresh process under ``IPU_EMULATOR_FAULTS`` or through a daemon holding faults).

``python -m tests.faults.faulted_host_program MODEL REQUESTS AUTO_RESET``: runs REQUESTS
requests of the seeds' example model one by one and prints one line per request: ``ok``
(the value checked against numpy), or the error's class, its recovery action (or -) and
the class of its cause (or -); a failure that nothing reset is recovered as the README
says (a new runner)."""

from __future__ import annotations

import sys

import numpy as np

import host_runtime as model_runtime
from host_runtime import popef


def main(argv: list[str]) -> int:
    path, requests, auto_reset = argv[0], int(argv[1]), argv[2] == "1"
    model = popef.load_model([path])
    td = model.tensorData("weights")
    assert td is not None
    shape = (1, 4)
    weights = np.frombuffer(td.data, np.float32).reshape(shape)
    cfg = model_runtime.ModelRunnerConfig(auto_reset=auto_reset)
    runner = model_runtime.ModelRunner(path, config=cfg)
    rng = np.random.default_rng(0)
    for _ in range(requests):
        a, b = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
        try:
            out = runner.execute({"tensor_A": a, "tensor_B": b})["tensor_C"]
            np.testing.assert_allclose(out, a * weights + b, rtol=1e-6)
            print("ok", flush=True)
        except model_runtime.ModelRuntimeError as exc:
            action = getattr(exc, "recovery_action", None)
            cause = type(exc.__cause__).__name__ if exc.__cause__ is not None else "-"
            print(type(exc).__name__, action.name if action is not None else "-", cause,
                  flush=True)
            if exc.__cause__ is not None and type(exc.__cause__) is type(exc):
                runner.close()                    # recover: a new runner
                runner = model_runtime.ModelRunner(path, config=cfg)
    runner.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
