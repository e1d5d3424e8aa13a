"""``python -m tools.bench lifecycle``: a runner's whole life (construct + first execute + close).

For the seeds' example model (``C = A * weights + B`` at [1, 4]) this times,
in one run, in rounds that interleave each mode with the reference:

- ``ort``: creating an onnxruntime ``InferenceSession`` in-process for the
  same graph and running it once (the reference);
- ``daemon``: ``ModelRunner(path)`` + ``execute`` + ``close()`` through a warm
  daemon (a private ``ipu-emulator daemon`` this benchmark starts with its
  own ``IPU_EMULATOR_HOME`` and shared-memory tag, and stops at the end);
- ``embedded``: the same with IPU processes this process starts itself (the
  template process of :mod:`ipu_emulator.ipu.forkserver` when it is on; also
  timed with it off, ``IPU_EMULATOR_FORKSERVER=0``, unless ``--no-cold``).

Each figure is the median of ``--repeats`` warm repeats, after ``--warmup`` untimed
rounds (a daemon's first lives, its IPU process and this process still warming up,
take 3-4 ms, falling to the steady 2.0-2.3 ms over about ten). The daemon is timed in rounds of ``ort`` and ``daemon`` alone, the embedded
modes in rounds of their own after those (each with its own ``ort`` reference): an
embedded runner's close leaves its IPU process exiting and the template process
forking, work that would otherwise land in the next daemon life (measured: 30-60%
on two CPUs). A life is construct + execute + close; checking its result is not
timed. ``--back-to-back N`` also times N daemon lives in a row after its rounds (no other
mode between two lives: its median is the daemon path's own cost, without what waking
the daemon and the IPU process after the other modes ran costs). Also timed: ``close()`` of an embedded runner of a chain model sharded
over 4 IPUs (4 IPU processes, stopped together). Targets: daemon <= 5x ort, embedded <= 150x ort. The medians of
construct, first execute and ``close()`` alone are printed too (issue 13 asks
<= 5 ms for ``close()`` of an idle runner).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Iterator

import numpy as np

from tools.bench._markdown import MarkdownTable

__all__ = ["main", "DESCRIPTION"]

DESCRIPTION = "construct + first execute + close of a ModelRunner, embedded and via a daemon, vs onnxruntime"

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _ort_once(model_bytes: bytes, inputs: dict[str, np.ndarray]) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    sess = ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])
    return sess.run(None, inputs)[0]


@contextlib.contextmanager
def private_daemon(base: str, num_ipus: int = 1) -> Iterator[str]:
    """Start ``ipu-emulator daemon`` with its own home and tag; yield its socket path."""
    from ipu_emulator.daemon import socket_protocol as wire

    sock = os.path.join(base, "d.sock")
    env = dict(os.environ, IPU_EMULATOR_HOME=os.path.join(base, "dhome"),
               IPU_EMULATOR_SHM_TAG="b" + secrets.token_hex(4),
               IPU_EMULATOR_DAEMON_LOG_LEVEL="WARNING")
    env.pop(wire.ENV_VAR, None)
    log = open(os.path.join(base, "daemon.log"), "wb")
    proc = subprocess.Popen([sys.executable, "-m", "tools.cli", "daemon", "--socket", sock,
                             "--num-ipus", str(num_ipus)], cwd=_REPO, env=env,
                            stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the daemon exited with {proc.returncode}; see "
                                   f"{base}/daemon.log")
            try:
                wire.request(sock, {"op": "hello"}, timeout=2.0)
                break
            except (OSError, ValueError):
                if time.monotonic() > deadline:
                    raise RuntimeError("the daemon did not answer within 120 s") from None
                time.sleep(0.05)   # bench start-up only
        yield sock
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


def _runner_life(path: str, inputs: dict[str, np.ndarray], expect: np.ndarray,
                 parts: list[tuple[float, float, float]]) -> None:
    """One runner's life; appends (construct, first execute, close) seconds to ``parts``."""
    import host_runtime as model_runtime

    cfg = model_runtime.ModelRunnerConfig()
    cfg.check_package_hash = False
    t0 = time.perf_counter()
    runner = model_runtime.ModelRunner(path, config=cfg)
    t1 = time.perf_counter()
    out = runner.execute(inputs)["tensor_C"]
    t2 = time.perf_counter()
    runner.close()
    parts.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
    if not np.allclose(out, expect, rtol=1e-6, atol=1e-6):
        raise AssertionError("the runner's result differs from onnxruntime's")


