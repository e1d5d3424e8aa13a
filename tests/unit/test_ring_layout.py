"""The drawing at the top of shm/ring.py is the ring's layout: the indices the code uses
(shm/_ring_layout.py) and those the C core defines (shm/_ringcore.c) agree with it."""

from __future__ import annotations

import pathlib
import re

import shm.ring
from shm import _ring_layout as layout

ROOT = pathlib.Path(__file__).resolve().parents[2]

# field in the drawing -> name of its word index in shm/_ring_layout.py
HEADER_FIELDS = {
    "magic": "_MAGIC", "version": "_VERSION", "slot_size": "_SLOT_SIZE",
    "num_slots": "_NUM_SLOTS", "slot_stride": "_STRIDE", "invalid": "_INVALID",
    "generation": "_GEN", "creator_pid": "_CREATOR", "published": "_PUBLISHED",
    "held": "_HELD", "producer_pid": "_PRODUCER_PID", "acquired": "_ACQUIRED",
    "released": "_RELEASED", "consumer_pid": "_CONSUMER_PID", "read_tag": "_READ_TAG",
    "user": "_USER", "doorbell": "_DOORBELL",
}
SLOT_FIELDS = {"seq": "_SEQ", "nbytes": "_NBYTES", "tag": "_TAG"}
# header word -> the C core's name for it
C_WORDS = {"invalid": "W_INVALID", "published": "W_PUBLISHED", "held": "W_HELD",
           "acquired": "W_ACQUIRED", "released": "W_RELEASED", "doorbell": "W_DOORBELL",
           "read_tag": "W_READ_TAG"}


def _drawing() -> tuple[dict[str, tuple[int, int]], dict[str, int]]:
    """(header field -> (byte offset, word), slot field -> byte offset) as drawn."""
    doc = shm.ring.__doc__ or ""
    header = {m[3]: (int(m[1]), int(m[2]))
              for m in re.finditer(r"^ +(\d+) +(\d+) +([a-z_]+) ", doc, re.M)}
    slot = {m[2]: int(m[1]) for m in re.finditer(r"^ +\+(\d+) +([a-z_]+) ", doc, re.M)}
    return header, slot


def test_the_drawing_gives_every_word_the_code_uses():
    header, slot = _drawing()
    assert set(header) == set(HEADER_FIELDS)
    for field, (offset, word) in header.items():
        assert offset == 8 * word, field
        assert getattr(layout, HEADER_FIELDS[field]) == word, field
    assert {f: o for f, o in slot.items() if f in SLOT_FIELDS} == \
        {f: 8 * getattr(layout, n) for f, n in SLOT_FIELDS.items()}
    assert slot["payload"] == layout.SLOT_HEADER_SIZE
    assert "HEADER_SIZE + i * slot_stride" in (shm.ring.__doc__ or "")
    assert layout.HEADER.size == layout.HEADER_SIZE == 384
    assert "(HEADER_SIZE = 384)" in (shm.ring.__doc__ or "")


def test_the_semaphores_sit_where_drawn_each_on_a_cache_line_of_its_own():
    import ctypes

    doc = shm.ring.__doc__ or ""
    drawn = {m[2]: int(m[1]) for m in re.finditer(r"^ +(\d+) +(free|full) ", doc, re.M)}
    assert drawn == {"free": layout._FREE_SEM, "full": layout._FULL_SEM}
    assert layout._FREE_SEM >= 8 * 32 and layout._FREE_SEM % 64 == layout._FULL_SEM % 64 == 0
    assert layout._FULL_SEM - layout._FREE_SEM == 64 and layout._FULL_SEM + 64 == layout.HEADER_SIZE
    assert ctypes.sizeof(ctypes.c_long) * 4 <= 64   # glibc's sem_t: 4 longs on 64-bit
    source = (ROOT / "shm" / "_ringcore.c").read_text()
    for name, value in (("SEM_FREE_OFFSET", layout._FREE_SEM),
                        ("SEM_FULL_OFFSET", layout._FULL_SEM)):
        m = re.search(rf"^#define {name} (\d+)", source, re.M)
        assert m and int(m[1]) == value, name


def test_the_c_core_uses_the_same_words():
    source = (ROOT / "shm" / "_ringcore.c").read_text()
    header, _ = _drawing()
    for field, name in C_WORDS.items():
        m = re.search(rf"^#define {name} (\d+)", source, re.M)
        assert m and int(m[1]) == header[field][1], name
    for name in ("HEADER_SIZE", "SLOT_HEADER_SIZE"):
        m = re.search(rf"^#define {name} (\d+)", source, re.M)
        assert m and int(m[1]) == getattr(layout, name), name
