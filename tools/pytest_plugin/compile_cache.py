"""``compile_onnx``'s cache: ONNX model + poprt options -> a PopEF file, once per run.

The key is the SHA-256 of the model's bytes (the serialized ``ModelProto``,
or the file's bytes) and of the options (as sorted JSON). The file is
``<folder>/<key>/executable.popef``, written into a private folder first and
renamed into place, so that workers of one run sharing the folder never see
half a file and compile each model at most once each (a race only costs a
duplicate compile).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from typing import Any

__all__ = ["compile_cached", "cache_key"]


def _model_bytes(model: Any) -> bytes:
    if isinstance(model, (str, os.PathLike)):
        with open(model, "rb") as f:
            return f.read()
    serialize = getattr(model, "SerializeToString", None)
    if serialize is None:
        raise TypeError("compile_onnx expects an ONNX file path or an onnx.ModelProto, "
                        f"got {type(model).__name__}")
    data: bytes = serialize()
    return data


def cache_key(model_bytes: bytes, options: dict[str, Any]) -> str:
    h = hashlib.sha256(model_bytes)
    h.update(b"\0options\0")
    h.update(json.dumps(options, sort_keys=True, default=repr).encode())
    return h.hexdigest()[:32]


def compile_cached(model: Any, folder: str, options: dict[str, Any]) -> tuple[str, bool]:
    """The PopEF path for ``model`` compiled with ``options`` (keyword arguments of
    ``host_runtime.poprt.compiler.compile``), and whether it was compiled now."""
    from host_runtime.poprt.compiler import POPEF_NAME, compile

    data = _model_bytes(model)
    key = cache_key(data, options)
    final = os.path.join(folder, key)
    path = os.path.join(final, POPEF_NAME)
    if os.path.exists(path):
        return path, False
    os.makedirs(folder, mode=0o700, exist_ok=True)
    work = tempfile.mkdtemp(prefix=f".{key}-", dir=folder)
    try:
        source = os.fspath(model) if isinstance(model, (str, os.PathLike)) else model
        compile(source, work, **options)
        try:
            os.rename(work, final)
        except OSError:
            if not os.path.exists(path):   # not another worker's rename: a real failure
                raise
            return path, False
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return path, True
