"""Compiled files are written safely: a temporary file in the output folder, created
O_EXCL|O_NOFOLLOW with mode 0600, renamed into place, so a symlink put at the output path
(before or during the compile) is replaced and its target never written; a failure
leaves the path as it was and no temporary file behind."""

from __future__ import annotations

import os
import pathlib
import stat

import onnx
import pytest

import host_runtime._atomic_file as atomic_file
from host_runtime import popef
from host_runtime._atomic_file import AtomicFile, umask
from host_runtime.errors import BadRequestError
from tools.generate_simple_popef import build_simple_model
from tools.poprt import main as poprt

VICTIM = b"precious bytes that must survive\n"


@pytest.fixture()
def onnx_path(tmp_path):
    p = tmp_path / "simple.onnx"
    onnx.save(build_simple_model((1, 4)), str(p))
    return p


def _victim(tmp_path: pathlib.Path, name: str = "victim") -> pathlib.Path:
    v = tmp_path / name
    v.write_bytes(VICTIM)
    v.chmod(0o644)
    return v


def _only_outputs(folder: pathlib.Path, *names: str) -> None:
    assert sorted(p.name for p in folder.iterdir()) == sorted(names)


def test_symlink_put_at_the_output_during_the_compile_is_replaced(onnx_path, tmp_path,
                                                                   monkeypatch):
    """The window of a check-then-open: the output paths were checked (inside the output
    folder, not a folder) and the folders made; then symlinks to a file elsewhere appear
    at both outputs before anything is opened."""
    import host_runtime.poprt.compiler as compiler

    out = tmp_path / "out"
    victim = _victim(tmp_path)
    real = compiler._make_dir
    planted = []

    def make_dir_then_plant(path, what):
        real(path, what)
        if not planted:
            for name in ("executable.popef", "simple.fp32.onnx"):
                (out / name).symlink_to(victim)
                planted.append(name)
    monkeypatch.setattr(compiler, "_make_dir", make_dir_then_plant)
    assert poprt(["--input_model", str(onnx_path), "--export_popef",
                  "--output_dir", str(out)]) == 0
    assert planted == ["executable.popef", "simple.fp32.onnx"]
    assert victim.read_bytes() == VICTIM and stat.S_IMODE(victim.stat().st_mode) == 0o644
    for name in planted:
        assert not (out / name).is_symlink() and (out / name).is_file()
    model = popef.load_model([str(out / "executable.popef")])
    assert model.metadata.executable() == "executable"
    assert onnx.load(str(out / "simple.fp32.onnx")).graph.node
    _only_outputs(out, "executable.popef", "simple.fp32.onnx")


def test_symlink_inside_the_output_folder_is_not_written_through(onnx_path, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    victim = _victim(out, "victim.popef")
    (out / "executable.popef").symlink_to(victim)
    assert poprt(["--input_model", str(onnx_path), "--export_popef",
                  "--output_dir", str(out)]) == 0
    assert victim.read_bytes() == VICTIM
    assert not (out / "executable.popef").is_symlink()
    popef.load_model([str(out / "executable.popef")])


def test_symlink_to_outside_left_from_before_is_replaced(onnx_path, tmp_path):
    """A link at the output name pointing out of the folder (say, into a cache): the
    output replaces the link; the file it pointed to keeps its bytes."""
    out = tmp_path / "out"
    out.mkdir()
    victim = _victim(tmp_path)
    (out / "executable.popef").symlink_to(victim)
    assert poprt(["--input_model", str(onnx_path), "--export_popef",
                  "--output_dir", str(out)]) == 0
    assert victim.read_bytes() == VICTIM and not (out / "executable.popef").is_symlink()


@pytest.mark.parametrize("name", ["..", "sub/..", "../x.popef", "sub/../../x.popef"])
def test_names_that_leave_the_folder_are_refused(onnx_path, tmp_path, capsys, name):
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    assert poprt(["--input_model", str(onnx_path), "--export_popef",
                  "--output_dir", str(out), "--popef_name", name]) == 2
    err = capsys.readouterr().err
    assert f"popef_name {name!r} must name a file inside the output folder" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "simple.onnx"]


def test_mode_follows_the_umask(onnx_path, tmp_path):
    old = os.umask(0o027)
    try:
        assert umask() == 0o027
        assert poprt(["--input_model", str(onnx_path), "--export_popef",
                      "--output_dir", str(tmp_path / "out")]) == 0
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "out" / "executable.popef").stat().st_mode) == 0o640


def test_a_taken_temporary_name_is_never_opened(tmp_path, monkeypatch):
    """A symlink planted at the next temporary name: O_EXCL|O_NOFOLLOW refuses it and
    another name is drawn; the link's target is untouched."""
    victim = _victim(tmp_path)
    names = iter(["aaaaaaaaaaaa", "bbbbbbbbbbbb"])
    monkeypatch.setattr(atomic_file.secrets, "token_hex", lambda n: next(names))
    out = tmp_path / "out"
    out.mkdir()
    (out / ".f.bin.aaaaaaaaaaaa.tmp").symlink_to(victim)
    with AtomicFile(out / "f.bin") as f:
        assert f.name == str(out / ".f.bin.bbbbbbbbbbbb.tmp")
        assert stat.S_IMODE(os.fstat(f.fileno()).st_mode) == 0o600
        f.write(b"new")
    assert (out / "f.bin").read_bytes() == b"new" and victim.read_bytes() == VICTIM
    _only_outputs(out, "f.bin", ".f.bin.aaaaaaaaaaaa.tmp")


def test_a_failed_write_leaves_the_old_file(tmp_path):
    path = tmp_path / "model.popef"
    path.write_bytes(VICTIM)
    with pytest.raises(RuntimeError, match="^boom$"):
        with popef.Writer(path) as w:
            w.writeOpaque("x", b"1234")
            raise RuntimeError("boom")
    assert path.read_bytes() == VICTIM
    _only_outputs(tmp_path, "model.popef")


def test_writer_replaces_a_symlink(tmp_path):
    victim = _victim(tmp_path)
    path = tmp_path / "model.popef"
    path.symlink_to(victim)
    with popef.Writer(path) as w:
        w.writeOpaque("x", b"1234")
    assert victim.read_bytes() == VICTIM and not path.is_symlink()
    reader = popef.Reader()
    reader.parseFile(str(path))
    assert [b.name for b in reader.opaqueBlobs()] == ["x"]


def test_writer_into_a_missing_folder(tmp_path):
    with pytest.raises(BadRequestError) as info:
        popef.Writer(tmp_path / "no" / "model.popef")
    assert str(info.value) == (f"cannot create PopEF file {str(tmp_path / 'no' / 'model.popef')!r}: "
                               "No such file or directory")
