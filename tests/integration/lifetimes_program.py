"""A program that drops what it made without close(), with the garbage collector off.

``python -m tests.integration.lifetimes_program MODEL SCENARIO...`` runs the scenarios
one after the other in a fresh interpreter (its own machine and shared-memory tag come
from the environment) and prints one JSON line: for each scenario, what was left after
each drop. Run by ``tests/integration/test_lifetimes.py``.

Before each scenario the collector is run once (what importing and the scenarios before
left is not this one's), then disabled and set to keep what it would free
(``DEBUG_SAVEALL``), so that ``gc.collect()`` at the scenario's end counts every reference
cycle it made: it must find none.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
import threading
from datetime import timedelta
from typing import Any, Callable

import numpy as np
import psutil

import host_runtime as model_runtime
# Imported up front: a module imported lazily during a scenario would leave its
# import-time garbage (a dataclass with slots= replaces its class) to be counted.
import host_runtime.runner._replica  # noqa: F401
import host_runtime.runner._model_runner  # noqa: F401
import host_runtime.poprt  # noqa: F401
import host_runtime.queues._queues  # noqa: F401
import host_runtime.session._session  # noqa: F401
from tools.generate_simple_popef import write_simple_popef
from host_runtime.devices._manager import DeviceManager, DeviceWaitConfig
from host_runtime.errors import BadRequestError, DeviceUnavailableError

TAG = os.environ["IPU_EMULATOR_SHM_TAG"]
SHAPE = (1, 4)


def shm_objects() -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if f"ipuemu_{TAG}_" in n)


def ipu_processes() -> list[int]:
    """Live IPU processes of this host: its children, or the children of its fork-server
    template (ipu_emulator.ipu.forkserver, a long-lived helper that is not an IPU process)."""
    me = psutil.Process()
    templates = set()
    for p in me.children():
        try:
            cmd = " ".join(p.cmdline())   # its title, or its argv before it set one
            if "ipu_emulator.ipu.forkserver" in cmd or cmd.startswith("ipu-emulator: fork server"):
                templates.add(p.pid)
        except psutil.Error:
            pass
    return sorted(p.pid for p in me.children(recursive=True)
                  if p.pid not in templates and p.status() != psutil.STATUS_ZOMBIE)


def threads() -> list[str]:
    # the fork-server template's reader lives as long as the template (the host's helper);
    # an event thread whose link ended waits for the next link, holding nothing of it
    # (host_runtime.devices._event_threads): one still serving a link is named by it
    return sorted(t.name for t in threading.enumerate()
                  if t is not threading.main_thread()
                  and t.name not in ("ipu-template-reader", "ipu-events-idle"))


class Probe:
    """What a drop must give back: shared memory, IPU processes, threads."""

    def __init__(self) -> None:
        self.shm = shm_objects()
        self.leaks: list[str] = []

    def check(self, what: str) -> None:
        """Right after a drop (no waiting): everything is back."""
        left = sorted(set(shm_objects()) - set(self.shm))
        if left:
            self.leaks.append(f"{what}: /dev/shm still holds {left}")
        procs = ipu_processes()
        if procs:
            self.leaks.append(f"{what}: IPU processes still running: {procs}")
        # A thread may take a moment to finish (bounded: it was told to, not timed out).
        for t in threading.enumerate():
            if t is not threading.main_thread():
                t.join(0.1)
        names = threads()
        if names:
            self.leaks.append(f"{what}: threads still running: {names}")


def feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {"tensor_A": rng.standard_normal(SHAPE).astype(np.float32),
            "tensor_B": rng.standard_normal(SHAPE).astype(np.float32)}


def expected(model: model_runtime.popef.Model, x: dict[str, np.ndarray]) -> np.ndarray:
    w = np.frombuffer(model.tensorData("weights").data, np.float32).reshape(SHAPE)
    return x["tensor_A"] * w + x["tensor_B"]


def run_once(path: str) -> np.ndarray:
    r = model_runtime.ModelRunner(path)
    x = feeds()
    out = r.execute(x)["tensor_C"]
    assert np.allclose(out, expected(r.model, x), rtol=1e-6), out
    return out  # r is dropped when the function returns


def kill_ipu(runner: model_runtime.ModelRunner) -> None:
    dev = runner._replicas[0].session.device()
    for pid in dev.pids():
        os.kill(pid, signal.SIGKILL)
    for p in dev._processes:
        p.wait_exit(10.0)


# -- scenarios ----------------------------------------------------------------------------

def runners(path: str, probe: Probe) -> None:
    """Twelve runners dropped without close(), then one made and dropped in a function."""
    x = feeds()
    for i in range(12):
        r = model_runtime.ModelRunner(path)
        out = r.execute(x)["tensor_C"]
        want = expected(r.model, x)
        del r
        probe.check(f"runner {i}")
        # the result outlives the runner
        assert np.allclose(out, want, rtol=1e-6), out
    out = run_once(path)
    probe.check("runner dropped when its function returned")
    assert out.shape == SHAPE


def killed(path: str, probe: Probe) -> None:
    """A runner whose IPU process was SIGKILLed, with and without auto_reset."""
    r = model_runtime.ModelRunner(path)
    r.execute(feeds())
    kill_ipu(r)
    del r
    probe.check("runner whose IPU process was killed")

    r = model_runtime.ModelRunner(path)
    r.execute(feeds())
    kill_ipu(r)
    for _ in range(2):   # the loss, then the runner's refusal to go on
        try:
            r.execute(feeds())
        except model_runtime.DeviceLostError:
            pass
        else:
            probe.leaks.append("a request to a killed device should fail")
    del r
    probe.check("runner that reported its killed IPU process")

    cfg = model_runtime.ModelRunnerConfig(auto_reset=True)
    r = model_runtime.ModelRunner(path, config=cfg)
    x = feeds()
    r.execute(x)
    kill_ipu(r)
    del r
    probe.check("auto_reset runner whose IPU process was killed")

    r = model_runtime.ModelRunner(path, config=cfg)
    r.execute(x)
    kill_ipu(r)
    out = r.execute(x)["tensor_C"]    # restarted on a fresh device
    assert np.allclose(out, expected(r.model, x), rtol=1e-6), out
    del r
    probe.check("auto_reset runner restarted after its IPU process was killed")


def hung(path: str, probe: Probe) -> None:
    """A runner and a session whose IPU process hangs (SIGSTOP): dropping them does not
    wait on the device for long; it kills the processes and frees everything."""
    from host_runtime.session._session import Session

    r = model_runtime.ModelRunner(path)
    r.execute(feeds())
    for pid in r._replicas[0].session.device().pids():
        os.kill(pid, signal.SIGSTOP)
    del r
    probe.check("runner whose IPU process hung")

    s = Session(path)
    for name in ("tensor_A", "tensor_B", "tensor_C"):
        s.direct.claim(name)
    loop = s.direct.start_main_loop()
    dev = s.device()
    assert dev is not None
    pids = dev.pids()
    del dev
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    del s
    probe.check("session whose IPU process hung")
    if not loop.done():
        probe.leaks.append("the main loop of a dropped session on a hung device did not end")


def device_error(path: str, probe: Probe) -> None:
    """Runners whose device program failed (onnxruntime raised on the device), with and
    without auto_reset: the errors they keep make no reference cycle."""
    gather = os.path.join(os.environ["IPU_EMULATOR_HOME"], "gather.popef")
    for auto_reset in (False, True):
        cfg = model_runtime.ModelRunnerConfig(auto_reset=auto_reset)
        r = model_runtime.ModelRunner(gather, config=cfg)
        errors = []
        for idx in (7, 1):      # out of range: the device fails; then a good request
            try:
                r.execute({"idx": np.array([idx], np.int64)})
            except model_runtime.ModelRuntimeError as exc:
                errors.append(type(exc).__name__)
        if not errors:
            probe.leaks.append("the out-of-range gather should have failed on the device")
        del r, cfg, errors
        probe.check(f"runner after a device program error (auto_reset={auto_reset})")


def sharded(path: str, probe: Probe) -> None:
    """A model sharded over two IPUs (two IPU processes, IPU-Link rings), dropped."""
    chain = os.path.join(os.environ["IPU_EMULATOR_HOME"], "out", "executable.popef")
    x = {"x": np.ones((2, 32), np.float32)}
    r = model_runtime.ModelRunner(chain)
    r.execute(x)
    del r
    probe.check("runner of a model sharded over two IPUs")
    r = model_runtime.ModelRunner(chain)
    fut = r.executeAsync(x)
    fut.wait()
    del r
    probe.check("runner of a sharded model, its result still referenced")
    assert fut["y"].shape == (2, 32)
    del fut


def _compile_chain(home: str) -> None:
    import onnx

    from tools import poprt
    from tools._chain_model import chain_model, write_shard_yaml

    onnx.save(chain_model(8, width=32, batch=2, seed=7), os.path.join(home, "chain.onnx"))
    shard = write_shard_yaml(os.path.join(home, "shard.yaml"), 8, 2, False)
    argv = ["--input_model", os.path.join(home, "chain.onnx"), "--num_ipus", "2",
            "--manual_sharding_config", shard, "--export_popef",
            "--output_dir", os.path.join(home, "out")]
    assert poprt.main(argv) == 0


def failing_constructor(path: str, probe: Probe) -> None:
    """Constructors that fail half-way release every IPU they attached."""
    dm = DeviceManager()
    held = [dm.getDevice(1) for _ in range(3)]    # IPUs 0-2 held: one IPU free
    detached = held[0]
    detached.close()
    held[0] = dm.getDevice(1)                      # still one free
    cfg = model_runtime.ModelRunnerConfig(replication_factor=2,
                                          replica_to_device={1: detached})
    # replica 0 attaches the free IPU and starts; replica 1's device is detached and no
    # other IPU is free: the constructor fails after replica 0 is running
    try:
        model_runtime.ModelRunner(path, config=cfg)
    except DeviceUnavailableError:
        pass
    else:
        raise AssertionError("the constructor should have failed")
    last = dm.tryGetDevice(1)
    if last is None:
        probe.leaks.append("the IPU the failed constructor attached was not released")
    del last, held, detached, cfg
    probe.check("failed constructor (replica 1 had no IPU)")

    cfg = model_runtime.ModelRunnerConfig(replication_factor=5)
    try:
        model_runtime.ModelRunner(path, config=cfg)
    except DeviceUnavailableError:
        pass
    del cfg
    probe.check("failed constructor (replication_factor larger than the machine)")

    cfg = model_runtime.ModelRunnerConfig(frozen_inputs={"tensor_B": np.zeros((3, 3))})
    try:
        model_runtime.ModelRunner(path, config=cfg)
    except BadRequestError:
        pass
    else:
        raise AssertionError("a bad frozen input should be refused")
    del cfg
    probe.check("failed constructor (bad frozen input)")


def futures(path: str, probe: Probe) -> None:
    """Results of executeAsync stay valid after the runner is dropped."""
    r = model_runtime.ModelRunner(path)
    x = feeds()
    want = expected(r.model, x)
    fut = r.executeAsync(x)
    fut.wait()
    view = model_runtime.InputMemoryView()
    view.update(x)
    mem = r.execute(view)
    del r
    probe.check("runner dropped while its results are referenced")
    assert np.allclose(fut["tensor_C"], want, rtol=1e-6)
    assert np.allclose(np.frombuffer(mem["tensor_C"], np.float32).reshape(SHAPE), want,
                       rtol=1e-6)
    del fut, mem, view


def pending(path: str, probe: Probe) -> None:
    """A runner dropped with requests in flight: they fail with InvalidStateError, and a
    watchdog thread (a partial dynamic batch waiting for its timeout) ends at once."""
    r = model_runtime.ModelRunner(path)
    fut = r.executeAsync(feeds())
    del r
    probe.check("runner dropped with a request in flight")
    if fut.exception() is None and not np.isfinite(fut["tensor_C"]).all():
        probe.leaks.append("a request in flight when its runner was dropped has garbage")
    del fut

    batched = os.path.join(os.environ["IPU_EMULATOR_HOME"], "batched.popef")
    cfg = model_runtime.ModelRunnerConfig(batching_dim=0, timeout_ns=timedelta(seconds=60))
    r = model_runtime.ModelRunner(batched, config=cfg)
    one = {"tensor_A": np.ones((1, 3), np.float32), "tensor_B": np.ones((1, 3), np.float32)}
    fut = r.executeAsync(one)          # a partial batch: the watchdog waits to flush it
    watchdog = r._replicas[0]._timers._watchdog
    if watchdog is None or not watchdog.is_alive():
        probe.leaks.append("expected a watchdog thread for the partial batch")
    del r, watchdog
    probe.check("runner dropped with a partial batch and its watchdog")
    exc = fut.exception()
    if not isinstance(exc, model_runtime.InvalidStateError) or "closed" not in str(exc):
        probe.leaks.append(f"the partial batch's request should fail as closed, got {exc!r}")
    del fut, exc, cfg


def session(path: str, probe: Probe) -> None:
    """Session (bound, loaded, with a queue manager and a running main loop), Device,
    DeviceManager, QueueManager dropped without close()."""
    from host_runtime.session._session import Session

    s = Session(path)
    s.bindToDevice(DeviceManager().getDevice(1))   # the session does not own this device:
    qm = s.createQueueManager()                    # the bound device lives while it does
    del qm
    s.runLoadPrograms()
    del s
    probe.check("session bound to a device it did not attach")

    s = Session(path)
    qm = s.createQueueManager()
    s.direct.input_ring("tensor_A")                      # attaches its own device
    del s
    del qm
    probe.check("session that attached its own device, with a queue manager")

    s = Session(path)
    for name in ("tensor_A", "tensor_B", "tensor_C"):
        s.direct.claim(name)
    loop = s.direct.start_main_loop()
    del s
    probe.check("session with a running main loop")
    if not loop.done():
        probe.leaks.append("the main loop of a dropped session did not end")

    dm = DeviceManager()
    dev = dm.getDevice(2)
    del dev, dm
    probe.check("device and device manager")

    m = model_runtime.popef.load_model([path])
    dev = DeviceManager().createIpuModelDevice(m)
    del dev, m
    probe.check("IPU model device")


def poprt(path: str, probe: Probe) -> None:
    from host_runtime.poprt import Runner

    r = Runner(path)
    x = feeds()
    out = {"tensor_C": np.empty(SHAPE, np.float32)}
    r.execute(x, out)
    del r
    probe.check("PopRT Runner")
    assert np.isfinite(out["tensor_C"]).all()


def shared(path: str, probe: Probe) -> None:
    a = model_runtime.empty_shared((64, 1024), np.float32)
    view = a[3:5]
    del a
    view[...] = 1.0
    if not set(shm_objects()) - set(probe.shm):
        probe.leaks.append("empty_shared: the region went while a view of it lived")
    del view
    probe.check("empty_shared array and its view")

    r = model_runtime.ModelRunner(path)
    x = feeds()
    a = model_runtime.empty_shared(SHAPE, np.float32)
    a[...] = x["tensor_A"]
    out = r.execute({"tensor_A": a, "tensor_B": x["tensor_B"]})["tensor_C"]
    want = expected(r.model, x)
    del r, a
    probe.check("runner and the shared input it read")
    assert np.allclose(out, want, rtol=1e-6)


SCENARIOS: dict[str, Callable[[str, Probe], None]] = {
    "runners": runners, "killed": killed, "hung": hung, "device_error": device_error,
    "sharded": sharded, "failing_constructor": failing_constructor,
    "futures": futures, "pending": pending, "session": session, "poprt": poprt, "shared": shared,
}


def run_scenario(name: str, path: str) -> dict[str, Any]:
    """One scenario with the collector off; then every IPU of the machine is attached."""
    gc.collect()                      # what importing (and earlier scenarios) left is not ours
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    probe = Probe()
    SCENARIOS[name](path, probe)
    garbage = gc.collect()
    kinds = sorted({type(o).__qualname__ if not isinstance(o, type) else "class " + o.__module__ + "." + o.__qualname__ for o in gc.garbage})[:20]
    gc.garbage.clear()
    gc.set_debug(0)
    enabled = gc.isenabled()
    # every IPU of the machine is free again
    dm = DeviceManager()
    devices = [dm.getDevice(1) for _ in range(dm.system.num_ipus)]
    ipus = sorted(i for d in devices for i in d.ipus())
    for d in devices:
        d.close()
    del devices, dm
    probe.check("after attaching every IPU")
    return {"leaks": probe.leaks, "garbage": garbage, "kinds": kinds, "ipus": ipus,
            "gc_enabled": enabled}


def main(argv: list[str]) -> int:
    path, *names = argv
    home = os.environ["IPU_EMULATOR_HOME"]
    # what a scenario compiles is compiled first: the compiler's imports leave garbage
    if "pending" in names:
        write_simple_popef(os.path.join(home, "batched.popef"), shape=(4, 3))
    if "sharded" in names:
        _compile_chain(home)
    if "device_error" in names:
        from tests._helpers import write_gather
        write_gather(os.path.join(home, "gather.popef"))
    results = {name: run_scenario(name, path) for name in names}
    print("RESULT " + json.dumps(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
