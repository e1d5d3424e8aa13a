"""``python -m tools.bench replicas``: how the throughput of a compute-bound model scales with replicas.

A chain of 4 [64, 1024] x [1024, 1024] float32 MatMul layers (each with a Relu,
``tools/_chain_model.py``), compiled for one IPU, is run by one ModelRunner with
``replication_factor = 1`` and one with ``replication_factor = 2``; requests go
through ``executeAsync`` with 4 in flight per replica, numpy arrays (copied),
spread over the replicas in turn. Against it: onnxruntime in this process with
``intra_op_num_threads`` 1 and 2, run back to back.

Also printed: how often the two replicas' IPU processes last ran on other CPUs
(``/proc/<pid>/stat`` sampled every millisecond while the 2 replicas run), which
shows the placement whatever else the machine runs.

Figures (requests/s, median of the rounds; each round measures every side one
after the other, so that they see the same machine):

- 2 replicas / 1 replica (target >= 1.7);
- 2 replicas / onnxruntime with 2 threads (target >= 0.85), and the two scalings
  compared: (2 replicas / 1 replica) / (onnxruntime 2 threads / 1 thread).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from collections import deque
from typing import Any

import numpy as np

from tools.bench._markdown import MarkdownTable

__all__ = ["main", "DESCRIPTION"]

DESCRIPTION = "throughput of a compute-bound model: 2 replicas vs 1, vs onnxruntime with 2 threads vs 1"

ROWS, WIDTH, LAYERS = 64, 1024, 4
IN_FLIGHT = 4   # per replica


def _compile(model: Any, folder: str) -> str:
    from host_runtime.poprt.compiler import compile as poprt_compile

    out = poprt_compile(model, folder, popef_name="chain.popef")
    assert out.popef_path is not None
    return str(out.popef_path)


def _runner_rate(runner: Any, replicas: int, x: np.ndarray, seconds: float) -> float:
    in_flight = IN_FLIGHT * replicas
    outs = [{"y": np.empty((ROWS, WIDTH), np.float32)} for _ in range(in_flight)]
    pending: deque[Any] = deque()
    n, k = 0, 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        while len(pending) < in_flight:
            pending.append(runner.executeAsync({"x": x}, outs[k % in_flight],
                                               replica_id=k % replicas))
            k += 1
        pending.popleft().wait()
        n += 1
    while pending:
        pending.popleft().wait()
        n += 1
    return n / (time.perf_counter() - t0)


class _Apart:
    """Samples, every millisecond while on, whether two processes last ran on other CPUs."""

    def __init__(self, pids: list[int]) -> None:
        self.paths = [f"/proc/{pid}/stat" for pid in pids]
        self.apart = self.together = 0
        self._on = threading.Event()
        self._end = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _cpu(self, path: str) -> int:
        with open(path, "rb") as f:
            data = f.read()
        return int(data[data.rindex(b")") + 2:].split()[36])

    def _run(self) -> None:
        while not self._end.wait(0.001):
            if self._on.is_set():
                try:
                    a, b = (self._cpu(p) for p in self.paths)
                except (OSError, ValueError, IndexError):
                    return
                if a == b:
                    self.together += 1
                else:
                    self.apart += 1

    def during(self, fn: Any, *args: Any) -> Any:
        self._on.set()
        try:
            return fn(*args)
        finally:
            self._on.clear()

    def close(self) -> float:
        self._end.set()
        self._thread.join()
        return self.apart / max(1, self.apart + self.together)


def _ort_rate(sess: Any, x: np.ndarray, seconds: float) -> float:
    n = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        sess.run(None, {"x": x})
        n += 1
    return n / (time.perf_counter() - t0)


def _ort_session(model: Any, threads: int) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])


def measure(seconds: float, rounds: int) -> dict[str, float]:
    from host_runtime import DeviceManager, ModelRunner, ModelRunnerConfig
    from tools._chain_model import chain_model

    model = chain_model(LAYERS, WIDTH, ROWS)
    x = np.random.default_rng(0).standard_normal((ROWS, WIDTH)).astype(np.float32)
    ort1, ort2 = _ort_session(model, 1), _ort_session(model, 2)
    want = ort1.run(None, {"x": x})[0]
    with tempfile.TemporaryDirectory(prefix="bench-replicas-") as tmp:
        path = _compile(model, tmp)
        runners = {}
        # the devices of the 2 replicas, to see where their IPU processes run
        devices = [DeviceManager().getDevice(1) for _ in range(2)]
        apart = _Apart([d.pids()[0] for d in devices])
        for n in (1, 2):
            cfg = ModelRunnerConfig()
            cfg.replication_factor = n
            if n == 2:
                cfg.replica_to_device = dict(enumerate(devices))
            cfg.ring_buffer_size_multiplier = IN_FLIGHT
            cfg.check_package_hash = False
            runners[n] = ModelRunner(path, config=cfg)
        try:
            for n, r in runners.items():
                for rid in range(n):
                    got = r.execute({"x": x}, replica_id=rid)["y"]
                    if not np.allclose(got, want, rtol=1e-4, atol=1e-4):
                        raise AssertionError(f"replica {rid} of {n} gave other results "
                                             "than onnxruntime")
                _runner_rate(r, n, x, seconds / 4)
            _ort_rate(ort1, x, seconds / 4)
            _ort_rate(ort2, x, seconds / 4)
            res: dict[str, list[float]] = {"r1": [], "r2": [], "o1": [], "o2": []}
            for _ in range(rounds):
                res["r1"].append(_runner_rate(runners[1], 1, x, seconds))
                res["r2"].append(apart.during(_runner_rate, runners[2], 2, x, seconds))
                res["o1"].append(_ort_rate(ort1, x, seconds))
                res["o2"].append(_ort_rate(ort2, x, seconds))
        finally:
            for r in runners.values():
                r.close()
            for d in devices:
                d.close()
            apart_share = apart.close()
    out = {k: statistics.median(v) for k, v in res.items()}
    out["apart"] = apart_share
    # ratios taken within each round, then their median
    out["scale"] = statistics.median(b / a for a, b in zip(res["r1"], res["r2"]))
    out["ort_scale"] = statistics.median(b / a for a, b in zip(res["o1"], res["o2"]))
    out["vs_ort"] = statistics.median((r2 / r1) / (o2 / o1) for r1, r2, o1, o2 in
                                      zip(res["r1"], res["r2"], res["o1"], res["o2"]))
    out["vs_ort2"] = statistics.median(r2 / o2 for r2, o2 in zip(res["r2"], res["o2"]))
    out["scale_min"] = min(b / a for a, b in zip(res["r1"], res["r2"]))
    out["scale_max"] = max(b / a for a, b in zip(res["r1"], res["r2"]))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench replicas", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=1.5, help="per throughput sample")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of all four samples")
    parser.add_argument("--markdown", action="store_true",
                        help="print the figures as rows of docs/benchmarks.md (report to stderr)")
    args = parser.parse_args(argv)
    table = MarkdownTable(args.markdown)
    m = measure(args.seconds, args.rounds)
    print(f"[{ROWS},{WIDTH}] x {LAYERS} MatMul layers, executeAsync, {IN_FLIGHT} in flight "
          f"per replica (requests/s, median of {args.rounds} rounds)")
    print(f"  ModelRunner, 1 replica                  {m['r1']:9.1f}")
    print(f"  ModelRunner, 2 replicas                 {m['r2']:9.1f}")
    print(f"  onnxruntime in-process, 1 thread        {m['o1']:9.1f}")
    print(f"  onnxruntime in-process, 2 threads       {m['o2']:9.1f}")
    print(f"  2 replicas / 1 replica = {m['scale']:.2f} (rounds {m['scale_min']:.2f}-"
          f"{m['scale_max']:.2f}; target >= 1.7)")
    print(f"  onnxruntime 2 threads / 1 thread = {m['ort_scale']:.2f}")
    print(f"  the 2 replicas' IPU processes last ran on other CPUs in {100 * m['apart']:.0f}% "
          "of 1 ms samples")
    print(f"  2 replicas / onnxruntime 2 threads = {m['vs_ort2']:.2f} (target >= 0.85); "
          f"replica scaling / onnxruntime's = {m['vs_ort']:.2f}")
    ok = m["scale"] >= 1.7 and m["vs_ort2"] >= 0.85
    table.add("2 replicas / 1 replica, [64,1024] x 4 MatMul layers, `executeAsync`",
              f"{m['r2']:.0f} / {m['r1']:.0f} req/s = {m['scale']:.2f}x",
              f"onnxruntime 2 threads / 1 thread {m['o2']:.0f} / {m['o1']:.0f} req/s "
              f"= {m['ort_scale']:.2f}x", m["vs_ort"], "≥ 1.7x")
    table.add("2 replicas / onnxruntime with 2 threads, same model",
              f"{m['r2']:.0f} req/s", f"onnxruntime 2 threads {m['o2']:.0f} req/s",
              m["vs_ort2"], "≥ 0.85")
    print("\nall targets met" if ok else "\nsome targets missed")
    table.emit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
