"""Every host call is bounded: a stopped (SIGSTOP) IPU process or daemon under close(),
attach, a Session's waits and a queue operation.

Each test sets a small host sync timeout (``IPU_EMULATOR_HOST_SYNC_TIMEOUT``, read when a
device, a queue or a daemon request is made) and checks the error's class and message (the peer's pid and ``stopped
(state T)``) and the time taken, with a generous upper bound (the timeout + 5 s) for a
loaded 2-core machine: below any other wait that could end the call instead (10 s socket
timeouts, the 30 s stop timeout). A stopped process is continued (or killed) in a ``finally``; the
autouse leak probe checks /dev/shm after each test.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Iterator

import numpy as np
import psutil
import pytest

import host_runtime as model_runtime
from host_runtime.devices._daemon_client import DaemonClient
from host_runtime.devices._manager import DeviceManager, DeviceWaitConfig
from host_runtime.errors import DeviceTimeoutError
from host_runtime.session._session import Session
from ipu_emulator.daemon import socket_protocol as wire
from tests._helpers import PATIENT

pytestmark = pytest.mark.usefixtures("private_machine")

SYNC = 1.0          # the host sync timeout of these tests, seconds
SLACK = 5.0         # what a loaded machine may add to it
SHAPE = (1, 4)


@pytest.fixture(autouse=True)
def short_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IPU_EMULATOR_HOST_SYNC_TIMEOUT", str(SYNC))


@contextmanager
def stopped(pid: int) -> Iterator[None]:
    """``pid`` stopped (SIGSTOP) inside the block; continued after it, if still there."""
    os.kill(pid, signal.SIGSTOP)
    try:
        _wait_state(pid, psutil.STATUS_STOPPED)
        yield
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def _wait_state(pid: int, status: str) -> None:
    deadline = time.monotonic() + 10.0
    while psutil.Process(pid).status() != status:   # SIGSTOP acts asynchronously
        assert time.monotonic() < deadline, f"process {pid} did not reach {status}"
        time.sleep(0.001)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def fill(value: np.ndarray):
    return lambda v: np.frombuffer(v, np.float32).__setitem__(slice(None), value.ravel())


STOPPED_PEER = r"IPU process pid {pid}, stopped \(state T\)"


# -- embedded: a stopped IPU process ---------------------------------------------------------

def test_runner_close_with_a_stopped_ipu_process_kills_it_within_the_bound(model_path, weights,
                                                                           caplog):
    runner = model_runtime.ModelRunner(model_runtime.PopefPaths([model_path]))
    a = np.ones(SHAPE, np.float32)
    np.testing.assert_allclose(runner.execute({"tensor_A": a, "tensor_B": a})["tensor_C"],
                               a * weights + a, rtol=1e-6)
    pid = runner._replicas[0].session.device().pids()[0]
    with stopped(pid), caplog.at_level(logging.WARNING):
        start = time.monotonic()
        runner.close()
        took = time.monotonic() - start
        assert gone(pid), "close() left the stopped IPU process running"
    assert SYNC <= took < SYNC + SLACK, took
    assert re.search(r"stop on device \d+ \(ipu \d+\): no progress from the device for 1 s "
                     r"\(the host sync timeout, IPU_EMULATOR_HOST_SYNC_TIMEOUT\); "
                     + STOPPED_PEER.format(pid=pid) + "; killing its IPU processes",
                     caplog.text), caplog.text
    with pytest.raises(model_runtime.InvalidStateError, match="closed"):
        runner.execute({"tensor_A": a, "tensor_B": a})


def test_close_with_save_programs_and_a_stopped_ipu_process_spends_the_bound_once(
        model_path, monkeypatch):
    sync = 5.0     # below 2 * sync: the bound spent once, with SLACK to spare
    monkeypatch.setenv("IPU_EMULATOR_HOST_SYNC_TIMEOUT", str(sync))
    cfg = model_runtime.ModelRunnerConfig(run_save_programs=True)
    runner = model_runtime.ModelRunner(model_runtime.PopefPaths([model_path]), cfg)
    a = np.ones(SHAPE, np.float32)
    runner.execute({"tensor_A": a, "tensor_B": a})
    pid = runner._replicas[0].session.device().pids()[0]
    with stopped(pid):
        start = time.monotonic()
        runner.close()            # ending the loop for the save programs times out: kill
        took = time.monotonic() - start
        assert gone(pid)
    assert sync <= took < 2 * sync, took   # not a second bound for the stop after it
    assert cfg.replica_to_save_programs_outputs == {}   # the save programs did not run


def test_session_run_and_close_with_a_stopped_ipu_process_are_bounded(model, weights):
    dev = DeviceManager().getDevice(1, wait_config=PATIENT)
    pid = dev.pids()[0]
    session = Session(model)
    try:
        session.bindToDevice(dev)
        a, b = np.full(SHAPE, 2, np.float32), np.ones(SHAPE, np.float32)
        out: list[np.ndarray] = []
        session.setCallbackForAnchor("tensor_A", fill(a))
        session.setCallbackForAnchor("tensor_B", fill(b))
        session.setCallbackForAnchor("tensor_C", lambda v: out.append(
            np.frombuffer(v, np.float32).reshape(SHAPE).copy()))
        session.setCallbackForAnchor("weights_saved", lambda v: None)
        session.runMainPrograms()
        np.testing.assert_allclose(out[0], a * weights + b, rtol=1e-6)
        with stopped(pid):
            start = time.monotonic()
            with pytest.raises(DeviceTimeoutError) as info:
                session.runMainPrograms()
            assert SYNC <= time.monotonic() - start < SYNC + SLACK
            assert re.fullmatch(
                r"main programs on device \d+ \(ipu \d+\): no progress from "
                r"the device for 1 s \(the host sync timeout, IPU_EMULATOR_HOST_SYNC_TIMEOUT\); "
                + STOPPED_PEER.format(pid=pid), str(info.value)), str(info.value)
            # the caller's device: the session's close is bounded and frees its own parts
            start = time.monotonic()
            session.close()
            assert time.monotonic() - start < SYNC + SLACK
            assert not gone(pid)
            # the device's close: SHUTDOWN ignored for the bound, then the stopped one killed
            start = time.monotonic()
            dev.close()
            assert time.monotonic() - start < SYNC + SLACK
            assert gone(pid)
    finally:
        session.close()
        dev.close()


def test_a_host_callback_slower_than_the_bound_is_not_the_device_stalling(model, weights):
    """The bound is on the device's progress: while the host services a stream event (a
    callback, e.g. one waiting for the application's queue) the device waits for the host."""
    a, b = np.full(SHAPE, 3, np.float32), np.ones(SHAPE, np.float32)
    out: list[np.ndarray] = []

    def slow_a(view: memoryview) -> None:
        threading.Event().wait(SYNC * 1.5)   # the application is slower than the bound
        fill(a)(view)
    with DeviceManager().getDevice(1, wait_config=PATIENT) as dev, Session(model) as session:
        session.bindToDevice(dev)
        session.setCallbackForAnchor("tensor_A", slow_a)
        session.setCallbackForAnchor("tensor_B", fill(b))
        session.setCallbackForAnchor("tensor_C", lambda v: out.append(
            np.frombuffer(v, np.float32).reshape(SHAPE).copy()))
        session.setCallbackForAnchor("weights_saved", lambda v: None)
        session.runMainPrograms()
    np.testing.assert_allclose(out[0], a * weights + b, rtol=1e-6)


