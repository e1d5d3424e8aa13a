"""shm.limits: the one place an OS refusal is recognised and named (descriptors, /dev/shm
room, file size), and the host's translation of the named errors (ResourceLimitError,
SharedMemoryFullError). The real EMFILE/EFBIG cases run in child processes in
tests/integration/test_os_limits.py; here the errnos that cannot be caused safely
(ENFILE, ENOSPC, ENOMEM) are fed in."""

from __future__ import annotations

import errno
import json
import os
import re
import resource
import subprocess
import sys

import posix_ipc
import pytest

import shm
import shm.region
from host_runtime.devices import translated
from host_runtime.errors import ResourceLimitError, SharedMemoryFullError
from shm import limits
from shm.errors import FileSizeLimitError, OutOfFileDescriptorsError, ShmFullError


def _ours() -> set[str]:
    """This process's objects in /dev/shm (names carry the creator's pid; the machine's
    /dev/shm is shared with other test processes)."""
    return {n for n in os.listdir("/dev/shm") if f"_{os.getpid()}_" in n}


def _shm_has() -> str:
    return r"/dev/shm has \d+ bytes free of \d+"


@pytest.mark.parametrize("exc, code", [
    (OSError(errno.EMFILE, "Too many open files"), errno.EMFILE),
    (OSError("This process already has the maximum number of files open"), errno.EMFILE),
    (OSError("The system limit on the total number of open files has been reached"),
     errno.ENFILE),
    (ValueError("The size is too large"), errno.EFBIG),
    (MemoryError("Not enough memory"), errno.ENOMEM),
    (OSError(errno.ENOSPC, "No space left on device"), errno.ENOSPC),
    (ValueError("something else"), None),
    (MemoryError(), None),
    (OSError(errno.EACCES, "Permission denied"), errno.EACCES),
])
def test_errno_of(exc, code):
    assert limits.errno_of(exc) == code


def test_enfile_is_named_with_the_limits():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    err = limits.named_error(OSError("The system limit on the total number of open files has "
                                     "been reached"), "creating the semaphores of ring x")
    assert isinstance(err, OutOfFileDescriptorsError) and isinstance(err, OSError)
    assert err.errno == errno.ENFILE and (err.soft, err.hard) == (soft, hard)
    assert re.fullmatch(
        r"out of file descriptors \(ENFILE\) creating the semaphores of ring x: the system's "
        r"table of open files is full \(fs.file-max\); this process has \d+ open, its limit "
        rf"RLIMIT_NOFILE is {soft} \(hard {hard if hard != resource.RLIM_INFINITY else 'unlimited'}\); "
        r"close processes or files, or raise fs.file-max", str(err)), str(err)


@pytest.mark.parametrize("exc, name", [(OSError(errno.ENOSPC, "No space left on device"),
                                        "ENOSPC"),
                                       (OSError(errno.ENOMEM, "Cannot allocate memory"),
                                        "ENOMEM"),
                                       (MemoryError("Not enough memory"), "ENOMEM")])
def test_enospc_and_enomem_are_shm_full(exc, name):
    err = limits.named_error(exc, "creating a shared-memory region of 4096 bytes", 4096)
    assert isinstance(err, ShmFullError) and err.needed == 4096 and err.free is not None
    assert re.fullmatch(rf"/dev/shm full \({name}\) creating a shared-memory region of 4096 "
                        rf"bytes: 4096 bytes needed, {_shm_has()}; free it \(ipu-emulator "
                        r"cleanup removes what dead processes left\) or enlarge it \(docker "
                        r"run --shm-size=...\)", str(err)), str(err)


def test_other_errors_are_not_named():
    assert limits.named_error(OSError(errno.EACCES, "Permission denied"), "x") is None
    assert limits.named_error(ValueError("region size must be positive"), "x") is None


