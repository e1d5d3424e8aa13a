"""Run by tests/integration/test_interrupt.py in a fresh interpreter: the issue's outside
program. A thread sends this process SIGINT every 50 ms (the default handler raises
KeyboardInterrupt in the main thread, wherever it is) while the main thread calls the
runner in a loop for ``seconds``; every answer is compared with numpy.

    python -m tests.integration.interrupt_program MODEL SECONDS {execute,async,mixed}

``execute``: ``runner.execute`` in a loop. ``async``: ``executeAsync`` then
``future.wait`` / ``future[...]``; a future whose wait was interrupted is waited for
again later (its answer must still be its own, or a named error). ``mixed``: both, with
requests of several sizes of batch.

Prints ``RESULT {json}``: right and wrong answers, interrupts caught, errors by type and
message, then (signals stopped) the wrong answers of 20 more calls and what this process
left in /dev/shm after ``close()``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections import Counter
from typing import Any

import numpy as np


def main(path: str, seconds: float, how: str) -> None:
    import host_runtime as model_runtime
    from shm.cleanup import list_objects

    runner = model_runtime.ModelRunner(path)
    shape = tuple(runner.getExecuteInputs()[0].shape)
    one, zero = np.ones(shape, np.float32), np.zeros(shape, np.float32)
    weights = runner.execute({"tensor_A": one, "tensor_B": zero})["tensor_C"]

    def inputs(i: int) -> dict[str, np.ndarray]:
        return {"tensor_A": np.full(shape, float(i % 1000), np.float32),
                "tensor_B": np.full(shape, 0.5, np.float32)}

    def right(i: int, out: Any) -> bool:
        return bool(np.allclose(np.asarray(out), float(i % 1000) * weights + 0.5, rtol=1e-6))

    counts: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    pending: list[tuple[int, Any]] = []     # futures whose wait was interrupted
    # A plain flag, not a threading.Event: its set() is Python code taking a lock that an
    # interrupt landing in it may leave held (and this program is interrupted anywhere).
    sending = [True]
    me = os.getpid()

    def sigint() -> None:
        while True:
            time.sleep(0.05)   # the pace of the signals
            if not sending[0]:
                return
            os.kill(me, signal.SIGINT)

    def check_future(i: int, fut: Any) -> None:
        try:
            out = fut["tensor_C"]
        except model_runtime.ModelRuntimeError as exc:
            errors[f"{type(exc).__name__}: {exc}"] += 1
            return
        counts["right" if right(i, out) else "wrong"] += 1

    # Python installs its SIGINT handler only when SIGINT was not ignored at start, and a
    # shell starts background jobs with it ignored (a suite run with `&`): install it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sender = threading.Thread(target=sigint, daemon=True)
    end = time.monotonic() + seconds
    i = 0
    sender.start()

    def turns() -> None:
        nonlocal i
        while True:
            try:      # an interrupt may land anywhere in the loop, its test included
                if time.monotonic() >= end:
                    sending[0] = False   # (one store: an interrupt comes before it or after)
                    break
                i += 1
                use_async = how == "async" or (how == "mixed" and i % 3 == 0)
                if pending and i % 5 == 0:
                    j, fut = pending.pop()
                    check_future(j, fut)
                elif use_async:
                    fut = runner.executeAsync(inputs(i))
                    try:
                        fut.wait()
                    except KeyboardInterrupt:
                        pending.append((i, fut))
                        raise
                    check_future(i, fut)
                else:
                    try:
                        out = runner.execute(inputs(i))["tensor_C"]
                    except model_runtime.ModelRuntimeError as exc:
                        errors[f"{type(exc).__name__}: {exc}"] += 1
                        continue
                    counts["right" if right(i, out) else "wrong"] += 1
            except KeyboardInterrupt:
                counts["interrupted"] += 1

    finished = False
    while not finished:
        try:
            turns()
            finished = True
        except KeyboardInterrupt:   # one landed between two turns (the loop's back-edge,
            counts["interrupted"] += 1   # outside its try), or as it returned
    while True:
        try:
            sender.join()
            break
        except KeyboardInterrupt:   # one sent just before the sender stopped
            counts["interrupted"] += 1
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # and one still on its way is dropped
    for j, fut in pending:
        check_future(j, fut)
    after = 0
    for k in range(20):
        out = runner.execute(inputs(5000 + k))["tensor_C"]
        if not right(5000 + k, out):
            after += 1
    runner.close()
    left = sorted(o.entry for o in list_objects() if o.pid == me)
    print("RESULT " + json.dumps({"right": counts["right"], "wrong": counts["wrong"],
                                  "interrupted": counts["interrupted"],
                                  "errors": dict(errors), "wrong_after": after, "left": left}),
          flush=True)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), sys.argv[3])
