"""The control/event message format and the load spec (no processes)."""

from __future__ import annotations

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


def _spec(**over):
    spec = {"key": "k", "fresh": 0, "executable_offset": 0, "executable_size": 10,
            "memory_region": None, "check_package_hash": True,
            "streams": [{"handle": "a", "ring": "/r", "direction": "in", "nbytes": 4,
                         "mode": ipu_protocol.MODE_EVENT}]}
    spec.update(over)
    return spec


def test_load_spec_round_trip_and_offset_fixed_point():
    spec = _spec()
    spec["executable_offset"] = ipu_protocol.spec_prefix_size(spec)
    prefix = ipu_protocol.encode_load_spec(spec)
    assert len(prefix) == spec["executable_offset"] and len(prefix) % 64 == 0
    region = bytearray(prefix + b"E" * 10)
    assert ipu_protocol.decode_load_spec(memoryview(region)) == spec


def test_load_spec_with_constants_round_trips():
    spec = _spec(constants={"region": "/c", "streams": [{"handle": "w", "offset": 0,
                                                          "nbytes": 16}]})
    spec["executable_offset"] = ipu_protocol.spec_prefix_size(spec)
    region = memoryview(bytearray(ipu_protocol.encode_load_spec(spec) + b"E" * 10))
    assert ipu_protocol.decode_load_spec(region) == spec


@pytest.mark.parametrize("over,match", [
    ({"executable_size": 10 ** 9}, "does not fit"),
    ({"streams": [{"handle": "a"}]}, "stream 0 must have keys"),
    ({"streams": [{"handle": "a", "ring": "/r", "direction": "sideways", "nbytes": 4,
                   "mode": 0}]}, "direction 'sideways'"),
    ({"constants": {"region": "/c", "streams": [{"handle": "w", "offset": -64, "nbytes": 4}]}},
     "'constants' must be"),
    ({"constants": {"region": "/c"}}, "'constants' must be"),
])
def test_load_spec_is_checked(over, match):
    spec = _spec(**over)
    spec["executable_offset"] = ipu_protocol.spec_prefix_size(spec)
    region = memoryview(bytearray(ipu_protocol.encode_load_spec(spec) + b"E" * 10))
    with pytest.raises(ProtocolError, match=match):
        ipu_protocol.decode_load_spec(region)


def test_describe_returncode():
    assert describe_returncode(None) == "is running"
    assert describe_returncode(3) == "exited with code 3"
    assert describe_returncode(-9) == "was killed by signal SIGKILL (9)"
