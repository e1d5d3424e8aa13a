"""Run by tests/integration/test_os_limits.py in a child process: lower a limit of the
child (RLIMIT_NOFILE, RLIMIT_FSIZE), do one thing that needs it, and print what was
raised as one JSON line ({"type", "msg", "cause", "pid"}), so that the test runner's own
limits are never touched.

    python -m tests.integration.os_limits_program CASE [POPEF]
"""

from __future__ import annotations

import json
import os
import resource
import sys
from typing import Any, Callable

_NOFILE = 256


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
    if case == "ring-nofile":          # the ring's region (then its semaphores)
        held.extend(_nofile(0))
        run = lambda: Ring.create(64, 4)                              # noqa: E731
    elif case == "sem-nofile":         # the ring's semaphores (its region is made)
        import posix_ipc
        _full_before(posix_ipc, "Semaphore", held)
        run = lambda: Ring.create(64, 4)                              # noqa: E731
    elif case == "process-nofile":     # the IPU process itself (its rings are made)
        _full_before(subprocess, "Popen", held)
        run = lambda: launch_ipu(IpuSpec(ipu_id=0))                   # noqa: E731
    elif case == "runner-nofile":      # a runner's first ring, through the host's errors
        _full_before(ring.Region, "create", held)
        run = lambda: model_runtime.ModelRunner(                      # noqa: E731
            model_runtime.PopefPaths([argv[1]]))
    elif case == "ring-fsize":
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, resource.RLIM_INFINITY))
        run = lambda: Ring.create(1 << 20, 4)                          # noqa: E731
    elif case == "runner-fsize":
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, resource.RLIM_INFINITY))
        run = lambda: model_runtime.ModelRunner(                      # noqa: E731
            model_runtime.PopefPaths([argv[1]]))
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
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
