"""The control/event message format and the load spec (no processes)."""

from __future__ import annotations

import dataclasses
import json
import struct

import pytest

from ipu_emulator import ipu_protocol
from ipu_emulator.ipu.launcher import describe_returncode
from ipu_emulator.ipu_protocol import Message, Op, ProtocolError


def test_message_round_trip_with_and_without_body():
    for msg in (Message(Op.RUN, seq=7, body=[0, 2]), Message(Op.NEED, index=3),
                Message(Op.ERROR, seq=-1, value=2 ** 40,
                        body=ipu_protocol.error_body(ipu_protocol.ErrorKind.PROGRAM, "boom", "tb"))):
        raw = ipu_protocol.to_bytes(msg, 4096)
        assert ipu_protocol.decode(memoryview(raw), int(msg.op)) == msg


def test_decode_refuses_garbage():
    with pytest.raises(ProtocolError, match="unknown opcode 77"):
        ipu_protocol.decode(memoryview(bytes(16)), 77)
    with pytest.raises(ProtocolError, match="shorter than its 16-byte header"):
        ipu_protocol.decode(memoryview(bytes(3)), int(Op.DONE))
    with pytest.raises(ProtocolError, match="not valid JSON"):
        ipu_protocol.decode(memoryview(bytes(16) + b"{nope"), int(Op.LOAD))


def test_oversized_body_is_refused_before_anything_is_sent():
    with pytest.raises(ProtocolError, match="does not fit a 64-byte slot"):
        ipu_protocol.to_bytes(Message(Op.RUN, body=list(range(100))), 64)


def test_error_body_keeps_the_end_of_a_long_traceback():
    body = ipu_protocol.error_body(ipu_protocol.ErrorKind.PROGRAM, "m", "x" * 100000 + "THE END")
    assert body["traceback"].endswith("THE END") and len(body["traceback"]) < 16384
    assert body["kind"] == "program"


@pytest.mark.parametrize("message,tb", [("m" * 9000, "x" * 100000), ("\n" * 2000, '"' * 9000),
                                        ("\u00e9" * 3000, "\u00e9\n" * 9000)],
                         ids=["long", "escaped", "non-ascii"])
def test_an_error_body_always_fits_one_event_slot(message, tb):
    body = ipu_protocol.error_body(ipu_protocol.ErrorKind.PROGRAM, message, tb, action="X")
    raw = ipu_protocol.to_bytes(Message(Op.ERROR, body=body), ipu_protocol.EVENT_SLOT_SIZE)
    assert len(raw) <= ipu_protocol.EVENT_SLOT_SIZE
    assert body["message"][:100] == message[:100] and body["action"] == "X"
    assert body["traceback"].endswith(tb[-100:]) or len(raw) > ipu_protocol.EVENT_SLOT_SIZE - 200


def _spec(**over):
    fields = dict(key="k", executable_size=10, streams=(ipu_protocol.LoadStream(
        "a", "/r", "in", 4, ipu_protocol.MODE_EVENT),))
    fields.update(over)
    spec = ipu_protocol.LoadSpec(**fields)
    return dataclasses.replace(spec, executable_offset=ipu_protocol.spec_prefix_size(spec))


def test_load_spec_round_trip_and_offset_fixed_point():
    spec = _spec()
    prefix = ipu_protocol.encode_load_spec(spec)
    assert len(prefix) == spec.executable_offset and len(prefix) % 64 == 0
    region = bytearray(prefix + b"E" * 10)
    assert ipu_protocol.decode_load_spec(memoryview(region)) == spec


@pytest.mark.parametrize("handles", [1, 40, 400])
def test_a_spec_prefix_ends_where_it_says_the_executable_starts(handles):
    """Whatever the offset's digits add, the prefix is exactly as long as the offset it
    holds (the executable follows it), for a spec of a few or many streams."""
    spec = ipu_protocol.LoadSpec(key="k", executable_size=10, executable_offset=123456789,
                                 streams=tuple(ipu_protocol.LoadStream(
                                     f"s{i}", f"/r@{i * 4096}", "in", 4, ipu_protocol.MODE_EVENT)
                                     for i in range(handles)))
    prefix = ipu_protocol.spec_prefix(spec)
    decoded = ipu_protocol.decode_load_spec(memoryview(bytearray(prefix + b"E" * 10)))
    assert decoded.executable_offset == len(prefix) == ipu_protocol.spec_prefix_size(spec)
    assert decoded == dataclasses.replace(spec, executable_offset=len(prefix))


def test_load_spec_with_constants_and_weights_round_trips():
    for spec in (_spec(constants=ipu_protocol.LoadConstants(
                     "/c", (ipu_protocol.LoadConstant("w", 0, 16),)), prepack=False),
                 _spec(weights_file=ipu_protocol.WeightsFile("/x.popef", 64, 128, (1, 2, 3, 4)),
                       fresh=True, memory_region="/m"),
                 _spec(weights_region="/w", prepack=True, check_package_hash=False)):
        region = memoryview(bytearray(ipu_protocol.encode_load_spec(spec) + b"E" * 10))
        assert ipu_protocol.decode_load_spec(region) == spec


def _raw(**over):
    """A spec region holding the JSON of a spec changed by ``over`` (what no LoadSpec
    encodes: the decoder must refuse it)."""
    spec = {"key": "k", "fresh": 0, "executable_offset": 0, "executable_size": 10,
            "memory_region": None, "check_package_hash": True,
            "streams": [{"handle": "a", "ring": "/r", "direction": "in", "nbytes": 4,
                         "mode": ipu_protocol.MODE_EVENT}]}
    spec.update(over)
    raw = json.dumps(spec).encode()
    prefix = struct.pack("<Q", len(raw)) + raw
    return memoryview(bytearray(prefix + b"E" * 10))


@pytest.mark.parametrize("over,match", [
    ({"executable_size": 10 ** 9}, "does not fit"),
    ({"streams": [{"handle": "a"}]}, "stream 0 must have keys"),
    ({"streams": [{"handle": "a", "ring": "/r", "direction": "sideways", "nbytes": 4,
                   "mode": 0}]}, "direction 'sideways'"),
    ({"constants": {"region": "/c", "streams": [{"handle": "w", "offset": -64, "nbytes": 4}]}},
     "'constants' must be"),
    ({"constants": {"region": "/c"}}, "'constants' must be"),
    ({"weights_file": {"path": "rel", "offset": 0, "length": 4}}, "'weights_file' must be"),
    ({"key": 3}, "'key' must be a str"),
])
def test_load_spec_is_checked(over, match):
    with pytest.raises(ProtocolError, match=match):
        ipu_protocol.decode_load_spec(_raw(**over))


def test_describe_returncode():
    assert describe_returncode(None) == "is running"
    assert describe_returncode(3) == "exited with code 3"
    assert describe_returncode(-9) == "was killed by signal SIGKILL (9)"
