"""Session on a loopback device: the IPU process's loop on a thread, no process.

The seeds' example model: ``tensor_C = tensor_A * weights + tensor_B``; the Load
program feeds ``weights`` from the PopEF data, the Save program streams them back
through ``weights_saved``.
"""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from host_runtime import popef
from host_runtime.devices import Device
from host_runtime.devices.loopback import (is_loopback, loopback_device, loopback_ipus,
                                           loopback_manager)
from host_runtime.errors import (BadRequestError, DeviceExecutionError, DeviceLostError,
                                 InvalidStateError, RemoteTraceback)
from host_runtime.session._session import Session
from tests._helpers import gather_model, gather_path  # noqa: F401  (fixtures)
from ipu_emulator.ipu.launcher import IpuSpec
from ipu_emulator.ipu.in_thread import launch_loopback
from shm import naming
from tests.unit._loopback import children, model, model_path, offline, weights  # noqa: F401
from tools.pytest_plugin.machine import shm_entries

SHAPE = (2, 3)


def rand(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32)


class Streams:
    """Callbacks over numpy arrays, counting their calls."""

    def __init__(self, s: Session, a: np.ndarray, b: np.ndarray) -> None:
        self.inputs = {"tensor_A": a, "tensor_B": b}
        self.outputs: dict[str, list[np.ndarray]] = {}
        self.calls: dict[str, int] = {}
        for name in self.inputs:
            s.setCallbackForAnchor(name, self._feed(name))
        for name in ("tensor_C", "weights_saved"):
            s.setCallbackForAnchor(name, self._sink(name))

    def _feed(self, name: str):
        def cb(view: memoryview) -> None:
            self.calls[name] = self.calls.get(name, 0) + 1
            np.frombuffer(view, np.float32)[:] = self.inputs[name].ravel()
        return cb

    def _sink(self, name: str):
        def cb(view: memoryview) -> None:
            self.calls[name] = self.calls.get(name, 0) + 1
            self.outputs.setdefault(name, []).append(
                np.frombuffer(view, np.float32).reshape(SHAPE).copy())
        return cb


def test_load_main_save_with_callbacks_match_numpy(model, weights):
    with offline():
        with loopback_device(model) as dev, Session(model) as s:
            assert is_loopback(dev) and dev.pids() == [os.getpid()]
            s.bindToDevice(dev)
            st = Streams(s, rand(1), rand(2))
            s.runLoadPrograms()
            for i in range(4):
                st.inputs["tensor_A"], st.inputs["tensor_B"] = rand(10 + i), rand(20 + i)
                s.runMainPrograms()
                np.testing.assert_allclose(st.outputs["tensor_C"][-1],
                                           rand(10 + i) * weights + rand(20 + i), rtol=1e-6)
            s.runSavePrograms()
            np.testing.assert_array_equal(st.outputs["weights_saved"], [weights])
            assert st.calls == {"tensor_A": 4, "tensor_B": 4, "tensor_C": 4,
                                "weights_saved": 1}
        assert not dev.isAttached()


def test_the_fixture_device_runs_a_session_and_refuses_bad_requests(loopback_device, model,
                                                                      weights):
    before = children()
    with Session(model) as s:
        s.bindToDevice(loopback_device)
        assert s.device() is loopback_device and loopback_device.isActiveSession(s)
        st = Streams(s, np.ones(SHAPE, np.float32), np.zeros(SHAPE, np.float32))
        s.runMainPrograms()
        np.testing.assert_allclose(st.outputs["tensor_C"][-1], weights, rtol=1e-6)
        with pytest.raises(BadRequestError, match=r"program indices \[7\] do not exist; the "
                                                  r"executable has programs 0..2"):
            s.runPrograms([7])
        with pytest.raises(BadRequestError, match="unknown anchor 'nope'; expected one of"):
            s.setCallbackForAnchor("nope", lambda v: None)
        s.runMainPrograms()   # still usable
        assert len(st.outputs["tensor_C"]) == 2
    assert children() == before


def test_a_callback_exception_fails_the_run_and_the_session_stays_usable(loopback_device,
                                                                         model, weights):
    with Session(model) as s:
        s.bindToDevice(loopback_device)
        st = Streams(s, np.ones(SHAPE, np.float32), np.zeros(SHAPE, np.float32))

        def bad(view: memoryview) -> None:
            raise KeyError("no data for B")
        s.setCallbackForAnchor("tensor_B", bad)
        with pytest.raises(DeviceExecutionError, match="callback of anchor 'tensor_B' raised "
                                                       "KeyError") as info:
            s.runMainPrograms()
        assert isinstance(info.value.__cause__, KeyError)
        s.setCallbackForAnchor("tensor_B", st._feed("tensor_B"))
        s.runMainPrograms()
        np.testing.assert_allclose(st.outputs["tensor_C"][-1], weights, rtol=1e-6)


