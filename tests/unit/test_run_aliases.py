"""ipu_emulator.run's name mapping in this interpreter: install(), the module objects it
gives, submodules, uninstall(), and the refusal over a real SDK."""

from __future__ import annotations

import importlib
import sys

import pytest

import host_runtime
import host_runtime.popef
from ipu_emulator import run
from ipu_emulator.errors import RealModulesError

NAMES = ("model_runtime", "popef", "poprt")


@pytest.fixture
def mapped():
    assert not run.installed()
    run.install()
    try:
        yield
    finally:
        run.uninstall()
    assert not run.installed()
    assert not [n for n in sys.modules if n.split(".")[0] in NAMES]


def test_the_names_are_this_projects_modules(mapped):
    import model_runtime
    import popef
    import poprt.runtime
    from poprt.runtime import Runner

    assert model_runtime is host_runtime and popef is host_runtime.popef
    assert poprt.runtime is importlib.import_module("host_runtime.poprt.runtime")
    assert Runner is poprt.runtime.Runner
    assert isinstance(popef.TensorInfo(), host_runtime.popef.TensorInfo)
    # the module keeps its own spec (relative imports, reload, pickling see its real name)
    assert popef.__spec__.name == "host_runtime.popef"
    assert importlib.import_module("popef.blobs") is importlib.import_module(
        "host_runtime.popef.blobs")
    assert sys.modules["popef.blobs"] is sys.modules["host_runtime.popef.blobs"]
    with pytest.raises(ModuleNotFoundError, match="No module named 'popef.nothing_here'"):
        importlib.import_module("popef.nothing_here")
    run.install()            # idempotent
    assert sum(isinstance(f, run.AliasFinder) for f in sys.meta_path) == 1


def test_without_install_the_names_are_unknown():
    assert not run.installed()
    with pytest.raises(ModuleNotFoundError, match="No module named 'popef'"):
        importlib.import_module("popef")


def test_target_of():
    assert run.target_of("poprt.passes.xyz") == "host_runtime.poprt.passes.xyz"
    assert run.target_of("model_runtime") == "host_runtime"
    assert run.target_of("popefx") is None and run.target_of("numpy") is None


def test_a_real_module_is_not_hidden(tmp_path, monkeypatch):
    (tmp_path / "poprt").mkdir()
    (tmp_path / "poprt" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert run.real_modules() == {"poprt": str(tmp_path / "poprt" / "__init__.py")}
    with pytest.raises(RealModulesError, match=r"\(poprt at .*poprt/__init__.py\): mapping "
                       r"model_runtime, popef, poprt onto the IPU emulator would hide them"):
        run.install()
    assert not run.installed()
    monkeypatch.setenv("IPU_EMULATOR_FORCE_MODULES", "1")
    run.install()
    try:
        import poprt
        assert poprt is importlib.import_module("host_runtime.poprt")
    finally:
        run.uninstall()
