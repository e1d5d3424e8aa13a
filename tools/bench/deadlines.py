"""``python -m tools.bench deadlines``: how exactly each deadline fires, timed from outside.

For each deadline at 10, 50 and 200 ms (``--ms``), in a fresh host process of
its own (embedded IPU processes), the time from the call to its answer, minus
the deadline (the *overshoot*; the target is at most 20 ms on an idle machine):

- ``timeout_ns``: a request missing an input (``validate_io_params`` off) fails
  with ``DeviceTimeoutError``;
- ``batch_size_timeout_ns``: one sample of a dynamic batch of 4 is flushed and
  answered;
- ``data_parallel_timeout_ns``: the same with 2 replicas, by that timeout;
- ``device wait``: ``getDevice`` with ``WAIT_WITH_TIMEOUT`` while every IPU is
  held fails with ``DeviceUnavailableError``;
- ``host sync``: a request to an IPU that hangs (an injected ``hang`` fault) fails
  with ``DeviceTimeoutError`` after ``IPU_EMULATOR_HOST_SYNC_TIMEOUT``.

Each figure is the median and the worst of ``--repeat`` calls.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

__all__ = ["main", "DESCRIPTION"]

DESCRIPTION = "overshoot of timeout_ns, batch/data-parallel timeouts, device wait, host sync"

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_PROGRAM = textwrap.dedent("""
    import json, statistics, sys, time
    from datetime import timedelta
    import numpy as np
    import host_runtime as mr
    from host_runtime import settings
    from ipu_emulator import faults

    path, path4, ms_list, repeat = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
    x = np.ones((1, 4), np.float32)
    out = {}

    def timed(fn, expect):
        took = []
        for _ in range(repeat):
            t = time.perf_counter()
            try:
                fn()
                if expect is not None:
                    raise SystemExit(f"expected {expect.__name__}")
            except Exception as exc:
                if expect is None or not isinstance(exc, expect):
                    raise
            took.append(time.perf_counter() - t)
        return took

    def config(**fields):
        cfg = mr.ModelRunnerConfig()
        for k, v in fields.items():
            setattr(cfg, k, v)
        return cfg

    for ms in ms_list:
        ns = int(ms * 1e6)
        row = {}
        with mr.ModelRunner(path, config=config(timeout_ns=ns, validate_io_params=False)) as r:
            r.execute({"tensor_A": x, "tensor_B": x})
            row["timeout_ns"] = timed(lambda: r.execute({"tensor_A": x}), mr.DeviceTimeoutError)
        with mr.ModelRunner(path4, config=config(batching_dim=0, batch_size_timeout_ns=ns,
                                          is_batch_size_timeout_enabled=True)) as r:
            r.execute({"tensor_A": np.ones((4, 4), np.float32), "tensor_B": np.ones((4, 4), np.float32)})
            row["batch_size_timeout_ns"] = timed(lambda: r.execute({"tensor_A": x, "tensor_B": x}), None)
        with mr.ModelRunner(path4, config=config(batching_dim=0, data_parallel_timeout_ns=ns,
                                          replication_factor=2,
                                          is_batch_size_timeout_enabled=True)) as r:
            r.execute({"tensor_A": np.ones((4, 4), np.float32), "tensor_B": np.ones((4, 4), np.float32)})
            row["data_parallel_timeout_ns"] = timed(lambda: r.execute({"tensor_A": x, "tensor_B": x}), None)
        dm = mr.DeviceManager()
        held = [dm.getDevice(1), dm.getDevice(1)]   # every IPU of the machine
        wait = mr.DeviceWaitConfig(mr.DeviceWaitStrategy.WAIT_WITH_TIMEOUT,
                                   timeout=timedelta(milliseconds=ms),
                                   sleepTime=timedelta(seconds=15))
        row["device wait"] = timed(lambda: dm.getDevice(1, wait_config=wait),
                                   mr.DeviceUnavailableError)
        for dev in held:
            dev.close()
        took = []
        for _ in range(repeat):
            for attempt in range(20):   # a loaded machine may load slower than the bound
                try:
                    with faults.inject(kind="hang"), settings.override(
                            host_sync_timeout=ms / 1000):
                        r = mr.ModelRunner(path)
                    break
                except mr.DeviceTimeoutError:
                    if attempt == 19:
                        raise
            t = time.perf_counter()
            try:
                r.execute({"tensor_A": x, "tensor_B": x})
                raise SystemExit("the hang was not noticed")
            except mr.DeviceTimeoutError:
                took.append(time.perf_counter() - t)
            r.close()
        row["host sync"] = took
        out[ms] = {k: [v - ms / 1000 for v in vs] for k, vs in row.items()}
    print(json.dumps(out))
""")


def measure(ms_list: list[float], repeat: int) -> dict[str, dict[str, list[float]]]:
    """Overshoots in seconds: {ms: {deadline: [overshoot per call]}}, from a fresh process."""
    from tools.generate_simple_popef import write_simple_popef

    with tempfile.TemporaryDirectory() as tmp:
        path, path4 = os.path.join(tmp, "simple.popef"), os.path.join(tmp, "batch4.popef")
        write_simple_popef(path)
        write_simple_popef(path4, shape=(4, 4))
        env = dict(os.environ, IPU_EMULATOR_NUM_IPUS="2",
                   IPU_EMULATOR_HOME=os.path.join(tmp, "home"),
                   PYTHONPATH=_REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("IPU_EMULATOR_DAEMON", None)
        proc = subprocess.run([sys.executable, "-c", _PROGRAM, path, path4, json.dumps(ms_list),
                               str(repeat)], env=env, capture_output=True, text=True,
                              timeout=600, cwd=_REPO)
        if proc.returncode != 0:
            raise RuntimeError(f"the measuring process failed:\n{proc.stderr[-3000:]}")
        result: dict[str, dict[str, list[float]]] = json.loads(proc.stdout.splitlines()[-1])
        return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench deadlines",
                                     description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--ms", type=float, action="append",
                        help="deadlines in ms (repeatable; default 10, 50, 200)")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--markdown", action="store_true")
    a = parser.parse_args(argv)
    ms_list = a.ms or [10.0, 50.0, 200.0]
    result = measure(ms_list, a.repeat)
    worst = 0.0
    if a.markdown:
        print("| deadline | " + " | ".join(f"{ms:g} ms" for ms in ms_list) + " |")
        print("|---|" + "---|" * len(ms_list))
    names = list(next(iter(result.values())))
    for name in names:
        cells = []
        for ms in ms_list:
            vs = sorted(result[str(ms)][name])
            med, top = vs[len(vs) // 2] * 1e3, vs[-1] * 1e3
            worst = max(worst, top)
            cells.append(f"+{med:.1f} (max +{top:.1f})")
        if a.markdown:
            print(f"| `{name}` | " + " | ".join(cells) + " |")
        else:
            print(f"{name:26s} " + "  ".join(f"{ms:g} ms: {c:22s}" for ms, c in zip(ms_list, cells)))
    print(f"worst overshoot: {worst:.1f} ms (target <= 20 ms)")
    return 0