def test_session_load_on_a_stopped_ipu_process_is_bounded(model):
    with DeviceManager().getDevice(1, wait_config=PATIENT) as dev:
        pid = dev.pids()[0]
        dev.link.start()   # READY read: what is left to wait for is the LOAD
        with stopped(pid), Session(model) as session:
            start = time.monotonic()
            with pytest.raises(DeviceTimeoutError) as info:
                session.bindToDevice(dev)   # LOAD: its own timeout is minutes
            assert SYNC <= time.monotonic() - start < SYNC + SLACK
            assert re.fullmatch(
                r"LOAD on device \d+ \(ipu \d+\): no progress from the device for 1 s \(the "
                r"host sync timeout, IPU_EMULATOR_HOST_SYNC_TIMEOUT\); "
                + STOPPED_PEER.format(pid=pid), str(info.value)), str(info.value)


def test_queue_enqueue_with_a_stopped_device_is_bounded(model):
    with DeviceManager().getDevice(1, wait_config=PATIENT) as dev, Session(model) as session:
        pid = dev.pids()[0]
        session.bindToDevice(dev)
        qm = session.createQueueManager(1)   # one transfer per queue
        a = np.ones(SHAPE, np.float32)
        queue = qm.inputQueue("tensor_A")
        with stopped(pid):
            queue.enqueue(a)                   # the one buffer
            start = time.monotonic()
            with pytest.raises(DeviceTimeoutError) as info:
                queue.enqueue(a)               # nobody takes the first: full
            assert SYNC <= time.monotonic() - start < SYNC + SLACK
            assert re.fullmatch(
                r"SpscRingBuffer 'tensor_A': all 1 buffers stayed full for 1 s: the consumer "
                r"took nothing \(the host sync timeout, IPU_EMULATOR_HOST_SYNC_TIMEOUT\); "
                r"device \d+ \(ipu \d+\): " + STOPPED_PEER.format(pid=pid),
                str(info.value)), str(info.value)


