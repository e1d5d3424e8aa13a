"""Main's loop started without a round trip for the load programs: where no callback of the
session can run, the load programs go ahead of the LOOP and are waited for after it; their
failure is raised by start_main_loop. On both kinds of IPU (tests/devices/conftest.py)."""

from __future__ import annotations

import concurrent.futures as cf

import numpy as np
import pytest

from host_runtime.errors import DeviceExecutionError
from host_runtime.session import _running
from host_runtime.session._session import Session
from ipu_emulator.ipu_protocol import Op
from tests._helpers import weights_of

SHAPE = (2, 3)


def _bound(model, device) -> Session:
    """A session on ``device`` whose Load and Main streams are direct or constant (the
    weights frozen, as ModelRunner does): no callback of the session can run in them."""
    s = Session(model)
    s.freeze_input("weights", memoryview(weights_of(model, SHAPE).tobytes()))
    s.bindToDevice(device)
    for h in ("tensor_A", "tensor_B", "tensor_C"):
        s.direct.claim(h)
    return s


def test_the_load_programs_go_ahead_of_the_loop_and_are_waited_for_after_it(model, device,
                                                                            monkeypatch):
    sent: list[Op] = []
    finished: list[tuple[str, list[Op]]] = []
    real_finish = _running.Runs._finish

    def finish(self: _running.Runs, dev, fut, what):
        finished.append((what, list(sent)))
        return real_finish(self, dev, fut, what)
    monkeypatch.setattr(_running.Runs, "_finish", finish)
    w = weights_of(model, SHAPE)
    with _bound(model, device) as s:
        real_request = device.link.request

        def request(op, *args, **kwargs):
            sent.append(op)
            return real_request(op, *args, **kwargs)
        monkeypatch.setattr(device.link, "request", request)
        ra, rb, rc = (s.direct.input_ring("tensor_A"), s.direct.input_ring("tensor_B"),
                      s.direct.output_ring("tensor_C"))
        loop = s.direct.start_main_loop()
        # the load programs' RUN, then the LOOP, both sent before the RUN was waited for
        assert finished == [("load programs", [Op.RUN, Op.LOOP])]
        a, b = np.full(SHAPE, 2, np.float32), np.ones(SHAPE, np.float32)
        ra.write(a.tobytes())
        rb.write(b.tobytes())
        data, _ = rc.read(timeout=30)
        np.testing.assert_allclose(np.frombuffer(data, np.float32).reshape(SHAPE), a * w + b,
                                   rtol=1e-6)
        s.stop()
        assert loop.result(timeout=30) is None


def test_a_callback_served_stream_makes_the_load_programs_run_first(model, device,
                                                                    monkeypatch):
    # a callback may run during the load programs: its error must be theirs, so they are
    # waited for before the LOOP is sent
    sent: list[Op] = []
    finished: list[list[Op]] = []
    real_finish = _running.Runs._finish

    def finish(self: _running.Runs, dev, fut, what):
        finished.append(list(sent))
        return real_finish(self, dev, fut, what)
    monkeypatch.setattr(_running.Runs, "_finish", finish)
    with Session(model) as s:
        s.bindToDevice(device)
        s.direct.claim("tensor_A")
        s.direct.claim("tensor_C")
        s.setCallbackForAnchor("tensor_B", lambda v: v.__setitem__(
            slice(None), np.ones(SHAPE, np.float32).tobytes()))
        real_request = device.link.request

        def request(op, *args, **kwargs):
            sent.append(op)
            return real_request(op, *args, **kwargs)
        monkeypatch.setattr(device.link, "request", request)
        s.direct.input_ring("tensor_A")
        loop = s.direct.start_main_loop()
        assert finished == [[Op.RUN]]   # waited for before the LOOP
        s.stop()
        assert loop.result(timeout=30) is None


def test_a_failure_of_the_load_programs_sent_ahead_is_raised_by_start(model, device,
                                                                      monkeypatch):
    real_start = _running.Runs._start

    def start(self: _running.Runs, dev, binding, progs):
        if list(progs) == list(self._streams.flow.load()):
            failed: cf.Future[None] = cf.Future()
            failed.set_exception(DeviceExecutionError("load program 0 failed on the device"))
            return failed
        return real_start(self, dev, binding, progs)
    monkeypatch.setattr(_running.Runs, "_start", start)
    s = _bound(model, device)
    with pytest.raises(DeviceExecutionError, match="load program 0 failed on the device"):
        s.direct.start_main_loop()
    assert s.main_loop_running()   # the LOOP went after them: the session's to stop
    s.close()
    assert not s.main_loop_running()
