"""Parts of the IPU process tested alone: the fit check both sides make, the host watch
(polling, as a loopback IPU uses it), and how a request ends."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ipu_emulator.fit import misfit
from ipu_emulator.ipu._ending import Ending, RunEnded
from ipu_emulator.ipu._host_watch import HostWatch
from ipu_emulator.ipu_protocol import ErrorKind

_DEVICE = dict(device="ipu 0", device_version=21, device_ipus=1, tiles_per_ipu=4,
               memory_per_tile=100)


def test_misfit_names_the_first_reason_an_executable_does_not_fit():
    assert misfit("m", 21, 400, 1, **_DEVICE) is None
    assert misfit("m", 2, 10, 1, **_DEVICE) == (
        ErrorKind.REQUEST, "executable 'm' was compiled for ipu2, but ipu 0 is ipu21")
    assert misfit("m", 21, 401, 1, **_DEVICE) == (
        ErrorKind.MEMORY, "executable 'm' needs 401 bytes of device memory, but ipu 0 has "
        "1 IPU(s) x 4 tiles x 100 bytes per tile = 400 bytes")
    assert misfit("m", 21, 10, 2, **_DEVICE) == (
        ErrorKind.REQUEST, "executable 'm' needs 2 IPUs, but ipu 0 has 1")
    assert misfit("m", 21, 10, None, **_DEVICE) is None   # the count not checked here


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_polled_host_watch_ends_the_run_when_the_host_or_the_client_is_gone():
    alive = [True]
    watch = HostWatch(12345, host_alive=lambda: alive[0])
    assert not watch.threaded and watch.wait_slice is not None
    watch.check()   # alive: nothing
    assert watch.gone() is None
    watch.set_client(_dead_pid())
    watch.next_check = 0.0
    with pytest.raises(RunEnded) as info:
        watch.check()
    assert info.value.ending is Ending.CLIENT_GONE
    watch.set_client(0)
    alive[0] = False
    watch.check()   # looked at less than HOST_CHECK ago: no new look yet
    watch.next_check = 0.0
    with pytest.raises(RunEnded) as info:
        watch.check()
    assert info.value.ending is Ending.HOST_GONE
    assert watch.after_interrupt() is Ending.HOST_GONE


_THREADED_WATCH = """
import os, subprocess, sys, time
from ipu_emulator.ipu._host_watch import HostWatch
client = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                          stdin=subprocess.PIPE)
watch = HostWatch(os.getppid())
thread = watch._thread
assert watch.threaded and thread is not None
watch.set_client(client.pid)
fd = thread._client_fd
# what the watch thread does with a descriptor its poll reported: an old client's pidfd
# closed meanwhile and its number taken by the new client's is not an exit
assert not thread._exited(fd) and watch.gone() is None and not watch.client_gone()
assert not thread._exited(fd + 1000)   # no such descriptor
client.stdin.close()
client.wait()                           # exited (and reaped): its pidfd is readable
assert watch.client_gone()
for _ in range(2000):                   # the thread notes it (bounded)
    if watch.gone() is not None:
        break
    time.sleep(0.001)
assert watch.gone().name == "CLIENT_GONE"
watch.set_client(0)
assert watch.gone() is None and not watch.client_gone()
print("ok")
"""


def test_the_watch_thread_notes_only_real_exits_of_the_pidfds_it_holds():
    """A pidfd the watch thread was polling may be closed by set_client and its number
    reused by the next client's: what the poll reported for it is checked again."""
    out = subprocess.run([sys.executable, "-c", _THREADED_WATCH], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
