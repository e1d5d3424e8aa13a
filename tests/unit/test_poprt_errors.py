"""poprt's failures are one ``poprt: error: ...`` line (no traceback), and a fusion YAML's
values are typed strictly and its outputs stay inside output_dir."""

from __future__ import annotations

import errno
import os
import pathlib

import onnx
import pytest

from host_runtime.errors import BadRequestError
from host_runtime.poprt.compiler import load_config_yaml
from tests.models import SEED_FUSION_CONFIG, seed_model0, seed_model1
from tools.generate_simple_popef import build_simple_model
from tools.poprt import main as poprt


@pytest.fixture()
def onnx_path(tmp_path):
    p = tmp_path / "simple.onnx"
    onnx.save(build_simple_model((1, 4)), str(p))
    return p


def _one_error_line(capsys, *words):
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("poprt: error: "), err
    assert "Traceback" not in err
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def test_output_dir_is_a_file(onnx_path, tmp_path, capsys):
    f = tmp_path / "afile"
    f.write_text("x")
    assert poprt(["--input_model", str(onnx_path), "--export_popef",
                  "--output_dir", str(f)]) == 2
    _one_error_line(capsys, "exists and is not a folder", str(f))


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_output_dir_unwritable(onnx_path, tmp_path, capsys):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    assert poprt(["--input_model", str(onnx_path), "--export_popef",
                  "--output_dir", str(ro / "sub")]) == 2
    _one_error_line(capsys, "Permission denied")


def test_output_dir_unwritable_path(onnx_path, tmp_path, capsys):
    assert poprt(["--input_model", str(onnx_path), "--export_popef",
                  "--output_dir", "/proc/no/such/dir"]) == 2
    _one_error_line(capsys, "cannot create output_dir")


def test_full_disk(onnx_path, tmp_path, capsys, monkeypatch):
    import host_runtime.popef.writer as writer

    def full(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(writer.Writer, "_write", full)
    out = tmp_path / "out"
    assert poprt(["--input_model", str(onnx_path), "--export_popef",
                  "--output_dir", str(out)]) == 2
    _one_error_line(capsys, "No space left on device", "executable.popef")
    assert not (out / "executable.popef").exists()   # no half-written file left


def test_huge_input_shape(onnx_path, capsys):
    assert poprt(["--input_model", str(onnx_path), "--input_shape",
                  "tensor_A=99999999999999999999,4"]) == 2
    _one_error_line(capsys, "99999999999999999999", "exceeds the limit")


def _fusion_dir(tmp_path: pathlib.Path, config: str | bytes) -> pathlib.Path:
    d = tmp_path / "fusion"
    d.mkdir()
    onnx.save(seed_model0(), str(d / "model0.onnx"))
    onnx.save(seed_model1(), str(d / "model1.onnx"))
    cfg = d / "config.yaml"
    if isinstance(config, bytes):
        cfg.write_bytes(config)
    else:
        cfg.write_text(config)
    return cfg


def test_config_not_utf8(tmp_path, capsys):
    cfg = _fusion_dir(tmp_path, SEED_FUSION_CONFIG.encode() + b"\nname: \xff\xfe\n")
    assert poprt(["--config_yaml", str(cfg)]) == 2
    _one_error_line(capsys, "is not UTF-8 text")


def test_config_lone_surrogate(tmp_path, capsys):
    cfg = _fusion_dir(tmp_path, SEED_FUSION_CONFIG + '\nname: "x\\udc80y"\n')
    assert poprt(["--config_yaml", str(cfg)]) == 2
    # libyaml refuses the escape itself; PyYAML's Python parser lets it through to the check
    line = _one_error_line(capsys)
    assert ("lone surrogate" in line or "found invalid Unicode character escape code at "
            "line 15, column 11 (while parsing a quoted scalar at line 15, column 7)" in line), line


@pytest.mark.parametrize("line, words", [
    ("export_popef: 'false'", ["export_popef must be a bool", "'false'"]),
    ("compress: 'no'", ["compress must be a bool", "'no'"]),
    ("output_dir: [a]", ["output_dir must be a str", "['a']", "list"]),
    ("batches_per_step: true", ["batches_per_step must be an integer", "True"]),
    ("name: 7", ["name must be a str", "7"]),
    ("popef_name: ../../x.popef", ["popef_name '../../x.popef' must name a file inside"]),
    ("output_model: ..", ["output_model '..' must name a file, not a folder"]),
])
def test_config_values_are_typed_strictly(tmp_path, line, words):
    base = "\n".join(ln for ln in SEED_FUSION_CONFIG.splitlines()
                     if not ln.startswith(line.split(":")[0] + ":"))
    cfg = _fusion_dir(tmp_path, base + "\n" + line + "\n")
    with pytest.raises(BadRequestError) as info:
        load_config_yaml(cfg)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_popef_name_outside_output_dir_from_the_command_line(onnx_path, tmp_path, capsys):
    out = tmp_path / "out"
    assert poprt(["--input_model", str(onnx_path), "--export_popef", "--output_dir", str(out),
                  "--popef_name", "../escaped.popef"]) == 2
    _one_error_line(capsys, "must name a file inside")
    assert not (tmp_path / "escaped.popef").exists()


def test_config_nested_too_deeply(tmp_path, capsys):
    cfg = tmp_path / "deep.yaml"
    cfg.write_text("model_fusion: " + "[" * 5000 + "]" * 5000 + "\n")
    assert poprt(["--config_yaml", str(cfg)]) == 2
    _one_error_line(capsys, "nests too deeply")


def test_the_compile_api_names_external_data_outside_the_models_folder(tmp_path):
    # Compiler.compile(path) as the poprt command: a named error, not onnx's ValidationError
    import numpy as np
    from onnx import TensorProto, helper

    from host_runtime.poprt.compiler import Compiler, CompilerOptions

    (tmp_path / "sub").mkdir()
    np.arange(2, dtype=np.float32).tofile(tmp_path / "secret.bin")
    w = onnx.TensorProto(name="W", data_type=TensorProto.FLOAT, dims=[2])
    w.data_location = TensorProto.EXTERNAL
    for k, v in (("location", "../secret.bin"), ("offset", "0"), ("length", "8")):
        w.external_data.add(key=k, value=v)
    g = helper.make_graph([helper.make_node("Add", ["x", "W"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])], [w])
    path = tmp_path / "sub" / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    with pytest.raises(BadRequestError, match=rf"model '{path}' cannot be loaded as ONNX: .*"
                       r"points outside the directory"):
        Compiler.compile(str(path), None, CompilerOptions())


def test_the_compiler_fits_models_to_the_machines_ipus(onnx_path, monkeypatch):
    # the emulated IPUs as configured, as the runtime checks them at load
    from host_runtime.poprt.compiler import Compiler, CompilerOptions

    monkeypatch.setenv("IPU_EMULATOR_TILES_PER_IPU", "1")
    monkeypatch.setenv("IPU_EMULATOR_MEMORY_PER_TILE", "16")
    with pytest.raises(Exception, match=r"16 bytes: the machine's IPU_EMULATOR_TILES_PER_IPU x "
                       r"IPU_EMULATOR_MEMORY_PER_TILE, less num_io_tiles"):
        Compiler.compile(str(onnx_path), None, CompilerOptions())
    monkeypatch.setenv("IPU_EMULATOR_MEMORY_PER_TILE", "4096")
    assert Compiler.compile(str(onnx_path), None, CompilerOptions()) is not None