def test_a_device_side_error_carries_the_interpreters_traceback(gather_model):
    out: list[float] = []
    idx = [2]
    with offline(), loopback_device(gather_model) as dev, Session(gather_model) as s:
        s.bindToDevice(dev)
        s.setCallbackForAnchor("idx", lambda v: v.__setitem__(
            slice(None), np.array(idx, np.int64).tobytes()))
        s.setCallbackForAnchor("out", lambda v: out.append(float(np.frombuffer(v, np.float32)[0])))
        s.runMainPrograms()
        idx[0] = 99
        with pytest.raises(DeviceExecutionError, match="program 1 failed") as info:
            s.runMainPrograms()
        assert "indices element out of data bounds" in str(info.value)
        cause = info.value.__cause__
        assert isinstance(cause, RemoteTraceback) and "DeviceProgramError" in cause.tb
        idx[0] = 3
        s.runMainPrograms()
        assert out == [20.0, 30.0]


def test_stop_interrupts_a_run_waiting_on_a_callback_free_stream(loopback_device, model):
    """A run blocked in a callback-less input (a queue nobody fills) ends with stop()."""
    import threading

    with Session(model) as s:
        s.bindToDevice(loopback_device)
        qm = s.createQueueManager()
        assert set(qm.inputs) == {"tensor_A", "tensor_B"}
        errors: list[BaseException] = []

        def run() -> None:
            try:
                s.runMainPrograms()
            except BaseException as exc:
                errors.append(exc)
        t = threading.Thread(target=run)
        t.start()
        s.stop()
        t.join(30)
        assert not t.is_alive() and s.isStopped()
        assert len(errors) == 1 and isinstance(errors[0], InvalidStateError), errors
        with pytest.raises(InvalidStateError, match=r"stopped; call reload\(\)"):
            s.runMainPrograms()


def test_a_killed_loopback_ipu_is_a_lost_device(model):
    with offline(), loopback_device(model) as dev, Session(model) as s:
        s.bindToDevice(dev)
        st = Streams(s, np.ones(SHAPE, np.float32), np.zeros(SHAPE, np.float32))
        s.runMainPrograms()
        (ipu,) = loopback_ipus(dev)
        ours = shm_entries(naming.current_tag())
        ipu.kill()   # the emulated SIGKILL: the device thread ends without a BYE
        assert not ipu.thread.is_alive() and ipu.returncode() == -signal.SIGKILL
        assert not ipu.alive() and "was killed by signal SIGKILL" in ipu.describe_exit()
        # the host is alive: the device side unlinked none of its objects (ProcessHooks)
        assert shm_entries(naming.current_tag()) == ours
        with pytest.raises(DeviceLostError, match=r"IPU model device \(1 x ipu21, 1472 tiles\): "
                                                  r"IPU process \d+ was killed by signal SIGKILL"):
            s.runMainPrograms()
        assert len(st.outputs["tensor_C"]) == 1


def test_a_loopback_manager_attaches_machine_devices_without_processes(model, weights):
    with offline():
        mgr = loopback_manager()
        with mgr.getDevice(model) as dev, Session(model) as s:
            assert isinstance(dev, Device) and is_loopback(dev)
            assert dev.getId() == 0 and not dev.isIpuModel()
            s.bindToDevice(dev)
            st = Streams(s, rand(3), rand(4))
            s.runMainPrograms()
            np.testing.assert_allclose(st.outputs["tensor_C"][-1], rand(3) * weights + rand(4),
                                       rtol=1e-6)
            # the IPU is held: a second attach of the same device fails
            assert mgr.tryGetSpecificDevice(0) is None
        again = mgr.tryGetSpecificDevice(0)   # released
        assert again is not None
        again.close()


def test_loopback_model_device_follows_the_models_needs(model):
    assert isinstance(model, popef.Model)
    with loopback_device(model) as dev:
        assert dev.numIpus() == 1 and dev.ipuVersion() == model.metadata.ipuVersion()
    with pytest.raises(BadRequestError, match="ipu_version must be 2 or 21, got 3"):
        loopback_device(1, ipu_version=3)


def test_a_loopback_ipu_is_an_ipu_connection_served_by_a_thread():
    with offline():
        ipu = launch_loopback(IpuSpec(ipu_id=-1, label="probe"), log_dir="/nonexistent")
        try:
            ready = ipu.wait_ready(timeout=30)
            assert ready.pid == os.getpid() == ipu.pid and ready.ipu_id == -1
            assert ready.capacity == IpuSpec(ipu_id=-1).capacity
            assert ipu.alive() and ipu.returncode() is None and ipu.thread.daemon
            assert ipu.wait_exit(0.01) is None and ipu.log_tail() == ""
        finally:
            ipu.close()
        assert not ipu.alive() and ipu.returncode() == 0   # SHUTDOWN: a clean exit
        assert ipu.describe_exit() == f"probe (loopback IPU in pid {os.getpid()}) exited with code 0"
        ipu.close()   # idempotent
