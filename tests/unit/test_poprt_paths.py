"""``poprt`` output paths as users give them (issue 21): ``--output_model`` and
``--export_popef PATH`` absolute or relative, inside or outside ``--output_dir``;
``--popef_name`` (documented as a name inside ``--output_dir``) absolute or relative,
refused only when it leaves ``--output_dir``."""

from __future__ import annotations

import os

import onnx
import pytest

from host_runtime import popef
from tests.models import simple_model
from tools.poprt import main as poprt


@pytest.fixture()
def onnx_path(tmp_path):
    path = tmp_path / "simple.onnx"
    onnx.save(simple_model(), str(path))
    return str(path)


def _is_onnx(path):
    return [n.op_type for n in onnx.load(str(path)).graph.node] == ["Mul", "Add"]


def _is_popef(path):
    return [a.name() for a in popef.load_model([str(path)]).metadata.anchors()] != []


@pytest.mark.parametrize("where", ["absolute inside", "relative inside", "absolute outside",
                                   "relative outside", "relative in a new folder"])
def test_output_model_anywhere(onnx_path, tmp_path, monkeypatch, where, capsys):
    out = tmp_path / "out"
    monkeypatch.chdir(tmp_path)
    given, expected = {
        "absolute inside": (str(out / "m.onnx"), out / "m.onnx"),
        "relative inside": ("m.onnx", out / "m.onnx"),
        "absolute outside": (str(tmp_path / "elsewhere" / "m.onnx"), tmp_path / "elsewhere" / "m.onnx"),
        "relative outside": ("../m.onnx", tmp_path / "m.onnx"),
        "relative in a new folder": ("sub/m.onnx", out / "sub" / "m.onnx"),
    }[where]
    (tmp_path / "elsewhere").mkdir()
    assert poprt(["--input_model", onnx_path, "--output_dir", "out", "--output_model", given,
                  "--export_popef"]) == 0
    assert _is_onnx(expected) and _is_popef(out / "executable.popef")
    wrote = [ln.split("poprt: wrote ", 1)[1] for ln in capsys.readouterr().out.splitlines()
             if ln.startswith("poprt: wrote ")]
    assert os.path.realpath(os.path.join(tmp_path, wrote[0])) == os.path.realpath(expected)


@pytest.mark.parametrize("relative", [False, True])
def test_export_popef_takes_a_path(onnx_path, tmp_path, monkeypatch, relative):
    monkeypatch.chdir(tmp_path)
    target = tmp_path / "models" / "vad.popef"
    given = "../models/vad.popef" if relative else str(target)
    assert poprt(["--input_model", onnx_path, "--output_dir", "out", "--export_popef", given]) == 0
    assert _is_popef(target)
    assert not (tmp_path / "out" / "executable.popef").exists()


def test_popef_name_absolute_inside_is_accepted(onnx_path, tmp_path):
    out = tmp_path / "out"
    assert poprt(["--input_model", onnx_path, "--output_dir", str(out), "--export_popef",
                  "--popef_name", str(out / "sub" / "x.popef")]) == 0
    assert _is_popef(out / "sub" / "x.popef")


def test_popef_name_absolute_outside_is_refused(onnx_path, tmp_path, capsys):
    out = tmp_path / "out"
    assert poprt(["--input_model", onnx_path, "--output_dir", str(out), "--export_popef",
                  "--popef_name", str(tmp_path / "x.popef")]) == 2
    assert "must name a file inside the output folder" in capsys.readouterr().err
    assert not (tmp_path / "x.popef").exists()


def test_output_model_naming_a_folder_is_refused(onnx_path, tmp_path, capsys):
    (tmp_path / "out" / "d").mkdir(parents=True)
    assert poprt(["--input_model", onnx_path, "--output_dir", str(tmp_path / "out"),
                  "--output_model", "d"]) == 2
    assert "output_model 'd' is a folder" in capsys.readouterr().err
