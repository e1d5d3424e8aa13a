"""Parts of the IPU process tested alone: the fit check both sides make, the host watch
(polling, as a loopback IPU uses it), and how a request ends."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import threading

import pytest

from ipu_emulator.fit import misfit
from ipu_emulator.ipu._ending import Ending, RunEnded
from ipu_emulator.ipu._host_watch import HostWatch, _PidfdThread
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


def test_a_pidfd_closed_under_the_watch_is_no_exit_of_the_client_that_took_its_number():
    # HOST 0 then HOST(pid) in quick succession: set_client closes the old client's pidfd
    # while the watch thread is about to poll it, and the new client's pidfd gets the same
    # number; poll reports the closed one as POLLNVAL, which must not end the new client
    watch = object.__new__(_PidfdThread)   # its state only: no thread, no signal handler
    watch._lock = threading.Lock()
    watch._host_fd, watch._client_fd = 100, 7
    watch._host_exited = watch._client_exited = False
    r, w = os.pipe()
    watch._wake_r = r
    try:
        assert watch._take([(7, select.POLLNVAL)]) is False
        assert watch.client_alive() and watch.host_alive()
        assert watch._take([(7, select.POLLIN)]) is True   # the client exited
        assert not watch.client_alive() and watch.host_alive()
        assert watch._take([(100, select.POLLIN | select.POLLHUP)]) is True
        assert not watch.host_alive()
    finally:
        os.close(r)
        os.close(w)
