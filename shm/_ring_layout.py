"""The ring's layout as numbers for the code.

The drawing at the top of ``shm/ring.py`` is the one place that says which word is
which and who writes it; this module gives the code the same words as indices into
the region viewed as int64 (``memoryview.cast("q")``), and the sizes the drawing
shows. ``shm/_ringcore.c`` repeats the indices it uses.
"""

from __future__ import annotations

import struct


MAGIC = int.from_bytes(b"IPUEMURG", "little", signed=True)
VERSION = 2
HEADER_SIZE = 384
SLOT_HEADER_SIZE = 64
_ALIGN = 64

# Header: 32 int64 words, then the two semaphores (see the drawing in shm/ring.py).
HEADER = struct.Struct("<8q 8q 8q 8q 128x")
SLOT_HEADER = struct.Struct("<3q 5q")
assert HEADER.size == HEADER_SIZE and SLOT_HEADER.size == SLOT_HEADER_SIZE

# Word indices in the region viewed as int64.
_MAGIC, _VERSION, _SLOT_SIZE, _NUM_SLOTS, _STRIDE, _INVALID, _GEN, _CREATOR = range(8)
_PUBLISHED, _HELD, _PRODUCER_PID = 8, 9, 10
_ACQUIRED, _RELEASED, _CONSUMER_PID, _READ_TAG = 16, 17, 18, 19
_USER = 24
_DOORBELL = 25
# Within a slot header, relative to the slot's first word.
_SEQ, _NBYTES, _TAG = 0, 1, 2

_MAX_SLOTS = 1 << 20
"""Most slots a ring may have (``Ring.create`` and ``Ring.attach`` check it)."""

# Byte offsets of the ring's two semaphores (process-shared, in the header: shm._semaphore).
_FREE_SEM, _FULL_SEM = 256, 320


def _stride(slot_size: int) -> int:
    """Bytes from one slot to the next: the slot header, then the payload rounded up to
    whole cache lines."""
    return SLOT_HEADER_SIZE + (slot_size + _ALIGN - 1) // _ALIGN * _ALIGN
