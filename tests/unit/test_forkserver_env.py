"""The template process (ipu_emulator.ipu.forkserver) forks an IPU process only for a launch that
agrees with it on every setting the IPU process's modules read when imported: the list it
compares is derived from shm.settings, and every module-level read of a setting in shm and
ipu_emulator is either of a knob the list holds or of a host-side knob."""

from __future__ import annotations

import ast
from pathlib import Path

from ipu_emulator.ipu.forkserver import IMPORT_TIME_ENV, _env_key
from shm.settings import IPU_IMPORT_ENV, knobs

ROOT = Path(__file__).resolve().parents[2]
KNOBS = {k.name: k for k in knobs()}


def _module_level_settings_reads(path: Path) -> set[str]:
    """Fields read as ``settings().field`` outside functions (at import)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Call) \
                and ast.unparse(node.value.func) in ("settings", "current"):
            found.add(node.attr)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


def test_the_compared_variables_are_the_ipu_import_time_knobs() -> None:
    assert set(IPU_IMPORT_ENV) <= set(IMPORT_TIME_ENV)
    assert {k.env for k in knobs() if k.ipu and k.when == "import"} == set(IPU_IMPORT_ENV)
    assert "IPU_EMULATOR_ZERO_COPY" in IMPORT_TIME_ENV           # read by the interpreter
    assert "IPU_EMULATOR_KEEP_APART" not in IMPORT_TIME_ENV      # read per IPU process start


def test_every_import_time_setting_is_compared_or_host_side() -> None:
    seen = 0
    for package in ("shm", "ipu_emulator"):
        for path in (ROOT / package).rglob("*.py"):
            rel = str(path.relative_to(ROOT))
            for name in _module_level_settings_reads(path):
                seen += 1
                knob = KNOBS[name]
                assert knob.when == "import", f"{rel} reads call-time {name} at import"
                # a host-side knob (ipu=False) may be read at import only by the modules
                # its Settings field names (hosts and daemons run them, IPU processes never
                # act on them)
                assert knob.ipu or rel in knob.used_in, \
                    f"{rel} reads {name} at import but the template does not compare it"
    assert seen, "the scan found no module-level setting at all: is it still working?"


def test_env_key_tells_settings_apart() -> None:
    base = {"PYTHONPATH": "/x", "HOME": "/h"}
    assert _env_key(base) == _env_key(dict(base, HOME="/other", IPU_EMULATOR_SHM_TAG="t",
                                           IPU_EMULATOR_KEEP_APART="0"))
    assert _env_key(base) != _env_key(dict(base, IPU_EMULATOR_ZERO_COPY="0"))
    assert _env_key(base) != _env_key(dict(base, IPU_EMULATOR_DEVICE_SPIN_US="7"))
