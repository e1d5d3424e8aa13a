"""What a PopRT runner loads: ``Runner(popef, config)``'s first argument.

Accepted (checked in this order):

- a path (``str`` or ``os.PathLike``) of a PopEF file, or a list of paths (one model
  over several files);
- a ``host_runtime.popef.Model`` (``popef`` module's model);
- the bytes of a PopEF file (``bytes``, ``bytearray``, ``memoryview``);
- an in-memory executable (PopRT's ``poprt.compiler.Executable``), by duck typing:
  an object with ``getPopefModel()`` or a ``model`` / ``popef_model`` attribute that is
  a ``popef.Model``; else with ``to_bytes()`` / ``popef_bytes()`` returning PopEF bytes;
  else with a ``popef_path`` / ``path`` attribute naming a PopEF file.
"""

from __future__ import annotations

import os
from typing import Any

from host_runtime import popef
from host_runtime.errors import BadRequestError
from host_runtime.memory import PopefPaths

__all__ = ["model_source", "ACCEPTED"]

ACCEPTED = ("a PopEF path or list of paths, a popef.Model, the bytes of a PopEF file, or an "
            "Executable (getPopefModel() / .model, to_bytes(), or .popef_path)")


def _from_bytes(data: bytes | bytearray | memoryview, name: str) -> popef.Model:
    reader = popef.Reader()
    reader.parseStream(bytes(data), name)
    return popef.ModelBuilder(reader).createModel()


def model_source(source: Any) -> popef.Model | PopefPaths | list[str]:
    """What ``host_runtime.ModelRunner`` takes for ``source`` (see the module docstring)."""
    if source is None or isinstance(source, (int, float, complex)):
        raise BadRequestError(f"a PopRT runner loads {ACCEPTED}; got {type(source).__name__}")
    if isinstance(source, (str, os.PathLike)):
        return PopefPaths([os.fspath(source)])
    if isinstance(source, (list, tuple)) and source and all(
            isinstance(p, (str, os.PathLike)) for p in source):
        return [os.fspath(p) for p in source]
    if isinstance(source, popef.Model):
        return source
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _from_bytes(source, "<PopEF bytes>")
    getter = getattr(source, "getPopefModel", None)
    if callable(getter):
        model = getter()
        if isinstance(model, popef.Model):
            return model
    for attr in ("model", "popef_model"):
        model = getattr(source, attr, None)
        if isinstance(model, popef.Model):
            return model
    for attr in ("to_bytes", "popef_bytes"):
        fn = getattr(source, attr, None)
        if callable(fn):
            data = fn()
            if isinstance(data, (bytes, bytearray, memoryview)):
                return _from_bytes(data, f"<{type(source).__name__}.{attr}()>")
    for attr in ("popef_path", "path"):
        path = getattr(source, attr, None)
        if isinstance(path, (str, os.PathLike)):
            return PopefPaths([os.fspath(path)])
    raise BadRequestError(f"a PopRT runner loads {ACCEPTED}; got {type(source).__name__}")
