"""``poprt_exec [poprt_run_popef] --popef PATH [options]``: run a PopEF file from the shell.

PopRT's command, on emulated IPUs, through ``host_runtime.poprt.runtime``::

    poprt_exec poprt_run_popef --popef model.popef                        # Runner
    poprt_exec poprt_run_popef --popef model.popef --runner lightRunner
    poprt_exec poprt_run_popef --popef fused.popef --iteration 1000 --numThreads 1 --index 0
    poprt_exec poprt_run_popef --popef pack.popef --runner packRunner --numThreads 12 \\
        --maxValidNum 10 --packTimeout 2000 --dynamicInputName input_ids \\
        --maskName attention_mask --batchSize 1

Options: ``--runner`` modelRunner (default), lightRunner, hostConcatRunner or
packRunner; ``--iteration`` requests per thread (default 1); ``--numThreads`` client
threads (default 1); ``--index`` the sub-graph of a fused model (its inputs only,
``index`` given as uint32; on an MFConverter model compiled without
``enable_model_fusion`` the other sub-graphs' inputs are zeros); ``--input NAME=FILE.npy`` input data (repeatable; other
inputs are random, fixed seed); ``--batchSize`` samples per request (a Runner with a
smaller batch than the model's batches dynamically along dimension 0; a packRunner
request is one sequence of 1..S tokens, ``--batchSize`` of them per client call);
``--maxValidNum``, ``--packTimeout`` (microseconds), ``--dynamicInputName``,
``--maskName`` (packRunner, single-row mode); ``--saveOutputs DIR`` writes the last
request's outputs as ``NAME.npy``; ``--timeoutNs`` the runner's ``timeout_ns``.

Prints the runner, the requests run, the wall time and the throughput. Exit status
0 on success, 1 when a request fails, 2 on bad arguments or an unreadable model.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

from host_runtime.errors import ModelRuntimeError
from host_runtime.poprt import runtime
from ipu_emulator import safe_files

__all__ = ["main"]

RUNNERS = ("modelRunner", "lightRunner", "hostConcatRunner", "packRunner")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="poprt_exec", description="Run a PopEF file (PopRT).")
    p.add_argument("tool", nargs="?", default="poprt_run_popef", choices=["poprt_run_popef"],
                   help="the tool to run (poprt_run_popef)")
    p.add_argument("--popef", required=True, help="the PopEF file")
    p.add_argument("--runner", default="modelRunner", choices=RUNNERS)
    p.add_argument("--iteration", type=int, default=1, help="requests per thread")
    p.add_argument("--numThreads", type=int, default=1, help="client threads")
    p.add_argument("--index", type=int, default=None, help="sub-graph of a fused model")
    p.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy")
    p.add_argument("--batchSize", type=int, default=0, help="samples per request")
    p.add_argument("--maxValidNum", type=int, default=0)
    p.add_argument("--packTimeout", type=int, default=0, help="microseconds")
    p.add_argument("--dynamicInputName", default="")
    p.add_argument("--maskName", default="")
    p.add_argument("--timeoutNs", type=int, default=None)
    p.add_argument("--saveOutputs", default=None, metavar="DIR")
    return p


def _given(items: list[str]) -> dict[str, np.ndarray]:
    out = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"poprt_exec: --input expects NAME=FILE.npy, got {item!r}")
        try:
            with safe_files.open_regular(path) as f:   # a FIFO there is refused, not waited on
                out[name] = np.load(f, allow_pickle=False)
        except (OSError, ValueError) as exc:
            why = f"{exc.strerror}" if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise SystemExit(f"poprt_exec: --input {name}={path}: {why}; expected a .npy "
                             "file of numbers") from None
    return out


def _random(shape: Sequence[int], dtype: np.dtype, rng: np.random.Generator) -> np.ndarray:
    if dtype.kind == "f":
        return rng.uniform(0, 1, tuple(shape)).astype(dtype)
    if dtype.kind == "b":
        return rng.integers(0, 2, tuple(shape)).astype(dtype)
    return rng.integers(0, 2, tuple(shape)).astype(dtype)


def _compiled_fused(path: str) -> bool:
    """Whether the PopEF file was compiled with model fusion (one Main per sub-graph)."""
    from host_runtime import popef
    return bool(popef.load_model([path]).metadata.subgraphs())


def _make_runner(args: argparse.Namespace) -> Any:
    cfg: Any
    if args.runner == "packRunner":
        cfg = runtime.PackRunnerConfig(timeout_microseconds=args.packTimeout,
                                       max_valid_num=args.maxValidNum,
                                       dynamic_input_name=args.dynamicInputName)
        if args.maskName:
            cfg.enable_input_single_row_mode(args.maskName)
        return runtime.Runner(args.popef, cfg)
    if args.runner == "lightRunner":
        cfg = runtime.LightRunnerConfig()
        kind: Callable[..., Any] = runtime.LightRunner
    elif args.runner == "hostConcatRunner":
        cfg = runtime.HostConcatRunnerConfig()
        kind = runtime.HostConcatRunner
    else:
        cfg = runtime.RuntimeConfig()
        kind = runtime.Runner
    if args.timeoutNs is not None:
        cfg.timeout_ns = args.timeoutNs
    if args.index is not None:
        cfg.validate_io_params = False
    if args.batchSize and args.runner == "modelRunner":
        cfg.batching_dim = 0
    return kind(args.popef, cfg)


def _requests(runner: Any, args: argparse.Namespace, given: dict[str, np.ndarray]
              ) -> Callable[[np.random.Generator], tuple[dict[str, Any], dict[str, Any]]]:
    """A function making one request's (inputs, outputs)."""
    ins = runner.get_execute_inputs()
    outs = runner.get_execute_outputs()
    zeros: list[Any] = []
    if args.index is not None:
        prefix = f"graph{args.index}/"
        if not _compiled_fused(args.popef):
            # an MFConverter model compiled as one graph runs every sub-graph: the
            # others' inputs are zeros, their outputs are not read
            zeros = [d for d in ins if not d.name.startswith(prefix) and d.name != "index"]
        ins = [d for d in ins if d.name.startswith(prefix)]
        outs = [d for d in outs if d.name.startswith(prefix)]
    if isinstance(runner, runtime.PackRunner):
        seq = ins[0].shape[1]

        def packed(rng: np.random.Generator) -> tuple[dict[str, Any], dict[str, Any]]:
            n = int(rng.integers(1, seq + 1))
            x = {d.name: given.get(d.name, _random([n, *d.shape[2:]], d.numpy_data_type(), rng))
                 for d in ins if d.name != "unpack_info"}
            if args.maskName:
                x[args.maskName] = np.ones(n, x[args.maskName].dtype)
            y = {d.name: np.zeros(d.shape[1:], d.numpy_data_type()) for d in outs}
            return x, y
        return packed

    def shape(d: Any) -> list[int]:
        return [args.batchSize, *d.shape[1:]] if args.batchSize and d.shape else d.shape

    def plain(rng: np.random.Generator) -> tuple[dict[str, Any], dict[str, Any]]:
        x = {d.name: given.get(d.name, _random(shape(d), d.numpy_data_type(), rng)) for d in ins}
        if args.index is not None:
            x["index"] = np.array([args.index], np.uint32)
            x.update({d.name: np.zeros(shape(d), d.numpy_data_type()) for d in zeros})
        y = {d.name: np.zeros(shape(d), d.numpy_data_type()) for d in outs}
        return x, y
    return plain


