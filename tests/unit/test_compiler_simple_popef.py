"""The seeds' example model written by tools.generate_simple_popef, read back and run."""

from __future__ import annotations

import numpy as np
import pytest

from host_runtime import popef
from ipu_emulator import package_hash
from ipu_emulator.executable import Executable, read_header
from ipu_emulator.ipu.interpreter import Interpreter
from tests.models.arrayio import ArrayIO
from tools.generate_simple_popef import main, write_simple_popef


@pytest.mark.parametrize("compress", [False, True])
def test_simple_popef_reads_back_and_runs(tmp_path, compress: bool) -> None:
    path = tmp_path / "simple.popef"
    assert write_simple_popef(path, shape=(2, 5), batches_per_step=2, seed=3,
                              compress=compress) == path
    model = popef.load_model([str(path)])
    md = model.metadata
    names = {a.name(): a for a in md.anchors()}
    assert set(names) == {"tensor_A", "tensor_B", "tensor_C", "weights", "weights_saved"}
    assert names["tensor_A"].type() == popef.TensorType.INPUT
    assert names["tensor_C"].type() == popef.TensorType.OUTPUT
    assert names["weights_saved"].type() == popef.TensorType.OUTPUT
    assert names["weights"].programs() == [0]
    assert names["tensor_A"].programs() == [1]
    assert names["weights_saved"].programs() == [2]
    assert names["tensor_C"].tensorInfo().shape() == [2, 5]
    assert names["tensor_C"].tensorInfo().dataType() == popef.DataType.F32
    flow = md.programFlow()
    assert (flow.load(), flow.main(), flow.save()) == ([0], [1], [2])
    assert md.deviceIterations() == 2
    assert md.ipuVersion() == 21
    assert model.executable.compressed is compress
    payload = model.executable.payload()
    assert read_header(payload).package_hash == package_hash()
    assert read_header(payload).name == md.executable()
    w = np.frombuffer(model.tensorData("weights").data, np.float32).reshape(2, 5)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((2, 2, 5)).astype(np.float32)
    b = rng.standard_normal((2, 2, 5)).astype(np.float32)
    io = ArrayIO({"weights": [w], "tensor_A": list(a), "tensor_B": list(b)},
                 {"tensor_C": (np.dtype(np.float32), (2, 5)),
                  "weights_saved": (np.dtype(np.float32), (2, 5))})
    interp = Interpreter(Executable.from_bytes(payload))
    for program in (0, 1, 2):
        interp.run_program(program, io)
    for k in range(2):
        np.testing.assert_allclose(io.outputs["tensor_C"][k], a[k] * w + b[k], rtol=1e-6)
    np.testing.assert_array_equal(io.outputs["weights_saved"][0], w)


def test_seed_changes_weights_and_command_line(tmp_path, capsys) -> None:
    p1, p2 = tmp_path / "a.popef", tmp_path / "b.popef"
    assert main([str(p1), "--shape", "1,4"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert main([str(p2), "--shape", "1,4", "--seed", "1"]) == 0
    w1 = popef.load_model([str(p1)]).tensorData("weights").data
    w2 = popef.load_model([str(p2)]).tensorData("weights").data
    assert len(w1) == 16 and w1 != w2
    with pytest.raises(SystemExit):
        main([str(p1), "--shape", "1,x"])
