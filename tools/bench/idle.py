"""``python -m tools.bench idle``: what idle costs, measured from outside.

Two figures, each the CPU time (user + system, from psutil) that a set of
processes used over ``--seconds`` of wall time while nothing was asked of them,
as a percentage of one core:

- ``daemon``: an ``ipu-emulator daemon --num-ipus N`` (default 64) and all its
  children (the IPU processes), after it has started and ``--settle`` seconds
  passed;
- ``runner``: a ``ModelRunner`` of the seeds' example model in a host process of
  its own (embedded IPU processes, one ``execute`` done, then nothing in flight):
  that host process and all its children (fork server and IPU process).

The target of both together: at most 1% of one core.
"""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
import tempfile
import textwrap
import time

import psutil

from tools.bench.lifecycle import private_daemon

__all__ = ["main", "DESCRIPTION", "cpu_percent"]

DESCRIPTION = "CPU used by an idle daemon of 64 IPUs and an idle runner (target <= 1% of a core)"

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_HOST = textwrap.dedent("""
    import sys
    import numpy as np
    import host_runtime as model_runtime
    runner = model_runtime.ModelRunner(model_runtime.PopefPaths([sys.argv[1]]))
    x = np.ones((1, 4), np.float32)
    runner.execute({"tensor_A": x, "tensor_B": x})
    print("ready", flush=True)
    sys.stdin.read()        # idle until the benchmark closes our stdin
    runner.close()
""")


def _tree_seconds(root: psutil.Process) -> dict[int, float]:
    """CPU seconds (user + system) so far of ``root`` and every descendant, by pid."""
    out: dict[int, float] = {}
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return out
    for p in procs:
        try:
            t = p.cpu_times()
            out[p.pid] = t.user + t.system
        except psutil.Error:
            pass
    return out


def cpu_percent(pid: int, seconds: float) -> float:
    """Percent of one core that process ``pid`` and its descendants used over ``seconds``
    (processes that exit meanwhile are not counted)."""
    root = psutil.Process(pid)
    before = _tree_seconds(root)
    t0 = time.monotonic()
    time.sleep(seconds)                     # the measurement window itself
    after = _tree_seconds(root)
    wall = time.monotonic() - t0
    used = sum(after[p] - before.get(p, 0.0) for p in after)
    return 100.0 * used / wall


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench idle", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-ipus", type=int, default=64, help="IPUs of the daemon")
    parser.add_argument("--seconds", type=float, default=10.0, help="measurement window")
    parser.add_argument("--settle", type=float, default=3.0,
                        help="seconds idle before measuring")
    a = parser.parse_args(argv)
    from ipu_emulator.daemon import socket_protocol as wire
    from tools.generate_simple_popef import write_simple_popef

    with tempfile.TemporaryDirectory(prefix="ipuemu-idle-") as tmp:
        with private_daemon(tmp, a.num_ipus) as sock:
            daemon_pid = wire.request(sock, {"op": "status"}, timeout=10.0)["daemon_pid"]
            time.sleep(a.settle)            # start-up work done
            daemon = cpu_percent(daemon_pid, a.seconds)
        path = os.path.join(tmp, "simple.popef")
        write_simple_popef(path, shape=(1, 4))
        env = dict(os.environ, IPU_EMULATOR_HOME=os.path.join(tmp, "home"),
                   IPU_EMULATOR_SHM_TAG="i" + secrets.token_hex(4))
        env.pop(wire.ENV_VAR, None)
        host = subprocess.Popen([sys.executable, "-c", _HOST, path], cwd=_REPO, env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert host.stdout is not None and host.stdin is not None
            line = host.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError(f"the runner's host did not start (said {line!r})")
            time.sleep(a.settle)
            runner = cpu_percent(host.pid, a.seconds)
            host.stdin.close()
            host.wait(60)
        finally:
            if host.poll() is None:
                host.kill()
                host.wait()
    print(f"idle CPU over {a.seconds:g} s, percent of one core:")
    print(f"  daemon with {a.num_ipus} IPUs (and its IPU processes): {daemon:6.2f}%")
    print(f"  runner with nothing in flight (host + IPU processes):  {runner:6.2f}%")
    print(f"  together: {daemon + runner:.2f}% (target <= 1%)")
    return 0
