"""A daemon's IPU process keeps what it built for a host (``ipu_emulator.ipu._kept``):
the next host's LOAD of the same executable reuses it, over that host's own device memory
and constants. Each host must still get its own right answer: hosts in turn with other
weights of the same executable, another executable, a host killed while its main loop
runs. One daemon of one IPU (its IPU process logging at DEBUG, which says when a build
is reused) serves the module."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

import host_runtime as model_runtime
from host_runtime import popef
from ipu_emulator.daemon import socket_protocol as wire
from tests._helpers import weights_of
from tests.daemon_rig import REPO, DaemonRig
from tools.generate_simple_popef import write_simple_popef

SHAPE = (1, 4)
REUSED = "a kept build reused"
BUILT = "built (kept for later hosts)"


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonRig]:
    rig = DaemonRig(tmp_path_factory.mktemp("kept"), num_ipus=1,
                    IPU_EMULATOR_DEVICE_LOG_LEVEL="DEBUG")
    try:
        yield rig
    finally:
        rig.stop()


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    base = tmp_path_factory.mktemp("models")
    return {name: str(write_simple_popef(base / f"{name}.popef", shape=shape, seed=seed))
            for name, shape, seed in (("w1", SHAPE, 1), ("w2", SHAPE, 2), ("other", (2, 3), 3))}


def log_lines(rig: DaemonRig, text: str) -> int:
    log = Path(rig.env["IPU_EMULATOR_HOME"]) / "logs" / "ipu0.log"
    return sum(text in line for line in log.read_text().splitlines()) if log.exists() else 0


def answer(path: str, shape: tuple[int, ...], seed: int) -> None:
    """One runner's life through the daemon: its answer is a * its weights + b."""
    rng = np.random.default_rng(seed)
    a, b = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    want = a * weights_of(popef.load_model([path]), shape) + b
    runner = model_runtime.ModelRunner(path)
    try:
        for _ in range(2):
            np.testing.assert_allclose(runner.execute({"tensor_A": a, "tensor_B": b})["tensor_C"],
                                       want, rtol=1e-6)
    finally:
        runner.close()


def test_hosts_in_turn_with_other_weights_get_their_own_answers(rig, paths, monkeypatch):
    monkeypatch.setenv(wire.ENV_VAR, rig.socket)
    one, two = (popef.load_model([paths[k]]) for k in ("w1", "w2"))
    assert one.executable.payload() == two.executable.payload()   # one executable
    assert not np.array_equal(weights_of(one, SHAPE), weights_of(two, SHAPE))
    reused = log_lines(rig, REUSED)
    for k, name in enumerate(("w1", "w2", "w1", "w2")):
        answer(paths[name], SHAPE, k)
    assert log_lines(rig, REUSED) >= reused + 3   # the first may have built it


def test_another_executable_is_built_and_the_kept_one_still_serves(rig, paths, monkeypatch):
    monkeypatch.setenv(wire.ENV_VAR, rig.socket)
    answer(paths["w1"], SHAPE, 10)
    built = log_lines(rig, BUILT)
    answer(paths["other"], (2, 3), 11)
    assert log_lines(rig, BUILT) == built + 1
    reused = log_lines(rig, REUSED)
    answer(paths["w2"], SHAPE, 12)
    answer(paths["other"], (2, 3), 13)
    assert log_lines(rig, REUSED) == reused + 2


def test_a_host_killed_while_its_main_loop_runs_is_followed_by_right_answers(
        rig, paths, monkeypatch):
    monkeypatch.setenv(wire.ENV_VAR, rig.socket)
    answer(paths["w1"], SHAPE, 20)
    host = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, host_runtime as mr
        runner = mr.ModelRunner({paths['w2']!r})
        print("looping", flush=True)
        sys.stdin.read()
        """)], cwd=REPO, env=dict(rig.host_env(), PYTHONPATH=str(REPO)),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout is not None and host.stdout.readline() == "looping\n"
    finally:
        host.send_signal(signal.SIGKILL)
        host.wait(60)
    reused = log_lines(rig, REUSED)
    answer(paths["w1"], SHAPE, 21)
    answer(paths["w2"], SHAPE, 22)
    assert log_lines(rig, REUSED) >= reused + 1
    assert [f for f in os.listdir("/dev/shm") if f"_{host.pid}_" in f] == []
