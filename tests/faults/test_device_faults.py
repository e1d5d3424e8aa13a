"""Faults: a killed IPU process, a killed host. /dev/shm is compared before and after."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import psutil
import pytest

from host_runtime.devices._manager import DeviceManager
from host_runtime.errors import DeviceLostError
from host_runtime.session._session import Session
from shm import PeerDiedError, naming
from shm.cleanup import list_objects
from tests._helpers import PATIENT, processes

SHAPE = (1, 4)


def ours() -> set[str]:
    return {o.entry for o in list_objects(naming.current_tag())}


@contextlib.contextmanager
def host_child(script: str, model_path: str):
    """A host process running ``script``; yields it and the IPU pids it prints; killed after."""
    child = subprocess.Popen([sys.executable, "-c", script, model_path],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline().strip()
        assert line, "host child did not start"
        yield child, [int(p) for p in line.split(",")]
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def kill_host_and_check_cleanup(child: subprocess.Popen, ipu_pids: list[int],
                                before: set[str]) -> None:
    """SIGKILL the host: its IPU processes must exit and /dev/shm be as ``before``."""
    child.kill()
    child.wait(30)
    gone, alive = psutil.wait_procs(processes(ipu_pids), timeout=60)
    assert not alive, f"IPU processes still running: {alive}"
    assert ours() - before == set()


def ones(view: memoryview) -> None:
    view[:] = np.ones(SHAPE, np.float32).tobytes()


def test_killed_ipu_process_fails_a_running_program_and_every_later_call(model):
    before = ours()
    dm = DeviceManager()
    dev = dm.getDevice(1, wait_config=PATIENT)
    pid = dev.pids()[0]
    s = Session(model)
    s.bindToDevice(dev)

    def kill_device(view: memoryview) -> None:   # the device is waiting for this input
        os.kill(pid, signal.SIGKILL)
        view[:] = bytes(len(view))
    s.setCallbackForAnchor("tensor_A", ones)
    s.setCallbackForAnchor("tensor_B", kill_device)
    s.setCallbackForAnchor("tensor_C", lambda v: None)
    with pytest.raises(DeviceLostError) as info:
        s.runMainPrograms()
    msg = str(info.value)
    assert f"device {dev.id} (ipu {dev.ipus()[0]})" in msg
    assert f"IPU process {pid} was killed by signal SIGKILL (9)" in msg
    with pytest.raises(DeviceLostError, match="SIGKILL"):
        s.runMainPrograms()
    assert s.direct.failure() is not None
    # the session recovers on a new device (what auto_reset builds on)
    dev.close()
    with dm.getDevice(1, wait_config=PATIENT) as fresh:
        s.bindToDevice(fresh)
        out: list[np.ndarray] = []
        s.setCallbackForAnchor("tensor_B", ones)
        s.setCallbackForAnchor("tensor_C", lambda v: out.append(np.frombuffer(v, np.float32).copy()))
        s.runMainPrograms()
        w = np.frombuffer(model.tensorData("weights").data, np.float32)
        np.testing.assert_allclose(out[-1], w + 1, rtol=1e-6)
        s.close()
    assert ours() == before


def test_killed_ipu_process_fails_direct_waiters_and_the_main_loop(model):
    before = ours()
    with DeviceManager().getDevice(1, wait_config=PATIENT) as dev, Session(model) as s:
        s.bindToDevice(dev)
        for h in ("tensor_A", "tensor_B", "tensor_C"):
            s.direct.claim(h)
        rc = s.direct.output_ring("tensor_C")
        loop = s.direct.start_main_loop()
        errors: list[BaseException] = []

        def reader() -> None:
            try:
                rc.read(timeout=120)   # the device never produces: it waits for inputs
            except BaseException as exc:
                errors.append(exc)
        t = threading.Thread(target=reader)
        t.start()
        os.kill(dev.pids()[0], signal.SIGTERM)
        t.join(60)
        assert not t.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], PeerDiedError), errors
        lost = s.direct.translate(errors[0])
        assert isinstance(lost, DeviceLostError) and "SIGTERM (15)" in str(lost)
        with pytest.raises(DeviceLostError, match="was killed by signal SIGTERM"):
            loop.result(timeout=60)
    assert ours() == before


def test_ipu_process_killed_before_load(model):
    before = ours()
    with DeviceManager().getDevice(1, wait_config=PATIENT) as dev, Session(model) as s:
        os.kill(dev.pids()[0], signal.SIGKILL)
        with pytest.raises(DeviceLostError, match="SIGKILL"):
            s.bindToDevice(dev)
    assert ours() == before


HOST = textwrap.dedent("""
    import sys
    import numpy as np
    from host_runtime import popef
    from datetime import timedelta
    from host_runtime.devices._manager import DeviceWaitConfig
    from host_runtime.session._session import Session, SessionConfig
    s = Session([sys.argv[1]], SessionConfig(
        wait_config=DeviceWaitConfig(timedelta(seconds=120), timedelta(seconds=0.05))))
    s.setCallbackForAnchor("tensor_A", lambda v: v.__setitem__(slice(None), bytes(len(v))))
    s.setCallbackForAnchor("tensor_B", lambda v: v.__setitem__(slice(None), bytes(len(v))))
    s.setCallbackForAnchor("tensor_C", lambda v: None)
    s.runMainPrograms()                 # acquires a device, loads, runs
    for h in ("tensor_A", "tensor_B", "tensor_C"):
        s.direct.claim(h)
    s.direct.start_main_loop()                # the device now waits on an input ring
    print(",".join(map(str, s.device().pids())), flush=True)
    sys.stdin.readline()
