"""Errors say what happened: running out of file descriptors (EMFILE) while creating a
region or ring, an IPU process or a runner is named so, with RLIMIT_NOFILE
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

from tests._paths import child_pythonpath

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
               PYTHONPATH=child_pythonpath())
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
                          "of 896 bytes: " + NOFILE.format(hard=_hard()))
    assert out["cause"] == "OSError"


def test_process_out_of_descriptors(tmp_path):
    out = _run("process-nofile", str(tmp_path))
    assert out["type"] == "shm.errors.OutOfFileDescriptorsError"
    assert out["msg"] == ("out of file descriptors (EMFILE) starting the IPU process of ipu 0: "
                          + NOFILE.format(hard=_hard()))


def test_runner_out_of_descriptors_is_not_called_shm_full(tmp_path, popef_path):
    out = _run("runner-nofile", str(tmp_path), popef_path)
    assert out["type"] == "host_runtime.errors.ResourceLimitError"
    # the device attaches while the session makes its rings: the first of the two to
    # create a region meets the limit
    assert re.fullmatch(r"cannot create (the process and the control and event rings of IPU 0|"
                        r"the ring of anchor '\w+' \(\d+ slots of \d+ bytes\)): out of file "
                        r"descriptors \(EMFILE\) creating a shared-memory region of \d+ bytes: "
                        + re.escape(NOFILE.format(hard=_hard())), out["msg"]), out["msg"]
    assert "full" not in out["msg"]
    assert out["cause"] == "OutOfFileDescriptorsError"


def test_ring_above_the_file_size_limit(tmp_path):
    out = _run("ring-fsize", str(tmp_path))
    assert out["type"] == "shm.errors.FileSizeLimitError"
    assert out["msg"] == ("file size limit (EFBIG) creating a shared-memory region of 4194944 "
                          "bytes: 4194944 bytes " + FSIZE)
    assert out["cause"] == "ValueError"


def test_runner_above_the_file_size_limit(tmp_path, popef_path):
    out = _run("runner-fsize", str(tmp_path), popef_path)
    assert out["type"] == "host_runtime.errors.ResourceLimitError"
    assert out["msg"] == ("cannot create the process and the control and event rings of IPU 0: "
                          "file size limit (EFBIG) creating a shared-memory region of 66944 "
                          "bytes: 66944 bytes " + FSIZE)


def test_an_attach_that_cannot_write_its_lock_file_is_a_resource_limit(tmp_path):
    """RLIMIT_FSIZE 0: the lock file's pid cannot be written (the host's error, not shm's)."""
    out = _run("locks-fsize", str(tmp_path))
    assert out["type"] == "host_runtime.errors.ResourceLimitError", out
    assert out["msg"].startswith("cannot attach ipus [0]: file size limit (EFBIG) "), out
    assert "RLIMIT_FSIZE of 0 bytes" in out["msg"], out


# -- from the outside: a program that simply has too few descriptors or too little /dev/shm

def test_a_program_out_of_descriptors_opening_its_popef_file_is_told_so(tmp_path, popef_path):
    """Not a PopefError ("recompile the model"): the file is fine, the process is full."""
    out = _run("popef-nofile", str(tmp_path), popef_path)
    assert out["type"] == "host_runtime.errors.ResourceLimitError"
    assert out["msg"] == (f"out of file descriptors (EMFILE) opening PopEF file {popef_path!r}: "
                          + NOFILE.format(hard=_hard()))
    assert out["cause"] == "OutOfFileDescriptorsError"


def test_a_multi_ipu_attach_out_of_descriptors_is_named_and_holds_no_ipu(tmp_path):
    """Two descriptors left: the lock folder and the first IPU's lock file open, the second
    IPU's lock file does not. The
    error is named and the first lock is let go: the whole machine attaches after."""
    out = _run("locks-nofile", str(tmp_path))
    assert out["type"] == "host_runtime.errors.ResourceLimitError"
    assert out["msg"] == ("cannot attach ipus [0, 1]: out of file descriptors (EMFILE) opening "
                          f"the lock files of ipus [0, 1] in {tmp_path}/locks: "
                          + NOFILE.format(hard=_hard()))
    assert out["after"] == [0, 1, 2, 3]


def test_every_descriptor_budget_gives_a_runner_or_a_named_error(tmp_path, popef_path):
    """A runner of two replicas made with 0, 2, 4, ... descriptors to spare: every failure,
    wherever it falls (the PopEF file, lock files, regions, IPU processes),
    is ResourceLimitError naming EMFILE and the limit, and leaves no IPU held (the collector
    off) and nothing in /dev/shm."""
    out = _run("budgets", str(tmp_path), popef_path)
    attempts = out["attempts"]
    assert attempts[-1]["type"] is None, attempts[-1]   # enough descriptors: it works
    assert len(attempts) > 5
    for a in attempts[:-1]:
        assert a["type"] == "host_runtime.errors.ResourceLimitError", a
        assert re.search(r"out of file descriptors \(EMFILE\) .*: this process has \d+ open and "
                         r"its limit RLIMIT_NOFILE is 256 \(hard \w+\); close runners", a["msg"]), a
        assert "full" not in a["msg"], a
        assert a["after"] == [0, 1, 2, 3], a    # the failed attempt holds no IPU
    assert out["after"] == [0, 1, 2, 3]


def _private_shm_works() -> bool:
    try:
        return subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs "
                               "/dev/shm"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@pytest.mark.skipif(not _private_shm_works(), reason="needs unshare -m and mount (root)")
def test_a_small_dev_shm_is_named_full_with_bytes_needed_and_free(tmp_path, popef_path):
    """A /dev/shm of 8 MiB of the program's own (a private mount namespace, as a container's
    --shm-size gives): a model needing more is refused before anything is made; arrays
    are refused once it is full, with the bytes needed and free; the runner made before
    still works; nothing is left in that /dev/shm."""
    big = str(write_simple_popef(tmp_path / "big.popef", shape=(512, 1024)))
    env = dict(os.environ, IPU_EMULATOR_HOME=str(tmp_path), IPU_EMULATOR_FORKSERVER="0",
               PYTHONPATH=child_pythonpath())
    script = ("mount -t tmpfs -o size=8m tmpfs /dev/shm && exec \"$0\" -m "
              "tests.integration.os_limits_program shm-full \"$1\" \"$2\"")
    proc = subprocess.run(["unshare", "-m", "sh", "-c", script, sys.executable, popef_path, big],
                          capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["big"]["type"] == "host_runtime.errors.SharedMemoryFullError"
    assert re.fullmatch(r"this model's rings and regions need \d+ bytes of shared memory .*, but "
                        r"/dev/shm has \d+ bytes free of 8388608; enlarge /dev/shm \(docker run "
                        r"--shm-size=...\) .*", out["big"]["msg"]), out["big"]["msg"]
    assert out["arrays"]["type"] == "host_runtime.errors.SharedMemoryFullError"
    assert re.fullmatch(r"cannot create an empty_shared array of 1048576 bytes: /dev/shm full "
                        r"creating a shared-memory region of 1048576 bytes: 1048576 bytes "
                        r"needed, /dev/shm has \d+ bytes free of 8388608; free it .*",
                        out["arrays"]["msg"]), out["arrays"]["msg"]
    assert 0 < out["made"] < 8
    assert out["works"] is True
    assert out["left"] == []
