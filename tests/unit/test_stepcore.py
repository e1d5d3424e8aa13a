"""ipu_emulator.ipu._stepcore.Step: one step of a stage between rings in one C call,
executing a plan given as data (what each tag means, how each output is published),
or nothing at all.

One process plays both sides: it writes the inputs and reads the outputs
(the far ends) and runs the step (the near ends). "Nothing at all" is checked
by the rings' counters and by the far ends then seeing exactly what they
would have seen without the step.
"""

from __future__ import annotations

import numpy as np
import pytest

import shm.ring as ring_module
from ipu_emulator.ipu import _iteration
from shm import Ring

# Built with shm._ringcore by the same setup.py: a missing _stepcore fails the tests.
pytestmark = pytest.mark.skipif(ring_module._ringcore is None,
                                reason="shm._ringcore is not built (IPU_EMULATOR_RING_C=0)")

N = 16              # floats per transfer
NBYTES = 4 * N
DESCRIPTOR_TAG = 2
REDIRECT_TAG = 5    # an output in memory is published with its own tag (the plan's data)


def ring_step(inputs, input_sizes, outputs, output_sizes, *, output_names, descriptors,
              descriptor_tag, calls):
    """A Step whose plan is: tag 0 is data in the slot, descriptor_tag a table key;
    outputs go out tagged 0, or REDIRECT_TAG when a table entry redirected them."""
    core = _iteration._stepcore
    accepts = ((0, core.IN_SLOT), (descriptor_tag, core.IN_TABLE))
    return core.Step(
        tuple((r.c_handle(), n, accepts) for r, n in zip(inputs, input_sizes)),
        tuple((r.c_handle(), n, name, 0, REDIRECT_TAG, True)
              for r, n, name in zip(outputs, output_sizes, output_names)),
        descriptors, calls)


def _address(buf) -> int:
    return int(np.frombuffer(buf, np.uint8).ctypes.data)


class Stage:
    """Input rings a, b -> output ring c, with out = a * 2 + b over each slot combination."""

    def __init__(self, slots: int = 2) -> None:
        self.a_far, self.b_far, self.c_near = (Ring.create(NBYTES, slots) for _ in range(3))
        self.a, self.b, self.c_far = (Ring.attach(r.name) for r in
                                      (self.a_far, self.b_far, self.c_near))
        self.descriptors: dict = {}
        self.calls: dict = {}
        self.ran: list[tuple[int, ...]] = []
        self.step = ring_step((self.a, self.b), (NBYTES, NBYTES), (self.c_near,), (NBYTES,),
                              output_names=("c",), descriptors=self.descriptors,
                              descriptor_tag=DESCRIPTOR_TAG, calls=self.calls)
        assert self.step is not None

    def take_roles(self) -> None:
        """The Python path's first use of each near end (the step needs its role taken)."""
        for far, near in ((self.a_far, self.a), (self.b_far, self.b)):
            far.write(np.zeros(N, np.float32))
            near.read()
        self.c_near.write(b"")
        self.c_far.read()

    def add_call(self, a_mem, b_mem, c_mem) -> None:
        """calls[(addresses)] computing c = a * 2 + b into c_mem."""
        a, b, c = (np.frombuffer(m, np.float32, N) for m in (a_mem, b_mem, c_mem))

        def compute(key: tuple[int, ...]) -> None:
            self.ran.append(key)
            np.add(a * 2, b, out=c)
        key = (_address(a_mem), _address(b_mem), _address(c_mem))
        self.calls[key] = (None, compute, (key,))

    def add_slot_calls(self) -> None:
        for ia in self.a._payload:
            for ib in self.b._payload:
                for ic in self.c_near._payload:
                    self.add_call(ia[:NBYTES], ib[:NBYTES], ic[:NBYTES])

    def send(self, a: np.ndarray, b: np.ndarray) -> None:
        self.a_far.write(a)
        self.b_far.write(b)

    def counters(self) -> tuple[int, ...]:
        return (self.a.readable(), self.b.readable(), self.a_far.writable(),
                self.b_far.writable(), self.c_near.writable(), self.c_far.readable())

    def close(self) -> None:
        for r in (self.a, self.b, self.c_far, self.a_far, self.b_far, self.c_near):
            r.close()
        for r in (self.a_far, self.b_far, self.c_near):
            r.unlink()


