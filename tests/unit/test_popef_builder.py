"""ModelBuilder: a model spread over several files, and files that disagree."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np
import pytest

from host_runtime import popef
from host_runtime.errors import PopefError
from tests.unit.test_popef_roundtrip import EXE, sample_metadata, weights


def _split(tmp_path: Path) -> tuple[Path, Path, Path]:
    md = sample_metadata()
    a, b, c = tmp_path / "meta.popef", tmp_path / "exe.popef", tmp_path / "data.popef"
    with popef.Writer(a) as w:
        w.writeMetadata(md)
    with popef.Writer(b) as w:
        w.writeExecutable(md.executable(), EXE, compress=True)
    with popef.Writer(c) as w:
        w.writeTensorData("weights", weights())
        w.writeFeedData("tensor_A", np.zeros((2, 1, 4), np.float32), 2)
        w.writeOpaque("o", b"op")
    return a, b, c


def test_three_files_merge_into_one_model(tmp_path: Path) -> None:
    a, b, c = _split(tmp_path)
    reader = popef.Reader()
    for p in (c, b, a):
        reader.parseFile(p)
    model = popef.ModelBuilder(reader).createModel()
    assert model.metadata == sample_metadata()
    assert model.executable.payload() == EXE
    assert [t.anchor for t in model.tensors] == ["weights"]
    assert [(f.anchor, f.num_transfers) for f in model.feeds] == [("tensor_A", 2)]
    assert [o.opaque_name for o in model.opaques] == ["o"]
    # The same through a list of readers, a list of paths, and load_model.
    readers = []
    for p in (a, b, c):
        r = popef.Reader()
        r.parseFile(p)
        readers.append(r)
    assert popef.ModelBuilder(readers).createModel() == model
    assert popef.ModelBuilder([a, b, c]).createModel() == model
    assert popef.load_model([a, b, c]) == model


def test_identical_duplicates_count_once(tmp_path: Path) -> None:
    a, b, c = _split(tmp_path)
    model = popef.load_model([a, b, c, a, c])
    assert len(model.tensors) == 1 and len(model.opaques) == 1
    # The same executable stored compressed in one file and plain in another.
    plain = tmp_path / "plain.popef"
    with popef.Writer(plain) as w:
        w.writeExecutable("simple_exe", EXE, compress=False)
    assert popef.load_model([a, b, c, plain]).executable.payload() == EXE


def _raises(match: str, paths: list[Path]) -> PopefError:
    with pytest.raises(PopefError) as info:
        popef.load_model(paths)
    assert re.search(match, str(info.value)), str(info.value)
    return info.value


def test_tensor_data_that_disagrees_names_both_files(tmp_path: Path) -> None:
    a, b, c = _split(tmp_path)
    other = tmp_path / "other.popef"
    with popef.Writer(other) as w:
        w.writeTensorData("weights", weights() + 1)
    err = _raises(r"two tensor data blobs named 'weights' disagree", [a, b, c, other])
    assert err.path == str(other) and err.offset == 16
    assert str(c) in str(err) and "tensor data 'weights'" in str(err)


def test_metadata_that_disagrees(tmp_path: Path) -> None:
    a, b, c = _split(tmp_path)
    other = tmp_path / "meta2.popef"
    with popef.Writer(other) as w:
        w.writeMetadata(sample_metadata(shape=(2, 4)))
    err = _raises(r"two metadata blobs disagree", [a, b, c, other])
    assert err.path == str(other)


def test_executables_that_disagree(tmp_path: Path) -> None:
    a, b, c = _split(tmp_path)
    other = tmp_path / "exe2.popef"
    with popef.Writer(other) as w:
        w.writeExecutable("simple_exe", EXE + b"!")
    _raises(r"two executable blobs named 'simple_exe' disagree", [a, b, c, other])


def test_no_metadata(tmp_path: Path) -> None:
    _, b, c = _split(tmp_path)
    _raises(r"no metadata blob in .*exe\.popef.*needs exactly one", [b, c])


def test_missing_executable(tmp_path: Path) -> None:
    a, _, c = _split(tmp_path)
    err = _raises(r"metadata names executable 'simple_exe' but no executable blob", [a, c])
    assert err.path == str(a) and err.offset == 16


def test_other_executables_are_ignored_with_a_warning(tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    a, b, c = _split(tmp_path)
    other = tmp_path / "exe2.popef"
    with popef.Writer(other) as w:
        w.writeExecutable("unrelated", b"zz")
    with caplog.at_level(logging.WARNING):
        model = popef.load_model([a, b, c, other])
    assert model.executable.name() == "simple_exe"
    assert "ignoring executable 'unrelated'" in caplog.text


def test_tensor_data_for_unknown_anchor(tmp_path: Path) -> None:
    a, b, _ = _split(tmp_path)
    bad = tmp_path / "bad.popef"
    with popef.Writer(bad) as w:
        w.writeTensorData("nope", b"1234")
    err = _raises(r"tensor data names anchor 'nope', which the metadata does not have",
                  [a, b, bad])
    assert err.path == str(bad) and err.blob is not None and "nope" in err.blob


def test_tensor_data_size_disagrees_with_anchor(tmp_path: Path) -> None:
    a, b, _ = _split(tmp_path)
    bad = tmp_path / "bad.popef"
    with popef.Writer(bad) as w:
        w.writeOpaque("pad", b"x")
        w.writeTensorData("weights", np.zeros(5, np.float32))
    err = _raises(r"tensor data for anchor 'weights' has 20 bytes, expected 16", [a, b, bad])
    assert err.path == str(bad)
    assert err.offset == 16 + 48 + 3 + 1
    assert f"file {str(bad)!r}" in str(err) and "offset 68" in str(err)


def test_feed_data_size_disagrees_with_anchor(tmp_path: Path) -> None:
    a, b, _ = _split(tmp_path)
    bad = tmp_path / "bad.popef"
    with popef.Writer(bad) as w:
        w.writeFeedData("tensor_A", np.zeros(6, np.float32), 2)
    _raises(r"feed data for anchor 'tensor_A' has 24 bytes, expected 2 transfers of 16 bytes",
            [a, b, bad])


def test_builder_rejects_wrong_argument_type() -> None:
    with pytest.raises(PopefError, match="expects a popef.Reader or a path, got int"):
        popef.ModelBuilder([1])  # type: ignore[list-item]
