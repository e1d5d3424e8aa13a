"""The executable attributes that carry a model's host-side tail (``ipu_emulator.host_tail``)."""

from __future__ import annotations

import pytest

from ipu_emulator import host_tail
from ipu_emulator.errors import ExecutableError


def test_a_tail_round_trips_through_chunks() -> None:
    data = bytes(range(256)) * 500            # 128000 bytes: three chunks of base64
    attrs = host_tail.encode(data)
    assert sorted(attrs) == ["host_tail.0", "host_tail.1", "host_tail.2"]
    assert all(len(v) <= host_tail.CHUNK for v in attrs.values())
    assert host_tail.decode({"models": "m", **attrs}) == data


def test_no_tail_and_a_damaged_tail() -> None:
    assert host_tail.decode({"models": "m"}) is None
    with pytest.raises(ExecutableError, match="'host_tail' is not valid base64"):
        host_tail.decode({"host_tail.0": "not base64!"})


def test_a_tail_too_big_for_the_attributes_is_refused() -> None:
    too_big = b"\0" * (host_tail.MAX_CHUNKS * host_tail.CHUNK)   # its base64 is 4/3 of that
    with pytest.raises(ValueError, match="at most"):
        host_tail.encode(too_big)
