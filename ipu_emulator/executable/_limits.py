"""The executable format's bounds: every size, count and depth is checked against these
before anything is allocated or walked (by the header, the codec and the validator)."""

from __future__ import annotations

ALIGNMENT = 64
"""Device tensors, the graph section and each external weight start at a multiple of it."""

# Bounds: checked before anything is allocated or walked.
_MAX_JSON = 256 << 20
_MAX_ITEMS = 1 << 20
_MAX_RANK = 32
_MAX_DIM = 1 << 40
_MAX_BYTES = 1 << 48
_MAX_NAME = 1024
_MAX_NAME_BYTES = 128
_MAX_DEPTH = 16
_MAX_REPEAT = (1 << 31) - 1
_IPU_VERSIONS = (2, 21)
