"""The Session's internal fast path (docs/design.md section 8) and device-side program errors,
on both kinds of IPU (tests/devices/conftest.py)."""

from __future__ import annotations

import numpy as np
import pytest

from host_runtime.errors import (BadRequestError, DeviceExecutionError, InvalidStateError,
                                 RemoteTraceback)
from host_runtime.session._session import Session, SessionConfig
from tests._helpers import weights_of

SHAPE = (2, 3)


def test_direct_rings_and_main_loop_until_stop(model, device):
    w = weights_of(model, SHAPE)
    with Session(model) as s:
        s.bindToDevice(device)
        direct = s.direct
        for h in ("tensor_A", "tensor_B", "tensor_C"):
            direct.claim(h)
        ra, rb, rc = (direct.input_ring("tensor_A"), direct.input_ring("tensor_B"),
                      direct.output_ring("tensor_C"))
        assert ra.slot_size == rb.slot_size == rc.slot_size == 2 * 3 * 4
        with pytest.raises(BadRequestError, match="'tensor_C' is an output anchor, not an input"):
            direct.input_ring("tensor_C")
        with pytest.raises(BadRequestError, match="unknown anchor 'nope'"):
            direct.claim("nope")
        with pytest.raises(InvalidStateError, match="'tensor_A' is serviced directly"):
            s.setCallbackForAnchor("tensor_A", lambda v: None)
        assert not direct.loop_running()
        loop = direct.start_main_loop()
        assert direct.loop_running() and s.main_loop_running() and not loop.done()
        with pytest.raises(InvalidStateError, match="main loop is running"):
            s.runMainPrograms()
        with pytest.raises(InvalidStateError, match="main loop is running"):
            direct.start_main_loop()
        rng = np.random.default_rng(0)
        for _ in range(50):
            a = rng.standard_normal(SHAPE).astype(np.float32)
            b = rng.standard_normal(SHAPE).astype(np.float32)
            ra.write(a.tobytes())
            rb.write(b.tobytes())
            data, _ = rc.read(timeout=30)
            np.testing.assert_allclose(np.frombuffer(data, np.float32).reshape(SHAPE),
                                       a * w + b, rtol=1e-6)
        assert direct.failure() is None
        s.stop()
        assert loop.result(timeout=30) is None and s.isStopped() and not direct.loop_running()
        with pytest.raises(InvalidStateError, match="the session is stopped"):
            direct.start_main_loop()
        # after reload the claimed anchors are still serviced directly, over the same rings
        s.reload()
        assert direct.input_ring("tensor_A") is ra
        loop = direct.start_main_loop()
        ra.write(np.ones(SHAPE, np.float32).tobytes())
        rb.write(np.zeros(SHAPE, np.float32).tobytes())
        np.testing.assert_allclose(np.frombuffer(rc.read(timeout=30)[0], np.float32).reshape(SHAPE),
                                   w, rtol=1e-6)
        s.stop()
        assert loop.result(timeout=30) is None


def test_the_fast_path_of_a_closed_session_refuses_to_start(model):
    s = Session(model)
    direct = s.direct
    s.close()
    del s
    with pytest.raises(InvalidStateError, match="the session is closed"):
        direct.start_main_loop()
    assert direct.failure() is None and not direct.loop_running()
    direct.stop_main_loop()   # nothing to stop


def test_loop_with_callback_serviced_anchors(model, device):
    w = weights_of(model, SHAPE)
    with Session(model) as s:
        s.bindToDevice(device)
        s.direct.claim("tensor_A")
        s.setCallbackForAnchor("tensor_B", lambda v: v.__setitem__(slice(None), np.ones(SHAPE, np.float32).tobytes()))
        s.direct.claim("tensor_C")
        ra, rc = s.direct.input_ring("tensor_A"), s.direct.output_ring("tensor_C")
        loop = s.direct.start_main_loop()
        for k in range(3):
            ra.write(np.full(SHAPE, k, np.float32).tobytes())
            data, _ = rc.read(timeout=30)
            np.testing.assert_allclose(np.frombuffer(data, np.float32).reshape(SHAPE), k * w + 1,
                                       rtol=1e-6)
        s.stop()
        assert loop.result(timeout=30) is None


