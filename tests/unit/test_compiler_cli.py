"""The ``poprt`` command end to end on one model: flags -> files -> PopEF -> interpreter."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import pytest

from host_runtime import popef
from ipu_emulator.executable import Executable
from ipu_emulator.ipu.interpreter import Interpreter
from tests.models import dynamic_model, run_reference
from tests.models.arrayio import ArrayIO
from tools.poprt import main as poprt


@pytest.fixture()
def mlp(tmp_path):
    path = tmp_path / "mlp.onnx"
    onnx.save(dynamic_model(), str(path))
    return path


def test_single_model_all_flags(tmp_path, mlp, capsys) -> None:
    out = tmp_path / "out"
    rc = poprt(["--input_model", str(mlp), "--input_shape", "x=4,6", "--export_popef",
                "--output_dir", str(out), "--ipu_version", "ipu2", "--batches_per_step", "3",
                "--weights_as_tensor_data", "--compress", "--precision", "fp32"])
    assert rc == 0, capsys.readouterr().err
    assert (out / "mlp.fp32.onnx").is_file()
    model = popef.load_model([str(out / "executable.popef")])
    md = model.metadata
    assert (md.ipuVersion(), md.deviceIterations()) == (2, 3)
    assert model.executable.compressed
    assert sorted(t.anchor for t in model.tensors) == ["b", "w"]
    anchors = {a.name(): a for a in md.anchors()}
    assert anchors["x"].tensorInfo().shape() == [4, 6]
    assert anchors["y"].tensorInfo().shape() == [4, 5]
    assert anchors["w"].programs() == [0] and anchors["x"].programs() == [1]
    interp = Interpreter(Executable.from_bytes(model.executable.payload()))
    xs = np.random.default_rng(3).standard_normal((3, 4, 6)).astype(np.float32)
    feeds = {t.anchor: [np.frombuffer(t.data, np.float32).reshape(
        anchors[t.anchor].tensorInfo().shape())] for t in model.tensors}
    feeds["x"] = list(xs)
    io = ArrayIO(feeds, {"y": (np.dtype(np.float32), (4, 5))})
    interp.run_program(0, io)
    interp.run_program(1, io)
    for k in range(3):
        np.testing.assert_allclose(io.outputs["y"][k],
                                   run_reference(dynamic_model(), {"x": xs[k]})["y"], rtol=1e-5)


def test_fp16_output_model_and_no_popef(tmp_path, mlp) -> None:
    out = tmp_path / "o"
    assert poprt(["--input_model", str(mlp), "--input_shape", "x=2,6", "--precision", "fp16",
                  "--output_dir", str(out), "--output_model", "half.onnx"]) == 0
    assert not (out / "executable.popef").exists()
    half = onnx.load(str(out / "half.onnx"))
    assert half.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    assert [d.dim_value for d in half.graph.input[0].type.tensor_type.shape.dim] == [2, 6]
    x = np.random.default_rng(4).standard_normal((2, 6)).astype(np.float32)
    y16 = run_reference(half, {"x": x.astype(np.float16)})["y"]
    np.testing.assert_allclose(y16.astype(np.float32), run_reference(dynamic_model(), {"x": x})["y"],
                               atol=1e-2)


def test_refusals_exit_2_with_the_reason(tmp_path, mlp, capsys) -> None:
    assert poprt(["--input_model", str(mlp), "--export_popef", "--output_dir",
                  str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "input 'x' has an unresolved dynamic shape" in err and "--input_shape" in err
    assert poprt(["--input_model", str(mlp), "--input_shape", "x1,2"]) == 2
    assert "must look like NAME=d0,d1" in capsys.readouterr().err
    # --max_tensor_size bounds constant folding only (PopRT's): the model's own tensors
    # may be larger (its weight w is 120 bytes)
    assert poprt(["--input_model", str(mlp), "--input_shape", "x=1,6",
                  "--max_tensor_size", "16", "--output_dir", str(tmp_path / "r")]) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit):
        poprt(["--input_model", str(mlp), "--ipu_version", "ipu9"])


def test_console_script_runs(tmp_path, mlp) -> None:
    proc = subprocess.run([sys.executable, "-m", "tools.poprt", "--input_model", str(mlp),
                           "--input_shape", "x=1,6", "--export_popef", "--output_dir",
                           str(tmp_path / "c")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "c" / "executable.popef").is_file()
