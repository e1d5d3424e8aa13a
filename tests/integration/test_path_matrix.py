"""The same integration and fault tests over every path the runtime can take.

The rest of the suite runs the default paths: the rings' C core, zero-copy
streams, embedded IPU processes. Each leg here runs a representative part of
the integration and fault suites again in a fresh pytest with paths
switched: the rings' pure-Python path with copying streams
(``IPU_EMULATOR_RING_C=0``, ``IPU_EMULATOR_ZERO_COPY=0``), the runner's general request path only
(``IPU_EMULATOR_RUNNER_FUSED=0``, ``_PLAIN=0``, ``_SMALL_IO=0``), and attachment through a daemon
(``IPU_EMULATOR_DAEMON``; tests marked ``embedded_only`` are skipped there).
A leg fails with the inner run's own report.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

RUNNER = ["tests/devices/test_runner.py", "tests/devices/test_runner_config.py",
          "tests/devices/test_runner_batching.py"]
FAULTS = ["tests/faults/test_device_faults.py",
          "tests/faults/test_model_runner_faults.py",
          "tests/faults/test_sharding_faults.py"]

INJECTED = ["tests/faults/test_injected_faults.py"]
"""Faults injected on purpose (ipu_emulator.faults): through a daemon too (the host's
schedule reaches the daemon's IPU processes)."""


HOST_KILLS = "not host_killed and not killed_host and not sigkilled_host"
"""The tests of a killed host: what its IPU processes clean up does not depend on the
runner's path, so only the rings' leg and the daemon's run them again."""


PROCESS_KIND = "not in_thread"
"""The tests of tests/devices/ run on loopback (in-thread) IPUs and on IPU processes
(tests/devices/conftest.py): the legs that change what an IPU process or a daemon does
run the IPU-process kind alone."""


def _run(paths: list[str], env: dict[str, str], select: str = "", marks: str = "") -> None:
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
           "-p", "no:randomly", *(["-k", select] if select else []),
           *(["-m", marks] if marks else []), *paths]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=540)
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-60:])
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{tail}"
    assert " passed" in proc.stdout, tail


def test_integration_and_faults_with_python_rings_and_copied_streams() -> None:
    """The rings' pure-Python path and copying streams, in one leg: the two are
    independent (one is how a ring waits and moves bytes, the other what the IPU process
    does with a slot), and each is what the other runs over."""
    _run(RUNNER + FAULTS, dict(os.environ, IPU_EMULATOR_RING_C="0", IPU_EMULATOR_ZERO_COPY="0"),
         marks=PROCESS_KIND)


RUNNER_FAST_PATHS = ("IPU_EMULATOR_RUNNER_FUSED", "IPU_EMULATOR_RUNNER_PLAIN",
                     "IPU_EMULATOR_RUNNER_SMALL_IO")
"""The runner's fast paths (host_runtime/runner/_transfer.py): off, every request takes
the general path (checked, a Request and its Transfers, drained, through slot views)."""


RUNNER_FAULTS = [path for path in FAULTS if path != "tests/faults/test_device_faults.py"]
"""The fault tests that make runners (test_device_faults.py drives devices and sessions
only: the runner's paths are not in it)."""


def test_runner_and_faults_with_the_runner_fast_paths_off() -> None:
    # (requests missing an input and 16 MiB ones take the general path anyway: the
    # deadline and large-tensor tests are not repeated here; both kinds of IPU run)
    _run(RUNNER + RUNNER_FAULTS + ["tests/devices/test_runner_shared.py",
                            # one interrupt loop: execute and executeAsync, mixed
                            "tests/integration/test_interrupt.py::"
                            "test_sigint_every_50_ms_into_a_loop_gives_no_wrong_answer[mixed]"],
         dict(os.environ, **{k: "0" for k in RUNNER_FAST_PATHS}), HOST_KILLS)


def test_integration_and_faults_through_a_daemon(tmp_path: Path) -> None:
    from tests.daemon_rig import DaemonRig

    rig = DaemonRig(tmp_path, num_ipus=4)
    try:
        _run(RUNNER + FAULTS + INJECTED, dict(os.environ, IPU_EMULATOR_DAEMON=rig.socket),
             marks=PROCESS_KIND)
    finally:
        rig.stop()
