"""Model fusion (seed 004): the YAML config, the poprt command, the fused PopEF and its Switch."""

from __future__ import annotations

import pathlib

import numpy as np
import onnx
import pytest

from host_runtime import popef
from host_runtime.errors import BadRequestError
from host_runtime.poprt.compiler import load_config_yaml
from ipu_emulator.executable import Executable
from ipu_emulator.ipu.interpreter import Interpreter
from tests.models import SEED_FUSION_CONFIG as SEED_CONFIG
from tests.models import run_reference, seed_model0, seed_model1
from tests.models.arrayio import ArrayIO
from tools.poprt import main as poprt


def _seed_dir(tmp_path: pathlib.Path, config: str = SEED_CONFIG) -> pathlib.Path:
    d = tmp_path / "fusion"
    d.mkdir()
    onnx.save(seed_model0(), str(d / "model0.onnx"))
    onnx.save(seed_model1(), str(d / "model1.onnx"))
    (d / "config.yaml").write_text(config)
    return d


def _interpreter(path: pathlib.Path) -> tuple[popef.Model, Interpreter]:
    model = popef.load_model([str(path)])
    return model, Interpreter(Executable.from_bytes(model.executable.payload()))


def test_seed_compile_and_run(tmp_path, monkeypatch, capsys) -> None:
    d = _seed_dir(tmp_path)
    monkeypatch.chdir(tmp_path)          # relative paths resolve against the YAML's folder
    assert poprt(["--config_yaml", str(d / "config.yaml")]) == 0
    assert "wrote" in capsys.readouterr().out
    assert (d / "executable.popef").is_file() and (d / "model_fusion.onnx").is_file()
    model, interp = _interpreter(d / "executable.popef")
    md = model.metadata
    anchors = {a.name(): a for a in md.anchors()}
    assert set(anchors) == {"index", "graph0/X", "graph0/Y", "graph0/O", "graph1/X", "graph1/O"}
    assert anchors["index"].tensorInfo().dataType() == popef.DataType.S32
    assert anchors["index"].tensorInfo().shape() == [1]
    assert anchors["graph0/O"].tensorInfo().shape() == [2]
    assert anchors["graph1/X"].tensorInfo().dataType() == popef.DataType.F16
    assert anchors["graph1/O"].tensorInfo().shape() == [1, 3]
    assert md.subgraphs() == {"graph0": ["graph0/X", "graph0/Y", "graph0/O"],
                              "graph1": ["graph1/X", "graph1/O"]}
    assert md.ipuVersion() == 21
    # run.py's two requests
    io = ArrayIO({"index": [np.array([0], np.int32), np.array([1], np.int32)],
                  "graph0/X": [np.ones([1, 2], np.float32)],
                  "graph0/Y": [np.ones([1, 2], np.float32) * 2],
                  "graph1/X": [np.zeros([1, 1], np.float16)]},
                 {"graph0/O": (np.dtype(np.float32), (2,)),
                  "graph1/O": (np.dtype(np.float16), (1, 3))})
    interp.run_program(0, io)
    interp.run_program(1, io)
    interp.run_program(1, io)
    np.testing.assert_array_equal(io.outputs["graph0/O"][0], np.ones([2], np.float32) * 3)
    np.testing.assert_array_equal(io.outputs["graph1/O"][0],
                                  np.array([[0.0, 1.5, 2.0]], dtype=np.float16))
    assert io.reads == ["index", "graph0/X", "graph0/Y", "index", "graph1/X"]


def test_fused_onnx_model_holds_both_graphs(tmp_path) -> None:
    d = _seed_dir(tmp_path)
    assert poprt(["--config_yaml", str(d / "config.yaml")]) == 0
    fused = onnx.load(str(d / "model_fusion.onnx"))
    onnx.checker.check_model(fused)
    assert [i.name for i in fused.graph.input] == ["index", "graph0/X", "graph0/Y", "graph1/X"]
    out = run_reference(fused, {"index": np.array([0], np.int32),
                                "graph0/X": np.ones([1, 2], np.float32),
                                "graph0/Y": np.full([1, 2], 2, np.float32),
                                "graph1/X": np.full([1, 1], 4, np.float16)})
    np.testing.assert_array_equal(out["graph0/O"], [3, 3])
    np.testing.assert_array_equal(out["graph1/O"], np.array([[4, 1.5, 2]], np.float16))


