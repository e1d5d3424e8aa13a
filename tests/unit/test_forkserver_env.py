"""The template process (ipu_emulator.device.forkserver) forks an IPU process only for a launch that
agrees with it on every setting the IPU process's modules read when imported: the list it
compares must name every environment variable read at module level in shm and ipu_emulator."""

from __future__ import annotations

import ast
from pathlib import Path

from ipu_emulator.device.forkserver import IMPORT_TIME_ENV, _env_key

ROOT = Path(__file__).resolve().parents[2]


def _module_level_env_reads(path: Path) -> set[str]:
    """Names in ``os.environ.get("X", ...)`` / ``os.environ["X"]`` outside functions."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "get" and ast.unparse(node.func.value) == "os.environ" \
                and node.args and isinstance(node.args[0], ast.Constant):
            found.add(str(node.args[0].value))
        if isinstance(node, ast.Subscript) and ast.unparse(node.value) == "os.environ" \
                and isinstance(node.slice, ast.Constant):
            found.add(str(node.slice.value))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return found


# read at import time by modules only hosts and daemons run (never an IPU process)
HOST_SIDE = {"IPU_EMULATOR_START_TIMEOUT",               # ipu_emulator/device/launcher.py
             "IPU_EMULATOR_DAEMON_HANDOVER_TIMEOUT"}     # ipu_emulator/daemon/_pool.py


def test_every_import_time_setting_is_compared() -> None:
    read = set()
    for package in ("shm", "ipu_emulator"):
        for path in (ROOT / package).rglob("*.py"):
            read |= {name for name in _module_level_env_reads(path)
                     if name.startswith("IPU_EMULATOR_")}
    assert read, "the scan found no module-level setting at all: is it still working?"
    missing = read - set(IMPORT_TIME_ENV) - HOST_SIDE
    assert not missing, f"read at import time but not compared by the template: {missing}"


def test_env_key_tells_settings_apart() -> None:
    base = {"PYTHONPATH": "/x", "HOME": "/h"}
    assert _env_key(base) == _env_key(dict(base, HOME="/other", IPU_EMULATOR_SHM_TAG="t"))
    assert _env_key(base) != _env_key(dict(base, IPU_EMULATOR_ZERO_COPY="0"))
