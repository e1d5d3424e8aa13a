"""The daemon's JSON-lines wire format: version field, size bound, strict objects."""

from __future__ import annotations

import pytest

from ipu_emulator.daemon import socket_protocol as wire


def test_encode_adds_the_version_and_ends_the_line():
    raw = wire.encode({"op": "status"})
    assert raw.endswith(b"\n") and raw.count(b"\n") == 1
    assert wire.decode(raw) == {"op": "status", "v": wire.VERSION}


@pytest.mark.parametrize("line, message", [
    (b'{"op": "status"}', "protocol version None is not supported; this side speaks version 2"),
    (b'{"v": 1}', "protocol version 1 is not supported; this side speaks version 2"),
    (b"[1]", "message must be a JSON object, got list"),
    (b"{nope", "message is not valid JSON"),
    (b"\xff", "message is not valid JSON"),
])
def test_decode_refuses(line, message):
    with pytest.raises(wire.DaemonProtocolError, match=message.replace("(", "\\(")):
        wire.decode(line)


def test_sizes_are_bounded():
    with pytest.raises(wire.DaemonProtocolError, match=f"exceeds the {wire.MAX_MESSAGE}-byte"):
        wire.encode({"op": "x", "pad": "y" * wire.MAX_MESSAGE})
    with pytest.raises(wire.DaemonProtocolError, match=f"exceeds the {wire.MAX_MESSAGE}-byte"):
        wire.decode(b"{" + b" " * wire.MAX_MESSAGE + b"}")


def test_socket_paths(tmp_path):
    assert wire.default_socket_path({"IPU_EMULATOR_HOME": "/h"}) == "/h/daemon.sock"
    with pytest.raises(wire.DaemonProtocolError, match="unix sockets allow at most 107"):
        wire.check_socket_path("/" + "a" * 120)
    assert wire.check_socket_path("rel.sock").startswith("/")
