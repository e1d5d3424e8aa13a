"""``ipu-emulator demo``: the seeds' example model through every ModelRunner mode.

On a fresh machine, with no daemon: writes the example model
(``tensor_C = tensor_A * weights + tensor_B``) into a temporary folder, loads
it on embedded emulated IPUs and runs the execution modes of seeds 000/001
(sync/async, runner/user-allocated outputs, InputMemoryView or numpy dicts),
frozen inputs, dynamic batch sizes, replication over 2 IPUs, 4 threads x 5
requests, the Save program, conditional execution of two fused models through
the PopRT ``Runner``, a MatMul/Relu chain sharded and pipelined over 2 IPUs
(one IPU process per part), and prints the monitoring statistics. Every
result is compared with numpy; each mode prints PASS or FAIL and the exit
status is non-zero if any failed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable

import numpy as np

__all__ = ["main"]


class _Demo:
    def __init__(self, path: str, weights: np.ndarray, verbose: bool) -> None:
        self.path = path
        self.weights = weights
        self.verbose = verbose
        self.results: list[tuple[str, bool, str]] = []
        self.rng = np.random.default_rng(1)

    def expect(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.asarray(a * self.weights + b)

    def inputs(self, shape: tuple[int, ...] | list[int]) -> tuple[np.ndarray, np.ndarray]:
        a = self.rng.standard_normal(shape).astype(np.float32)
        b = self.rng.standard_normal(shape).astype(np.float32)
        return a, b

    def mode(self, name: str, fn: Callable[[], None]) -> None:
        t0 = time.perf_counter()
        try:
            fn()
        except Exception as exc:  # report and carry on with the other modes
            detail = f"{type(exc).__name__}: {exc}"
            if self.verbose:
                detail += "\n" + traceback.format_exc()
            self.results.append((name, False, detail))
            print(f"FAIL  {name}: {detail}", flush=True)
            return
        ms = (time.perf_counter() - t0) * 1e3
        self.results.append((name, True, ""))
        print(f"PASS  {name} ({ms:.1f} ms)", flush=True)


def _check(got: Any, want: np.ndarray, what: str) -> None:
    arr = np.asarray(got)
    if arr.shape != want.shape or not np.allclose(arr, want, rtol=1e-5, atol=1e-6):
        raise AssertionError(f"{what}: got {arr!r}, expected {want!r}")


def _write_fused_model(workdir: str) -> str:
    """Fuse two small ONNX models into one PopEF (seed 004's model fusion):
    graph0: O = reshape(X + Y, [2]) in fp32; graph1: O = concat(X, [[1.5, 2.0]]) in fp16."""
    from onnx import TensorProto, helper, numpy_helper

    from host_runtime.poprt.compiler import compile as poprt_compile
    from ipu_emulator.compiler import ModelSpec

    def model(graph: Any) -> Any:
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
        m.ir_version = 8
        return m

    f32, f16 = TensorProto.FLOAT, TensorProto.FLOAT16
    m0 = model(helper.make_graph(
        [helper.make_node("Add", ["X", "Y"], ["Z"]), helper.make_node("Reshape", ["Z", "C"], ["O"])],
        "sum", [helper.make_tensor_value_info("X", f32, (1, 2)),
                helper.make_tensor_value_info("Y", f32, (1, 2))],
        [helper.make_tensor_value_info("O", f32, (2,))],
        initializer=[numpy_helper.from_array(np.array([2], np.int64), "C")]))
    m1 = model(helper.make_graph(
        [helper.make_node("Concat", ["X", "C"], ["O"], axis=1)], "concat",
        [helper.make_tensor_value_info("X", f16, (1, 1))],
        [helper.make_tensor_value_info("O", f16, (1, 3))],
        initializer=[numpy_helper.from_array(np.array([[1.5, 2.0]], np.float16), "C")]))
    out = poprt_compile([ModelSpec(m0), ModelSpec(m1)], workdir, fuse=True,
                        popef_name="fused.popef")
    assert out.popef_path is not None
    return str(out.popef_path)


def run_demo(workdir: str, verbose: bool = False) -> int:
    import host_runtime as model_runtime
    from host_runtime import popef
    from tools.generate_simple_popef import write_simple_popef

    path = os.path.join(workdir, "simple_model.popef")
    write_simple_popef(path, shape=(1, 4))
    model = popef.load_model([path])
    td = model.tensorData("weights")
    assert td is not None, "the example model has no 'weights' tensor data"
    weights = np.frombuffer(td.data, dtype=np.float32).reshape(1, 4)
    print(f"Wrote the example model to {path}: tensor_C = tensor_A * weights + tensor_B")
    print(f"weights = {weights}")
    demo = _Demo(path, weights, verbose)

    config = model_runtime.ModelRunnerConfig()
    config.run_save_programs = True
    saved = np.zeros((1, 4), np.float32)
    save_view = model_runtime.OutputMemoryView()
    save_view["weights_saved"] = saved
    config.replica_to_save_programs_outputs = {0: save_view}
    print("Creating ModelRunner with", config)
    runner = model_runtime.ModelRunner(model_runtime.PopefPaths([path]), config=config)
    try:
        ins = runner.getExecuteInputs()
        outs = runner.getExecuteOutputs()
        print("execute inputs: ", ins)
        print("execute outputs:", outs)
        a, b = demo.inputs(ins[0].shape)
        want = demo.expect(a, b)
        view = model_runtime.InputMemoryView()
        view["tensor_A"] = a
        view["tensor_B"] = b
        numpy_in = {"tensor_A": a, "tensor_B": b}
        out_desc = outs[0]

        def sync_runner_allocated() -> None:
            result = runner.execute(view)
            got = np.frombuffer(result["tensor_C"], dtype=out_desc.numpy_data_type())
            _check(got.reshape(out_desc.shape), want, "tensor_C")

        def sync_user_allocated() -> None:
            out = np.zeros(out_desc.shape, out_desc.numpy_data_type())
            ov = model_runtime.OutputMemoryView()
            ov["tensor_C"] = out
            runner.execute(view, ov)
            _check(out, want, "tensor_C")

        def async_runner_allocated() -> None:
            fut = runner.executeAsync(view)
            fut.wait()
            got = np.frombuffer(fut["tensor_C"], dtype=out_desc.numpy_data_type())
            _check(got.reshape(out_desc.shape), want, "tensor_C")

        def async_user_allocated() -> None:
            out = np.zeros(out_desc.shape, out_desc.numpy_data_type())
            ov = model_runtime.OutputMemoryView()
            ov["tensor_C"] = out
            fut = runner.executeAsync(view, ov)
            fut.wait()
            _check(out, want, "tensor_C")

        def sync_numpy_runner_allocated() -> None:
            result = runner.execute(numpy_in)
            _check(result["tensor_C"], want, "tensor_C")

        def sync_numpy_user_allocated() -> None:
            out = {"tensor_C": np.zeros(out_desc.shape, np.float32)}
            runner.execute(numpy_in, out)
            _check(out["tensor_C"], want, "tensor_C")

        def async_numpy_runner_allocated() -> None:
            fut = runner.executeAsync(numpy_in)
            fut.wait()
            item = fut["tensor_C"]
            tensor = item.numpy()
            copy = np.array(item, copy=True)
            view_ = np.array(item, copy=False)
            if np.shares_memory(view_, copy) or np.shares_memory(tensor, copy) \
                    or np.shares_memory(tensor, view_):
                raise AssertionError("numpy() / copy=True must copy and copy=False must view")
            _check(tensor, want, "tensor_C")

        def async_numpy_user_allocated() -> None:
            out = {"tensor_C": np.zeros(out_desc.shape, np.float32)}
            fut = runner.executeAsync(numpy_in, out)
            fut.wait()
            item = fut["tensor_C"]
            if not (np.shares_memory(out["tensor_C"], item.numpy())
                    and np.shares_memory(out["tensor_C"], np.array(item, copy=False))):
                raise AssertionError("user-allocated results must share the user's memory")
            if np.shares_memory(out["tensor_C"], np.array(item, copy=True)):
                raise AssertionError("np.array(copy=True) must copy")
            _check(out["tensor_C"], want, "tensor_C")

        def batch_of_eight() -> None:
            a8, b8 = demo.inputs((8, 4))
            result = runner.execute({"tensor_A": a8, "tensor_B": b8})
            _check(result["tensor_C"], demo.expect(a8, b8), "tensor_C (batch 8)")

        demo.mode("sync, InputMemoryView, output allocated by ModelRunner", sync_runner_allocated)
        demo.mode("sync, InputMemoryView, output allocated by the user", sync_user_allocated)
        demo.mode("async, InputMemoryView, output allocated by ModelRunner", async_runner_allocated)
        demo.mode("async, InputMemoryView, output allocated by the user", async_user_allocated)
        demo.mode("sync, numpy dict, output allocated by ModelRunner", sync_numpy_runner_allocated)
        demo.mode("sync, numpy dict, output allocated by the user", sync_numpy_user_allocated)
        demo.mode("async, numpy dict, output allocated by ModelRunner (copy/view semantics)",
                  async_numpy_runner_allocated)
        demo.mode("async, numpy dict, output allocated by the user (shares memory)",
                  async_numpy_user_allocated)
        demo.mode("sync, batch of 8 (8 transfers of the model's batch 1)", batch_of_eight)

        def statistics() -> None:
            for _ in range(20):
                runner.execute(numpy_in)
            trace = runner.getTimeTrace({})
            mean = runner.getMonitoringStatisticsMean({})
            p99 = runner.getMonitoringStatisticsPercentile({}, 0.99)
            count = runner.getMonitoringStatisticsTotalCount({})
            for title, d in (("time trace of the last request", trace), ("mean", mean),
                             ("P99", p99), ("count", count)):
                print(f"      {title}:")
                for k, v in d.items():
                    print(f"        {k:52s} {v:12.1f}")
            if count["request_monitoring_statistics_count"] < 20:
                raise AssertionError(f"request count {count} < 20")

        demo.mode("monitoring statistics", statistics)
    finally:
        runner.close()

    def save_program() -> None:
        _check(saved, weights, "weights_saved (Save program on close)")

    demo.mode("Save program run on close (run_save_programs)", save_program)

    def frozen_inputs() -> None:
        frozen_b = demo.rng.standard_normal((1, 4)).astype(np.float32)
        cfg = model_runtime.ModelRunnerConfig()
        frozen = model_runtime.InputMemoryView()
        frozen["tensor_B"] = frozen_b
        cfg.frozen_inputs = frozen
        with model_runtime.ModelRunner(model, config=cfg) as r:
            names = [d.name for d in r.getExecuteInputs()]
            if names != ["tensor_A"]:
                raise AssertionError(f"execute inputs with tensor_B frozen: {names}")
            for _ in range(3):
                a1 = demo.rng.standard_normal((1, 4)).astype(np.float32)
                result = r.execute({"tensor_A": a1})
                _check(result["tensor_C"], demo.expect(a1, frozen_b), "tensor_C")

    demo.mode("frozen inputs (tensor_B frozen, popef.Model given)", frozen_inputs)

    def dynamic_batching() -> None:
        cfg = model_runtime.ModelRunnerConfig()
        cfg.batching_dim = 0
        with model_runtime.ModelRunner(path, config=cfg) as r:
            for n in (1, 3, 5):
                an, bn = demo.inputs((n, 4))
                result = r.execute({"tensor_A": an, "tensor_B": bn})
                _check(result["tensor_C"], demo.expect(an, bn), f"tensor_C (batch {n})")

    demo.mode("dynamic batch sizes 1, 3, 5 (batching_dim = 0)", dynamic_batching)

    def replication() -> None:
        cfg = model_runtime.ModelRunnerConfig()
        cfg.replication_factor = 2
        with model_runtime.ModelRunner(model_runtime.PopefPaths([path]), config=cfg) as r:
            for replica_id in range(2):
                a1, b1 = demo.inputs((1, 4))
                iv = model_runtime.InputMemoryView()
                iv["tensor_A"] = a1
                iv["tensor_B"] = b1
                result = r.execute(iv, replica_id=replica_id)
                got = np.frombuffer(result["tensor_C"], dtype=np.float32).reshape(1, 4)
                _check(got, demo.expect(a1, b1), f"tensor_C (replica {replica_id})")

    demo.mode("replication over 2 IPUs", replication)

    def multithreading() -> None:
        cfg = model_runtime.ModelRunnerConfig()
        cfg.thread_safe = True
        errors: list[str] = []
        with model_runtime.ModelRunner(path, config=cfg) as r:
            def worker(worker_id: int) -> None:
                rng = np.random.default_rng(100 + worker_id)
                try:
                    reqs = [(rng.standard_normal((1, 4)).astype(np.float32),
                             rng.standard_normal((1, 4)).astype(np.float32)) for _ in range(5)]
                    futures = [r.executeAsync({"tensor_A": x, "tensor_B": y}) for x, y in reqs]
                    for (x, y), fut in zip(reqs, futures):
                        fut.wait()
                        _check(fut["tensor_C"].numpy(), demo.expect(x, y), "tensor_C")
                except Exception as exc:  # collected and reported by the main thread
                    errors.append(f"worker {worker_id}: {exc}")
            threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            if errors:
                raise AssertionError("; ".join(errors))

    demo.mode("multithreading: 4 threads x 5 async requests (thread_safe)", multithreading)

    def conditional_execution() -> None:
        from host_runtime.poprt import Runner, RuntimeConfig

        fused = _write_fused_model(workdir)
        config = RuntimeConfig()
        config.timeout_ns = 0
        config.validate_io_params = False
        with Runner(fused, config) as runner:
            x = demo.rng.standard_normal((1, 2)).astype(np.float32)
            y = demo.rng.standard_normal((1, 2)).astype(np.float32)
            out0 = np.zeros(2, np.float32)
            runner.execute({"graph0/X": x, "graph0/Y": y}, {"graph0/O": out0})
            _check(out0, (x + y).reshape(2), "graph0/O")
            x1 = np.array([[0.5]], np.float16)
            out1 = np.zeros((1, 3), np.float16)
            runner.execute({"graph1/X": x1}, {"graph1/O": out1})
            _check(out1, np.array([[0.5, 1.5, 2.0]], np.float16), "graph1/O")

    demo.mode("conditional execution: two fused models, PopRT Runner fills 'index'",
              conditional_execution)

    def sharded() -> None:
        _sharded_mode(workdir, demo, pipelined=False)

    def pipelined() -> None:
        _sharded_mode(workdir, demo, pipelined=True)

    for label, fn in (("sharded", sharded), ("pipelined", pipelined)):
        demo.mode(f"{label} over 2 IPUs: an 8-layer MatMul/Relu chain, one IPU process per "
                  "part", fn)

    failed = [name for name, ok, _ in demo.results if not ok]
    print()
    print(f"{len(demo.results) - len(failed)} of {len(demo.results)} modes passed")
    if failed:
        print("FAILED: " + "; ".join(failed))
        return 1
    return 0


def _sharded_mode(workdir: str, demo: _Demo, pipelined: bool) -> None:
    """poprt --num_ipus 2 --manual_sharding_config ... [--enable_pipelining], then
    ModelRunner with 8 requests in flight, compared with onnxruntime in this process."""
    from host_runtime import ModelRunner
    from tools import poprt
    from ipu_emulator import safe_files
    from tools._chain_model import chain_model, reference, write_shard_yaml

    name = "pipelined" if pipelined else "sharded"
    folder = os.path.join(workdir, name)
    os.makedirs(folder, exist_ok=True)
    model = chain_model(8, width=64, batch=4, seed=5)
    safe_files.write_atomic(os.path.join(folder, "chain.onnx"), model.SerializeToString())
    shard = write_shard_yaml(os.path.join(folder, "shard.yaml"), 8, 2, pipelined)
    argv = ["--input_model", os.path.join(folder, "chain.onnx"), "--num_ipus", "2",
            "--manual_sharding_config", shard, "--batches_per_step", "2" if pipelined else "1",
            "--export_popef", "--output_dir", folder]
    if pipelined:
        argv.append("--enable_pipelining")
    import contextlib
    import io

    said = io.StringIO()
    with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
        rc = poprt.main(argv)
    if rc != 0:
        raise AssertionError(f"poprt refused the sharded model: {said.getvalue()}")
    with ModelRunner(os.path.join(folder, "executable.popef")) as runner:
        xs = [demo.rng.standard_normal((4, 64)).astype(np.float32) for _ in range(8)]
        futures = [runner.executeAsync({"x": x}) for x in xs]
        for x, f in zip(xs, futures):
            _check(f.result()["y"], reference(model, x), "y")
        pids = runner.device_pids(0)
        if len(set(pids)) != 2:
            raise AssertionError(f"expected 2 IPU processes, the device has {pids}")
        if demo.verbose:
            print(f"      {name}: IPU processes {pids}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="ipu-emulator demo",
        description="Write the seeds' example model and run it in every ModelRunner mode.")
    parser.add_argument("--dir", help="folder for the model (default: a temporary folder)")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="print tracebacks of failed modes")
    parser.add_argument("--trace", metavar="FILE",
                        help="record a timeline of the demo into FILE (docs/tracing.md)")
    args = parser.parse_args(argv)
    if not args.trace:
        return _run(args)
    from ipu_emulator import trace

    with trace.tracing(args.trace):
        code = _run(args)
    print(f"timeline written to {args.trace} (summary: ipu-emulator trace {args.trace})")
    return code


def _run(args: argparse.Namespace) -> int:
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
        return run_demo(args.dir, args.verbose)
    with tempfile.TemporaryDirectory(prefix="ipu-emulator-demo-") as tmp:
        return run_demo(tmp, args.verbose)


if __name__ == "__main__":
    sys.exit(main())
