"""A compiled PopEF file that ends early, anywhere, is refused whole: by the reader,
by popef_dump and by ModelRunner, with PopefError, before anything runs. Cut exactly
between two blobs too: the seeds' example model cut after its executable (its weights,
PopEF tensor data, gone) must not load and then ask for ``frozen_inputs``."""

from __future__ import annotations

import os

import pytest

import host_runtime as model_runtime
from host_runtime import popef
from host_runtime.errors import PopefError
from shm.cleanup import list_objects
from tools.generate_simple_popef import write_simple_popef
from tools.popef_dump import main as popef_dump

pytestmark = pytest.mark.usefixtures("private_machine")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("cut") / "simple.popef"
    write_simple_popef(str(path))
    return path.read_bytes()


def _cuts(data: bytes) -> list[int]:
    r = popef.Reader()
    r.parseStream(data)
    infos = r.blobs()
    assert [b.type.label for b in infos].count("tensor data") >= 1
    boundaries = {b.offset for b in infos} | {b.offset + b.size for b in infos}
    step = max(1, len(data) // 48)
    return sorted((boundaries | set(range(0, len(data), step))
                   | set(range(len(data) - 40, len(data)))) - {len(data)})


def test_a_compiled_file_cut_anywhere_is_refused_everywhere(compiled, tmp_path, capsys):
    before = {o.entry for o in list_objects() if o.pid == os.getpid()}
    path = tmp_path / "cut.popef"
    for cut in _cuts(compiled):
        path.write_bytes(compiled[:cut])
        with pytest.raises(PopefError) as info:
            popef.Reader().parseFile(path)
        assert info.value.path == str(path), cut
        assert popef_dump([str(path)]) == 2, cut
        err = capsys.readouterr().err
        assert err.startswith("popef_dump: error: ") and str(path) in err, (cut, err)
        with pytest.raises(PopefError) as info:
            model_runtime.ModelRunner(str(path))
        assert str(path) in str(info.value), cut
    assert {o.entry for o in list_objects() if o.pid == os.getpid()} == before


def test_a_cut_after_the_executable_names_what_is_missing(compiled, tmp_path):
    r = popef.Reader()
    r.parseStream(compiled)
    exe = next(b for b in r.blobs() if b.type.label == "executable")
    path = tmp_path / "no_weights.popef"
    path.write_bytes(compiled[:exe.offset + exe.size])
    with pytest.raises(PopefError, match="without the end record its header announces") as info:
        model_runtime.ModelRunner(str(path))
    assert f"the last one executable {exe.name!r}" in str(info.value)
    assert "is missing" in str(info.value)