# -- daemon mode: a stopped daemon -----------------------------------------------------------

def daemon_pid(daemon) -> int:
    return int(daemon.status()["daemon_pid"])


def test_runner_close_with_the_daemon_stopped_releases_locally(daemon, model_path, weights,
                                                               monkeypatch, caplog):
    monkeypatch.setenv(wire.ENV_VAR, daemon.socket)
    runner = model_runtime.ModelRunner(model_runtime.PopefPaths([model_path]))
    a = np.ones(SHAPE, np.float32)
    np.testing.assert_allclose(runner.execute({"tensor_A": a, "tensor_B": a})["tensor_C"],
                               a * weights + a, rtol=1e-6)
    dpid = daemon_pid(daemon)
    with stopped(dpid), caplog.at_level(logging.WARNING):
        start = time.monotonic()
        runner.close()
        assert time.monotonic() - start < SYNC + SLACK
    assert re.search(rf"the IPU emulator daemon at {re.escape(daemon.socket)} \(pid {dpid}, "
                     rf"stopped \(state T\)\) did not answer release within 1 s .*; ipus \[\d\] "
                     rf"released locally", caplog.text), caplog.text
    # continued, the daemon took the closed connection as the release: both IPUs attach
    monkeypatch.setenv("IPU_EMULATOR_HOST_SYNC_TIMEOUT", "60")
    wait = DeviceWaitConfig(timedelta(seconds=60), timedelta(seconds=0.05))
    devices = DeviceManager(daemon=daemon.socket).get_devices_all_or_none(
        model_runtime.popef.load_model([model_path]), 2, wait)
    for dev in devices:
        dev.close()


def test_attach_with_the_daemon_stopped_is_bounded(daemon):
    dm = DeviceManager(daemon=daemon.socket)   # hello answered
    dpid = daemon_pid(daemon)
    with stopped(dpid):
        start = time.monotonic()
        with pytest.raises(DeviceTimeoutError) as info:
            dm.getDevice(1, wait_config=PATIENT)
        assert SYNC <= time.monotonic() - start < SYNC + SLACK
        assert str(info.value) == (
            f"the IPU emulator daemon at {daemon.socket} (pid {dpid}, stopped (state T)) did "
            "not answer attach within 1 s (the host sync timeout is "
            "IPU_EMULATOR_HOST_SYNC_TIMEOUT); continue or restart it")
        # a manager made now uses the hello kept for this socket; asking it is bounded too
        assert DeviceManager(daemon=daemon.socket).system.num_ipus == dm.system.num_ipus
        start = time.monotonic()
        with pytest.raises(DeviceTimeoutError, match=rf"\(pid {dpid}, stopped \(state T\)\) "
                                                     "did not answer hello within 1 s"):
            DaemonClient(daemon.socket).request({"op": "hello"})
        assert time.monotonic() - start < SYNC + SLACK
    # continued: the abandoned attach was released (its connection closed)
    with dm.getDevice(1, wait_config=PATIENT) as dev:
        assert dev.pids()[0] in daemon.pool_pids
