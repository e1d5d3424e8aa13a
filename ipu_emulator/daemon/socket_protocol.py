"""The daemon's socket protocol: JSON lines over a local (unix) stream socket.

Each message is one line of strict JSON (an object) of at most
:data:`MAX_MESSAGE` bytes, with ``"v": VERSION``. A client sends requests and
reads one reply per request, in order::

    {"v":2,"op":"hello"}                       -> {"ok":true,"daemon_pid":..,"system":{..}}
    {"v":2,"op":"status"}
        -> {"ok":true,..,"ipus":[{"ipu","state","holder","pid","device",..}],
            "devices":[{"device_id","ipus","holder","states"}]}   (one per held attachment)
    {"v":2,"op":"attach","ipus":[0,1],"device_id":4}
        -> {"ok":true,"ipus":[{"ipu","pid","control","events","log","ready"}]}
        |  {"ok":false,"error":"busy","busy":{"0":1234},"message":".."}
    {"v":2,"op":"release"}                     -> {"ok":true}   (the IPUs are clean and free)
    {"v":2,"op":"exit_status","pid":N}         -> {"ok":true,"returncode":rc or null}
    {"v":2,"op":"partition_create"|"partition_list"|"partition_get"|"partition_remove",..}
        -> V-IPU partitions (ipu_emulator.daemon.partitions); "attach" may name one

Every failure is ``{"ok":false,"error":<kind>,"message":<text>}``. A
connection holds at most one attachment; closing the connection (or the
death of the process that opened it) releases it.

The version also stands for the wire between a host and the daemon's IPU processes
(the rings' layout, ``shm.ring``): a daemon and a host of two installations whose
rings differ refuse each other at the first message (version 2: a ring's semaphores
are in its segment).
"""

from __future__ import annotations

import json
import os
import socket
import struct
from typing import Any, Mapping

from ipu_emulator.errors import DaemonProtocolError, DaemonVersionError

__all__ = ["VERSION", "MAX_MESSAGE", "ENV_VAR", "SOCKET_NAME", "DaemonProtocolError",
           "DaemonVersionError",
           "default_socket_path", "encode", "decode", "LineConnection", "request"]

VERSION = 2
MAX_MESSAGE = 64 * 1024
ENV_VAR = "IPU_EMULATOR_DAEMON"
SOCKET_NAME = "daemon.sock"
_SUN_PATH_MAX = 107


def default_socket_path(environ: Mapping[str, str] | None = None) -> str:
    """``$IPU_EMULATOR_HOME/daemon.sock`` (see :func:`ipu_emulator.system.emulator_home`)."""
    from ipu_emulator.system import emulator_home

    return os.path.join(emulator_home(environ), SOCKET_NAME)


def check_socket_path(path: str) -> str:
    """``path`` made absolute; raises DaemonProtocolError if a unix socket cannot have it."""
    full = os.path.abspath(path)
    if len(full.encode()) > _SUN_PATH_MAX:
        raise DaemonProtocolError(f"socket path {full!r} is {len(full.encode())} bytes long; "
                                  f"unix sockets allow at most {_SUN_PATH_MAX}")
    return full


__all__.append("check_socket_path")


def encode(message: dict[str, Any]) -> bytes:
    """One line: ``message`` with the version field, as compact JSON plus a newline."""
    raw = json.dumps(dict(message, v=VERSION), separators=(",", ":")).encode() + b"\n"
    if len(raw) > MAX_MESSAGE:
        raise DaemonProtocolError(f"{message.get('op', 'reply')} message of {len(raw)} bytes "
                                  f"exceeds the {MAX_MESSAGE}-byte limit")
    return raw


def decode(line: bytes) -> dict[str, Any]:
    """Parse one line; check its size, that it is a JSON object and its version."""
    if len(line) > MAX_MESSAGE:
        raise DaemonProtocolError(f"message of {len(line)} bytes exceeds the "
                                  f"{MAX_MESSAGE}-byte limit")
    try:
        obj = json.loads(line.decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise DaemonProtocolError(f"message is not valid JSON: {exc}") from None
    except RecursionError:   # e.g. [[[[...]]]] a few thousand deep
        raise DaemonProtocolError("message is not valid JSON: it nests arrays or objects "
                                  "too deeply") from None
    if not isinstance(obj, dict):
        raise DaemonProtocolError(f"message must be a JSON object, got {type(obj).__name__}")
    if obj.get("v") != VERSION:
        raise DaemonVersionError(f"protocol version {obj.get('v')!r} is not supported; "
                                  f"this side speaks version {VERSION}")
    return obj


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a unix socket (SO_PEERCRED)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def check_peer(sock: socket.socket, path: str) -> None:
    """The daemon at ``path`` must run as this user (or root): else DaemonProtocolError.

    Another user's process listening on a socket we were told to use could hand
    out rings and pids of its choosing.
    """
    pid, uid, _ = peer_credentials(sock)
    me = os.getuid()
    if uid not in (me, 0):
        raise DaemonProtocolError(f"the process at {path} (pid {pid}) runs as uid {uid}, not "
                                  f"as this user (uid {me}) or root; refusing to use it as "
                                  "the IPU emulator daemon")


__all__ += ["peer_credentials", "check_peer"]


class LineConnection:
    """A blocking client connection: ``call(request) -> reply``; ``close()`` is idempotent.

    The peer is checked on connect (``check_peer``: same uid or root)."""

    def __init__(self, path: str, timeout: float = 30.0) -> None:
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        self.peer_pid: int | None = None   # the daemon's pid (SO_PEERCRED), once connected
        try:
            self._sock.connect(path)
            self.peer_pid = peer_credentials(self._sock)[0]
            check_peer(self._sock, path)
        except BaseException:
            self._sock.close()
            raise
        self._buf = b""

    def call(self, message: dict[str, Any], timeout: float | None = 30.0) -> dict[str, Any]:
        self.send(message, timeout)
        return self.receive(timeout)

    def send(self, message: dict[str, Any], timeout: float | None = 30.0) -> None:
        """Send one request; its reply is read by :meth:`receive`."""
        self._sock.settimeout(timeout)
        self._sock.sendall(encode(message))

    def receive(self, timeout: float | None = 30.0) -> dict[str, Any]:
        """The next reply, within ``timeout`` s of each read (TimeoutError)."""
        self._sock.settimeout(timeout)
        while b"\n" not in self._buf:
            if len(self._buf) > MAX_MESSAGE:
                raise DaemonProtocolError(f"reply exceeds the {MAX_MESSAGE}-byte limit")
            chunk = self._sock.recv(65536)
            if not chunk:
                raise ConnectionError(f"the daemon at {self.path} closed the connection")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return decode(line)

    def fileno(self) -> int:
        return self._sock.fileno()

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> "LineConnection":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def request(path: str, message: dict[str, Any], timeout: float = 30.0) -> dict[str, Any]:
    """One request on a fresh connection (hello, status, exit_status)."""
    with LineConnection(path, timeout) as conn:
        return conn.call(message, timeout)