def _run(runner: Any, make: Callable[..., Any], args: argparse.Namespace
         ) -> tuple[int, list[BaseException], dict[str, Any]]:
    errors: list[BaseException] = []
    last: dict[str, Any] = {}
    done = [0]
    lock = threading.Lock()
    per_call = max(args.batchSize, 1) if isinstance(runner, runtime.PackRunner) else 1

    def client(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(args.iteration):
            reqs = [make(rng) for _ in range(per_call)]
            try:
                futures = [runner.execute_async(x, y) for x, y in reqs]
                for f in futures:
                    f.wait()
                    if hasattr(f, "result"):
                        f.result()
            except (ModelRuntimeError, TimeoutError) as exc:
                with lock:
                    errors.append(exc)
                return
            with lock:
                done[0] += len(reqs)
                last.update(reqs[-1][1])
    threads = [threading.Thread(target=client, args=(k,)) for k in range(args.numThreads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return done[0], errors, last


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.iteration < 1 or args.numThreads < 1 or args.batchSize < 0:
        print("poprt_exec: --iteration and --numThreads must be >= 1, --batchSize >= 0",
              file=sys.stderr)
        return 2
    try:
        given = _given(args.input)
        runner = _make_runner(args)
    except (ModelRuntimeError, OSError, ValueError) as exc:
        print(f"poprt_exec: {exc}", file=sys.stderr)
        return 2
    try:
        make = _requests(runner, args, given)
        t0 = time.perf_counter()
        count, errors, last = _run(runner, make, args)
        wall = time.perf_counter() - t0
    finally:
        runner.close()
    print(f"runner: {type(runner).__name__}  popef: {args.popef}")
    print(f"requests: {count} ({args.numThreads} thread(s) x {args.iteration} iteration(s))")
    print(f"wall time: {wall:.3f} s  throughput: {count / wall if wall else 0:.1f} requests/s")
    if args.saveOutputs and last:
        os.makedirs(args.saveOutputs, exist_ok=True)
        for name, arr in last.items():   # replaced whole, never written through a link
            with safe_files.AtomicFile(os.path.join(
                    args.saveOutputs, name.replace("/", "_") + ".npy")) as f:
                np.save(f, arr)
    if errors:
        print(f"poprt_exec: {len(errors)} client(s) failed: {errors[0]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
