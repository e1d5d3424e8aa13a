"""The executable attributes that carry a model's host-side tail.

A model whose only non-tensor part is its tail (a classifier's ``ZipMap``) is compiled
without it (``ipu_emulator.compiler``); the tail is a small ONNX model the host runs on
each result (``host_runtime.runner``). The executable carries its ONNX bytes as base64
in the attributes ``host_tail.0``, ``host_tail.1``... (chunks of ``CHUNK`` characters, an
attribute value holds at most 64 KiB). Both sides use this module; it imports nothing
of ONNX.
"""

from __future__ import annotations

import base64
import binascii
from typing import Mapping

from ipu_emulator.errors import ExecutableError

__all__ = ["KEY", "CHUNK", "MAX_CHUNKS", "encode", "decode"]

KEY = "host_tail"
CHUNK = 60000
MAX_CHUNKS = 512


def encode(model_bytes: bytes) -> dict[str, str]:
    """The attributes carrying ``model_bytes`` (ValueError when they are too many)."""
    text = base64.b64encode(model_bytes).decode("ascii")
    chunks = [text[i:i + CHUNK] for i in range(0, len(text), CHUNK)] or [""]
    if len(chunks) > MAX_CHUNKS:
        raise ValueError(f"the host-side tail is {len(text)} characters of base64; at most "
                         f"{MAX_CHUNKS * CHUNK} fit an executable's attributes")
    return {f"{KEY}.{k}": c for k, c in enumerate(chunks)}


def decode(attributes: Mapping[str, str]) -> bytes | None:
    """The tail's ONNX bytes (None: the executable has no tail)."""
    parts = []
    for k in range(MAX_CHUNKS):
        chunk = attributes.get(f"{KEY}.{k}")
        if chunk is None:
            break
        parts.append(chunk)
    if not parts:
        return None
    try:
        return base64.b64decode("".join(parts), validate=True)
    except (binascii.Error, ValueError):
        raise ExecutableError(f"executable attribute {KEY!r} is not valid base64") from None