def test_onnxruntime_error_comes_back_with_the_device_traceback(gather_model, device):
    idx = [2]
    out: list[float] = []
    with Session(gather_model) as s:
        s.bindToDevice(device)
        s.setCallbackForAnchor("idx", lambda v: v.__setitem__(slice(None), np.array(idx, np.int64).tobytes()))
        s.setCallbackForAnchor("out", lambda v: out.append(float(np.frombuffer(v, np.float32)[0])))
        s.runMainPrograms()
        assert out == [20.0]
        idx[0] = 99
        with pytest.raises(DeviceExecutionError) as info:
            s.runMainPrograms()
        msg = str(info.value)
        assert msg.startswith(f"{device.describe()}: program 1 failed")
        assert "indices element out of data bounds" in msg
        cause = info.value.__cause__
        assert isinstance(cause, RemoteTraceback)
        assert "Traceback (most recent call last)" in cause.tb and "DeviceProgramError" in cause.tb
        assert out == [20.0]
        idx[0] = 3
        s.runMainPrograms()   # the session stays usable
        assert out == [20.0, 30.0]


def test_error_in_the_main_loop_fails_its_future_and_a_new_loop_can_start(gather_model, device):
    with Session(gather_model) as s:
        s.bindToDevice(device)
        s.direct.claim("idx")
        s.direct.claim("out")
        ri, ro = s.direct.input_ring("idx"), s.direct.output_ring("out")
        loop = s.direct.start_main_loop()
        ri.write(np.array([1], np.int64).tobytes())
        assert np.frombuffer(ro.read(timeout=30)[0], np.float32)[0] == 10.0
        ri.write(np.array([-99], np.int64).tobytes())
        with pytest.raises(DeviceExecutionError, match="out of data bounds") as info:
            loop.result(timeout=60)
        assert isinstance(info.value.__cause__, RemoteTraceback)
        loop = s.direct.start_main_loop()
        ri.write(np.array([0], np.int64).tobytes())
        assert np.frombuffer(ro.read(timeout=30)[0], np.float32)[0] == 0.0
        s.stop()
        assert loop.result(timeout=30) is None


def test_stop_main_loop_keeps_the_session_runnable_for_save(model, device):
    w = weights_of(model, SHAPE)
    with Session(model) as s:
        s.bindToDevice(device)
        for h in ("tensor_A", "tensor_B", "tensor_C"):
            s.direct.claim(h)
        ra, rb, rc = s.direct.input_ring("tensor_A"), s.direct.input_ring("tensor_B"), s.direct.output_ring("tensor_C")
        loop = s.direct.start_main_loop()
        ra.write(np.ones(SHAPE, np.float32).tobytes())
        rb.write(np.zeros(SHAPE, np.float32).tobytes())
        np.testing.assert_allclose(np.frombuffer(rc.read(timeout=30)[0], np.float32).reshape(SHAPE),
                                   w, rtol=1e-6)
        s.direct.stop_main_loop()          # the device now waits in the next iteration: abandoned
        assert loop.result(timeout=30) is None and not s.isStopped()
        saved: list[np.ndarray] = []
        s.setCallbackForAnchor("weights_saved",
                               lambda v: saved.append(np.frombuffer(v, np.float32).copy()))
        s.runSavePrograms()
        np.testing.assert_array_equal(saved[-1].reshape(SHAPE), w)
        s.direct.stop_main_loop()          # no loop: nothing to do


def test_max_look_ahead_sets_the_depth_of_main_rings(model, device):
    with pytest.raises(BadRequestError, match='max_look_ahead must be "unlimited" or an '
                                              "unsigned integer, got 'soon'"):
        Session(model, SessionConfig(max_look_ahead="soon"))
    with Session(model, SessionConfig(max_look_ahead="3")) as s:
        s.bindToDevice(device)
        assert s.direct.input_ring("tensor_A").num_slots == 4
        assert s.direct.input_ring("weights").num_slots == 2   # load-only anchor
    with Session(model) as s:
        s.bindToDevice(device)
        assert s.direct.output_ring("tensor_C").num_slots == 8  # "unlimited"