""")


@pytest.mark.allow_shm_leak   # checked here, after the IPU process had its chance to clean up
@pytest.mark.embedded_only   # through a daemon the IPU processes are the daemon's: test_daemon_faults.py
def test_sigkilled_host_leaves_no_ipu_process_and_nothing_in_dev_shm(model_path):
    before = ours()
    with host_child(HOST, model_path) as (child, ipu_pids):
        during = ours() - before
        assert any(f"_{child.pid}_" in e for e in during)   # the host's rings and regions exist
        # among them the region of the weights its Load program reads (PopEF tensor data)
        assert any(f"_{child.pid}_" in e and e.endswith("_cst") for e in during), during
        kill_host_and_check_cleanup(child, ipu_pids, before)
    # and the device is free again
    with DeviceManager().getDevice(1, wait_config=PATIENT):
        pass


STARTING_HOST = textwrap.dedent("""
    import os, signal
    from datetime import timedelta
    from host_runtime.devices._manager import DeviceManager, DeviceWaitConfig
    dev = DeviceManager().getDevice(1, wait_config=DeviceWaitConfig(
        timedelta(seconds=120), timedelta(seconds=0.05)))   # starts the IPU process; does not wait for it
    print(",".join(map(str, dev.pids())), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.mark.allow_shm_leak   # checked here, after the IPU process had its chance to clean up
@pytest.mark.embedded_only   # through a daemon the IPU processes are the daemon's: test_daemon_faults.py
def test_host_killed_while_its_ipu_process_starts():
    before = ours()
    child = subprocess.Popen([sys.executable, "-c", STARTING_HOST], stdout=subprocess.PIPE,
                             text=True)
    line = child.stdout.readline().strip()
    child.wait(60)
    assert child.returncode == -signal.SIGKILL and line
    ipu_pids = [int(p) for p in line.split(",")]
    gone, alive = psutil.wait_procs(processes(ipu_pids), timeout=60)
    assert not alive
    assert ours() - before == set()


def test_closing_a_device_fails_a_program_blocked_on_another_thread(model):
    before = ours()
    release = threading.Event()
    errors: list[BaseException] = []
    with DeviceManager().getDevice(1, wait_config=PATIENT) as dev, Session(model) as s:
        s.bindToDevice(dev)
        s.setCallbackForAnchor("tensor_A", lambda v: release.wait(60))   # never fed in time
        s.setCallbackForAnchor("tensor_B", ones)
        s.setCallbackForAnchor("tensor_C", lambda v: None)

        def run() -> None:
            try:
                s.runMainPrograms()
            except BaseException as exc:
                errors.append(exc)
        t = threading.Thread(target=run)
        t.start()
        dev.close()
        release.set()
        t.join(60)
        assert not t.is_alive()
        assert len(errors) == 1 and "was detached" in str(errors[0]), errors
    assert ours() == before


SPINNING_HOST = textwrap.dedent("""
    import sys
    from datetime import timedelta
    from host_runtime.devices._manager import DeviceWaitConfig
    from host_runtime.session.predicates import AnchorCallbackPolicy
    from host_runtime.session._session import Session, SessionConfig
    s = Session([sys.argv[1]], SessionConfig(
        wait_config=DeviceWaitConfig(timedelta(seconds=120), timedelta(seconds=0.05))))
    empty = lambda anchor: AnchorCallbackPolicy.BIND_EMPTY_CB
    s.setUserInputHandler(lambda info: None, empty)
    s.setUserOutputHandler(lambda info: None, empty)
    s.direct.start_main_loop()     # nothing to wait for: the device loops flat out
    print(",".join(map(str, s.device().pids())), flush=True)
    sys.stdin.readline()
""")


@pytest.mark.allow_shm_leak   # checked here, after the IPU process had its chance to clean up
@pytest.mark.embedded_only   # through a daemon the IPU processes are the daemon's: test_daemon_faults.py
def test_host_killed_while_its_device_loops_without_waiting(model_path):
    before = ours()
    with host_child(SPINNING_HOST, model_path) as (child, ipu_pids):
        kill_host_and_check_cleanup(child, ipu_pids, before)


def test_an_idle_devices_event_thread_sleeps_until_its_ipu_process_exits(model):
    """Nothing wakes the event thread of an idle device (its IPU process's exit is watched
    by pidfd, not polled); the exit itself does, and fails the next call with how the
    process died."""
    before = ours()
    with DeviceManager().getDevice(1, wait_config=PATIENT) as dev, Session(model) as s:
        s.bindToDevice(dev)
        for h in ("tensor_A", "tensor_B"):
            s.setCallbackForAnchor(h, ones)
        s.setCallbackForAnchor("tensor_C", lambda v: None)
        s.runMainPrograms()
        pid = dev.pids()[0]
        [thread] = [t for t in threading.enumerate() if t.name == f"ipu-events-{pid}"]

        def sleeps() -> int:   # times the event thread went to sleep so far
            with open(f"/proc/self/task/{thread.native_id}/status") as f:
                return int(re.search(r"^voluntary_ctxt_switches:\s+(\d+)", f.read(),
                                     re.M).group(1))
        start = sleeps()
        time.sleep(1.5)   # a window of idleness, not a synchronisation
        assert sleeps() - start <= 1     # a look every 0.25 s would be 6
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(DeviceLostError, match=f"IPU process {pid} was killed by signal "
                                                  "SIGKILL"):
            s.runMainPrograms()
    assert ours() == before
