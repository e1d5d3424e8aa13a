"""The library's shape, measured from the outside (``ast``): in ``shm``, ``ipu_emulator``
and ``host_runtime``, no class is over 350 lines, no function over 80 and no module
over 700 (a class or function: its node's ``end_lineno - lineno``; a module: its lines).

A reader holds a class, a function or a module in mind at once; past these sizes it is
two concepts sharing a name. Split by concept (a reader can name each new part's concern
in one phrase), not in arbitrary halves.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("shm", "ipu_emulator", "host_runtime")
MAX_CLASS_LINES = 350
MAX_FUNCTION_LINES = 80
MAX_MODULE_LINES = 700

def _sizes() -> dict[str, tuple[str, int, int]]:
    """Every module, class and function of the packages: key -> (kind, lines, limit)."""
    found: dict[str, tuple[str, int, int]] = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            text = path.read_text()
            found[rel] = ("module", len(text.splitlines()), MAX_MODULE_LINES)
            _walk(ast.parse(text, rel), rel, "", found)
    return found


def _walk(node: ast.AST, rel: str, prefix: str, found: dict[str, tuple[str, int, int]]) -> None:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            assert child.end_lineno is not None
            name = prefix + child.name
            if isinstance(child, ast.ClassDef):
                found[f"{rel}:{name}"] = ("class", child.end_lineno - child.lineno,
                                          MAX_CLASS_LINES)
            else:
                found[f"{rel}:{name}"] = ("function", child.end_lineno - child.lineno,
                                          MAX_FUNCTION_LINES)
            _walk(child, rel, name + ".", found)
        else:
            _walk(child, rel, prefix, found)


def test_no_class_function_or_module_is_over_its_limit() -> None:
    sizes = _sizes()
    assert any(kind == "class" for kind, _, _ in sizes.values()), "nothing measured: wrong root?"
    over = {key: (kind, n, limit) for key, (kind, n, limit) in sizes.items() if n > limit}
    offenders = sorted(f"{key} ({kind}: {n} lines, limit {limit})"
                       for key, (kind, n, limit) in over.items())
    assert not offenders, ("over the structure limits (split by concept):\n  "
                           + "\n  ".join(offenders))
