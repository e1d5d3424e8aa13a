"""Run by tests/integration/test_fork.py in a fresh interpreter (collector on): a runner,
then for each case a forked child that leaves through ``sys.exit`` (its exit hooks, and
the runner dropped as the interpreter unwinds and tears its modules down); the parent
checks that its /dev/shm objects are all there and that its runner still answers right.

Prints ``RESULT {json}``: per case the parent's objects missing after the child's exit,
the parent's wrong answers after it, and the child's exit code; and what was left in
/dev/shm by this program and its children once the runner is closed.
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

RUNNER = None   # a module global too: module teardown drops it in the child


def main(path: str) -> None:
    global RUNNER
    import host_runtime as model_runtime
    from shm.cleanup import list_objects

    def objects(pids: set[int]) -> set[str]:
        return {o.entry for o in list_objects() if o.pid in pids}

    runner = RUNNER = model_runtime.ModelRunner(path)
    one, zero = np.ones((1, 4), np.float32), np.zeros((1, 4), np.float32)
    weights = runner.execute({"tensor_A": one, "tensor_B": zero})["tensor_C"]
    me = os.getpid()
    result: dict[str, object] = {"cases": []}
    children = set()
    for case in ("sys_exit", "sys_exit_closed", "sys_exit_used"):
        before = objects({me})
        pid = os.fork()
        if pid == 0:   # the child: leave as a program does
            code = 0
            if case == "sys_exit_closed":
                runner.close()
            elif case == "sys_exit_used":
                try:
                    runner.execute({"tensor_A": one, "tensor_B": zero})
                    code = 3
                except model_runtime.ForkedProcessError:
                    code = 0
            sys.exit(code)
        children.add(pid)
        _, status = os.waitpid(pid, 0)
        wrong = 0
        for i in range(20):
            a = np.full((1, 4), float(i), np.float32)
            out = runner.execute({"tensor_A": a, "tensor_B": one})["tensor_C"]
            if not np.allclose(out, a * weights + 1.0, rtol=1e-6):
                wrong += 1
        result["cases"].append(case)   # type: ignore[attr-defined]
        result[case] = {"missing": sorted(before - objects({me})), "wrong": wrong,
                        "child": os.waitstatus_to_exitcode(status)}
    runner.close()
    RUNNER = runner = None
    result["left"] = sorted(objects({me} | children))
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