def _sharded_close(tmp: str, repeats: int, ipus: int = 4) -> tuple[float, float]:
    """Medians (ms) of construct and close() of an embedded runner of a chain model
    sharded over ``ipus`` IPUs (one IPU process each), after one execute."""
    from host_runtime import ModelRunner
    from host_runtime.poprt.compiler import compile as poprt_compile
    from tools._chain_model import chain_model, reference, shard_config

    model = chain_model(ipus, width=32, batch=2, seed=1)
    sharding, _ = shard_config(ipus, ipus)
    out = poprt_compile(model, os.path.join(tmp, f"sharded{ipus}"), num_ipus=ipus,
                        sharding_info=sharding)
    x = np.ones((2, 32), np.float32)
    want = reference(model, x)
    constructs, closes = [], []
    for k in range(repeats + 1):
        t0 = time.perf_counter()
        runner = ModelRunner(str(out.popef_path))
        t1 = time.perf_counter()
        y = runner.execute({"x": x})["y"]
        t2 = time.perf_counter()
        runner.close()
        t3 = time.perf_counter()
        if not np.allclose(y, want, rtol=1e-5, atol=1e-5):
            raise AssertionError("the sharded runner's result differs from onnxruntime's")
        if k:   # the first is a warm-up
            constructs.append(t1 - t0)
            closes.append(t3 - t2)
    return statistics.median(constructs) * 1e3, statistics.median(closes) * 1e3


def _timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


