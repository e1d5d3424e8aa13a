"""Daemon socket hardening, without a daemon: deep JSON, the peer's uid (SO_PEERCRED),
the types of the daemon's replies, and the fallback home's owner and mode."""

from __future__ import annotations

import json
import os
import socket
import stat
import threading

import pytest

from host_runtime.devices._daemon_client import DaemonClient
from host_runtime.errors import DeviceUnavailableError
from ipu_emulator.daemon import socket_protocol as wire
from ipu_emulator.system import SystemConfigError, private_dir


def test_deeply_nested_json_is_a_protocol_error():
    line = b'{"v": 2, "op": ' + b"[" * 30000 + b"]" * 30000 + b"}"
    with pytest.raises(wire.DaemonProtocolError, match="nests arrays or objects too deeply"):
        wire.decode(line)


class FakeDaemon:
    """A unix socket answering each line with the next canned reply (then closing)."""

    def __init__(self, path: str, replies: list[dict], version: int = wire.VERSION) -> None:
        self.path = path
        self.replies = list(replies)
        self.version = version
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(4)
        self.sock.settimeout(30)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while self.replies:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.settimeout(30)
                buf = b""
                while self.replies:
                    while b"\n" not in buf:
                        chunk = conn.recv(65536)
                        if not chunk:
                            break
                        buf += chunk
                    if b"\n" not in buf:
                        break
                    _, buf = buf.split(b"\n", 1)
                    conn.sendall(json.dumps(dict(self.replies.pop(0), v=self.version)).encode()
                                 + b"\n")

    def close(self) -> None:
        # a client refused before it sent anything leaves the thread in accept(): a
        # shutdown wakes it at once (close() alone would leave it to its 30 s timeout)
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self.thread.join(30)
        assert not self.thread.is_alive(), "the fake daemon's thread did not end"


@pytest.fixture()
def sock_path(tmp_path):
    return str(tmp_path / "d.sock")


_SYSTEM = {"num_ipus": 2, "ipu_version": "ipu21", "tiles_per_ipu": 1472,
           "memory_per_tile": 638976, "compute_threads": 1}


@pytest.mark.parametrize("reply, words", [
    ({"ok": True}, "system is missing"),
    ({"ok": True, "system": dict(_SYSTEM, num_ipus="2")},
     "system.num_ipus must be int, got '2' (str)"),
    ({"ok": True, "system": [1]}, "system must be dict, got [1] (list)"),
    ({"ok": False, "error": "x", "message": "no"}, "refused hello: 'no'"),
])
def test_hello_reply_types_are_checked(sock_path, tmp_path, reply, words):
    fake = FakeDaemon(sock_path, [reply])
    try:
        with pytest.raises(DeviceUnavailableError) as info:
            DaemonClient(sock_path).system(str(tmp_path))
        assert words in str(info.value) and sock_path in str(info.value)
    finally:
        fake.close()


def test_a_daemon_of_another_version_is_named_so(sock_path, tmp_path):
    """A daemon of an older installation (its rings laid out otherwise): the host says so
    at the first message instead of failing on the daemon's rings."""
    fake = FakeDaemon(sock_path, [{"ok": True, "system": _SYSTEM}], version=wire.VERSION - 1)
    try:
        with pytest.raises(DeviceUnavailableError) as info:
            DaemonClient(sock_path).system(str(tmp_path))
        assert str(info.value) == (
            f"the IPU emulator daemon at {sock_path} (IPU_EMULATOR_DAEMON) is another version "
            f"of the emulator: protocol version {wire.VERSION - 1} is not supported; this side "
            f"speaks version {wire.VERSION}; restart it with this installation ('ipu-emulator "
            "daemon --socket PATH')")
    finally:
        fake.close()


@pytest.mark.parametrize("reply, words", [
    ({"ok": True, "ipus": "0"}, "ipus must be list"),
    ({"ok": True, "ipus": [{"ipu": 0, "pid": "1", "control": "c", "events": "e"}]},
     "ipus[0].pid must be int"),
    ({"ok": True, "ipus": [{"ipu": 1, "pid": 5, "control": "c", "events": "e"}]},
     "asked for ipus [0], got [1]"),
    ({"ok": True, "ipus": [{"ipu": 0, "pid": 5, "control": "c", "events": "e", "log": 3}]},
     "ipus[0].log must be str or null"),
    ({"ok": False, "error": "busy", "busy": {"zero": 3}}, "'busy' must map ipu numbers"),
])
def test_attach_reply_types_are_checked(sock_path, reply, words):
    fake = FakeDaemon(sock_path, [reply])
    try:
        with pytest.raises(DeviceUnavailableError, match="sent a malformed attach reply") as info:
            DaemonClient(sock_path).try_attach(0, (0,))
        assert words in str(info.value)
    finally:
        fake.close()


def test_a_peer_of_another_uid_is_refused(sock_path, monkeypatch):
    fake = FakeDaemon(sock_path, [{"ok": True, "system": _SYSTEM}])
    other = os.getuid() + 4242
    monkeypatch.setattr(wire, "peer_credentials", lambda sock: (777, other, other))
    try:
        with pytest.raises(DeviceUnavailableError) as info:
            DaemonClient(sock_path).system("/tmp")
        msg = str(info.value)
        assert f"runs as uid {other}, not as this user (uid {os.getuid()}) or root" in msg
        assert "pid 777" in msg
    finally:
        monkeypatch.undo()
        fake.close()


def test_the_real_peer_is_this_user(sock_path):
    fake = FakeDaemon(sock_path, [{"ok": True, "system": _SYSTEM}])
    try:
        assert DaemonClient(sock_path).system("/tmp").num_ipus == 2
    finally:
        fake.close()


def test_private_dir_creates_0700(tmp_path):
    d = private_dir(str(tmp_path / "home"))
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700


def test_private_dir_makes_a_world_writable_home_private(tmp_path):
    d = tmp_path / "home"
    d.mkdir()
    os.chmod(d, 0o777)
    private_dir(str(d))
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700


def test_private_dir_refuses_a_symlink(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "home")
    with pytest.raises(SystemConfigError, match="is a symlink or not a folder; refusing to follow"):
        private_dir(str(tmp_path / "home"))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a folder to another user")
def test_private_dir_refuses_another_users_home(tmp_path):
    d = tmp_path / "home"
    d.mkdir(mode=0o700)
    os.chown(d, 4242, 4242)
    with pytest.raises(SystemConfigError, match="belongs to uid 4242, not to this user"):
        private_dir(str(d))


def test_fallback_home_is_checked(monkeypatch, tmp_path):
    import ipu_emulator.system as system

    seen = []
    monkeypatch.setattr(system, "private_dir", lambda p: seen.append(p) or p)
    monkeypatch.setattr(os.path, "expanduser", lambda p: "~")
    assert system.emulator_home({}) == f"/tmp/ipu_emulator-{os.getuid()}"
    assert seen == [f"/tmp/ipu_emulator-{os.getuid()}"]
