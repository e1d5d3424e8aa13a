"""/dev/shm filled by someone else after a runner exists: nothing is killed by SIGBUS.

Every shared-memory object is backed when it is made (``shm.region``), so a full
/dev/shm is a named error at creation and never a signal at a later first touch. The
program (tests/faults/shm_full_program.py) runs in a mount namespace of its own with a
private 48 MiB tmpfs on /dev/shm, which it fills to the last byte: other tests never see
a full /dev/shm. Skipped where a mount namespace cannot be made (not root, no unshare).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.usefixtures("private_machine")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHM_MIB = 48


def _namespace_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root to mount a private tmpfs on /dev/shm in a mount namespace"
    if shutil.which("unshare") is None:
        return "no unshare(1) on this machine"
    probe = subprocess.run(["unshare", "-m", "--propagation", "private", "true"],
                           capture_output=True, timeout=30)
    if probe.returncode != 0:
        return f"cannot make a mount namespace: {probe.stderr.decode(errors='replace')}"
    return None


def run_in_private_shm(*args: str) -> dict:
    why = _namespace_unavailable()
    if why is not None:
        pytest.skip(why)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    env.pop("IPU_EMULATOR_DAEMON", None)   # embedded IPU processes: inside the namespace
    script = (f"mount -t tmpfs -o size={SHM_MIB}M,mode=1777 tmpfs /dev/shm && "
              f'exec "$0" -m tests.faults.shm_full_program "$@"')
    proc = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script,
                           sys.executable, *args], capture_output=True, text=True,
                          timeout=180, env=env, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (proc.returncode, proc.stdout[-3000:],
                                            proc.stderr[-3000:])
    return json.loads(lines[-1][len("RESULT "):])


def test_a_runner_survives_dev_shm_filled_after_it_was_made(model_path):
    report = run_in_private_shm(model_path)
    assert report["filled"] > 0 and report["free_after_fill"] == 0, report
    assert report["sparse_ok"], report
    assert report["wrong"] == 0, report
    assert report["back_error"][0] == "ShmFullError", report
    assert "allocating the pages of" in report["back_error"][1], report
    assert report["region_error"][0] == "ShmFullError", report
    assert "/dev/shm full" in report["region_error"][1], report
    assert report["runner_error"][0] == "SharedMemoryFullError", report
    assert "/dev/shm" in report["runner_error"][1], report
    assert report["again_right"], report
    assert report["left"] == [], report
