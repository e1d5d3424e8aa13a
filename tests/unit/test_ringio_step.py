"""The IPU process's Main iterations in one C call (``_RingIO.run_group``, the
``ipu_emulator.ipu._stepcore`` Step).

White-box, in one process: the test holds the host ends of real stream rings,
the device ends go to a ``_RingIO`` over an ``Interpreter`` of the example
model, and a stand-in device gives it what it needs of ``DeviceProcess``.
That the C step served an iteration is shown by the step-by-step path
raising if it is used. The first pass over the rings' slots runs step by
step: it takes the rings' roles and binds each slot combination.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import host_runtime as model_runtime
from host_runtime.memory._shared import shared_location
import shm.ring as ring_module
from ipu_emulator.ipu._host_memory import HostMemory
from ipu_emulator.ipu._stream_io import _Loaded, _RingIO, _Stream
from ipu_emulator.compiler import CompileOptions, ModelSpec, compile_onnx
from ipu_emulator.errors import DeviceProgramError
from ipu_emulator.executable import Executable
from ipu_emulator.ipu.interpreter import Interpreter
from ipu_emulator.ipu_protocol import (MODE_DIRECT, MODE_EVENT, TAG_SHARED, Message, Op,
                                   host_memory_descriptor)
from shm import Ring
from tests.models import simple_model

pytestmark = pytest.mark.skipif(ring_module._ringcore is None,
                                reason="shm._ringcore is not built (IPU_EMULATOR_RING_C=0)")

SHAPE = (2, 3)
NBYTES = 24
SLOTS = 4
SLOT_SIZE = 256   # room for a shared-memory descriptor
LOAD, MAIN = 0, 1


class Device:
    """What _RingIO uses of DeviceProcess."""

    keeps_apart = True

    def __init__(self) -> None:
        self.host_memory = HostMemory()
        self.posted: list[Message] = []

    def post(self, msg: Message) -> None:
        self.posted.append(msg)

    def wait_on(self, fn: Any) -> Any:
        return fn(5.0)   # a test that has to wait has failed: the rings hold what it needs


class Rig:
    def __init__(self, out_mode: int = MODE_DIRECT, a_mode: int = MODE_DIRECT) -> None:
        result = compile_onnx(ModelSpec(simple_model(SHAPE, seed=2)), CompileOptions(
            weights_as_tensor_data=True, save_weights=True))
        self.weights = np.frombuffer(next(a.data for a in result.anchors if a.name == "weights"),
                                     np.float32).reshape(SHAPE)
        self.interp = Interpreter(Executable.from_bytes(result.executable.to_bytes()))
        self.host: dict[str, Ring] = {}
        self.loaded = _Loaded("k", self.interp, [])
        specs = [("weights", "in"), ("tensor_A", "in"), ("tensor_B", "in"), ("tensor_C", "out"),
                 ("weights_saved", "out")]
        for k, (handle, direction) in enumerate(specs):
            host = self.host[handle] = Ring.create(SLOT_SIZE, SLOTS)
            mode = {"tensor_C": out_mode, "tensor_A": a_mode}.get(handle, MODE_DIRECT)
            s = _Stream(k, handle, direction, NBYTES, Ring.attach(host.name), mode)
            self.loaded.streams.append(s)
            self.loaded.by_handle[handle] = s
        self.dev = Device()
        self.io = _RingIO(self.dev, self.loaded)   # type: ignore[arg-type]
        self.host["weights"].write(self.weights)
        self.interp.run_program(LOAD, self.io)

    def send(self, a: Any, b: Any, tag_a: int = 0) -> None:
        self.host["tensor_A"].write(a, tag_a)
        self.host["tensor_B"].write(b)

    def result(self) -> tuple[np.ndarray, int]:
        data, tag = self.host["tensor_C"].read(timeout=0)
        return np.frombuffer(data, np.float32).reshape(SHAPE) if data else data, tag

    def warm(self, first: int = 100) -> None:
        """One pass over the slots, step by step, checked."""
        for k in range(SLOTS):
            a, b = _pair(first + k)
            self.send(a, b)
            self.interp.run_program(MAIN, self.io)
            np.testing.assert_allclose(self.result()[0], a * self.weights + b, rtol=1e-6)

    def no_step_by_step(self) -> None:
        """From now on an iteration done step by step fails the test."""
        def refuse(*args: Any) -> Any:
            raise AssertionError("the step-by-step path ran")
        for name in ("acquire_input", "acquire_output", "read_input", "write_output"):
            setattr(self.io, name, refuse)

    def close(self) -> None:
        self.loaded.close()
        for r in self.host.values():
            r.close()
            r.unlink()
        self.dev.host_memory.close()


@pytest.fixture
def rig():
    r = Rig()
    yield r
    r.close()


def _pair(k: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(k)
    return (rng.standard_normal(SHAPE).astype(np.float32),
            rng.standard_normal(SHAPE).astype(np.float32))


def test_after_one_pass_over_the_slots_main_runs_as_one_c_step(rig) -> None:
    rig.warm()
    rig.no_step_by_step()
    pairs = [_pair(k) for k in range(SLOTS)]   # a ring's worth of requests in flight
    for a, b in pairs:
        rig.send(a, b)
    for _ in pairs:
        rig.interp.run_program(MAIN, rig.io)
    results = [rig.result() for _ in pairs]
    for a, b in [_pair(10 + k) for k in range(2 * SLOTS)]:   # then one at a time
        pairs.append((a, b))
        rig.send(a, b)
        rig.interp.run_program(MAIN, rig.io)
        results.append(rig.result())
    for (a, b), (out, tag) in zip(pairs, results, strict=True):
        assert tag == 0
        np.testing.assert_allclose(out, a * rig.weights + b, rtol=1e-6)
    assert rig.host["tensor_A"].writable() == SLOTS and rig.host["tensor_C"].readable() == 0
    assert rig.dev.posted == []


def test_an_input_in_host_memory_with_its_output_redirected(rig) -> None:
    a_host = model_runtime.empty_shared(SHAPE, np.float32)
    c_host = model_runtime.empty_shared(SHAPE, np.float32)
    (a_name, a_off) = shared_location(a_host)
    (c_name, c_off) = shared_location(c_host)
    descriptor = host_memory_descriptor(a_name, a_off, NBYTES,
                                        [("tensor_C", c_name, c_off, NBYTES)])
    for k in range(3 * SLOTS):   # a pass step by step (resolves and binds), then C steps
        if k == SLOTS:
            rig.no_step_by_step()
        a, b = _pair(10 + k)
        a_host[...] = a
        c_host[...] = 0
        rig.send(descriptor, b, tag_a=TAG_SHARED)
        rig.interp.run_program(MAIN, rig.io)
        assert rig.result() == (b"", TAG_SHARED)   # "the output is in your memory"
        np.testing.assert_allclose(c_host, a * rig.weights + b, rtol=1e-6)


def test_an_iteration_whose_input_is_not_there_yet_is_left_to_the_waiting_path(rig) -> None:
    rig.warm()
    a, b = _pair(20)
    rig.host["tensor_A"].write(a)   # B comes later: the C step declines, nothing is taken
    group = next(iter(rig.loaded.steps))
    assert rig.io.run_group(group) is False
    assert rig.loaded.by_handle["tensor_A"].ring.readable() == 1
    rig.host["tensor_B"].write(b)
    assert rig.io.run_group(group) is True
    np.testing.assert_allclose(rig.result()[0], a * rig.weights + b, rtol=1e-6)


def test_onnxruntime_failing_in_a_c_step_fails_the_iteration_and_keeps_the_rings(rig) -> None:
    rig.warm()
    group = next(iter(rig.loaded.steps))

    def fail(*args: Any) -> None:
        raise RuntimeError("onnxruntime ran out of memory")
    saved = dict(group.calls)
    group.calls.update({key: (entry[0], fail, ()) for key, entry in saved.items()})
    rig.send(*_pair(31))
    with pytest.raises(DeviceProgramError, match=r"graph 0 failed in onnxruntime: "
                                                 r"onnxruntime ran out of memory"):
        rig.interp.run_program(MAIN, rig.io)
    # the request is consumed, nothing is published, nothing is left held
    assert rig.host["tensor_A"].writable() == SLOTS and rig.host["tensor_B"].writable() == SLOTS
    assert rig.host["tensor_C"].readable() == 0
    group.calls.update(saved)
    a, b = _pair(32)   # the next request is served (the slots of its inputs and output
    #                    no longer pair up as before: step by step, which binds them)
    rig.send(a, b)
    rig.interp.run_program(MAIN, rig.io)
    np.testing.assert_allclose(rig.result()[0], a * rig.weights + b, rtol=1e-6)


def test_an_output_in_event_mode_keeps_the_step_by_step_path() -> None:
    r = Rig(out_mode=MODE_EVENT)
    try:
        for k in range(2 * SLOTS):
            a, b = _pair(40 + k)
            r.send(a, b)
            r.interp.run_program(MAIN, r.io)
            np.testing.assert_allclose(r.result()[0], a * r.weights + b, rtol=1e-6)
        assert list(r.loaded.steps.values()) == [None]
        assert [(m.op, m.index) for m in r.dev.posted] == [(Op.OUT, 3)] * 2 * SLOTS
    finally:
        r.close()


def test_main_runs_back_to_back_until_a_control_message_or_the_deadline() -> None:
    import time

    control_far = Ring.create(64, 4)

    class Controlled(Device):
        control = Ring.attach(control_far.name)

    control_far.write(b"")
    Controlled.control.read()   # the IPU process reads its control ring
    r = Rig()
    r.dev = Controlled()
    r.io = _RingIO(r.dev, r.loaded)   # type: ignore[arg-type]
    try:
        r.warm()
        r.no_step_by_step()
        far = time.monotonic_ns() + 60 * 10**9
        pairs = [_pair(50 + k) for k in range(SLOTS)]
        for a, b in pairs:
            r.send(a, b)
        assert r.interp.run_program_many(MAIN, r.io, far) == SLOTS   # then no more inputs
        for a, b in pairs:
            np.testing.assert_allclose(r.result()[0], a * r.weights + b, rtol=1e-6)
        r.send(*pairs[0])
        assert r.interp.run_program_many(MAIN, r.io, time.monotonic_ns() - 1) == 0
        control_far.write(b"STOP")   # a control message waits: the loop looks at it first
        assert r.interp.run_program_many(MAIN, r.io, far) == 0
        Controlled.control.read()
        assert r.interp.run_program_many(MAIN, r.io, far) == 1
        np.testing.assert_allclose(r.result()[0], pairs[0][0] * r.weights + pairs[0][1],
                                   rtol=1e-6)
    finally:
        r.close()
        Controlled.control.close()
        control_far.close()
        control_far.unlink()


def test_an_iteration_polls_for_its_inputs_then_runs_as_one_c_step(rig) -> None:
    rig.warm()
    rig.no_step_by_step()
    a, b = _pair(60)
    rig.host["tensor_A"].write(a)
    polled = []

    def poll(ready: Any) -> bool:
        assert not ready()                  # B is missing: nothing was taken meanwhile
        assert rig.loaded.by_handle["tensor_A"].ring.readable() == 1
        rig.host["tensor_B"].write(b)       # it arrives while the IPU process polls
        polled.append(True)
        return bool(ready())
    rig.io._wait.poll = poll   # type: ignore[method-assign]
    rig.interp.run_program(MAIN, rig.io)
    assert polled == [True]
    np.testing.assert_allclose(rig.result()[0], a * rig.weights + b, rtol=1e-6)


def test_inputs_in_event_mode_are_not_polled_for_by_the_c_step() -> None:
    r = Rig(a_mode=MODE_EVENT)
    try:
        r.warm()
        group = next(iter(r.loaded.steps))
        step, inputs_there = r.loaded.steps[group]
        assert step is not None and inputs_there is None   # its NEED must be posted first

        def poll(ready: Any) -> bool:
            raise AssertionError("polled")
        r.io._wait.poll = poll   # type: ignore[method-assign]
        assert r.io.run_group(group) is False
        a, b = _pair(61)
        r.send(a, b)
        assert r.io.run_group(group) is True   # with its inputs there, the step serves it
        np.testing.assert_allclose(r.result()[0], a * r.weights + b, rtol=1e-6)
    finally:
        r.close()
