"""The ``shared-machine`` scenario of ``ipu-emulator stress``, inside one host
(``tools._stress_host``): what another user of the machine can do to a running runner.

The host compiles a MatMul/Relu chain of its own (4 MiB of weights: its PopEF file is
read through a snapshot, ``host_runtime.popef.reader``) and runs it with ``auto_reset``
on one thread, while a second thread, in a seeded random order, every 50-250 ms:

- *truncates* the PopEF file in place (to a random length), then writes it back;
- *rewrites* a random span of it in place with random bytes, then writes it back
  (after a cut always, after a rewrite half the time, kills the IPU process while
  the file is changed);
- *fills* /dev/shm with a file of its own (``--shm-fill-mib`` at most, never past the
  room there is: to the last byte of a private tmpfs, see :func:`reexec_in_private_shm`)
  for a moment, then removes it (always: ``finally``);
- *kills* the runner's IPU process (SIGKILL), so that ``auto_reset`` loads the model
  again, from the snapshot, whatever the file holds now.

Every few requests the worker also makes a new runner from the file as it is then. Each
answer is counted: *right* (onnxruntime's value); *failed as expected* with a named
error: ``DeviceLostError`` (a kill), ``SharedMemoryFullError``/``ResourceLimitError``
(/dev/shm full while something was made), ``PopefError`` (a new runner of a file cut or
rewritten at that moment); *wrong* anything else. A crash (SIGBUS) ends the host without
a result and fails the scenario.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable

import numpy as np

from tools._stress_spec import HostSpec

__all__ = ["PRIVATE_SHM_ENV", "reexec_in_private_shm", "run_shared"]

PRIVATE_SHM_ENV = "STRESS_IN_PRIVATE_SHM"   # set inside the namespace (no re-exec)
_FILL_BLOCK = 1 << 20
_WIDTH, _LAYERS, _BATCH = 512, 4, 2      # 4 MiB of weights: over reader.MAP_MIN_BYTES


def reexec_in_private_shm(argv: list[str], mib: int) -> int | None:
    """Run this stress command again in a mount namespace of its own whose /dev/shm is a
    private tmpfs of ``mib`` MiB (so that the scenario fills a /dev/shm to its last byte
    that no other process of the machine uses); its exit code. None where that cannot be
    done (not root, no ``unshare``, already inside one): the caller runs as it is."""
    if os.environ.get(PRIVATE_SHM_ENV) or os.geteuid() != 0 or shutil.which("unshare") is None:
        return None
    env = dict(os.environ, **{PRIVATE_SHM_ENV: str(mib)})
    script = (f"mount -t tmpfs -o size={int(mib)}M,mode=1777 tmpfs /dev/shm && "
              'exec "$0" -m tools.stress "$@"')
    try:   # its output passes through this process (sys.stdout: captured where it is)
        proc = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script,
                               sys.executable, *argv], env=env, stdout=subprocess.PIPE,
                              text=True, timeout=None)
    except OSError:
        return None
    sys.stdout.write(proc.stdout)
    sys.stdout.flush()
    return proc.returncode


class _Changes:
    """The second thread (module docstring): changes the file and /dev/shm, and kills."""

    def __init__(self, path: str, pristine: bytes, pid_of: Callable[[], list[int]],
                 seed: int, fill_bytes: int) -> None:
        self.path, self.pristine, self.pid_of = path, pristine, pid_of
        self.rng = random.Random(seed)
        self.fill_bytes = fill_bytes
        self.counts = {"truncate": 0, "rewrite": 0, "fill": 0, "kill": 0}
        self.filled_to_last_byte = 0
        self.problems: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="stress-changes")

    def _run(self) -> None:
        while not self.stop.wait(self.rng.uniform(0.05, 0.25)):
            kind = self.rng.choice(sorted(self.counts))
            try:
                getattr(self, "_" + kind)()
                self.counts[kind] += 1
            except Exception as exc:  # noqa: BLE001 - a finding of the scenario
                self.problems.append(f"{kind}: {type(exc).__name__}: {exc}")

    def _restore(self) -> None:
        with open(self.path, "r+b") as f:   # in place, as the damage was
            f.write(self.pristine)
            f.truncate(len(self.pristine))

    def _while_changed(self, kill: float) -> None:
        """The file is changed: with probability ``kill`` the IPU process is killed now,
        so that ``auto_reset`` loads the model again while the file is as it is now."""
        if self.rng.random() < kill:
            self._kill()
            self.counts["kill"] += 1
        self.stop.wait(self.rng.uniform(0.1, 0.3))
        self._restore()

    def _truncate(self) -> None:
        os.truncate(self.path, self.rng.randrange(0, len(self.pristine)))
        self._while_changed(1.0)

    def _rewrite(self) -> None:
        at = self.rng.randrange(0, len(self.pristine) - 4096)
        with open(self.path, "r+b") as f:
            f.seek(at)
            f.write(os.urandom(self.rng.randrange(1, 4096)))
        self._while_changed(0.5)

    def _fill(self) -> None:
        path = f"/dev/shm/ipuemu_stress_fill_{os.getpid()}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            st = os.statvfs("/dev/shm")
            room = st.f_bavail * st.f_frsize
            block = b"\x5a" * _FILL_BLOCK
            written = 0
            while written < min(room, self.fill_bytes):   # bounded by both
                try:
                    written += os.write(fd, block[:min(_FILL_BLOCK, room - written)])
                except OSError:
                    break
            if os.statvfs("/dev/shm").f_bavail == 0:
                self.filled_to_last_byte += 1
            self.stop.wait(self.rng.uniform(0.05, 0.3))
        finally:
            os.close(fd)
            os.unlink(path)

    def _kill(self) -> None:
        for pid in self.pid_of():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _compile(folder: str, seed: int) -> tuple[str, Any]:
    from host_runtime.poprt.compiler import compile as poprt_compile
    from tools._chain_model import chain_model

    model = chain_model(_LAYERS, width=_WIDTH, batch=_BATCH, seed=seed)
    out = poprt_compile(model, folder, popef_name="shared.popef")
    assert out.popef_path is not None
    return str(out.popef_path), model


def run_shared(spec: HostSpec, tally: Any, seconds: float,
               budget: int | None) -> dict[str, Any]:
    """The scenario (module docstring) for ``seconds`` once its runner is made (or
    ``budget`` requests); counts into ``tally``; returns its figures."""
    import host_runtime as model_runtime
    from host_runtime.errors import (DeviceLostError, DeviceTimeoutError, PopefError,
                                     ResourceLimitError, SharedMemoryFullError)
    from tools._chain_model import reference

    expected = (DeviceLostError, DeviceTimeoutError, SharedMemoryFullError,
                ResourceLimitError, PopefError)
    folder = tempfile.mkdtemp(prefix="ipuemu-stress-shared-")
    seed = spec.seed
    try:
        path, model = _compile(folder, seed % 1000)
        with open(path, "rb") as f:
            pristine = f.read()
        rng = np.random.default_rng(seed)
        cfg = model_runtime.ModelRunnerConfig()
        cfg.auto_reset = True
        runner = model_runtime.ModelRunner(path, config=cfg)
        changes = _Changes(path, pristine, lambda: list(runner.device_pids(0)), seed,
                           int(spec.shm_fill_mib or 256) << 20)
        changes.thread.start()
        deadline = time.time() + seconds
        n = 0
        named: dict[str, int] = {}
        try:
            while time.time() < deadline and (budget is None or n < budget):
                n += 1
                x = rng.standard_normal((_BATCH, _WIDTH)).astype(np.float32)
                fresh = n % 10 == 0
                t0 = time.monotonic()
                try:
                    if fresh:   # a new runner of the file as it is now
                        with model_runtime.ModelRunner(path) as other:
                            got = other.execute({"x": x})["y"]
                    else:
                        got = runner.execute({"x": x})["y"]
                except expected as exc:
                    with tally.lock:
                        tally.expected += 1
                    named[type(exc).__name__] = named.get(type(exc).__name__, 0) + 1
                    continue
                except Exception as exc:  # noqa: BLE001 - counted
                    tally.problem("errors", f"request {n}: {type(exc).__name__}: {exc}")
                    continue
                took = time.monotonic() - t0
                if np.allclose(got, reference(model, x), rtol=1e-4, atol=1e-5):
                    with tally.lock:
                        tally.ok += 1
                        tally.latencies.append(took)
                        tally.latency_sum += took
                else:
                    tally.problem("wrong", f"request {n}: the answer differs from onnxruntime's")
        finally:
            changes.stop.set()
            changes.thread.join(10)
            runner.close()
        for p in changes.problems[:10]:
            tally.problem("errors", f"changes: {p}")
        return {"injected": sum(changes.counts.values()), "changes": changes.counts,
                "filled_to_last_byte": changes.filled_to_last_byte,
                "named_errors": named}
    finally:
        shutil.rmtree(folder, ignore_errors=True)