@pytest.fixture
def stage():
    s = Stage()
    s.take_roles()
    yield s
    s.close()


def _vectors(k: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(k)
    return (rng.standard_normal(N).astype(np.float32), rng.standard_normal(N).astype(np.float32))


def test_steps_compute_publish_and_release_across_wraparound(stage) -> None:
    stage.add_slot_calls()
    for k in range(5):   # rings of 2 slots: wraps around twice
        a, b = _vectors(k)
        stage.send(a, b)
        assert stage.step.run() is True
        data, tag = stage.c_far.read()
        assert tag == 0
        np.testing.assert_array_equal(np.frombuffer(data, np.float32), a * 2 + b)
        assert stage.counters() == (0, 0, 2, 2, 2, 0)
    assert len(stage.ran) == 5 and len(set(stage.ran)) == 2   # slot pairs alternate


def test_nothing_happens_while_an_input_is_missing(stage) -> None:
    stage.add_slot_calls()
    a, b = _vectors(1)
    stage.a_far.write(a)
    before = stage.counters()
    assert stage.step.run() is False
    assert stage.counters() == before and stage.ran == []
    stage.b_far.write(b)
    assert stage.step.run() is True   # the token given back on a is taken again
    np.testing.assert_array_equal(np.frombuffer(stage.c_far.read()[0], np.float32), a * 2 + b)


def test_nothing_happens_while_the_output_ring_is_full(stage) -> None:
    stage.add_slot_calls()
    stage.c_near.write(b"x")
    stage.c_near.write(b"y")
    a, b = _vectors(2)
    stage.send(a, b)
    before = stage.counters()
    assert stage.step.run() is False
    assert stage.counters() == before and stage.ran == []
    assert [stage.c_far.read()[0] for _ in range(2)] == [b"x", b"y"]
    assert stage.step.run() is True
    np.testing.assert_array_equal(np.frombuffer(stage.c_far.read()[0], np.float32), a * 2 + b)


@pytest.mark.parametrize("case", ["short slot", "other tag", "unknown addresses",
                                  "unknown descriptor", "closed", "invalidated"])
def test_anything_unusual_leaves_the_rings_to_the_python_path(stage, case) -> None:
    a, b = _vectors(3)
    if case != "unknown addresses":
        stage.add_slot_calls()
    if case == "short slot":
        stage.a_far.write(a[:-1])
    elif case in ("other tag", "unknown descriptor"):
        stage.a_far.write(a, tag=1 if case == "other tag" else DESCRIPTOR_TAG)
    else:
        stage.a_far.write(a)
    stage.b_far.write(b)
    if case == "closed":
        stage.b.close()
    elif case == "invalidated":
        stage.c_far.invalidate()
    before = stage.counters() if case not in ("closed", "invalidated") else None
    assert stage.step.run() is False
    assert stage.ran == []
    if before is not None:
        assert stage.counters() == before
        data, tag = stage.a.read()   # the Python path gets the transfer as it was sent
        assert data == a[:len(data) // 4].tobytes()
        assert tag == {"other tag": 1, "unknown descriptor": DESCRIPTOR_TAG}.get(case, 0)


def test_roles_not_taken_yet_leave_the_first_step_to_the_python_path() -> None:
    s = Stage()
    try:
        s.add_slot_calls()
        a, b = _vectors(4)
        s.send(a, b)
        assert s.step.run() is False
        assert s.a.readable() == 1 and s.b.readable() == 1
    finally:
        s.close()


def test_a_descriptor_gives_the_input_and_sends_the_output_to_memory(stage) -> None:
    a, b = _vectors(5)
    a_mem = memoryview(bytearray(a.tobytes()))
    c_mem = memoryview(bytearray(NBYTES))
    descriptor = b"input a lives elsewhere"
    stage.descriptors[descriptor] = (a_mem, (("c", c_mem),))
    for ib in stage.b._payload:
        stage.add_call(a_mem, ib[:NBYTES], c_mem)
    stage.a_far.write(descriptor, tag=DESCRIPTOR_TAG)
    stage.b_far.write(b)
    assert stage.step.run() is True
    data, tag = stage.c_far.read()
    assert (data, tag) == (b"", REDIRECT_TAG)   # "the output is in your memory"
    np.testing.assert_array_equal(np.frombuffer(c_mem, np.float32), a * 2 + b)
    assert stage.counters() == (0, 0, 2, 2, 2, 0)


@pytest.mark.parametrize("entry", ["other output", "short memory", "read-only output"])
def test_a_descriptor_the_step_cannot_serve_changes_nothing(stage, entry) -> None:
    a, b = _vectors(6)
    a_mem = memoryview(bytearray(a.tobytes()))
    c_mem = memoryview(bytearray(NBYTES))
    outputs = {"other output": (("d", c_mem),),
               "short memory": (("c", c_mem[:-4]),),
               "read-only output": (("c", c_mem.toreadonly()),)}[entry]
    stage.descriptors[b"d"] = (a_mem, outputs)
    for ib in stage.b._payload:
        stage.add_call(a_mem, ib[:NBYTES], c_mem)
    stage.a_far.write(b"d", tag=DESCRIPTOR_TAG)
    stage.b_far.write(b)
    before = stage.counters()
    assert stage.step.run() is False
    assert stage.counters() == before and stage.ran == []


def test_a_failing_call_consumes_the_inputs_and_publishes_nothing(stage) -> None:
    stage.add_slot_calls()

    def boom(*args) -> None:
        raise RuntimeError("the computation failed")
    for key in stage.calls:
        stage.calls[key] = (None, boom, ())
    stage.send(*_vectors(7))
    with pytest.raises(RuntimeError, match="the computation failed"):
        stage.step.run()
    assert stage.counters() == (0, 0, 2, 2, 2, 0)
    stage.add_slot_calls()   # the stage goes on with the next transfers
    a, b = _vectors(8)
    stage.send(a, b)
    assert stage.step.run() is True
    np.testing.assert_array_equal(np.frombuffer(stage.c_far.read()[0], np.float32), a * 2 + b)


def test_construction_checks_its_arguments(stage) -> None:
    core = _iteration._stepcore
    accepts = ((0, core.IN_SLOT),)

    def make(ins=None, outs=None, table=None, calls=None):
        return core.Step(ins if ins is not None else ((stage.a.c_handle(), NBYTES, accepts),),
                         outs if outs is not None else
                         ((stage.c_near.c_handle(), NBYTES, "c", 0, REDIRECT_TAG, True),),
                         {} if table is None else table, {} if calls is None else calls)

    assert make() is not None
    with pytest.raises(ValueError, match=r"outputs 0: transfers of 65 bytes do not fit "
                                         r"slots of 64 bytes"):
        make(outs=((stage.c_near.c_handle(), NBYTES + 1, "c", 0, REDIRECT_TAG, True),))
    with pytest.raises(ValueError, match="inputs 1 is also inputs 0"):
        make(ins=((stage.a.c_handle(), NBYTES, accepts),) * 2)
    with pytest.raises(TypeError, match="expected a ring handle"):
        make(ins=((stage.a, NBYTES, accepts),))
    with pytest.raises(TypeError, match="inputs 0 must be a tuple of 3 items"):
        make(ins=((stage.a.c_handle(), NBYTES),))
    with pytest.raises(ValueError, match="action 7 is not IN_SLOT or IN_TABLE"):
        make(ins=((stage.a.c_handle(), NBYTES, ((0, 7),)),))
    with pytest.raises(TypeError):
        make(calls=[])


FAR_FUTURE = 1 << 62


def test_run_many_does_the_steps_that_can_be_done_back_to_back() -> None:
    s = Stage(slots=4)
    try:
        s.take_roles()
        s.add_slot_calls()
        pairs = [_vectors(10 + k) for k in range(3)]
        for a, b in pairs:
            s.send(a, b)
        # units of 2: the second unit ends after its first step (no more inputs)
        assert s.step.run_many(2, FAR_FUTURE) == 3
        for a, b in pairs:
            np.testing.assert_array_equal(np.frombuffer(s.c_far.read()[0], np.float32), a * 2 + b)
        assert s.step.run_many(1, FAR_FUTURE) == 0
    finally:
        s.close()


def test_run_many_stops_at_its_deadline_and_at_a_message_to_watch(stage) -> None:
    import time

    stage.add_slot_calls()
    stage.send(*_vectors(20))
    before = stage.counters()
    assert stage.step.run_many(1, time.monotonic_ns() - 1) == 0   # CLOCK_MONOTONIC, both
    assert stage.counters() == before
    watch_far = Ring.create(64, 2)
    watch = Ring.attach(watch_far.name)
    try:
        watch_far.write(b"x")
        watch.read()                       # the role taken: the watched end is empty
        watch_far.write(b"stop")
        assert stage.step.run_many(1, FAR_FUTURE, watch.c_handle()) == 0
        assert stage.counters() == before
        assert watch.read()[0] == b"stop"
        assert stage.step.run_many(1, FAR_FUTURE, watch.c_handle()) == 1
        watch_far.invalidate()
        stage.send(*_vectors(21))
        assert stage.step.run_many(1, FAR_FUTURE, watch.c_handle()) == 0   # invalid: look at it
    finally:
        watch.close()
        watch_far.close()
        watch_far.unlink()


def test_run_many_raises_what_a_step_raised_after_the_steps_before_it(stage) -> None:
    stage.add_slot_calls()
    keys = list(stage.calls)
    calls = 0

    def second_fails(key: tuple[int, ...], inner=dict(stage.calls)) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("the second step failed")
        inner[key][1](*inner[key][2])
    for key in keys:
        stage.calls[key] = (None, second_fails, (key,))
    a, b = _vectors(22)
    stage.send(a, b)
    stage.send(*_vectors(23))
    with pytest.raises(RuntimeError, match="the second step failed"):
        stage.step.run_many(1, FAR_FUTURE)
    np.testing.assert_array_equal(np.frombuffer(stage.c_far.read()[0], np.float32), a * 2 + b)
    assert stage.counters() == (0, 0, 2, 2, 2, 0)


def test_run_many_checks_its_arguments(stage) -> None:
    with pytest.raises(ValueError, match="run_many: unit must be at least 1, got 0"):
        stage.step.run_many(0, FAR_FUTURE)
    with pytest.raises(TypeError, match=r"expected a ring handle \(Ring.c_handle\(\)\), got Ring"):
        stage.step.run_many(1, FAR_FUTURE, stage.a)


# -- the plan the step executes (ipu_emulator.ipu._iteration) ---------------------------


def test_the_step_core_is_built_and_reaches_rings_through_the_shm_c_api() -> None:
    assert _iteration._stepcore is not None, "ipu_emulator.ipu._stepcore did not build"
    import shm._ringcore as ringcore
    assert type(ringcore._C_API).__name__ == "PyCapsule"
    assert "shm._ringcore._C_API" in repr(ringcore._C_API)
    assert not hasattr(ringcore, "Step")   # shm knows no iterations


def test_the_tag_table_is_the_one_rule_python_and_c_follow(stage, monkeypatch) -> None:
    """A tag the table does not list is data to Python but not done in C; listing it
    (one edit, in INPUT_TAGS) makes the C step serve it too."""
    from ipu_emulator.ipu_protocol import MODE_DIRECT, TAG_ABORT, TAG_DATA, TAG_SHARED

    I = _iteration.InAction
    assert _iteration.input_action(TAG_DATA) is I.SLOT
    assert _iteration.input_action(TAG_SHARED) is I.HOST
    assert _iteration.input_action(TAG_ABORT) is I.ABORT
    assert _iteration.input_action(9) is I.SLOT
    core = _iteration._stepcore
    assert set(_iteration.c_accepts()) == {(TAG_DATA, core.IN_SLOT),
                                           (TAG_SHARED, core.IN_TABLE)}

    def step():
        ins = [(r, NBYTES, _iteration.plan_stream("in", MODE_DIRECT)) for r in (stage.a, stage.b)]
        outs = [(stage.c_near, NBYTES, "c", _iteration.plan_stream("out", MODE_DIRECT))]
        made = _iteration.make_step(ins, outs, stage.descriptors, stage.calls)
        assert made is not None
        return made[0]

    stage.add_slot_calls()
    a, b = _vectors(30)
    stage.a_far.write(a, tag=9)
    stage.b_far.write(b)
    assert step().run() is False   # not in the table: left to Python
    monkeypatch.setitem(_iteration.INPUT_TAGS, 9, I.SLOT)
    assert step().run() is True
    data, tag = stage.c_far.read()
    assert tag == _iteration.SLOT_TAG
    np.testing.assert_array_equal(np.frombuffer(data, np.float32), a * 2 + b)


def test_outputs_are_published_with_the_plans_tags(stage) -> None:
    a, b = _vectors(31)
    a_mem = memoryview(bytearray(a.tobytes()))
    c_mem = memoryview(bytearray(NBYTES))
    stage.descriptors[b"desc"] = (a_mem, (("c", c_mem),))
    for ib in stage.b._payload:
        stage.add_call(a_mem, ib[:NBYTES], c_mem)
    from ipu_emulator.ipu_protocol import MODE_DIRECT, TAG_SHARED

    ins = [(r, NBYTES, _iteration.plan_stream("in", MODE_DIRECT)) for r in (stage.a, stage.b)]
    outs = [(stage.c_near, NBYTES, "c", _iteration.plan_stream("out", MODE_DIRECT))]
    step, _ = _iteration.make_step(ins, outs, stage.descriptors, stage.calls)
    stage.a_far.write(b"desc", tag=TAG_SHARED)
    stage.b_far.write(b)
    assert step.run() is True
    assert stage.c_far.read() == (b"", _iteration.HOST_TAG)
    np.testing.assert_array_equal(np.frombuffer(c_mem, np.float32), a * 2 + b)


def test_run_many_polls_for_the_next_inputs_once_a_step_was_done(stage) -> None:
    """poll_ns: after a step, the next inputs are polled for up to poll_ns (bounded by the
    deadline and by a message on the watched ring), never before the first step."""
    import time

    stage.add_slot_calls()
    assert stage.step.run_many(1, FAR_FUTURE, None, 10 * 10**9) == 0   # nothing done: no poll
    stage.send(*_vectors(30))
    t0 = time.monotonic_ns()
    assert stage.step.run_many(1, FAR_FUTURE, None, 20 * 10**6) == 1
    assert time.monotonic_ns() - t0 >= 20 * 10**6        # polled its 20 ms for a second one
    stage.c_far.read()
    stage.send(*_vectors(31))
    t0 = time.monotonic_ns()
    assert stage.step.run_many(1, t0 + 20 * 10**6, None, 10 * 10**9) == 1
    assert time.monotonic_ns() - t0 < 5 * 10**9           # the deadline cut the poll
    stage.c_far.read()
    watch_far = Ring.create(64, 2)
    watch = Ring.attach(watch_far.name)
    try:
        watch_far.write(b"x")
        watch.read()                       # the role taken: the watched end is empty
        stage.send(*_vectors(32))
        watch_far.write(b"stop")           # a message arrives: the poll ends at once
        t0 = time.monotonic_ns()
        # (the message is there before the first step too: run_many does no step)
        assert stage.step.run_many(1, FAR_FUTURE, watch.c_handle(), 10 * 10**9) == 0
        assert watch.read()[0] == b"stop"
        assert stage.step.run_many(1, FAR_FUTURE, watch.c_handle(), 10 * 10**6) == 1
        assert time.monotonic_ns() - t0 < 5 * 10**9
    finally:
        watch.close()
        watch_far.close()
        watch_far.unlink()
