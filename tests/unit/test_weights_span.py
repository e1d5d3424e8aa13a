"""``weights_span`` answers a model made again without parsing its program section anew
(a production model's is megabytes of JSON, read twice per runner made), and still
refuses a damaged one every time."""

from __future__ import annotations

import json

import pytest

from host_runtime import popef
from ipu_emulator.executable import ExecutableError, read_header, weights_span
from ipu_emulator.executable import _executable
from tests._helpers import write_example


def test_a_span_is_parsed_once_and_a_damaged_section_refused_each_time(
        tmp_path, monkeypatch) -> None:
    exe = bytes(popef.load_model([write_example(tmp_path, (1, 4))]).executable.payload())
    _executable._spans.clear()
    parsed = []
    real = json.loads
    monkeypatch.setattr(_executable.json, "loads", lambda s: parsed.append(1) or real(s))
    first = weights_span(exe)
    assert weights_span(bytearray(exe)) == first and len(parsed) == 1
    hdr = read_header(exe)
    at = hdr.program_offset
    # the same length, not JSON any more: refused, and not from the kept answer
    broken = exe[:at] + b"#" + exe[at + 1:]
    for _ in range(2):
        with pytest.raises(ExecutableError, match="program section is not valid JSON"):
            weights_span(broken)
    assert len(parsed) == 3
