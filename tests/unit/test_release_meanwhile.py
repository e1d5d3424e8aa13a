"""Closing a session gives its IPUs back to the daemon and unlinks its own rings at once:
``DaemonAttachment.release(meanwhile)`` runs ``meanwhile`` once the release is sent and
before the daemon's answer is read; ``Device.close_then`` runs it exactly once, whatever
the device's state."""

from __future__ import annotations

import socket

import pytest

from host_runtime.devices._daemon_client import DaemonAttachment, DaemonClient
from host_runtime.devices.loopback import loopback_device
from ipu_emulator.daemon import socket_protocol as wire


@pytest.fixture
def stand_in(tmp_path):
    """A listening socket that plays the daemon, and an attachment held on it."""
    path = str(tmp_path / "d.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    server.settimeout(10)
    client = DaemonClient(path)
    conn = wire.LineConnection(path, 10)
    peer, _ = server.accept()
    att = DaemonAttachment(client, conn, (0,), [])
    yield att, peer
    peer.close()
    server.close()


def test_meanwhile_runs_after_the_release_is_sent_and_before_its_answer(stand_in):
    att, peer = stand_in
    seen: list[str] = []

    def meanwhile() -> None:
        line = peer.recv(65536, socket.MSG_DONTWAIT)   # sent already (else BlockingIOError)
        seen.append(wire.decode(line)["op"])
        peer.sendall(wire.encode({"ok": True}))   # the answer comes only now

    att.release(meanwhile)
    assert seen == ["release"] and not att.held
    att.release(meanwhile)   # nothing left to release: not run again
    assert seen == ["release"]


def test_meanwhile_runs_when_the_daemon_is_gone(stand_in):
    att, peer = stand_in
    peer.close()
    seen: list[int] = []
    att.release(lambda: seen.append(1))   # the daemon's end closed: released locally
    assert seen == [1] and not att.held


def test_close_then_runs_meanwhile_exactly_once():
    dev = loopback_device(1, ipu_version=21)
    seen: list[int] = []
    dev.close_then(lambda: seen.append(1))
    assert seen == [1]
    dev.close_then(lambda: seen.append(2))   # closed already: still run, once
    assert seen == [1, 2]


def test_an_error_of_meanwhile_is_raised_once_the_release_is_done(stand_in):
    att, peer = stand_in

    def meanwhile() -> None:
        peer.sendall(wire.encode({"ok": True}))
        raise OSError("cannot unlink a ring")

    with pytest.raises(OSError, match="cannot unlink a ring"):
        att.release(meanwhile)
    assert not att.held
    assert wire.decode(peer.recv(65536))["op"] == "release"   # the release went out
