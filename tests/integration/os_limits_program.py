"""Run by tests/integration/test_os_limits.py in a child process: lower a limit of the
child (RLIMIT_NOFILE, RLIMIT_FSIZE), do one thing that needs it, and print what was
raised as one JSON line ({"type", "msg", "cause", "pid"}), so that the test runner's own
limits are never touched.

    python -m tests.integration.os_limits_program CASE [POPEF [BIG_POPEF]]

The cases after the first six are programs as a user writes them: every descriptor in
use, one left for a two-IPU attach, a runner tried with 0, 2, 4, ... to spare, and a
small private /dev/shm (run under ``unshare -m`` by the test).
"""

from __future__ import annotations

import json
import os
import resource
import sys
from typing import Any, Callable

_NOFILE = 256



def _no_bytecode_from_here() -> None:
    """Under a lowered RLIMIT_FSIZE, a module imported for the first time would have its
    bytecode cut at the limit: CPython's atomic .pyc write ignores a short write and
    renames the cut file into place (with the suite's shared PYTHONPYCACHEPREFIX, for
    every later interpreter: 'marshal data too short'). Nothing is written from here on."""
    sys.dont_write_bytecode = True

def _fill(free: int) -> list[int]:
    """Open /dev/null until only ``free`` descriptors are left below the soft limit."""
    held: list[int] = []
    try:
        while True:
            held.append(os.open("/dev/null", os.O_RDONLY))
    except OSError:
        pass
    for _ in range(free):
        os.close(held.pop())
    return held


def _nofile(free: int) -> list[int]:
    resource.setrlimit(resource.RLIMIT_NOFILE,
                       (_NOFILE, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    return _fill(free)


def _full_before(owner: Any, name: str, held: list[int]) -> None:
    """Make ``owner.name`` (a function or class) first use up every descriptor left, so
    that the call under test, and nothing before it, meets EMFILE."""
    real = getattr(owner, name)

    def full_then_call(*args: Any, **kwargs: Any) -> Any:
        if not held:
            held.extend(_nofile(0))
        return real(*args, **kwargs)
    setattr(owner, name, full_then_call)


def main(argv: list[str]) -> int:
    case = argv[0]
    import subprocess

    import host_runtime as model_runtime
    from ipu_emulator.ipu.launcher import IpuSpec, launch_ipu
    from shm import Ring, ring

    held: list[int] = []
    run: Callable[[], Any]
    if case == "ring-nofile":          # the ring's region (its semaphores are inside)
        held.extend(_nofile(0))
        run = lambda: Ring.create(64, 4)                              # noqa: E731
    elif case == "process-nofile":     # the IPU process itself (its rings are made)
        _full_before(subprocess, "Popen", held)
        run = lambda: launch_ipu(IpuSpec(ipu_id=0))                   # noqa: E731
    elif case == "runner-nofile":      # a runner's first ring, through the host's errors
        _full_before(ring.Region, "create", held)
        run = lambda: model_runtime.ModelRunner(                      # noqa: E731
            model_runtime.PopefPaths([argv[1]]))
    elif case == "ring-fsize":
        _no_bytecode_from_here()
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, resource.RLIM_INFINITY))
        run = lambda: Ring.create(1 << 20, 4)                          # noqa: E731
    elif case == "runner-fsize":
        _no_bytecode_from_here()
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, resource.RLIM_INFINITY))
        run = lambda: model_runtime.ModelRunner(                      # noqa: E731
            model_runtime.PopefPaths([argv[1]]))
    elif case == "locks-fsize":        # no byte may be written: the lock file's pid either
        _no_bytecode_from_here()
        dm = model_runtime.DeviceManager()
        resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.RLIM_INFINITY))
        run = lambda: dm.getDevice(1)                                 # noqa: E731
    elif case == "popef-nofile":       # a program with every descriptor in use
        make = model_runtime.ModelRunner   # imported (a lazy import opens files too)
        held.extend(_nofile(0))
        run = lambda: make(argv[1])                                   # noqa: E731
    elif case == "locks-nofile":       # two descriptors left (the lock folder's, the first
        dm = model_runtime.DeviceManager()   # IPU's lock file): the second IPU's lock file
        held.extend(_nofile(2))
        run = lambda: dm.getDevice(2)                                 # noqa: E731
    elif case == "budgets":
        return _budgets(argv[1])
    elif case == "shm-full":
        return _shm_full(argv[1], argv[2])
    else:
        raise SystemExit(f"unknown case {case!r}")
    out: dict[str, Any] = {"pid": os.getpid()}
    try:
        made = run()
        out["type"] = None
        del made
    except Exception as exc:
        out.update(type=f"{type(exc).__module__}.{type(exc).__qualname__}", msg=str(exc),
                   cause=type(exc.__cause__).__name__ if exc.__cause__ else None)
    for fd in held:
        os.close(fd)
    if case == "locks-nofile":         # no IPU stayed locked by the failed attach
        out["after"] = _attach_all()
    print(json.dumps(out), flush=True)
    return 0


def _error(exc: BaseException) -> dict[str, Any]:
    return {"type": f"{type(exc).__module__}.{type(exc).__qualname__}", "msg": str(exc)}


def _attach_all() -> Any:
    """The IPUs of the whole machine (NO_WAIT): all free, or the error saying which not."""
    import host_runtime as model_runtime

    try:
        dev = model_runtime.DeviceManager().getDevice(4)
    except Exception as exc:
        return _error(exc)
    ipus = dev.ipus()
    dev.close()
    return ipus


def _budgets(path: str) -> int:
    """A program making a runner of two replicas with 0, 2, 4, ... descriptors to spare:
    each attempt either works or fails with a named error; none leaves an IPU held, with
    the collector off (what a failed attempt held comes back when it fails)."""
    import gc

    import host_runtime as model_runtime

    gc.disable()
    cfg = model_runtime.ModelRunnerConfig()
    cfg.replication_factor = 2
    attempts = []
    for free in range(0, 80, 2):
        held = _nofile(free)
        try:
            runner = model_runtime.ModelRunner(path, config=cfg)
        except Exception as exc:
            attempts.append({"free": free, **_error(exc)})
            runner = None
        for fd in held:
            os.close(fd)
        if runner is None:
            attempts[-1]["after"] = _attach_all()
        if runner is not None:
            attempts.append({"free": free, "type": None})
            runner.close()
            break
    print(json.dumps({"pid": os.getpid(), "attempts": attempts, "after": _attach_all()}),
          flush=True)
    return 0


def _shm_full(small: str, big: str) -> int:
    """Run in a /dev/shm of a few MiB (a private mount): a model too big for it, then
    arrays until it is full; then what is left in that /dev/shm, which is this program's
    alone."""
    import numpy as np

    import host_runtime as model_runtime

    out: dict[str, Any] = {"pid": os.getpid()}
    try:
        model_runtime.ModelRunner(big)
        out["big"] = {"type": None}
    except Exception as exc:
        out["big"] = _error(exc)
    runner = model_runtime.ModelRunner(small)
    arrays = []
    try:
        while len(arrays) < 1000:
            arrays.append(model_runtime.empty_shared((256, 1024), np.float32))
            arrays[-1][...] = 1.0   # every page touched: no SIGBUS
        out["arrays"] = {"type": None}
    except Exception as exc:
        out["arrays"] = _error(exc)
    out["made"] = len(arrays)
    one = np.ones((1, 4), np.float32)
    out["works"] = runner.execute({"tensor_A": one, "tensor_B": one})["tensor_C"].shape == (1, 4)
    runner.close()
    del arrays
    out["left"] = sorted(os.listdir("/dev/shm"))
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