def test_region_create_names_enospc(monkeypatch):
    """shm_open failing with ENOSPC (tmpfs out of inodes): /dev/shm full, nothing left."""
    before = _ours()

    def no_room(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(shm.region.posix_ipc, "SharedMemory", no_room)
    with pytest.raises(ShmFullError) as info:
        shm.Region.create(8192)
    assert re.fullmatch(rf"/dev/shm full \(ENOSPC\) creating a shared-memory region of 8192 "
                        rf"bytes: 8192 bytes needed, {_shm_has()}; .*", str(info.value))
    assert isinstance(info.value.__cause__, OSError)
    monkeypatch.undo()
    assert _ours() - before == set()


def test_a_ring_whose_semaphores_cannot_be_made_leaves_nothing(monkeypatch):
    """A failure after the ring's region is made (its semaphores' sem_init) removes the
    region again and propagates."""
    from shm._semaphore import SharedSemaphore

    before = _ours()

    def refuse(self, value):
        raise OSError(errno.EINVAL, f"sem_init of a ring: value {value}")
    monkeypatch.setattr(SharedSemaphore, "init", refuse)
    with pytest.raises(OSError, match=r"sem_init of a ring: value 2"):
        shm.Ring.create(64, 2)
    monkeypatch.undo()
    assert _ours() - before == set()


def test_host_translation():
    fds = OutOfFileDescriptorsError("out of file descriptors (EMFILE) x", errno=errno.EMFILE,
                                    soft=64, hard=128, open_fds=64)
    with pytest.raises(ResourceLimitError) as info:
        with translated("the ring of anchor 'a'", 4096):
            raise fds
    assert str(info.value) == "cannot create the ring of anchor 'a': out of file descriptors (EMFILE) x"
    assert info.value.__cause__ is fds and isinstance(info.value, OSError)

    with pytest.raises(ResourceLimitError, match=r"^cannot create the ring of anchor 'a': file "
                       r"size limit \(EFBIG\) creating the ring of anchor 'a': 4096 bytes "
                       r"exceed RLIMIT_FSIZE"):
        with translated("the ring of anchor 'a'", 4096):
            raise ValueError("The size is too large")

    with pytest.raises(SharedMemoryFullError, match=r"^cannot create the device memory region "
                       r"of 4096 bytes in shared memory: /dev/shm full \(ENOSPC\) creating the "
                       r"device memory region: 4096 bytes needed"):
        with translated("the device memory region", 4096):
            raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(ValueError, match="^unrelated$"):   # not a limit: passes unchanged
        with translated("the device memory region", 4096):
            raise ValueError("unrelated")
    with pytest.raises(SharedMemoryFullError, match="Permission denied"):   # as before
        with translated("the device memory region", 4096):
            raise OSError(errno.EACCES, "Permission denied")


_COUNT_FDS = """
import errno, json, os, resource, threading
from shm import limits

threads = threading.active_count()
expected = len(os.listdir("/proc/self/fd")) - 1    # less the listing's own
listed = limits.open_fds()
probed = None
if resource.getrlimit(resource.RLIMIT_NOFILE)[0] <= 1 << 16:  # the probe's bound

    def emfile(path):
        raise OSError(errno.EMFILE, "Too many open files")
    limits.os.listdir = emfile
    probed = limits.open_fds()
print(json.dumps([threads, expected, listed, probed]))
"""


def test_open_fds_counts_with_and_without_a_free_descriptor():
    # Counted in a process of one thread: a pytest worker may run threads of earlier
    # tests that open and close descriptors between two counts.
    run = subprocess.run([sys.executable, "-c", _COUNT_FDS], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    threads, expected, listed, probed = json.loads(run.stdout)
    assert threads == 1 and expected >= 3    # stdin, stdout, stderr at least
    assert listed == expected
    if probed is None:
        pytest.skip("the probe is bounded to 65536 descriptors")
    assert probed == expected


@pytest.mark.parametrize("how", ["named", "translated"])
def test_a_named_error_keeps_no_frame_alive_with_the_collector_off(how):
    """The error raised holds the frames it went through (its traceback); a frame that
    holds that error too (the context manager's own) makes a cycle, and everything those
    frames hold (a lock, a ring made before the failure) waits for the collector."""
    import gc

    class Held:   # a local of a frame in the error's traceback
        pass

    def fail() -> None:
        held = Held()   # noqa: F841 (held by this frame)
        cm = (limits.named_errors("opening a test file") if how == "named"
              else translated("a test region", 64))
        with cm:
            raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    gc.disable()
    try:
        raised = None
        try:
            fail()
        except (OutOfFileDescriptorsError, ResourceLimitError) as exc:
            raised = type(exc)
        assert raised is (OutOfFileDescriptorsError if how == "named" else ResourceLimitError)
        assert not [o for o in gc.get_objects() if isinstance(o, Held)]
    finally:
        gc.enable()
