"""The private machine of ``ipu-emulator stress``: home, shm tag, models, daemon, processes.

Everything the harness starts is tracked here: host processes (fresh Pythons
through ``subprocess``, never fork), the IPU processes they or the daemon start
(seen by a scanner thread walking our descendants), and the daemon. ``finish``
stops what is left, then reports any process still alive and any /dev/shm
object of the run's tag as a leak (and removes it).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from tools._stress_spec import HostSpec, ModelPaths, encode

REPO = Path(__file__).resolve().parents[1]
_DAEMON_ENV = "IPU_EMULATOR_DAEMON"
_PROGRESS_FIELDS = ("ok", "expected", "wrong", "hung", "errors", "cycles", "latency_s")


def write_models(directory: Path, seed: int) -> ModelPaths:
    """The example model (random weights), a batch-4 example model whose weight rows are
    equal (a sample's value does not depend on its row in a dynamic batch) and the fused
    model of the demo."""
    from host_runtime.poprt.compiler import write_popef
    from ipu_emulator.compiler import CompileOptions, ModelSpec, compile_onnx
    from onnx import numpy_helper

    from tools.demo import _write_fused_model
    from tools.generate_simple_popef import build_simple_model, write_simple_popef

    model = str(directory / "simple.popef")
    # 4 KiB tensors: large enough to travel in place from empty_shared (SHARED_MIN_BYTES)
    write_simple_popef(model, shape=(4, 256), seed=seed)
    onnx_model = build_simple_model((4, 3), seed=seed + 1)
    init = onnx_model.graph.initializer[0]
    rows = numpy_helper.to_array(init)
    init.CopyFrom(numpy_helper.from_array(
        rows[:1].repeat(rows.shape[0], axis=0).copy(), init.name))
    result = compile_onnx(ModelSpec(onnx_model), CompileOptions(
        name="simple_model", weights_as_tensor_data=True, save_weights=True))
    batch = str(directory / "batch4.popef")
    write_popef(result, batch)
    fused_dir = directory / "fused"
    fused_dir.mkdir(exist_ok=True)
    pipeline_model, pipeline_onnx = _write_pipeline_model(directory, seed)
    return ModelPaths(model=model, batch_model=batch,
                      fused_model=_write_fused_model(str(fused_dir)),
                      pipeline_model=pipeline_model, pipeline_onnx=pipeline_onnx)


def _write_pipeline_model(directory: Path, seed: int) -> tuple[str, str]:
    """A MatMul/Relu chain pipelined over 2 IPUs (the kill-pipeline scenario), and its ONNX
    model (the hosts compute the expected values with onnxruntime). Its second half reuses
    the first half's weights, as PopEF tensor data (IPU 0's Load program forwards them to
    IPU 1), and IPU 0 streams the tensor between the halves to IPU 1 and to the host."""
    import onnx

    from host_runtime.poprt.compiler import compile as poprt_compile
    from tools._chain_model import chain_model, shard_config

    model = chain_model(4, width=64, batch=4, seed=seed + 2, fanout=True)
    onnx_path = str(directory / "chain.onnx")
    onnx.save(model, onnx_path)
    sharding, stages = shard_config(4, 2, pipelined=True)
    out = poprt_compile(model, directory, popef_name="pipeline.popef", num_ipus=2,
                        sharding_info=sharding, pipelining_info=stages, enable_pipelining=True,
                        batches_per_step=2, weights_as_tensor_data=True)
    return str(out.popef_path), onnx_path


@dataclass
class HostProc:
    """One host process of a scenario."""
    index: int
    proc: subprocess.Popen[str]
    result_path: Path
    stderr_path: Path
    ready: threading.Event = field(default_factory=threading.Event)
    quiesce: threading.Event = field(default_factory=threading.Event)
    deadline: float = 0.0
    killed: bool = False
    ipu_pids: list[int] = field(default_factory=list)
    progress: dict[str, float] = field(default_factory=dict)   # its last PROGRESS line

    def result(self) -> dict[str, Any] | None:
        try:
            with open(self.result_path) as f:
                data: dict[str, Any] = json.load(f)
                return data
        except (OSError, ValueError):
            return None

    def go(self) -> None:
        """Tell a quiesced host that no more faults come."""
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write("GO\n")
            self.proc.stdin.flush()
        except (OSError, ValueError):
            pass

    def stderr_tail(self, lines: int = 8) -> str:
        try:
            text = self.stderr_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return "\n".join(text[-lines:])


class Rig:
    """A private emulated machine: IPU_EMULATOR_HOME, shm tag, optional daemon."""

    def __init__(self, num_ipus: int, seed: int, keep: bool = False) -> None:
        self.workdir = Path(tempfile.mkdtemp(prefix="ipuemu-stress-"))
        self.tag = "s" + secrets.token_hex(4)
        self.keep = keep
        self.num_ipus = num_ipus
        self.env = dict(os.environ, IPU_EMULATOR_HOME=str(self.workdir / "home"),
                        IPU_EMULATOR_SHM_TAG=self.tag, IPU_EMULATOR_NUM_IPUS=str(num_ipus))
        self.env.pop(_DAEMON_ENV, None)
        self.env.pop("IPU_EMULATOR_CONFIG", None)
        self.env["PYTHONPATH"] = os.pathsep.join(
            [str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
        self.seed = seed
        self.models = ModelPaths()   # refresh_models compiles them
        self.daemon: subprocess.Popen[str] | None = None
        self.daemon_socket: str | None = None
        self.daemon_lines: list[str] = []
        self._seen: dict[int, float] = {}       # pid -> create_time of every descendant
        self._seen_lock = threading.Lock()
        self._roots: list[subprocess.Popen[str]] = []
        self._stop = threading.Event()
        self._scanner = threading.Thread(target=self._scan, daemon=True, name="stress-scan")
        self._scanner.start()
        self._host_count = 0
        self._daemons = 0

    def refresh_models(self, name: str) -> ModelPaths:
        """Compile the models afresh (for each scenario: a PopEF file carries the package hash
        of the sources that compiled it, and a development tree may change under a long run)."""
        directory = self.workdir / f"models-{name}"
        directory.mkdir(exist_ok=True)
        self.models = write_models(directory, self.seed)
        return self.models

    # ------------------------------------------------------------------ processes
    def _scan(self) -> None:
        while not self._stop.is_set():
            self.scan_once()
            self._stop.wait(0.1)

    def adopt(self, proc: subprocess.Popen[str]) -> None:
        """Track ``proc`` and every process it starts (never other children of ours)."""
        with self._seen_lock:
            self._roots.append(proc)
        self.scan_once()

    def scan_once(self) -> None:
        """Record the processes our roots (hosts, daemon) and their descendants run now."""
        with self._seen_lock:
            roots = [r for r in self._roots if r.poll() is None]
        for root in roots:
            try:
                p = psutil.Process(root.pid)
                procs = [p] + p.children(recursive=True)
            except psutil.Error:
                continue
            with self._seen_lock:
                for k in procs:
                    try:
                        self._seen.setdefault(k.pid, k.create_time())
                    except psutil.Error:
                        pass

    def ipu_processes_of(self, pid: int) -> list[psutil.Process]:
        """IPU processes started by ``pid`` (a host or the daemon): its children running
        ``python -m ipu_emulator``, or those its template process forked (with the template:
        it must go too)."""
        try:
            kids = psutil.Process(pid).children()
        except psutil.Error:
            return []
        found = []
        for k in kids:
            try:
                cmd = " ".join(k.cmdline())   # a title (ipu_emulator.titles) or argv
                if "ipu_emulator.ipu.forkserver" in cmd or "ipu-emulator: fork server" in cmd:
                    found += k.children()
                if "ipu_emulator" in cmd or cmd.startswith("ipu-emulator: "):
                    found.append(k)
            except psutil.Error:
                pass
        return found

    def alive(self, pid: int) -> bool:
        """``pid`` is a process this run started and it has not exited."""
        with self._seen_lock:
            created = self._seen.get(pid)
        try:
            p = psutil.Process(pid)
            return p.status() != psutil.STATUS_ZOMBIE and (
                created is None or abs(p.create_time() - created) < 0.01)
        except psutil.Error:
            return False

    def start_host(self, spec: HostSpec) -> HostProc:
        self._host_count += 1
        n = self._host_count
        spec_path = self.workdir / f"host{n}.json"
        spec_path.write_text(encode(spec))
        result_path = self.workdir / f"host{n}.result.json"
        stderr_path = self.workdir / f"host{n}.stderr"
        env = dict(self.env)
        if spec.daemon_socket:
            env[_DAEMON_ENV] = spec.daemon_socket
        with open(stderr_path, "w") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tools._stress_host", str(spec_path), str(result_path)],
                cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=err, text=True)
        host = HostProc(n, proc, result_path, stderr_path)
        threading.Thread(target=self._read_host, args=(host,), daemon=True).start()
        self.adopt(proc)
        return host

    @staticmethod
    def _read_host(host: HostProc) -> None:
        assert host.proc.stdout is not None
        for line in host.proc.stdout:
            words = line.split()
            if words[:1] == ["READY"]:
                host.deadline = float(words[1])
                host.ready.set()
            elif words[:1] == ["QUIESCE"]:
                host.quiesce.set()
            elif words[:1] == ["PROGRESS"] and len(words) == 1 + len(_PROGRESS_FIELDS):
                try:
                    host.progress = dict(zip(_PROGRESS_FIELDS, map(float, words[1:])))
                except ValueError:
                    pass
        host.ready.set()
        host.quiesce.set()

    def kill_all(self) -> None:
        """SIGKILL every host still running (an interrupted run); the daemon stops in finish."""
        with self._seen_lock:
            roots = [r for r in self._roots if r is not self.daemon and r.poll() is None]
        for r in roots:
            r.kill()
            r.wait()

    # ------------------------------------------------------------------ daemon
    def start_daemon(self, num_ipus: int) -> str:
        """Start a private daemon of ``num_ipus`` IPUs; return its socket."""
        self._daemons += 1
        sock = str(self.workdir / f"daemon{self._daemons}.sock")
        self.daemon_lines = []
        env = dict(self.env, IPU_EMULATOR_DAEMON_LOG_LEVEL="INFO")
        self.daemon = subprocess.Popen(
            [sys.executable, "-m", "tools.cli", "daemon", "--socket", sock,
             "--num-ipus", str(num_ipus)], cwd=REPO, env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        ready = threading.Event()

        def read() -> None:
            assert self.daemon is not None and self.daemon.stderr is not None
            for line in self.daemon.stderr:
                self.daemon_lines.append(line.rstrip("\n"))
                if " serving " in line:
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        self.adopt(self.daemon)
        if not ready.wait(180) or self.daemon.poll() is not None:
            raise RuntimeError("the stress daemon did not start:\n"
                               + "\n".join(self.daemon_lines[-10:]))
        self.daemon_socket = sock
        return sock

    def stop_daemon(self) -> list[str]:
        """SIGTERM the daemon; problems if it does not exit 0 within 60 s."""
        problems: list[str] = []
        self.daemon_socket = None
        if self.daemon is None or self.daemon.poll() is not None:
            return problems
        self.daemon.send_signal(signal.SIGTERM)
        try:
            code = self.daemon.wait(60)
        except subprocess.TimeoutExpired:
            self.daemon.kill()
            code = self.daemon.wait()
            problems.append("leak: the daemon did not exit within 60 s of SIGTERM")
        if code != 0:
            problems.append(f"the daemon exited with code {code}: "
                            + " | ".join(self.daemon_lines[-3:]))
        return problems

    # ------------------------------------------------------------------ leaks
    def shm_objects(self, pids: set[int] | None = None) -> list[str]:
        from shm.cleanup import list_objects

        if pids is None:     # every entry of the tag, even one whose name does not parse
            try:
                return sorted(n for n in os.listdir("/dev/shm") if f"ipuemu_{self.tag}_" in n)
            except FileNotFoundError:
                return []
        return [o.entry for o in list_objects(self.tag) if o.pid in pids]

    def wait_gone(self, pids: set[int], timeout: float) -> tuple[list[int], list[str]]:
        """Wait until none of ``pids`` is alive and /dev/shm holds nothing they created."""
        end = time.monotonic() + timeout
        while True:
            live = sorted(p for p in pids if self.alive(p))
            objs = self.shm_objects(pids)
            if (not live and not objs) or time.monotonic() > end:
                return live, objs
            time.sleep(0.05)

    def finish(self, grace: float = 30.0) -> list[str]:
        """Stop everything; return leak problems (processes alive, objects left) after
        waiting up to ``grace`` seconds for our processes to exit."""
        self.scan_once()
        problems = self.stop_daemon()
        self._stop.set()
        self._scanner.join(5)
        with self._seen_lock:
            seen = dict(self._seen)
        live, objs = self.wait_gone(set(seen), grace)
        for pid in live:
            problems.append(f"leak: process {pid} started by the run is still alive; killed")
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for entry in self.shm_objects():
            problems.append(f"leak: /dev/shm/{entry} left behind; removed")
            try:
                os.unlink(os.path.join("/dev/shm", entry))
            except OSError:
                pass
        if not self.keep:
            shutil.rmtree(self.workdir, ignore_errors=True)
        return problems
