"""``python -m tools.bench memory``: memory of a large model per replica, and its first answer.

A chain of MatMul/Relu layers (``tools/_chain_model.py``) of ``--weights-mib``
MiB of float32 weights (W; 192 MiB by default: 12 layers of [2048, 2048]) is
compiled once to PopEF. Then, each in a fresh process with its own machine
(home folder and shared-memory tag):

- a ``ModelRunner`` of it with ``replication_factor`` 1, 2, 3 (``--replicas``),
  once with the default settings and once with the IPU processes' prepacking
  off (``IPU_EMULATOR_PREPACK=0``), each replica answering one request that is
  compared with onnxruntime's answer;
- onnxruntime in-process (one session, one run) for reference.

Memory is summed from the outside while the process waits: the private pages
(``Private_Clean + Private_Dirty`` of ``/proc/<pid>/smaps``) of the host and
of every process it started (IPU processes, the fork server), plus the bytes
the machine's shared-memory objects hold in ``/dev/shm``. A shared-memory
object's pages are counted once, as the object (the private pages of a mapping
of one of them are not added again). Figures are in MiB and in units of W.

First answer: in fresh processes, alternating, ``--rounds`` times: the time from
before ``import host_runtime`` to the first result of a new ``ModelRunner``
against the time from before ``import onnxruntime`` to the result of a new
``InferenceSession`` (both read the same files, warm in the page cache); then
the same with the runner's IPU from a warm daemon (``--no-daemon``: not).

The weights fed by a Load program from PopEF tensor data instead
(``--weights_as_tensor_data``; ``--no-tensor-data``: not measured): the same
runner with 1 and 2 replicas, default settings; the replicas share one
read-only copy of them (docs/memory.md), so the second replica adds little.

Execute: the median ``execute`` latency of the model on one replica, default
and prepacking off, against onnxruntime in the same process (one thread each),
the two run in turn after the memory was measured (median of the ratios).

Targets (issue 22): 1 replica <= 2.0 W, 2 replicas <= 3.5 W, each further
replica <= 1.2 W, and with prepacking off each further replica <= 0.2 W;
first answer <= 1.5x onnxruntime's create + run.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

from tools.bench._markdown import MarkdownTable

__all__ = ["main", "DESCRIPTION", "tree_memory"]

DESCRIPTION = "memory of a 192 MiB model per replica (units of its weights), first answer vs onnxruntime"

_MiB = 1 << 20
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WIDTH = 2048
BATCH = 4

# A host: one runner, one request per replica (checked), then it waits for the parent.
_RUNNER_CHILD = r"""
import sys, time, json
t0 = time.perf_counter()
import numpy as np
import host_runtime as model_runtime
path, replicas, xfile, yfile, timed, onnx_path = sys.argv[1:7]
replicas, timed = int(replicas), int(timed)
x = np.load(xfile)
config = model_runtime.ModelRunnerConfig()
config.replication_factor = replicas
runner = model_runtime.ModelRunner(path, config=config)
first = runner.execute({"x": x})["y"]
t1 = time.perf_counter()
y = np.load(yfile)
diffs = [float(np.max(np.abs(first - y)))]
for r in range(1, replicas):
    diffs.append(float(np.max(np.abs(runner.execute({"x": x}, replica_id=r)["y"] - y))))