def test_globals_apply_and_per_model_keys_override(tmp_path) -> None:
    config = """\
precision: fp16
export_popef: true
batches_per_step: 2
weights_as_tensor_data: true
output_dir: out
model_fusion:
  - input_model: model0.onnx
    input_shape: ['X=1,2', 'Y=1,2']
    precision: fp32
  - input_model: model1.onnx
"""
    d = _seed_dir(tmp_path, config)
    cfg = load_config_yaml(d / "config.yaml")
    assert [m.precision for m in cfg.models] == ["fp32", "fp16"]
    assert cfg.models[0].input_shapes == {"X": [1, 2], "Y": [1, 2]}
    assert cfg.models[1].input_shapes == {}
    assert cfg.output_dir == d.resolve() / "out"
    assert cfg.options["batches_per_step"] == 2
    assert poprt(["--config_yaml", str(d / "config.yaml")]) == 0
    model, interp = _interpreter(d / "out" / "executable.popef")
    anchors = {a.name(): a for a in model.metadata.anchors()}
    assert anchors["graph0/X"].tensorInfo().dataType() == popef.DataType.F32
    assert anchors["graph1/C"].programs() == [0]          # fp16 constant as tensor data
    assert "graph0/C" not in anchors                       # int64 shape stays compiled in
    assert model.metadata.subgraphs()["graph1"] == ["graph1/C", "graph1/X", "graph1/O"]
    assert model.metadata.deviceIterations() == 2
    c = model.tensorData("graph1/C").data
    assert np.frombuffer(c, np.float16).tolist() == [1.5, 2.0]
    io = ArrayIO({"graph1/C": [np.frombuffer(c, np.float16).reshape(1, 2)],
                  "index": [np.array([1], np.int32), np.array([0], np.int32)],
                  "graph1/X": [np.full([1, 1], 7, np.float16)],
                  "graph0/X": [np.ones([1, 2], np.float32)],
                  "graph0/Y": [np.ones([1, 2], np.float32)]},
                 {"graph0/O": (np.dtype(np.float32), (2,)),
                  "graph1/O": (np.dtype(np.float16), (1, 3))})
    interp.run_program(0, io)
    interp.run_program(1, io)   # two device iterations: graph1 then graph0
    assert io.outputs["graph1/O"][0].tolist() == [[7.0, 1.5, 2.0]]
    assert io.outputs["graph0/O"][0].tolist() == [2.0, 2.0]


@pytest.mark.parametrize("config, message", [
    ("model_fusion: []\n", "model_fusion must be a non-empty list"),
    ("bogus: 1\nmodel_fusion: [{input_model: model0.onnx}]\n", r"unknown keys \['bogus'\]"),
    ("model_fusion: [{input_model: model0.onnx, speed: 3}]\n",
     r"model_fusion\[0\]: unknown keys \['speed'\]"),
    ("model_fusion: [{input_shape: ['X=1,2']}]\n", r"model_fusion\[0\]: input_model"),
    ("model_fusion: [{input_model: model0.onnx, input_shape: ['X:1,2']}]\n",
     "must look like NAME=d0,d1"),
    ("max_tensor_size: big\nmodel_fusion: [{input_model: model0.onnx}]\n",
     "max_tensor_size must be an integer"),
    ("- just a list\n", "must be a mapping of keys"),
    ("a: [\n", "not valid YAML"),
])
def test_bad_configs_are_named(tmp_path, config: str, message: str) -> None:
    d = _seed_dir(tmp_path, config)
    with pytest.raises(BadRequestError, match=message):
        load_config_yaml(d / "config.yaml")


def test_cli_reports_refused_fusion(tmp_path, capsys) -> None:
    config = SEED_CONFIG.replace("input_shape: ['X=1,1']", "input_shape: ['Q=1,1']")
    d = _seed_dir(tmp_path, config)
    assert poprt(["--config_yaml", str(d / "config.yaml")]) == 2
    err = capsys.readouterr().err
    assert "poprt: error:" in err and "--input_shape names 'Q', which is not an input" in err
    assert not (d / "executable.popef").exists()


def test_without_export_popef_only_the_onnx_model_is_written(tmp_path) -> None:
    d = _seed_dir(tmp_path, SEED_CONFIG.replace("export_popef: True", "export_popef: False"))
    assert poprt(["--config_yaml", str(d / "config.yaml")]) == 0
    assert (d / "model_fusion.onnx").is_file()
    assert not (d / "executable.popef").exists()
    assert poprt(["--config_yaml", str(d / "config.yaml"), "--export_popef",
                  "--output_dir", str(tmp_path / "cli")]) == 0
    assert (tmp_path / "cli" / "executable.popef").is_file()
