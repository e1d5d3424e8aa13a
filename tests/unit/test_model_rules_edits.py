"""Every single edit of the example's Main iteration (drop, duplicate or swap
instructions; other Repeat counts) is either refused by the model rules or, run by the
interpreter, answers each request with the right value: never a wrong answer."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from host_runtime import popef
from host_runtime.errors import ModelRuleError
from host_runtime.popef._check import check_model
from ipu_emulator.executable import Executable, Program, Repeat
from ipu_emulator.ipu.interpreter import Interpreter
from ipu_emulator.validate import check_loaded_streams, check_loop
from tests.crafted import load_parts


@pytest.fixture(scope="module")
def parts(tmp_path_factory):
    from tools.generate_simple_popef import write_simple_popef
    model, exe = load_parts(write_simple_popef(tmp_path_factory.mktemp("edits") / "s.popef"))
    return model, exe


def _edits(body):
    n = len(body)
    for i in range(n):
        yield f"drop {i}", body[:i] + body[i + 1:]
        yield f"dup {i}", body[:i + 1] + body[i:]
    for i, j in itertools.combinations(range(n), 2):
        b = list(body)
        b[i], b[j] = b[j], b[i]
        yield f"swap {i} {j}", tuple(b)


def _variants(exe):
    rep = exe.programs[1].body[0]
    assert isinstance(rep, Repeat)
    for name, body in _edits(rep.body):
        yield name, (Repeat(rep.count, body),)
    for count in (0, 2, 3):
        yield f"repeat {count}", (Repeat(count, rep.body),)
    yield "unrolled", rep.body
    yield "unrolled twice", rep.body + rep.body


class _IO:
    def __init__(self, a, b):
        self.a, self.b = list(a), list(b)
        self.c: list[np.ndarray] = []
        self.reads = {"tensor_A": 0, "tensor_B": 0}

    def read_input(self, handle, dest):
        src = {"tensor_A": self.a, "tensor_B": self.b}[handle].pop(0)
        self.reads[handle] += 1
        np.frombuffer(dest, np.uint8)[:] = src.reshape(-1).view(np.uint8)

    def write_output(self, handle, src):
        assert handle == "tensor_C"
        self.c.append(np.frombuffer(bytes(src), np.float32).reshape(1, 4))


def test_each_edit_is_refused_or_right(parts):
    model, exe = parts
    weights = np.frombuffer(model.tensorData("weights").data, np.float32).reshape(1, 4)
    accepted, refused = [], []
    for name, main in _variants(exe):
        edited = dataclasses.replace(exe, programs=[exe.programs[0], Program("main", main),
                                                    exe.programs[2]])
        m = popef.Model(model.metadata, popef.ExecutableBlob(
            exe.name, edited.to_bytes()), model.tensors)
        try:
            check_model(m)
        except ModelRuleError as exc:
            refused.append((name, exc.rule))
            continue
        accepted.append(name)
        # what the host accepts, the IPU process's own checks accept too
        check_loop(edited, [1], ["tensor_A", "tensor_B", "tensor_C", "weights",
                                 "weights_saved"])
        check_loaded_streams(edited, [("tensor_A", "in"), ("tensor_B", "in"),
                                      ("tensor_C", "out"), ("weights", "in"),
                                      ("weights_saved", "out")])
        # run it: iterations per Main run, requests = 2 runs' worth
        per_run = main[0].count if len(main) == 1 and isinstance(main[0], Repeat) else 1
        n = 2 * per_run
        rng = np.random.default_rng(0)
        a = [rng.standard_normal((1, 4)).astype(np.float32) for _ in range(n)]
        b = [rng.standard_normal((1, 4)).astype(np.float32) for _ in range(n)]
        io = _IO(a, b)
        with Interpreter(Executable.from_bytes(m.executable.payload())) as interp:
            interp.tensor("weights")[:] = weights
            for _ in range(2):
                interp.run_program(1, io)
        assert io.reads == {"tensor_A": n, "tensor_B": n}, name
        assert len(io.c) == n, name
        for k in range(n):
            np.testing.assert_allclose(io.c[k], a[k] * weights + b[k], rtol=1e-6,
                                       err_msg=name)
    assert {"swap 0 1", "repeat 2", "repeat 3", "unrolled"} <= set(accepted), accepted
    assert dict(refused)["repeat 0"] == "repeat-count"
    assert dict(refused)["dup 3"] == "stream-count"
    assert dict(refused)["swap 2 3"] == "stream-order"
    assert dict(refused)["unrolled twice"] == "stream-count"