print(json.dumps({"first": t1 - t0, "diff": max(diffs)}), flush=True)
sys.stdin.readline()   # memory measured: now execute, interleaved with onnxruntime here
if timed:
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    sess = ort.InferenceSession(onnx_path, so, providers=["CPUExecutionProvider"])
    sess.run(None, {"x": x})
    ratios, ours, theirs = [], [], []
    for _ in range(timed):
        a = time.perf_counter()
        runner.execute({"x": x})
        b = time.perf_counter()
        sess.run(None, {"x": x})
        c = time.perf_counter()
        ours.append(b - a)
        theirs.append(c - b)
        ratios.append((b - a) / (c - b))
    med = lambda v: sorted(v)[len(v) // 2]
    print(json.dumps({"latency": med(ours), "ort": med(theirs), "ratio": med(ratios)}),
          flush=True)
    sys.stdin.readline()
runner.close()
"""

# onnxruntime in-process: one session, one run, then it waits for the parent.
_ORT_CHILD = r"""
import sys, time, json
t0 = time.perf_counter()
import numpy as np
import onnxruntime as ort
path, xfile, timed = sys.argv[1], sys.argv[2], int(sys.argv[3])
x = np.load(xfile)
so = ort.SessionOptions()
so.intra_op_num_threads = 1
so.inter_op_num_threads = 1
sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
sess.run(None, {"x": x})
t1 = time.perf_counter()
lat = []
for _ in range(timed):
    a = time.perf_counter()
    sess.run(None, {"x": x})
    lat.append(time.perf_counter() - a)
print(json.dumps({"first": t1 - t0, "latency": sorted(lat)[len(lat) // 2] if lat else None}),
      flush=True)
sys.stdin.readline()
"""


# -- measuring from the outside ------------------------------------------------------------

def _private_bytes(pid: int, skip_prefix: str) -> int:
    """Private pages of ``pid`` (smaps), without mappings whose path starts ``skip_prefix``."""
    total = 0
    skip = False
    try:
        with open(f"/proc/{pid}/smaps", encoding="utf-8", errors="replace") as f:
            for line in f:
                head = line.split(None, 5)
                if head and "-" in head[0] and len(head) >= 5 and ":" not in head[0]:
                    path = head[5].strip() if len(head) > 5 else ""
                    skip = path.startswith(skip_prefix)
                elif not skip and (line.startswith("Private_Clean:")
                                   or line.startswith("Private_Dirty:")):
                    total += int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return 0
    return total


def shm_bytes(tag: str) -> tuple[int, int]:
    """(bytes held, objects) of the machine's shared-memory objects (tag ``tag``)."""
    prefix = f"ipuemu_{tag}_"
    held = count = 0
    for name in os.listdir("/dev/shm"):
        if name.startswith(prefix) or name.startswith("sem." + prefix):
            try:
                st = os.stat(os.path.join("/dev/shm", name))
            except FileNotFoundError:
                continue
            held += st.st_blocks * 512
            count += 1
    return held, count


def tree_memory(pid: int, tag: str | None) -> dict[str, Any]:
    """Private bytes of ``pid`` and its descendants (by process), plus the tag's /dev/shm."""
    import psutil

    skip = f"/dev/shm/ipuemu_{tag}_" if tag else "/dev/shm/\0"
    root = psutil.Process(pid)
    procs = {pid: _private_bytes(pid, skip)}
    for child in root.children(recursive=True):
        procs[child.pid] = _private_bytes(child.pid, skip)
    shm, objects = shm_bytes(tag) if tag else (0, 0)
    return {"host": procs[pid], "others": sorted((v for k, v in procs.items() if k != pid),
                                                  reverse=True),
            "shm": shm, "objects": objects, "total": sum(procs.values()) + shm}


class _Child:
    """A fresh process running one of the scripts above, on a machine of its own."""

    def __init__(self, script: str, args: list[str], base: str, env: dict[str, str]) -> None:
        self.tag = "m" + secrets.token_hex(4)
        home = tempfile.mkdtemp(prefix="home", dir=base)
        full = dict(os.environ, IPU_EMULATOR_SHM_TAG=self.tag, IPU_EMULATOR_HOME=home,
                    PYTHONPATH=_REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        full.pop("IPU_EMULATOR_DAEMON", None)
        full.pop("PYTHONDONTWRITEBYTECODE", None)   # as installed: imports from .pyc files
        if _MACHINE_TILE:
            full["IPU_EMULATOR_MEMORY_PER_TILE"] = str(_MACHINE_TILE)
        full.update(env)
        self.proc = subprocess.Popen([sys.executable, "-c", script, *args], cwd=_REPO,
                                     env=full, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)

    def result(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            raise RuntimeError(f"the measured process exited with {self.proc.returncode} "
                               "before its result")
        return dict(json.loads(line))

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()

    def finish(self) -> int:
        """Let it close and exit; the objects its tag still holds in /dev/shm afterwards."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write("\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass
        self.proc.wait(timeout=120)
        return shm_bytes(self.tag)[1]


# -- the model -------------------------------------------------------------------------------

def _prepare(folder: str, weights_mib: int) -> tuple[str, str, str, str, int]:
    """(popef path, onnx path, x.npy, y.npy, weight bytes) of the chain model."""
    import onnx

    from host_runtime.poprt.compiler import compile as poprt_compile
    from tools._chain_model import chain_model, reference

    layers = max(1, weights_mib * _MiB // (WIDTH * WIDTH * 4))
    onnx_path = os.path.join(folder, "chain.onnx")
    x = np.random.default_rng(1).standard_normal((BATCH, WIDTH)).astype(np.float32)
    if layers * WIDTH * WIDTH * 4 < _BIG:
        model = chain_model(layers=layers, width=WIDTH, batch=BATCH)
        onnx.save(model, onnx_path)
        out = poprt_compile(model, folder, popef_name="chain.popef")
        y = reference(model, x)
    else:   # over protobuf's 2 GiB: the weights only ever in an external data file; and
        # over one IPU's 900 MiB: compiled for (and run on) IPUs with more memory per tile
        _big_chain(onnx_path, layers)
        out = poprt_compile(onnx_path, folder, popef_name="chain.popef",
                            ipu_memory=_TILES * _big_tile(layers * WIDTH * WIDTH * 4))
        y = _reference_from_file(onnx_path, x)
    assert out.popef_path is not None
    xf, yf = os.path.join(folder, "x.npy"), os.path.join(folder, "y.npy")
    np.save(xf, x)
    np.save(yf, y)
    return str(out.popef_path), onnx_path, xf, yf, layers * WIDTH * WIDTH * 4


_BIG = 1 << 30   # weights from here on are written as external data, never in a ModelProto
_TILES = 1472
_MACHINE_TILE = 0   # set for a model larger than an IPU (bytes per tile of the machine)


def _big_tile(weights: int) -> int:
    """Bytes per tile of an IPU that holds ``weights`` and some room."""
    return -(-(weights + (256 << 20)) // _TILES)


def _big_chain(path: str, layers: int) -> None:
    """``chain_model``'s graph with its weights in ``<path>.data`` (external data)."""
    from onnx import TensorProto

    from tools._chain_model import chain_model

    data = path + ".data"
    with open(data, "wb") as f:
        def external(name: str, w: np.ndarray) -> Any:
            t = TensorProto()
            t.name, t.data_type = name, TensorProto.FLOAT
            t.dims.extend(w.shape)
            t.data_location = TensorProto.EXTERNAL
            for key, value in (("location", os.path.basename(data)), ("offset", str(f.tell())),
                               ("length", str(w.nbytes))):
                e = t.external_data.add()
                e.key, e.value = key, value
            f.write(w.tobytes())
            return t

        model = chain_model(layers=layers, width=WIDTH, batch=BATCH, initializer=external)
    with open(path, "wb") as f:
        f.write(model.SerializeToString())


def _reference_from_file(path: str, x: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return np.asarray(sess.run(None, {"x": x})[0])


def _tensor_data_lines(folder: str, onnx_path: str, xf: str, yf: str, counts: list[int],
                       W: float, table: MarkdownTable) -> None:
    """Memory of the model compiled with its weights as PopEF tensor data (fed by the Load
    program), with ``counts`` replicas."""
    import onnx

    from host_runtime.poprt.compiler import compile as poprt_compile

    out = poprt_compile(onnx.load(onnx_path), os.path.join(folder, "td"),
                        popef_name="chain_td.popef", weights_as_tensor_data=True)
    totals: dict[int, float] = {}
    for r in counts:
        child = _Child(_RUNNER_CHILD, [str(out.popef_path), str(r), xf, yf, "0", onnx_path],
                       folder, {})
        res = child.result()
        mem = tree_memory(child.proc.pid, child.tag)
        left = child.finish()
        totals[r] = mem["total"]
        print(f"weights as PopEF tensor data, {r} replica(s): {_mib(mem['total']):>10s} = "
              f"{mem['total'] / W:4.2f} W  (host {_mib(mem['host'])}; processes "
              f"{' + '.join(_mib(v) for v in mem['others']) or 'none'}; "
              f"/dev/shm {_mib(mem['shm'])}); max |diff| vs "
              f"onnxruntime {res['diff']:.3g}; /dev/shm objects left after close: {left}")
        table.add(f"memory: {r} replica(s), weights as tensor data",
                  f"{mem['total'] / W:.2f} W", _mib(mem["total"]))
    if 1 in totals and 2 in totals:
        step = (totals[2] - totals[1]) / W
        print(f"weights as PopEF tensor data: replica 2 adds {step:.2f} W")
        table.add("memory: replica 2 adds (weights as tensor data)", f"{step:.2f} W", "")


def _mib(n: float) -> str:
    return f"{n / _MiB:,.0f} MiB"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench memory", description=DESCRIPTION)
    ap.add_argument("--weights-mib", type=int, default=192)
    ap.add_argument("--replicas", default="1,2,3", help="replica counts, comma-separated")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the first-answer timing")
    ap.add_argument("--timed", type=int, default=20, help="execute calls timed per process")
    ap.add_argument("--no-daemon", dest="daemon", action="store_false",
                    help="skip the first answer through a warm daemon")
    ap.add_argument("--no-tensor-data", dest="tensor_data", action="store_false",
                    help="skip the model whose weights a Load program feeds from PopEF "
                         "tensor data")
    ap.add_argument("--first-only", action="store_true",
                    help="only the first-answer timing (no memory, no execute)")
    ap.add_argument("--markdown", action="store_true", help="print rows for docs/benchmarks.md")
    args = ap.parse_args(argv)
    table = MarkdownTable(args.markdown)
    counts = [int(c) for c in args.replicas.split(",") if c.strip()]
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as folder:
        popef_path, onnx_path, xf, yf, wbytes = _prepare(folder, args.weights_mib)
        global _MACHINE_TILE
        _MACHINE_TILE = _big_tile(wbytes) if wbytes >= _BIG else 0
        W = float(wbytes)
        print(f"model: {wbytes // (WIDTH * WIDTH * 4)} x [{WIDTH}, {WIDTH}] float32 MatMul "
              f"layers, W = {_mib(W)} of weights; batch {BATCH}")

        if not args.first_only:
            _memory_and_execute(args, table, counts, folder, popef_path, onnx_path, xf, yf, W)

        def first_answers(env: dict[str, str]) -> tuple[float, float, float]:
            firsts, ort_firsts, ratios = [], [], []
            for _ in range(args.rounds):
                o = _Child(_ORT_CHILD, [onnx_path, xf, "0"], folder, {})
                a = o.result()["first"]
                o.finish()
                c = _Child(_RUNNER_CHILD, [popef_path, "1", xf, yf, "0", onnx_path], folder,
                           env)
                b = c.result()["first"]
                c.finish()
                firsts.append(b)
                ort_firsts.append(a)
                ratios.append(b / a)
            return (statistics.median(firsts), statistics.median(ort_firsts),
                    statistics.median(ratios))

        ours, theirs, ratio = first_answers({})
        print(f"first answer of a new runner: {ours:.2f} s vs onnxruntime create + run "
              f"{theirs:.2f} s (imports included): {ratio:.2f}x (target <= 1.5x)")
        table.add("first answer (import + create + run)", f"{ours:.2f} s", f"{theirs:.2f} s",
                  ratio, "<= 1.5x")
        if args.daemon:
            from tools.bench.lifecycle import private_daemon

            with private_daemon(folder) as sock:
                ours, theirs, ratio = first_answers({"IPU_EMULATOR_DAEMON": sock})
            print(f"same through a warm daemon (its IPU processes started): {ours:.2f} s vs "
                  f"{theirs:.2f} s: {ratio:.2f}x")
            table.add("first answer, IPU from a warm daemon", f"{ours:.2f} s",
                      f"{theirs:.2f} s", ratio)
    table.emit()
    return 0


def _memory_and_execute(args: argparse.Namespace, table: MarkdownTable, counts: list[int],
                        folder: str, popef_path: str, onnx_path: str, xf: str, yf: str,
                        W: float) -> None:
    """The memory figures per replica count and the execute latencies."""
    ort = _Child(_ORT_CHILD, [onnx_path, xf, "0"], folder, {})
    ort.result()
    ort_mem = tree_memory(ort.proc.pid, None)
    ort.finish()
    print(f"onnxruntime in-process: {_mib(ort_mem['total'])} = "
          f"{ort_mem['total'] / W:.2f} W")
    table.add("memory: onnxruntime in-process", f"{ort_mem['total'] / W:.2f} W",
              _mib(ort_mem["total"]))

    figures: dict[tuple[str, int], float] = {}
    timing: dict[str, dict[str, float]] = {}
    for mode, env in (("default", {}), ("prepacking off", {"IPU_EMULATOR_PREPACK": "0"})):
        for r in counts:
            timed = args.timed if r == 1 else 0
            child = _Child(_RUNNER_CHILD, [popef_path, str(r), xf, yf, str(timed),
                                           onnx_path], folder, env)
            res = child.result()
            mem = tree_memory(child.proc.pid, child.tag)
            if timed:
                child.go()
                timing[mode] = child.result()
            left = child.finish()
            figures[(mode, r)] = mem["total"]
            others = " + ".join(_mib(v) for v in mem["others"]) or "none"
            print(f"{mode:15s} {r} replica(s): {_mib(mem['total']):>10s} = "
                  f"{mem['total'] / W:4.2f} W  (host {_mib(mem['host'])}; processes "
                  f"{others}; /dev/shm {_mib(mem['shm'])} in {mem['objects']} objects); "
                  f"max |diff| vs onnxruntime {res['diff']:.3g}; /dev/shm objects left "
                  f"after close: {left}")
            if left:
                print(f"  LEAK: {left} shared-memory objects left by tag {child.tag}")
            table.add(f"memory: {r} replica(s), {mode}", f"{mem['total'] / W:.2f} W",
                      _mib(mem["total"]), None,
                      {1: "<= 2.0 W", 2: "<= 3.5 W"}.get(r, "") if mode == "default"
                      else "")
        for r in counts:
            if r - 1 in counts:
                step = (figures[(mode, r)] - figures[(mode, r - 1)]) / W
                target = "<= 1.2 W" if mode == "default" else "<= 0.2 W"
                print(f"{mode:15s} replica {r} adds {step:.2f} W (target {target})")
                table.add(f"memory: replica {r} adds ({mode})", f"{step:.2f} W", "", None,
                          target)
    if args.tensor_data and W < _BIG:
        _tensor_data_lines(folder, onnx_path, xf, yf, [r for r in counts if r <= 2], W,
                           table)
    for mode, t in timing.items():
        print(f"execute, 1 replica, {mode}: {t['latency'] * 1e3:.1f} ms vs onnxruntime "
              f"in-process {t['ort'] * 1e3:.1f} ms, interleaved: {t['ratio']:.2f}x")
        table.add(f"execute [{BATCH},{WIDTH}] 1 replica ({mode})",
                  f"{t['latency'] * 1e3:.1f} ms", f"{t['ort'] * 1e3:.1f} ms", t["ratio"])


if __name__ == "__main__":
    sys.exit(main())
