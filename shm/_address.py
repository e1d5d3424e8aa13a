"""``buffer_address``: where a buffer's bytes are (for IO bindings that take pointers)."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

__all__ = ["buffer_address"]


def _address_py(buffer: Any) -> int:
    """The address of a C-contiguous buffer's first byte (the path without the C core)."""
    return int(np.frombuffer(buffer, np.uint8).ctypes.data)


try:   # ~0.05 us a call against ~0.5 (a helper of the C core; not a ring path, so it
    # is used whenever it is built, IPU_EMULATOR_RING_C or not)
    from shm._ringcore import address as _address_c
except ImportError:   # built without the C extension
    _address_c = None

buffer_address: Callable[[Any], int] = _address_c if _address_c is not None else _address_py
"""``buffer_address(buffer) -> int``: the address of a C-contiguous buffer's first byte
(any object with the buffer protocol: memoryview, bytearray, numpy array). The buffer's
owner must keep it alive (and mapped) while the address is used."""
