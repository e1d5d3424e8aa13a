"""What a user installs: setup.cfg declares every package the code imports, with lower
bounds CI installs (.ci/lowest_constraints.py), and the wheel holds the four packages of
the layout, the C cores and the commands. The wheel itself is checked where CI's wheel leg
installed it (IPU_EMULATOR_TEST_INSTALLED names it): these tests then look at the
installed files, not the checkout."""

from __future__ import annotations

import ast
import configparser
import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("shm", "ipu_emulator", "host_runtime", "tools")
# import name -> distribution name, where they differ
DISTRIBUTION = {"yaml": "PyYAML", "prometheus_client": "prometheus-client"}
COMMANDS = ("ipu-emulator", "poprt", "popef_dump", "model_runtime_example_generate_simple_popef")


def _config() -> configparser.ConfigParser:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg", encoding="utf-8")
    return cfg


def _declared(section: str, key: str) -> set[str]:
    names = set()
    for line in _config().get(section, key).splitlines():
        line = line.strip()
        if line:
            names.add(line.split(">")[0].split("=")[0].split("<")[0].split("[")[0].strip().lower())
    return names


def _third_party_imports() -> dict[str, str]:
    """Top-level modules the packages import that are neither ours nor the standard
    library's -> one file that imports each."""
    found: dict[str, str] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    tops = [a.name.split(".")[0] for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    tops = [node.module.split(".")[0]]
                else:
                    continue
                for top in tops:
                    if top in PACKAGES or top in sys.stdlib_module_names or top == "__future__":
                        continue
                    found.setdefault(top, str(path.relative_to(ROOT)))
    return found


# imported only by the benches, the test plugin or behind TYPE_CHECKING, and declared by
# the test extra (pytest, hypothesis, mypy) -- or by name only, in a try/except
_OPTIONAL = {"pytest", "_pytest", "xdist", "hypothesis", "mypy"}
# imported inside a function only by the feature its own extra installs (and the test extra)
_EXTRAS = {"ray": "ray"}


def test_every_import_is_a_declared_dependency() -> None:
    install = _declared("options", "install_requires")
    test = _declared("options.extras_require", "test")
    missing = []
    for top, where in sorted(_third_party_imports().items()):
        dist = DISTRIBUTION.get(top, top).lower().replace("_", "-")
        if dist in install or dist.replace("-", "_") in install:
            continue
        if top in _OPTIONAL and (dist in test or top in ("_pytest", "xdist")):
            continue
        if top in _EXTRAS and dist in _declared("options.extras_require", _EXTRAS[top]) \
                and dist in test:
            continue
        missing.append(f"{top} (imported by {where})")
    assert not missing, f"imported but not in setup.cfg's install_requires: {missing}"


def test_the_compiler_needs_sympy_and_it_is_declared() -> None:
    """onnxruntime's symbolic shape inference imports sympy; onnxruntime no longer
    requires it, so setup.cfg must."""
    assert "sympy" in _declared("options", "install_requires")
    assert importlib.util.find_spec("sympy") is not None


def test_every_requirement_has_a_lower_bound_ci_installs() -> None:
    sys.path.insert(0, str(ROOT / ".ci"))
    try:
        from lowest_constraints import lowest_pins
    finally:
        sys.path.remove(str(ROOT / ".ci"))
    pins = {p.split("==")[0].lower() for p in lowest_pins(ROOT / "setup.cfg")}
    unbounded = sorted((_declared("options", "install_requires")
                        | _declared("options.extras_require", "test")) - pins - {"types-pyyaml"})
    assert not unbounded, f"requirements without a lower bound: {unbounded}"


def test_only_the_layouts_packages_are_installed_at_top_level() -> None:
    include = [x.strip() for x in _config().get("options.packages.find", "include").split()]
    assert sorted({x.split(".")[0] for x in include}) == sorted(PACKAGES)


_WHEEL = os.environ.get("IPU_EMULATOR_TEST_INSTALLED", "")
wheel_only = pytest.mark.skipif(not _WHEEL, reason="CI's wheel leg (.ci/run) sets "
                                "IPU_EMULATOR_TEST_INSTALLED to the wheel it installed")


@wheel_only
def test_the_wheel_holds_the_layouts_packages_c_cores_and_commands() -> None:
    with zipfile.ZipFile(_WHEEL) as whl:
        names = whl.namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == set(PACKAGES), tops
    assert any(n.startswith("shm/_ringcore.") and n.endswith(".so") for n in names), names
    assert any(n.startswith("ipu_emulator/ipu/_stepcore.") and n.endswith(".so")
               for n in names)
    scripts = pathlib.Path(sysconfig.get_path("scripts"))
    for command in COMMANDS:
        assert (scripts / command).exists() or shutil.which(command), command


@wheel_only
def test_child_interpreters_in_the_checkout_import_the_wheel() -> None:
    """IPU processes, daemons and the suite's helper programs are fresh interpreters, often
    started in the checkout: they too must run the wheel's code."""
    code = "import host_runtime, shm._ringcore as c; print(host_runtime.__file__, c.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True, timeout=60).stdout
    assert str(ROOT) not in out, out
    assert "site-packages" in out, out


def test_the_readme_names_the_lowest_versions_ci_tests() -> None:
    """README's "Tested versions" names each lower bound of setup.cfg as CI installs it."""
    sys.path.insert(0, str(ROOT / ".ci"))
    try:
        from lowest_constraints import lowest_pins
    finally:
        sys.path.remove(str(ROOT / ".ci"))
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start = text.index("Tested versions:")
    paragraph = " ".join(text[start:text.index("\n\n", start)].split())
    missing = [pin for pin in lowest_pins(ROOT / "setup.cfg")
               if pin.split("==")[0] not in ("hypothesis", "mypy")
               and f"{pin.split('==')[0]} {pin.split('==')[1]}" not in paragraph]
    assert not missing, f"README's tested versions do not name {missing}"
