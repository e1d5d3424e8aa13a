"""Multi-IPU devices (one IPU process, or loopback thread, per IPU: all or none) and version
matching, on both kinds of IPU (tests/devices/conftest.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from host_runtime.errors import DeviceLostError, DeviceUnavailableError
from host_runtime.session._session import Session
from ipu_emulator.system import SystemConfig, load_system_config
from tests._helpers import PATIENT


def test_a_two_ipu_device_runs_and_fails_when_any_of_its_ipus_dies(kind, model):
    dm = kind.manager()
    with kind.device(2) as dev:
        assert dev.numIpus() == 2 and len(dev.processes) == 2
        assert dev.memoryBytes() == 2 * 1472 * 624 * 1024
        if kind.in_thread:
            assert dev.pids() == [os.getpid()] * 2, "loopback IPUs are threads of this process"
        else:   # a device of the machine: its IPUs are held, each in a process of its own
            assert len(set(dev.pids())) == 2
            assert dev.ipus() in ([0, 1], [2, 3]) and dev.id in (4, 5)
            with pytest.raises(DeviceUnavailableError,
                               match=f"ipu {dev.ipus()[0]} by pid {os.getpid()}"):
                dm.getSpecificDevice(dev.ipus()[0])
        with Session(model) as s:
            s.bindToDevice(dev)
            out: list[np.ndarray] = []
            s.setCallbackForAnchor("tensor_A", lambda v: v.__setitem__(
                slice(None), np.ones(4, np.float32).tobytes()))
            s.setCallbackForAnchor("tensor_B", lambda v: v.__setitem__(slice(None), bytes(16)))
            s.setCallbackForAnchor("tensor_C", lambda v: out.append(
                np.frombuffer(v, np.float32).copy()))
            s.runMainPrograms()
            np.testing.assert_array_equal(out[-1], np.frombuffer(model.tensorData("weights").data,
                                                                 np.float32))
            secondary = kind.lose(dev, 1)
            with pytest.raises(DeviceLostError,
                               match=f"IPU process {secondary} was killed by signal SIGKILL"):
                s.runMainPrograms()
            assert len(out) == 1
    assert not dev.isAttached()
    if not kind.in_thread:   # all of its IPUs are free again
        with dm.getDevice(2, wait_config=PATIENT) as again:
            assert again.numIpus() == 2


def test_model_ipu_version_must_match_the_machine(kind, model):
    ipu2 = kind.manager(SystemConfig(ipu_version="ipu2", home=load_system_config().home))
    with pytest.raises(DeviceUnavailableError, match="the model needs ipu21 IPUs, but this "
                                                     "machine's IPUs are ipu2"):
        ipu2.getDevice(model)
    assert ipu2.tryGetDevice(model) is None


def test_first_requests_of_several_threads_start_one_event_thread(kind):
    """A device's first request is sent before its event thread starts (the IPU works on
    it meanwhile); first requests racing from several threads start one thread, and every
    one is answered."""
    import threading

    from ipu_emulator.ipu_protocol import Op

    with kind.device() as dev:
        link = dev.link
        barrier = threading.Barrier(8)
        futures: list = []
        lock = threading.Lock()

        def first() -> None:
            barrier.wait(30)
            fut = link.request(Op.PING)
            with lock:
                futures.append(fut)
        threads = [threading.Thread(target=first) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for fut in futures:
            assert fut.result(60) is None
        assert len(futures) == 8
        names = [t.name for t in threading.enumerate()
                 if t.name == f"ipu-events-{link.pid}"]
        assert names == [f"ipu-events-{link.pid}"]
