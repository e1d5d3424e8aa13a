"""The interpreter: Load/Main/Save on the example model, Repeat, Switch, Copy, errors."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from ipu_emulator.compiler import CompileOptions, ModelSpec, compile_onnx
from ipu_emulator.errors import DeviceProgramError, ExecutableError
from ipu_emulator.executable import (
    Copy, Execute, Executable, Graph, Program, Repeat, StreamIn, StreamOut, StreamSpec, Switch,
    TensorSig, plan_memory)
from ipu_emulator.ipu.interpreter import CallableStreamIO, Interpreter
from tests.models import make_model, seed_model0, seed_model1, simple_model
from tests.models.arrayio import ArrayIO

F32 = np.dtype(np.float32)


def _simple(iterations: int = 1):
    model = simple_model((2, 3), seed=4)
    result = compile_onnx(ModelSpec(model), CompileOptions(
        weights_as_tensor_data=True, save_weights=True, device_iterations=iterations))
    weights = np.frombuffer(next(a.data for a in result.anchors if a.name == "weights"),
                            np.float32).reshape(2, 3)
    return Executable.from_bytes(result.executable.to_bytes()), weights


def test_example_model_load_main_save_matches_numpy() -> None:
    exe, w = _simple()
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((2, 2, 3)).astype(np.float32)
    io = ArrayIO({"weights": [w], "tensor_A": [a], "tensor_B": [b]},
                 {"tensor_C": (F32, (2, 3)), "weights_saved": (F32, (2, 3))})
    with Interpreter(exe) as interp:
        interp.run_program(0, io)
        np.testing.assert_array_equal(interp.tensor("weights"), w)
        interp.run_program(1, io)
        interp.run_program(2, io)
    np.testing.assert_allclose(io.outputs["tensor_C"][0], a * w + b, rtol=1e-6)
    np.testing.assert_array_equal(io.outputs["weights_saved"][0], w)
    assert io.reads == ["weights", "tensor_A", "tensor_B"]


def test_main_repeats_device_iterations_in_order() -> None:
    exe, w = _simple(iterations=4)
    rng = np.random.default_rng(1)
    a = rng.standard_normal((4, 2, 3)).astype(np.float32)
    b = rng.standard_normal((4, 2, 3)).astype(np.float32)
    io = ArrayIO({"weights": [w], "tensor_A": list(a), "tensor_B": list(b)},
                 {"tensor_C": (F32, (2, 3))})
    interp = Interpreter(exe)
    interp.run_program(0, io)
    interp.run_program(1, io)
    assert len(io.outputs["tensor_C"]) == 4
    for k in range(4):
        np.testing.assert_allclose(io.outputs["tensor_C"][k], a[k] * w + b[k], rtol=1e-6)
    assert io.reads == ["weights"] + ["tensor_A", "tensor_B"] * 4
    interp.close()
    interp.close()
    with pytest.raises(DeviceProgramError, match="closed"):
        interp.run_program(1, io)


def test_device_tensors_live_in_the_given_memory() -> None:
    exe, w = _simple()
    memory = bytearray(exe.memory_bytes + 100)
    interp = Interpreter(exe, memory)
    interp.run_program(0, ArrayIO({"weights": [w]}, {}))
    off = exe.tensors["weights"].offset
    np.testing.assert_array_equal(np.frombuffer(memory, np.float32, 6, off).reshape(2, 3), w)
    with pytest.raises(ValueError, match=f"smaller than the {exe.memory_bytes} bytes"):
        Interpreter(exe, bytearray(exe.memory_bytes - 1))
    with pytest.raises(ValueError, match="writable"):
        Interpreter(exe, memoryview(bytes(exe.memory_bytes)))


def test_unknown_program_and_stream_errors_propagate() -> None:
    exe, w = _simple()
    interp = Interpreter(exe)
    with pytest.raises(DeviceProgramError, match=r"program 3 does not exist.*programs 0\.\.2"):
        interp.run_program(3, ArrayIO({}, {}))

    class Broken(RuntimeError):
        pass

    def fail(_dest: memoryview) -> None:
        raise Broken("ring invalidated")

    with pytest.raises(Broken, match="ring invalidated"):
        interp.run_program(0, CallableStreamIO({"weights": fail}))
    with pytest.raises(KeyError, match="no input callable for stream 'weights'"):
        interp.run_program(0, CallableStreamIO())


def test_fused_switch_runs_only_the_chosen_branch() -> None:
    """Seed 004 run.py values, through the interpreter."""
    result = compile_onnx([ModelSpec(seed_model0(), {"X": [1, 2], "Y": [1, 2]}, "fp32"),
                           ModelSpec(seed_model1(), {"X": [1, 1]}, "fp16")],
                          CompileOptions(ipu_version="ipu21"))
    interp = Interpreter(Executable.from_bytes(result.executable.to_bytes()))
    io0 = ArrayIO({"index": [np.array([0], np.int32)],
                   "graph0/X": [np.ones((1, 2), np.float32)],
                   "graph0/Y": [np.ones((1, 2), np.float32) * 2]},
                  {"graph0/O": (F32, (2,))})
    interp.run_program(1, io0)
    np.testing.assert_array_equal(io0.outputs["graph0/O"][0], np.ones(2, np.float32) * 3)
    assert io0.reads == ["index", "graph0/X", "graph0/Y"]
    io1 = ArrayIO({"index": [np.array([1], np.int32)], "graph1/X": [np.zeros((1, 1), np.float16)]},
                  {"graph1/O": (np.dtype(np.float16), (1, 3))})
    interp.run_program(1, io1)
    np.testing.assert_array_equal(io1.outputs["graph1/O"][0],
                                  np.array([[0.0, 1.5, 2.0]], np.float16))
    assert io1.reads == ["index", "graph1/X"]
    with pytest.raises(DeviceProgramError, match=r"switch index 'index' is 7; expected 0\.\.1"):
        interp.run_program(1, ArrayIO({"index": [np.array([7], np.int32)]}, {}))
    assert result.subgraphs == {"graph0": ["graph0/X", "graph0/Y", "graph0/O"],
                                "graph1": ["graph1/X", "graph1/O"]}


def _hand_built(graph_model: onnx.ModelProto, inputs: list[TensorSig], outputs: list[TensorSig],
                extra: list[tuple[str, str, tuple[int, ...]]] = (), body: tuple = ()
                ) -> Executable:
    specs = [(s.name, s.dtype, s.shape) for s in inputs + outputs] + list(extra)
    tensors, mem = plan_memory(specs)
    streams = {s.name: StreamSpec("in", s.dtype, list(s.shape), tensors[s.name].nbytes)
               for s in inputs}
    streams.update({s.name: StreamSpec("out", s.dtype, list(s.shape), tensors[s.name].nbytes)
                    for s in outputs})
    main = tuple(StreamIn(s.name, s.name) for s in inputs) + (
        Execute(0, tuple((s.name, s.name) for s in inputs),
                tuple((s.name, s.name) for s in outputs)),) + body + tuple(
        StreamOut(s.name, s.name) for s in outputs)
    return Executable("hand", [Program("main", main)],
                      [Graph(tuple(inputs), tuple(outputs), graph_model.SerializeToString())],
                      tensors, streams, mem)


def test_onnxruntime_failure_becomes_device_program_error() -> None:
    g = helper.make_graph([helper.make_node("Gather", ["data", "idx"], ["out"])], "g",
                          [helper.make_tensor_value_info("data", TensorProto.FLOAT, [3]),
                           helper.make_tensor_value_info("idx", TensorProto.INT64, [1])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1])])
    exe = _hand_built(make_model(g), [TensorSig("data", "F32", (3,)), TensorSig("idx", "S64", (1,))],
                      [TensorSig("out", "F32", (1,))])
    interp = Interpreter(exe)
    io = ArrayIO({"data": [np.arange(3, dtype=np.float32)] * 2,
                  "idx": [np.array([2]), np.array([100])]}, {"out": (F32, (1,))})
    interp.run_program(0, io)
    assert io.outputs["out"][0].tolist() == [2.0]
    with pytest.raises(DeviceProgramError, match="graph 0 failed in onnxruntime") as ei:
        interp.run_program(0, io)
    assert ei.value.__cause__ is not None


def test_passthrough_output_and_copy_instruction() -> None:
    """A graph output that is also a graph input, and Copy between device tensors."""
    g = helper.make_graph([helper.make_node("Neg", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4]),
                           helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])])
    m = make_model(g)
    x = TensorSig("x", "F32", (4,))
    specs = [("in_x", "F32", (4,)), ("y", "F32", (4,)), ("x_copy", "F32", (4,)),
             ("copied", "F32", (4,))]
    tensors, mem = plan_memory(specs)
    streams = {"in_x": StreamSpec("in", "F32", [4], 16), "y": StreamSpec("out", "F32", [4], 16),
               "x_copy": StreamSpec("out", "F32", [4], 16),
               "copied": StreamSpec("out", "F32", [4], 16)}
    main = (StreamIn("in_x", "in_x"),
            Execute(0, (("x", "in_x"),), (("y", "y"), ("x", "x_copy"))),
            Copy("y", "copied"),
            StreamOut("y", "y"), StreamOut("x_copy", "x_copy"), StreamOut("copied", "copied"))
    exe = Executable("pt", [Program("main", main)],
                     [Graph((x,), (TensorSig("y", "F32", (4,)), x), m.SerializeToString())],
                     tensors, streams, mem)
    exe = Executable.from_bytes(exe.to_bytes())
    v = np.array([1, -2, 3, -4], np.float32)
    io = ArrayIO({"in_x": [v]}, {h: (F32, (4,)) for h in ("y", "x_copy", "copied")})
    Interpreter(exe).run_program(0, io)
    np.testing.assert_array_equal(io.outputs["y"][0], -v)
    np.testing.assert_array_equal(io.outputs["x_copy"][0], v)
    np.testing.assert_array_equal(io.outputs["copied"][0], -v)


def test_nested_repeat_and_switch_by_hand() -> None:
    g = helper.make_graph([helper.make_node("Add", ["a", "one"], ["b"])], "g",
                          [helper.make_tensor_value_info("a", TensorProto.INT32, [1])],
                          [helper.make_tensor_value_info("b", TensorProto.INT32, [1])],
                          initializer=[helper.make_tensor("one", TensorProto.INT32, [1], [1])])
    m = make_model(g)
    tensors, mem = plan_memory([("acc", "S32", (1,)), ("tmp", "S32", (1,)), ("sel", "U8", ())])
    streams = {"sel": StreamSpec("in", "U8", [], 1), "acc": StreamSpec("out", "S32", [1], 4)}
    inc = (Execute(0, (("a", "acc"),), (("b", "tmp"),)), Copy("tmp", "acc"))
    main = (Repeat(3, (StreamIn("sel", "sel"), Switch("sel", ((), inc + inc)))),
            StreamOut("acc", "acc"))
    exe = Executable("nest", [Program("main", main)],
                     [Graph((TensorSig("a", "S32", (1,)),), (TensorSig("b", "S32", (1,)),),
                            m.SerializeToString())], tensors, streams, mem)
    interp = Interpreter(Executable.from_bytes(exe.to_bytes()))
    sel = [np.array(v, np.uint8) for v in (1, 0, 1)]
    io = ArrayIO({"sel": sel}, {"acc": (np.dtype(np.int32), (1,))})
    interp.run_program(0, io)
    assert io.outputs["acc"][0].tolist() == [4]


def test_graph_interface_must_match_its_onnx_model() -> None:
    g = helper.make_graph([helper.make_node("Neg", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])])
    m = make_model(g)
    ok = _hand_built(m, [TensorSig("x", "F32", (4,))], [TensorSig("y", "F32", (4,))])
    Interpreter(ok).close()
    lying = _hand_built(m, [TensorSig("x", "F32", (2,))], [TensorSig("y", "F32", (4,))])
    with pytest.raises(ExecutableError, match=r"graph 0 input 'x' is declared F32\[2\] but the "
                                              r"ONNX model has tensor\(float\)\[4\]"):
        Interpreter(lying)
    renamed = _hand_built(m, [TensorSig("x", "F32", (4,))], [TensorSig("z", "F32", (4,))])
    with pytest.raises(ExecutableError, match=r"declares outputs \['z'\] but its ONNX model "
                                              r"has \['y'\]"):
        Interpreter(renamed)
    garbage = Executable("bad", [], [Graph((), (), b"not onnx")], {}, {}, 0)
    with pytest.raises(DeviceProgramError, match="graph 0 cannot be loaded by onnxruntime"):
        Interpreter(garbage)
