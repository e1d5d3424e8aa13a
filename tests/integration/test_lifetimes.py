"""Dropping what a program made frees it at once, by reference counting alone.

The scenarios of ``tests/integration/lifetimes_program.py`` run a few to a fresh
interpreter (a test process has collected and imported too much to tell), each
with the garbage collector disabled from its start: each makes runners, sessions, devices, queue
managers, PopRT runners and shared arrays, drops them without ``close()``, and
after each drop checks that /dev/shm holds nothing more than before, that no IPU
process and no thread of theirs is left, and finally that every IPU of the
machine can be attached again and that ``gc.collect()`` (with ``DEBUG_SAVEALL``)
finds no reference cycle: nothing waited for the collector.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys

import pytest

SHAPE = (1, 4)     # the example model (model_path fixture); the program assumes it

SCENARIOS = [("runners", "killed", "hung", "device_error"),
             ("sharded", "failing_constructor", "futures", "pending"),
             ("session", "poprt", "shared")]
"""The scenarios of lifetimes_program, a few to an interpreter (each checked on its own:
collector off from its start, its cycles counted at its end, every IPU attached after)."""


@pytest.mark.parametrize("scenarios", SCENARIOS, ids="+".join)
def test_dropped_objects_free_everything_without_the_collector(scenarios, model_path, tmp_path):
    tag = "l" + secrets.token_hex(4)
    (tmp_path / "home").mkdir()
    env = dict(os.environ, IPU_EMULATOR_SHM_TAG=tag, IPU_EMULATOR_HOME=str(tmp_path / "home"),
               IPU_EMULATOR_NUM_IPUS="4", PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("IPU_EMULATOR_DAEMON", None)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "tests.integration.lifetimes_program", model_path,
             *scenarios],
            env=env, capture_output=True, text=True, timeout=300,
            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    finally:
        left = [n for n in os.listdir("/dev/shm") if f"ipuemu_{tag}_" in n]
        for n in left:
            os.unlink(os.path.join("/dev/shm", n))
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-2000:]
    results = json.loads(lines[-1][len("RESULT "):])
    assert list(results) == list(scenarios)
    for scenario, result in results.items():
        assert not result["gc_enabled"], scenario
        assert result["leaks"] == [], scenario
        assert result["ipus"] == [0, 1, 2, 3], f"{scenario}: every IPU can be attached again"
        assert result["garbage"] == 0, f"{scenario}: reference cycles: {result['kinds']}"
    assert left == [], "the program left shared memory behind at exit"


def test_runners_on_a_daemon_dropped_without_the_collector(daemon, model_path):
    """Through a daemon: each dropped runner hands its IPU back at once and intact (the
    daemon neither waits for it nor restarts the IPU process), and leaves no cycle."""
    import gc

    import numpy as np

    import host_runtime as model_runtime
    import host_runtime.runner._model_runner  # noqa: F401  (import-time garbage is not ours)
    from host_runtime.devices._manager import DeviceManager

    x = {"tensor_A": np.ones(SHAPE, np.float32), "tensor_B": np.ones(SHAPE, np.float32)}
    cfg = model_runtime.ModelRunnerConfig()

    def once() -> None:
        dm = DeviceManager(daemon=daemon.socket)
        cfg.replica_to_device = {0: dm.getDevice(1)}
        r = model_runtime.ModelRunner(model_path, config=cfg)
        r.execute(x)
        del r
        dev = cfg.replica_to_device.pop(0)
        del dev, dm          # the device the runner did not own goes with its last user
        held = [ipu for ipu in daemon.status()["ipus"] if ipu.get("holder")]
        assert held == [], held

    once()   # lazy imports on the way make module-level cycles: not the runner's garbage
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for _ in range(4):
            once()
        garbage = gc.collect()
        kinds = sorted({type(o).__qualname__ for o in gc.garbage})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert garbage == 0, kinds
    assert [ipu["pid"] for ipu in daemon.status()["ipus"]] == daemon.pool_pids, \
        "the daemon had to restart an IPU process a host handed back"
