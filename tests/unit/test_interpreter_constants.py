"""Constant streams in the interpreter: which tensors are the shared value itself (read
in place, never copied into device memory) and which get a copy (a program writes them),
and that neither reads its stream."""

from __future__ import annotations

import dataclasses

import numpy as np

from ipu_emulator.compiler import CompileOptions, ModelSpec, compile_onnx
from ipu_emulator.executable import (Copy, Execute, Executable, Program, Repeat, StreamIn,
                                     StreamOut)
from ipu_emulator.ipu._constants import plan_constants
from ipu_emulator.ipu.interpreter import Interpreter
from tests.models import simple_model
from tests.models.arrayio import ArrayIO

F32 = np.dtype(np.float32)


def _simple() -> tuple[Executable, np.ndarray]:
    result = compile_onnx(ModelSpec(simple_model((2, 3), seed=5)), CompileOptions(
        weights_as_tensor_data=True, save_weights=True))
    weights = np.frombuffer(next(a.data for a in result.anchors if a.name == "weights"),
                            np.float32).reshape(2, 3)
    return Executable.from_bytes(result.executable.to_bytes()), weights


def _with_main_tail(exe: Executable, *tail: object) -> Executable:
    """``exe`` with instructions appended to its Main iteration."""
    rep = exe.programs[1].body[0]
    assert isinstance(rep, Repeat)
    progs = list(exe.programs)
    progs[1] = Program("main", (Repeat(rep.count, (*rep.body, *tail)),))  # type: ignore[arg-type]
    return dataclasses.replace(exe, programs=progs)


def test_a_tensor_only_read_is_the_shared_value_and_its_stream_is_not_read() -> None:
    exe, w = _simple()
    value = memoryview(w.tobytes())
    assert plan_constants(exe, ["weights"]).shared == {"weights": "weights"}
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((2, 2, 3)).astype(np.float32)
    memory = bytearray(exe.memory_bytes)
    io = ArrayIO({"tensor_A": [a], "tensor_B": [b]},
                 {"tensor_C": (F32, (2, 3)), "weights_saved": (F32, (2, 3))})
    with Interpreter(exe, device_memory=memory, constants={"weights": value}) as interp:
        interp.run_program(0, io)
        interp.run_program(1, io)
        interp.run_program(2, io)
        assert not interp.tensor("weights").flags.writeable
    np.testing.assert_allclose(io.outputs["tensor_C"][0], a * w + b, rtol=1e-6)
    np.testing.assert_array_equal(io.outputs["weights_saved"][0], w)
    assert io.reads == ["tensor_A", "tensor_B"]          # never the weights' stream
    t = exe.tensors["weights"]
    assert bytes(memory[t.offset:t.offset + t.nbytes]) == bytes(t.nbytes)   # not copied


def test_a_tensor_a_program_writes_gets_a_copy_restored_at_each_load_run() -> None:
    exe, w = _simple()
    exe = _with_main_tail(exe, Copy("tensor_C", "weights"))
    value = bytearray(w.tobytes())
    plan = plan_constants(exe, ["weights"])
    assert plan.shared == {} and plan.copied == {"weights": ("weights",)}
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((2, 2, 3)).astype(np.float32)
    io = ArrayIO({"tensor_A": [a, a, a], "tensor_B": [b, b, b]}, {"tensor_C": (F32, (2, 3))})
    with Interpreter(exe, constants={"weights": memoryview(value).toreadonly()}) as interp:
        interp.run_program(0, io)
        interp.run_program(1, io)
        interp.run_program(1, io)
        interp.run_program(0, io)
        interp.run_program(1, io)
    c = io.outputs["tensor_C"]
    np.testing.assert_allclose(c[0], a * w + b, rtol=1e-6)
    np.testing.assert_allclose(c[1], a * c[0] + b, rtol=1e-5)
    np.testing.assert_allclose(c[2], c[0], rtol=1e-6)    # the Load run restored it
    assert bytes(value) == w.tobytes()                    # the value itself never changed
    assert io.reads == ["tensor_A", "tensor_B"] * 3


def test_what_counts_as_writing_a_tensor() -> None:
    exe, _ = _simple()
    ex = exe.programs[1].body[0].body[2]    # type: ignore[union-attr]
    assert isinstance(ex, Execute)
    as_output = dataclasses.replace(ex, outputs=(("tensor_C", "weights"),))
    cases = {
        "an Execute output": _with_main_tail(exe, as_output),
        "a Copy into it": _with_main_tail(exe, Copy("tensor_A", "weights")),
        "another stream into it": _with_main_tail(exe, StreamIn("tensor_A", "weights")),
    }
    for what, edited in cases.items():
        assert plan_constants(edited, ["weights"]).copied == {"weights": ("weights",)}, what
    # read by a Copy, a StreamOut, an Execute: still shared
    read = _with_main_tail(exe, Copy("weights", "tensor_A"), StreamOut("weights", "tensor_C"))
    assert plan_constants(read, ["weights"]).shared == {"weights": "weights"}
    # one stream into two tensors: a copy each
    two = _with_main_tail(exe, StreamIn("weights", "tensor_B"))
    assert plan_constants(two, ["weights"]).copied == {"weights": ("tensor_B", "weights")}
    # a handle no program streams in: nothing
    assert plan_constants(exe, ["nothing"]) == plan_constants(exe, [])
