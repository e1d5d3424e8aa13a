"""The emulated IPU: executable format, interpreter, compiler back end, IPU process.

``package_hash()`` identifies the emulator build that compiled an executable:
a SHA-256 over the package's Python sources (relative path and bytes, in
sorted order), computed once per process.
"""

from __future__ import annotations

import functools
import hashlib
import pathlib

from ipu_emulator.errors import CompileError, DeviceProgramError, ExecutableError, IpuEmulatorError

__all__ = [
    "package_hash",
    "IpuEmulatorError",
    "ExecutableError",
    "CompileError",
    "DeviceProgramError",
]

_ROOT = pathlib.Path(__file__).resolve().parent


@functools.lru_cache(maxsize=1)
def package_hash() -> str:
    """Hex SHA-256 of this package's ``*.py`` sources; stable across processes and machines."""
    return _hash_tree(_ROOT)


def _hash_tree(root: pathlib.Path) -> str:
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*.py")
                       if "__pycache__" not in p.relative_to(root).parts):
        rel = path.relative_to(root).as_posix().encode()
        data = path.read_bytes()
        h.update(len(rel).to_bytes(4, "little"))
        h.update(rel)
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()
