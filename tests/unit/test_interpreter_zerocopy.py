"""Zero-copy streams: onnxruntime reads/writes the StreamIO's buffers in place."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from ipu_emulator.ipu._zerocopy import plan_zero_copy
from ipu_emulator.compiler import CompileOptions, ModelSpec, compile_onnx
from ipu_emulator.errors import DeviceProgramError
from ipu_emulator.executable import (
    Copy, Execute, Executable, Graph, Program, StreamIn, StreamOut, StreamSpec, TensorSig,
    plan_memory)
from ipu_emulator.ipu.interpreter import Interpreter
from tests.models import make_model, seed_model0, seed_model1, simple_model
from tests.models.arrayio import ArrayIO

F32 = np.dtype(np.float32)


class LendingIO(ArrayIO):
    """ArrayIO that also lends buffers (a ZeroCopyStreamIO), recording what happens.

    Lent input buffers are fresh arrays per transfer (like ring slots, their
    addresses vary); lent output buffers rotate over ``slots`` arrays.
    """

    def __init__(self, inputs: dict[str, list[np.ndarray]],
                 outputs: dict[str, tuple[np.dtype, tuple[int, ...]]], slots: int = 3) -> None:
        super().__init__(inputs, outputs)
        self.events: list[tuple[str, str]] = []
        self._out_slots = {h: [np.full(int(np.prod(s)) * np.dtype(d).itemsize, 0xEE, np.uint8)
                               for _ in range(slots)] for h, (d, s) in outputs.items()}
        self._next = {h: 0 for h in outputs}
        self._lent: dict[str, np.ndarray] = {}
        self.held: set[str] = set()

    def acquire_input(self, handle: str, nbytes: int) -> memoryview:
        self.events.append(("acquire_input", handle))
        arr = np.ascontiguousarray(self._inputs[handle].pop(0)).reshape(-1).view(np.uint8).copy()
        assert arr.nbytes == nbytes
        self.held.add(handle)
        return memoryview(arr)

    def release_input(self, handle: str) -> None:
        self.events.append(("release_input", handle))
        self.held.remove(handle)

    def acquire_output(self, handle: str, nbytes: int) -> memoryview:
        self.events.append(("acquire_output", handle))
        slots = self._out_slots[handle]
        buf = slots[self._next[handle] % len(slots)]
        buf[:] = 0xEE
        self._lent[handle] = buf
        return memoryview(buf)

    def publish_output(self, handle: str) -> None:
        self.events.append(("publish_output", handle))
        self._next[handle] += 1
        self.write_output(handle, memoryview(self._lent.pop(handle)))


def _simple(iterations: int = 1) -> tuple[Executable, np.ndarray]:
    result = compile_onnx(ModelSpec(simple_model((2, 3), seed=4)), CompileOptions(
        weights_as_tensor_data=True, save_weights=True, device_iterations=iterations))
    weights = np.frombuffer(next(a.data for a in result.anchors if a.name == "weights"),
                            np.float32).reshape(2, 3)
    return Executable.from_bytes(result.executable.to_bytes()), weights


def test_plan_of_the_example_model_skips_load_and_save_streams() -> None:
    exe, _ = _simple()
    plan = plan_zero_copy(exe)
    assert plan.inputs == {"tensor_A": "tensor_A", "tensor_B": "tensor_B"}
    assert plan.outputs == {"tensor_C": "tensor_C"}   # weights: Load + Save, never zero-copy


@pytest.mark.parametrize("iterations", [1, 5])
def test_zero_copy_main_matches_numpy_and_save_sees_device_memory(iterations: int) -> None:
    exe, w = _simple(iterations)
    rng = np.random.default_rng(iterations)
    a = rng.standard_normal((iterations, 2, 3)).astype(np.float32)
    b = rng.standard_normal((iterations, 2, 3)).astype(np.float32)
    io = LendingIO({"weights": [w], "tensor_A": list(a), "tensor_B": list(b)},
                   {"tensor_C": (F32, (2, 3)), "weights_saved": (F32, (2, 3))})
    with Interpreter(exe) as interp:
        interp.run_program(0, io)   # Load: weights through device memory
        interp.run_program(1, io)
        interp.run_program(1, LendingIO({"tensor_A": list(a), "tensor_B": list(b)},
                                        {"tensor_C": (F32, (2, 3))}))   # again, same bindings
        interp.run_program(2, io)   # Save streams the device's weights back
        # the zero-copy tensors' device memory was never written
        assert not interp.tensor("tensor_A").any() and not interp.tensor("tensor_C").any()
    assert len(io.outputs["tensor_C"]) == iterations
    for k in range(iterations):
        np.testing.assert_allclose(io.outputs["tensor_C"][k], a[k] * w + b[k], rtol=1e-6)
    np.testing.assert_array_equal(io.outputs["weights_saved"][0], w)
    assert io.reads == ["weights"]   # only the Load stream took the copying path
    one = [("acquire_input", "tensor_A"), ("acquire_input", "tensor_B"),
           ("acquire_output", "tensor_C"), ("publish_output", "tensor_C"),
           ("release_input", "tensor_A"), ("release_input", "tensor_B")]   # after the publish
    assert io.events == one * iterations
    assert not io.held


def test_plain_stream_io_keeps_the_general_path() -> None:
    exe, w = _simple(2)
    a = np.ones((2, 2, 3), np.float32)
    b = np.full((2, 2, 3), 0.5, np.float32)
    io = ArrayIO({"weights": [w], "tensor_A": list(a), "tensor_B": list(b)},
                 {"tensor_C": (F32, (2, 3))})
    with Interpreter(exe) as interp:
        interp.run_program(0, io)
        interp.run_program(1, io)
        np.testing.assert_array_equal(interp.tensor("tensor_A"), a[1])   # device memory used
    for k in range(2):
        np.testing.assert_allclose(io.outputs["tensor_C"][k], a[k] * w + b[k], rtol=1e-6)


def test_fused_model_index_is_copied_and_branches_run_zero_copy() -> None:
    result = compile_onnx([ModelSpec(seed_model0(), {"X": [1, 2], "Y": [1, 2]}, "fp32"),
                           ModelSpec(seed_model1(), {"X": [1, 1]}, "fp16")],
                          CompileOptions(ipu_version="ipu21"))
    exe = Executable.from_bytes(result.executable.to_bytes())
    plan = plan_zero_copy(exe)
    assert "index" not in plan.inputs   # read by the Switch
    assert set(plan.inputs) == {"graph0/X", "graph0/Y", "graph1/X"}
    assert set(plan.outputs) == {"graph0/O", "graph1/O"}
    interp = Interpreter(exe)
    io0 = LendingIO({"index": [np.array([0], np.int32)],
                     "graph0/X": [np.ones((1, 2), np.float32)],
                     "graph0/Y": [np.ones((1, 2), np.float32) * 2]},
                    {"graph0/O": (F32, (2,))})
    interp.run_program(1, io0)
    np.testing.assert_array_equal(io0.outputs["graph0/O"][0], np.ones(2, np.float32) * 3)
    assert io0.reads == ["index"]
    io1 = LendingIO({"index": [np.array([1], np.int32)], "graph1/X": [np.zeros((1, 1), np.float16)]},
                    {"graph1/O": (np.dtype(np.float16), (1, 3))})
    interp.run_program(1, io1)
    np.testing.assert_array_equal(io1.outputs["graph1/O"][0],
                                  np.array([[0.0, 1.5, 2.0]], np.float16))
    assert not io0.held and not io1.held


def _neg_graph() -> bytes:
    g = helper.make_graph([helper.make_node("Neg", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    return make_model(g).SerializeToString()


def _neg_exe(main: tuple, extra: list[tuple[str, str, tuple[int, ...]]] = (),
             out_streams: tuple[str, ...] = ("y",)) -> Executable:
    tensors, mem = plan_memory([("x", "F32", (4,)), ("y", "F32", (4,)), *extra])
    streams = {"x": StreamSpec("in", "F32", [4], 16)}
    streams.update({h: StreamSpec("out", "F32", [4], 16) for h in out_streams})
    sig = (TensorSig("x", "F32", (4,)),), (TensorSig("y", "F32", (4,)),)
    exe = Executable("neg", [Program("main", main)], [Graph(*sig, _neg_graph())], tensors,
                     streams, mem)
    return Executable.from_bytes(exe.to_bytes())


def test_tensors_with_other_uses_are_not_zero_copy() -> None:
    v = np.array([1, -2, 3, -4], np.float32)
    # x is also copied, y is also read by a Copy: both keep device memory
    exe = _neg_exe((StreamIn("x", "x"), Copy("x", "x2"), Execute(0, (("x", "x"),), (("y", "y"),)),
                    Copy("y", "y2"), StreamOut("y", "y"), StreamOut("x2", "x2"),
                    StreamOut("y2", "y2")),
                   extra=[("x2", "F32", (4,)), ("y2", "F32", (4,))],
                   out_streams=("y", "x2", "y2"))
    plan = plan_zero_copy(exe)
    assert plan.inputs == {} and plan.outputs == {}
    io = LendingIO({"x": [v]}, {h: (F32, (4,)) for h in ("y", "x2", "y2")})
    Interpreter(exe).run_program(0, io)
    assert io.events == []
    np.testing.assert_array_equal(io.outputs["y"][0], -v)
    np.testing.assert_array_equal(io.outputs["x2"][0], v)
    np.testing.assert_array_equal(io.outputs["y2"][0], -v)
    # a StreamOut before the Execute that writes it reads the previous value: not zero-copy
    exe2 = _neg_exe((StreamOut("y", "y"), StreamIn("x", "x"), Execute(0, (("x", "x"),), (("y", "y"),))))
    assert plan_zero_copy(exe2).outputs == {} and plan_zero_copy(exe2).inputs == {"x": "x"}
    io2 = LendingIO({"x": [v, -v]}, {"y": (F32, (4,))})
    interp2 = Interpreter(exe2)
    interp2.run_program(0, io2)
    interp2.run_program(0, io2)
    np.testing.assert_array_equal(io2.outputs["y"][0], np.zeros(4, np.float32))
    np.testing.assert_array_equal(io2.outputs["y"][1], -v)   # the previous iteration's result
    assert io2.events == [("acquire_input", "x"), ("release_input", "x")] * 2


def test_wrong_buffer_size_fails_and_releases_held_inputs() -> None:
    exe = _neg_exe((StreamIn("x", "x"), Execute(0, (("x", "x"),), (("y", "y"),)),
                    StreamOut("y", "y")))

    class ShortOutput(LendingIO):
        def acquire_output(self, handle: str, nbytes: int) -> memoryview:
            return super().acquire_output(handle, nbytes)[:nbytes - 4]

    io = ShortOutput({"x": [np.zeros(4, np.float32)]}, {"y": (F32, (4,))})
    with pytest.raises(DeviceProgramError,
                       match=r"stream 'y': the stream lent a buffer of 12 bytes; one transfer "
                             r"is 16 bytes"):
        Interpreter(exe).run_program(0, io)
    assert io.events[-1] == ("release_input", "x") and not io.held


def test_stream_io_errors_after_an_acquire_release_the_input() -> None:
    exe = _neg_exe((StreamIn("x", "x"), Execute(0, (("x", "x"),), (("y", "y"),)),
                    StreamOut("y", "y")))

    class Boom(RuntimeError):
        pass

    class FailingOutput(LendingIO):
        def acquire_output(self, handle: str, nbytes: int) -> memoryview:
            raise Boom("output ring gone")

    io = FailingOutput({"x": [np.zeros(4, np.float32)]}, {"y": (F32, (4,))})
    with pytest.raises(Boom, match="output ring gone"):
        Interpreter(exe).run_program(0, io)
    assert io.events == [("acquire_input", "x"), ("release_input", "x")] and not io.held


class GroupIO(LendingIO):
    """LendingIO with ``run_group``: a Python model of the IPU process's C step.

    Input transfers are copied into one fixed buffer per handle and outputs use
    one buffer per handle, so the address keys of the step-by-step path and of
    run_group are the same.
    """

    def __init__(self, inputs, outputs) -> None:
        super().__init__(inputs, outputs, slots=1)
        self._fixed = {h: np.zeros(np.asarray(v[0]).nbytes, np.uint8) for h, v in inputs.items()}
        self.groups: list = []
        self.served = 0

    def acquire_input(self, handle: str, nbytes: int) -> memoryview:
        buf = self._fixed[handle]
        buf[:] = np.frombuffer(super().acquire_input(handle, nbytes), np.uint8)
        return memoryview(buf)

    def run_group(self, group) -> bool:
        self.groups.append(group)
        key = (*(self._fixed[h].ctypes.data for h in group.in_handles),
               *(self._out_slots[h][0].ctypes.data for h in group.out_handles))
        entry = group.calls.get(key)
        if entry is None:
            return False
        for h, n in zip(group.in_handles, group.in_sizes):
            src = np.ascontiguousarray(self._inputs[h].pop(0)).reshape(-1).view(np.uint8)
            assert src.nbytes == n
            self._fixed[h][:] = src
        entry[1](*entry[2])
        for h in group.out_handles:
            self.write_output(h, memoryview(self._out_slots[h][0]))
        self.served += 1
        return True


def test_a_main_iteration_is_offered_as_one_group_and_served_from_the_calls_table() -> None:
    exe, w = _simple(3)
    rng = np.random.default_rng(9)
    a = rng.standard_normal((6, 2, 3)).astype(np.float32)
    b = rng.standard_normal((6, 2, 3)).astype(np.float32)
    io = GroupIO({"weights": [w], "tensor_A": list(a), "tensor_B": list(b)},
                 {"tensor_C": (F32, (2, 3))})
    with Interpreter(exe) as interp:
        interp.run_program(0, io)
        interp.run_program(1, io)
        interp.run_program(1, io)
    group = io.groups[0]
    assert all(g is group for g in io.groups)
    assert (group.in_handles, group.in_sizes) == (("tensor_A", "tensor_B"), (24, 24))
    assert (group.out_handles, group.out_sizes) == (("tensor_C",), (24,))
    assert len(group.calls) == 1           # filled by the first, step-by-step iteration
    assert io.served == 5                  # every later iteration was one group
    assert io.events.count(("acquire_input", "tensor_A")) == 1
    for k in range(6):
        np.testing.assert_allclose(io.outputs["tensor_C"][k], a[k] * w + b[k], rtol=1e-6)


def test_a_group_whose_call_fails_raises_device_program_error() -> None:
    exe, w = _simple()
    a, b = np.ones((2, 2, 3), np.float32), np.zeros((2, 2, 3), np.float32)
    io = GroupIO({"weights": [w], "tensor_A": list(a), "tensor_B": list(b)},
                 {"tensor_C": (F32, (2, 3))})
    with Interpreter(exe) as interp:
        interp.run_program(0, io)
        interp.run_program(1, io)   # step by step: fills the calls table

        def boom(*args) -> None:
            raise RuntimeError("no memory on the device")
        group = io.groups[0]
        group.calls.update({k: (v[0], boom, ()) for k, v in group.calls.items()})
        with pytest.raises(DeviceProgramError,
                           match=r"executable 'executable': graph 0 failed in onnxruntime: "
                                 r"no memory on the device"):
            interp.run_program(1, io)


def test_streams_not_right_around_their_execute_run_step_by_step() -> None:
    v = np.array([1, -2, 3, -4], np.float32)
    exe = _neg_exe((StreamIn("x", "x"), Copy("z", "z2"), Execute(0, (("x", "x"),), (("y", "y"),)),
                    StreamOut("y", "y")), extra=[("z", "F32", (4,)), ("z2", "F32", (4,))])
    assert plan_zero_copy(exe).inputs == {"x": "x"} and plan_zero_copy(exe).outputs == {"y": "y"}
    io = GroupIO({"x": [v, -v]}, {"y": (F32, (4,))})
    interp = Interpreter(exe)
    interp.run_program(0, io)
    interp.run_program(0, io)
    assert io.groups == [] and io.served == 0
    np.testing.assert_array_equal(np.stack(io.outputs["y"]), np.stack([-v, v]))


class ManyIO(GroupIO):
    """GroupIO with ``run_groups``: does up to ``budget`` runs, then stops (even inside a unit)."""

    def __init__(self, inputs, outputs, budget: int) -> None:
        super().__init__(inputs, outputs)
        self.budget = budget
        self.asked: list[tuple[int, int]] = []

    def run_groups(self, group, unit: int, deadline_ns: int) -> int:
        self.asked.append((unit, deadline_ns))
        n = 0
        while n < self.budget and self.run_group(group):
            n += 1
        return n


def test_run_program_many_finishes_a_run_the_groups_stopped_inside() -> None:
    exe, w = _simple(3)   # Main: Repeat(3) of one group
    rng = np.random.default_rng(11)
    a = rng.standard_normal((12, 2, 3)).astype(np.float32)
    b = rng.standard_normal((12, 2, 3)).astype(np.float32)
    io = ManyIO({"weights": [w], "tensor_A": list(a), "tensor_B": list(b)},
                {"tensor_C": (F32, (2, 3))}, budget=4)
    with Interpreter(exe) as interp:
        assert interp.run_program_many(0, io, 123) == 0   # Load is no single group
        interp.run_program(0, io)
        assert interp.run_program_many(1, io, 123) == 0   # the calls table is empty yet
        interp.run_program(1, io)                         # fills it (3 iterations)
        io.events.clear()
        io.served = 0
        # 4 runs of the group in "C", then the 5th and 6th iteration step by step
        assert interp.run_program_many(1, io, 123) == 2
        assert io.asked[-1] == (3, 123)
        assert io.events.count(("acquire_input", "tensor_A")) == 0   # all served as groups
        assert io.served == 6
        io.budget = 1
        assert interp.run_program_many(1, io, 123) == 1
    for k in range(9):
        np.testing.assert_allclose(io.outputs["tensor_C"][k], a[k] * w + b[k], rtol=1e-6)
    assert not io.held


def test_run_program_many_wraps_a_failing_call() -> None:
    exe, w = _simple()

    class Failing(ManyIO):
        def run_groups(self, group, unit: int, deadline_ns: int) -> int:
            raise RuntimeError("onnxruntime gave up")

    z = np.zeros((2, 3), np.float32)
    io = Failing({"weights": [w], "tensor_A": [z], "tensor_B": [z]},
                 {"tensor_C": (F32, (2, 3))}, budget=1)
    with Interpreter(exe) as interp:
        interp.run_program(0, io)
        with pytest.raises(DeviceProgramError, match=r"executable 'executable': graph 0 failed "
                                                     r"in onnxruntime: onnxruntime gave up"):
            interp.run_program_many(1, io, 0)


def test_close_lets_go_of_device_memory_after_groups_ran() -> None:
    import gc

    exe, w = _simple(2)
    memory = bytearray(exe.memory_bytes)
    a = np.ones((4, 2, 3), np.float32)
    io = ManyIO({"weights": [w], "tensor_A": list(a), "tensor_B": list(a)},
                {"tensor_C": (F32, (2, 3))}, budget=2)
    interp = Interpreter(exe, memory)
    interp.run_program(0, io)
    interp.run_program(1, io)
    assert interp.run_program_many(1, io, 0) == 1
    interp.close()
    del io
    gc.collect()
    memory.extend(b"\0")   # BufferError while anything still exports the device memory