def test_ring_depth_option_sizes_the_rings_and_look_ahead_caps_main_ones(model, device):
    from host_runtime.queues._queues import ring_size_multiplier_factory

    depth = ring_size_multiplier_factory.ringSizeMultForMainProgs(model, 5, 1)
    with Session(model, SessionConfig(ring_depth=depth)) as s:
        s.bindToDevice(device)
        assert [s.direct.input_ring(h).num_slots for h in ("tensor_A", "tensor_B", "weights")] \
            == [5, 5, 1]
        assert [s.direct.output_ring(h).num_slots for h in ("tensor_C", "weights_saved")] == [5, 1]
        # a main run still works over these rings (the load-only ring has one slot)
        w = weights_of(model, SHAPE)
        a = np.full(SHAPE, 2, np.float32)
        b = np.full(SHAPE, 1, np.float32)
        out: list[np.ndarray] = []
        s.setCallbackForAnchor("tensor_A", lambda v: v.cast("B").__setitem__(
            slice(None), a.tobytes()))
        s.setCallbackForAnchor("tensor_B", lambda v: v.cast("B").__setitem__(
            slice(None), b.tobytes()))
        s.setCallbackForAnchor("tensor_C",
                               lambda v: out.append(np.frombuffer(v, np.float32).copy()))
        s.runLoadPrograms()
        s.runMainPrograms()
        np.testing.assert_allclose(out[-1].reshape(SHAPE), a * w + b, rtol=1e-6)
    with Session(model, SessionConfig(ring_depth=depth, max_look_ahead="1")) as s:
        s.bindToDevice(device)
        assert s.direct.input_ring("tensor_A").num_slots == 2      # look-ahead 1 caps Main rings
        assert s.direct.input_ring("weights").num_slots == 1
    with Session(model, SessionConfig(ring_depth=lambda a: 10 ** 9)) as s:
        s.bindToDevice(device)
        assert s.direct.output_ring("tensor_C").num_slots == 1024  # capped
    for bad in (0, 2.5, True, None):
        with pytest.raises(BadRequestError, match=(
                rf"SessionConfig.ring_depth gave {bad!r} for anchor 'tensor_A'; "
                r"expected an int >= 1 \(ring slots\)")):
            Session(model, SessionConfig(ring_depth=lambda a, _b=bad: _b))


def test_a_device_running_another_sessions_loop_refuses_a_new_binding(model, device):
    with Session(model) as s1, Session(model) as s2:
        s1.bindToDevice(device)
        for h in ("tensor_A", "tensor_B", "tensor_C"):
            s1.direct.claim(h)
        loop = s1.direct.start_main_loop()
        with pytest.raises(InvalidStateError, match="running the main loop of another session"):
            s2.bindToDevice(device)
        assert device.isActiveSession(s1)
        s1.direct.stop_main_loop()
        assert loop.result(timeout=30) is None
        s2.bindToDevice(device)
        assert device.isActiveSession(s2)


def test_disconnecting_the_streams_ends_the_main_loop(model, device):
    with Session(model) as s:
        s.bindToDevice(device)
        for h in ("tensor_A", "tensor_B", "tensor_C"):
            s.direct.claim(h)
        loop = s.direct.start_main_loop()
        for h in ("tensor_A", "tensor_B"):
            s.direct.input_ring(h).invalidate()
        with pytest.raises(InvalidStateError, match="streams were disconnected"):
            loop.result(timeout=60)
        assert not s.isStopped()
        s.reload()                       # resets the rings
        ra, rb, rc = s.direct.input_ring("tensor_A"), s.direct.input_ring("tensor_B"), s.direct.output_ring("tensor_C")
        loop = s.direct.start_main_loop()
        ra.write(np.zeros(SHAPE, np.float32).tobytes())
        rb.write(np.full(SHAPE, 7, np.float32).tobytes())
        np.testing.assert_array_equal(
            np.frombuffer(rc.read(timeout=30)[0], np.float32), np.full(6, 7, np.float32))
        s.stop()
        assert loop.result(timeout=30) is None


def test_a_run_whose_output_was_disconnected_fails_rather_than_answer_without_it(model, device):
    """Dummy data "until the run returns": what a run computed after its streams were
    disconnected is dropped, and the run says so rather than answer as done."""
    with Session(model) as s:
        s.bindToDevice(device)
        s.direct.claim("tensor_C")
        out = s.direct.output_ring("tensor_C")

        def fill_a(view: memoryview) -> None:
            out.invalidate()   # disconnected (without a STOP) while the run waits for inputs
            view.cast("B")[:] = np.zeros(SHAPE, np.float32).tobytes()

        s.setCallbackForAnchor("tensor_A", fill_a)
        s.setCallbackForAnchor("tensor_B", lambda v: v.cast("B").__setitem__(
            slice(None), np.ones(SHAPE, np.float32).tobytes()))
        with pytest.raises(InvalidStateError, match="its outputs were dropped"):
            s.runMainPrograms()
        assert not out.readable()