@contextlib.contextmanager
def _env(**values: str | None) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench lifecycle", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=31, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=10, help="untimed rounds first")
    parser.add_argument("--back-to-back", type=int, default=0, metavar="N",
                        help="also time N daemon lives in a row (default 0: not)")
    parser.add_argument("--no-cold", action="store_true",
                        help="skip embedded runners with the template process off")
    parser.add_argument("--markdown", action="store_true",
                        help="print the figures as rows of docs/benchmarks.md (report to stderr)")
    args = parser.parse_args(argv)
    table = MarkdownTable(args.markdown)

    from ipu_emulator.daemon import socket_protocol as wire
    from tools.generate_simple_popef import build_simple_model, write_simple_popef
    from tools.bench.runner import _onnx_bytes

    with tempfile.TemporaryDirectory(prefix="bench-lifecycle-") as tmp, \
            _env(IPU_EMULATOR_HOME=os.path.join(tmp, "home"),
                 IPU_EMULATOR_SHM_TAG="l" + secrets.token_hex(4), **{wire.ENV_VAR: None}):
        path = os.path.join(tmp, "simple.popef")
        write_simple_popef(path, shape=(1, 4))
        model_bytes = _onnx_bytes(build_simple_model((1, 4)))
        rng = np.random.default_rng(0)
        inputs = {"tensor_A": rng.standard_normal((1, 4)).astype(np.float32),
                  "tensor_B": rng.standard_normal((1, 4)).astype(np.float32)}
        expect = _ort_once(model_bytes, inputs)

        closes: dict[str, list[tuple[float, float, float]]] = {
            "daemon": [], "embedded": [], "cold": []}
        def ort_once() -> None:
            _ort_once(model_bytes, inputs)

        with private_daemon(tmp) as sock:
            def via_daemon() -> None:
                with _env(**{wire.ENV_VAR: sock}):
                    _runner_life(path, inputs, expect, closes["daemon"])

            def embedded() -> None:
                _runner_life(path, inputs, expect, closes["embedded"])

            def cold() -> None:
                with _env(IPU_EMULATOR_FORKSERVER="0"):
                    _runner_life(path, inputs, expect, closes["cold"])

            phases: list[dict[str, Callable[[], object]]] = [
                {"ort": ort_once, "daemon": via_daemon},
                {"ort": ort_once, "embedded": embedded}]
            if not args.no_cold:
                phases[1]["cold"] = cold
            times: dict[str, list[float]] = {}
            row: list[tuple[float, float, float]] = []   # the back-to-back lives
            refs: dict[str, list[float]] = {}   # each mode's ort, timed in its rounds
            for phase in phases:
                for _ in range(max(1, args.warmup)):   # warm-up rounds, not timed
                    for fn in phase.values():
                        fn()
                for name in phase:
                    closes.get(name, []).clear()
                ort_times: list[float] = []
                for _ in range(args.repeats):
                    for name, fn in phase.items():
                        if name == "ort":
                            ort_times.append(_timed(fn))
                        else:
                            fn()   # a life: the sum of its parts (the result check untimed)
                            times.setdefault(name, []).append(sum(closes[name][-1]))
                refs.update((name, ort_times) for name in phase if name != "ort")
                times.setdefault("ort", []).extend(ort_times)
                if "daemon" in phase:   # right after its rounds, before any embedded runner
                    with _env(**{wire.ENV_VAR: sock}):
                        for _ in range(max(0, args.back_to_back)):
                            _runner_life(path, inputs, expect, row)
        from host_runtime.settings import HostSettings

        with _env(IPU_EMULATOR_NUM_IPUS=str(HostSettings.read("num_ipus") or 4)):
            sharded = _sharded_close(tmp, args.repeats)

    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    # construct, execute, close medians (ms)
    cmed = {k: [statistics.median(p[i] for p in v) * 1e3 for i in range(3)]
            for k, v in closes.items() if v}
    ort = med["ort"]
    ort_of = {k: statistics.median(v) * 1e3 for k, v in refs.items()}
    print(f"construct + first execute + close, [1,4] example model, median of "
          f"{args.repeats} warm repeats (ms)")
    print(f"  onnxruntime InferenceSession + run, in-process  {ort:8.2f}  (in the daemon's "
          f"rounds {ort_of['daemon']:.2f}, the embedded ones' {ort_of['embedded']:.2f})")
    rows = [("daemon", "ModelRunner through a warm daemon", 5.0),
            ("embedded", "ModelRunner embedded (template process)", 150.0),
            ("cold", "ModelRunner embedded, template off", None)]
    ok = True
    for key, text, target in rows:
        if key not in med:
            continue
        ratio = med[key] / ort_of[key]
        goal = f"(target <= {target:g}x)" if target else ""
        c, e, z = cmed.get(key, [0.0, 0.0, 0.0])
        print(f"  {text:47s} {med[key]:8.2f}  = {ratio:6.1f}x ort {goal}\n"
              f"      construct {c:7.2f}   first execute {e:6.2f}   close() {z:7.2f}")
        if target:
            ok &= ratio <= target
        table.add(f"construct + first execute + close: {text}",
                  f"{med[key]:.1f} ms (close {z:.1f})",
                  f"onnxruntime session + run in-process {ort_of[key]:.2f} ms", ratio,
                  f"≤ {target:g}" if target else "")
    if row:
        life = statistics.median(sum(p) for p in row) * 1e3
        c, e, z = (statistics.median(p[i] for p in row) * 1e3 for i in range(3))
        ort = ort_of["daemon"]
        print(f"  ModelRunner through a warm daemon, {len(row)} lives back to back "
              f"{life:8.2f}  = {life / ort:6.1f}x ort\n"
              f"      construct {c:7.2f}   first execute {e:6.2f}   close() {z:7.2f}")
        table.add(f"same, {len(row)} lives back to back", f"{life:.1f} ms (close {z:.1f})",
                  "", life / ort, "")
    print(f"  ModelRunner embedded, chain sharded over 4 IPUs: construct {sharded[0]:7.2f}   "
          f"close() {sharded[1]:7.2f}  (4 IPU processes)")
    table.add("`close()` of an embedded runner of a model sharded over 4 IPUs",
              f"{sharded[1]:.1f} ms")
    print("\nall targets met" if ok else "\nsome targets missed")
    table.emit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
