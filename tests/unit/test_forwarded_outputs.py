"""Outputs that are an input forwarded by an Identity: copied by the IPU process, not onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from ipu_emulator.compiler import CompileOptions, ModelSpec, compile_onnx
from ipu_emulator.executable import Executable, Graph, TensorSig
from ipu_emulator.ipu._forwarding import forwarded_outputs
from ipu_emulator.ipu.interpreter import Interpreter
from shm.copy import PARALLEL_MIN_BYTES
from tests.models import make_model
from tests.models.arrayio import ArrayIO
from tests.unit.test_interpreter_zerocopy import LendingIO

F32 = np.dtype(np.float32)


def _vi(name: str, n: int, dtype: int = TensorProto.FLOAT) -> object:
    return helper.make_tensor_value_info(name, dtype, [n])


def _model(n: int, computed: bool = True) -> object:
    """y = Identity(x) (forwarded); with ``computed``: z = x + u, c = Identity(w) of an
    initializer, m = Identity(x + u) of an intermediate (none of them forwarded)."""
    nodes = [helper.make_node("Identity", ["x"], ["y"])]
    outputs = [_vi("y", n)]
    inits = []
    if computed:
        nodes += [helper.make_node("Add", ["x", "u"], ["z"]),
                  helper.make_node("Identity", ["w"], ["c"]),
                  helper.make_node("Identity", ["z"], ["m"])]
        outputs += [_vi("z", n), _vi("c", 3), _vi("m", n)]
        inits.append(helper.make_tensor("w", TensorProto.FLOAT, [3], [1.0, 2.0, 3.0]))
    inputs = [_vi("x", n)] + ([_vi("u", n)] if computed else [])
    return make_model(helper.make_graph(nodes, "fwd", inputs, outputs, inits))


def _graph(model: object, n: int) -> Graph:
    sig = {"x": TensorSig("x", "F32", (n,)), "u": TensorSig("u", "F32", (n,))}
    outs = [TensorSig(o.name, "F32", (3,) if o.name == "c" else (n,))
            for o in model.graph.output]  # type: ignore[attr-defined]
    ins = [sig[i.name] for i in model.graph.input]  # type: ignore[attr-defined]
    return Graph(tuple(ins), tuple(outs), model.SerializeToString())  # type: ignore[attr-defined]


def test_only_an_identity_of_a_graph_input_is_forwarded() -> None:
    assert forwarded_outputs(_graph(_model(8), 8)) == {"y": "x"}
    assert forwarded_outputs(_graph(_model(8, computed=False), 8)) == {"y": "x"}


def test_an_identity_of_another_domain_or_another_shape_is_not_forwarded() -> None:
    m = _model(8, computed=False)
    m.graph.node[0].domain = "com.example"  # type: ignore[attr-defined]
    assert forwarded_outputs(_graph(m, 8)) == {}
    g = _graph(_model(8, computed=False), 8)
    other = Graph(g.inputs, (TensorSig("y", "F16", (8,)),), g.model)   # declared otherwise
    assert forwarded_outputs(other) == {}


@pytest.mark.parametrize("cut", [1, 7, 40, -3])
def test_a_damaged_model_forwards_nothing(cut: int) -> None:
    g = _graph(_model(8), 8)
    damaged = g.model[:cut] + b"\xff\xff" + g.model[cut + 2:]
    assert forwarded_outputs(Graph(g.inputs, g.outputs, damaged)) in ({}, {"y": "x"})
    assert forwarded_outputs(Graph(g.inputs, g.outputs, g.model[:cut])) in ({}, {"y": "x"})


def _exe(n: int, computed: bool, iterations: int) -> Executable:
    result = compile_onnx(ModelSpec(_model(n, computed)),  # type: ignore[arg-type]
                          CompileOptions(device_iterations=iterations))
    return Executable.from_bytes(result.executable.to_bytes())


@pytest.mark.parametrize("lend", [False, True], ids=["device memory", "zero-copy"])
@pytest.mark.parametrize("n,computed", [(1000, True), (1000, False),
                                        (PARALLEL_MIN_BYTES // 4 + 17, False)],
                         ids=["with computed outputs", "alone", "above the parallel copy"])
def test_forwarded_outputs_carry_each_transfer_s_input(lend: bool, n: int,
                                                       computed: bool) -> None:
    iterations = 3
    exe = _exe(n, computed, iterations)
    main = next(k for k, p in enumerate(exe.programs) if p.name == "main")
    rng = np.random.default_rng(n)
    x = rng.standard_normal((iterations, n)).astype(np.float32)
    u = rng.standard_normal((iterations, n)).astype(np.float32)
    feeds = {"x": list(x)} | ({"u": list(u)} if computed else {})
    outs = {"y": (F32, (n,))} | ({"z": (F32, (n,)), "c": (F32, (3,)), "m": (F32, (n,))}
                                 if computed else {})
    assert forwarded_outputs(exe.graphs[0]) == {"y": "x"}
    with Interpreter(exe) as interp:
        for _ in range(2):   # twice: the second run reuses the first one's bindings
            io = LendingIO(feeds, outs, slots=2) if lend else ArrayIO(feeds, outs)
            interp.run_program(main, io)
            for k in range(iterations):
                np.testing.assert_array_equal(io.outputs["y"][k], x[k])
                if computed:
                    np.testing.assert_allclose(io.outputs["z"][k], x[k] + u[k], rtol=1e-6)
                    np.testing.assert_allclose(io.outputs["m"][k], x[k] + u[k], rtol=1e-6)
                    np.testing.assert_array_equal(io.outputs["c"][k], [1.0, 2.0, 3.0])
            if lend:
                assert not io.held and io.reads == []   # every stream went zero-copy
