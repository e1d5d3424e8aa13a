"""Dropping what a program made frees it at once, by reference counting alone.

Each scenario of ``tests/integration/lifetimes_program.py`` runs in a fresh
interpreter with the garbage collector disabled (a test process has collected
and imported too much to tell): it makes runners, sessions, devices, queue
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

SCENARIOS = ["runners", "killed", "failing_constructor", "futures", "session", "poprt",
             "shared"]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_dropped_objects_free_everything_without_the_collector(scenario, model_path, tmp_path):
    tag = "l" + secrets.token_hex(4)
    env = dict(os.environ, IPU_EMULATOR_SHM_TAG=tag, IPU_EMULATOR_HOME=str(tmp_path / "home"),
               IPU_EMULATOR_NUM_IPUS="4", PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("IPU_EMULATOR_DAEMON", None)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "tests.integration.lifetimes_program", model_path, scenario],
            env=env, capture_output=True, text=True, timeout=300,
            cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    finally:
        left = [n for n in os.listdir("/dev/shm") if f"ipuemu_{tag}_" in n]
        for n in left:
            os.unlink(os.path.join("/dev/shm", n))
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(lines[-1][len("RESULT "):])
    assert not result["gc_enabled"]
    assert result["leaks"] == []
    assert result["ipus"] == [0, 1, 2, 3], "every IPU can be attached again"
    assert result["garbage"] == 0, f"reference cycles: {result['kinds']}"
    assert left == [], "the program left shared memory behind at exit"
