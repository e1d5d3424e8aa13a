"""Errors say what happened: running out of file descriptors (EMFILE) while creating a
region, a ring's semaphores, an IPU process or a runner is named so, with RLIMIT_NOFILE
and the count of open descriptors; a shared-memory object above RLIMIT_FSIZE is named
so (posix_ipc says ``ValueError('The size is too large')``). Each case runs in a child
process (tests/integration/os_limits_program.py) whose limits are lowered, so the test
runner keeps its own; the child must leave nothing in /dev/shm."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tools.generate_simple_popef import write_simple_popef

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOFILE = ("this process has 256 open and its limit RLIMIT_NOFILE is 256 (hard {hard}); close "
          "runners, sessions or files it no longer uses, or raise the limit (ulimit -n, "
          "resource.setrlimit)")
FSIZE = ("exceed RLIMIT_FSIZE of 65536 bytes (hard unlimited), which bounds shared memory "
         "too; raise it (ulimit -f unlimited, resource.setrlimit)")


@pytest.fixture(scope="module")
def popef_path(tmp_path_factory):
    return str(write_simple_popef(tmp_path_factory.mktemp("limits") / "s.popef"))


def _run(case: str, home: str, *args: str) -> dict:
    env = dict(os.environ, IPU_EMULATOR_HOME=home, IPU_EMULATOR_FORKSERVER="0",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "tests.integration.os_limits_program", case,
                           *args], capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    left = [n for n in os.listdir("/dev/shm") if f"_{out['pid']}_" in n]
    assert left == [], left
    return out


def _hard() -> str:
    import resource
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return "unlimited" if hard == resource.RLIM_INFINITY else str(hard)


def test_region_out_of_descriptors(tmp_path):
    out = _run("ring-nofile", str(tmp_path))
    assert out["type"] == "shm.errors.OutOfFileDescriptorsError"
    assert out["msg"] == ("out of file descriptors (EMFILE) creating a shared-memory region "
                          "of 768 bytes: " + NOFILE.format(hard=_hard()))
    assert out["cause"] == "OSError"


def test_semaphores_out_of_descriptors(tmp_path):
    out = _run("sem-nofile", str(tmp_path))
    assert out["type"] == "shm.errors.OutOfFileDescriptorsError"
    assert re.fullmatch(r"out of file descriptors \(EMFILE\) creating the semaphores of ring "
                        r"/ipuemu_\w+: " + re.escape(NOFILE.format(hard=_hard())), out["msg"])
    assert out["cause"] == "OSError"   # posix_ipc's text without an errno


def test_process_out_of_descriptors(tmp_path):
    out = _run("process-nofile", str(tmp_path))
    assert out["type"] == "shm.errors.OutOfFileDescriptorsError"
    assert out["msg"] == ("out of file descriptors (EMFILE) starting the IPU process of ipu 0: "
                          + NOFILE.format(hard=_hard()))


def test_runner_out_of_descriptors_is_not_called_shm_full(tmp_path, popef_path):
    out = _run("runner-nofile", str(tmp_path), popef_path)
    assert out["type"] == "host_runtime.errors.ResourceLimitError"
    assert out["msg"] == ("cannot create the process and the control and event rings of IPU 0: "
                          "out of file descriptors (EMFILE) creating a shared-memory region of "
                          "66816 bytes: " + NOFILE.format(hard=_hard()))
    assert "full" not in out["msg"]
    assert out["cause"] == "OutOfFileDescriptorsError"


def test_ring_above_the_file_size_limit(tmp_path):
    out = _run("ring-fsize", str(tmp_path))
    assert out["type"] == "shm.errors.FileSizeLimitError"
    assert out["msg"] == ("file size limit (EFBIG) creating a shared-memory region of 4194816 "
                          "bytes: 4194816 bytes " + FSIZE)
    assert out["cause"] == "ValueError"


def test_runner_above_the_file_size_limit(tmp_path, popef_path):
    out = _run("runner-fsize", str(tmp_path), popef_path)
    assert out["type"] == "host_runtime.errors.ResourceLimitError"
    assert out["msg"] == ("cannot create the process and the control and event rings of IPU 0: "
                          "file size limit (EFBIG) creating a shared-memory region of 66816 "
                          "bytes: 66816 bytes " + FSIZE)
