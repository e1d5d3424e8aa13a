"""A host asks a daemon's hello once: the answer is kept while the socket is the same
file, and asked again of a daemon that started anew at the same path."""

from __future__ import annotations

import os
import socket
import threading

from host_runtime.devices._daemon_client import DaemonClient
from ipu_emulator.daemon import socket_protocol as wire


class FakeDaemon:
    """Answers hello with a pool of ``num_ipus``; counts the connections it served."""

    def __init__(self, path: str, num_ipus: int) -> None:
        self.num_ipus = num_ipus
        self.served = 0
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(path)
        self._sock.listen(4)
        self._path = path
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:   # closed
                return
            with conn:
                line = conn.makefile("rb").readline()
                assert wire.decode(line)["op"] == "hello"
                self.served += 1
                conn.sendall(wire.encode({"ok": True, "daemon_pid": os.getpid(), "system": {
                    "num_ipus": self.num_ipus, "ipu_version": "ipu21", "tiles_per_ipu": 1472,
                    "memory_per_tile": 638976, "compute_threads": 1}}))

    def stop(self) -> None:
        self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join(5)
        os.unlink(self._path)


def test_the_hello_is_kept_per_socket_file_and_asked_again_of_a_new_daemon(tmp_path) -> None:
    path = str(tmp_path / "d.sock")
    first = FakeDaemon(path, num_ipus=2)
    try:
        assert DaemonClient(path).system(str(tmp_path)).num_ipus == 2
        assert DaemonClient(path).system(str(tmp_path)).num_ipus == 2
        assert first.served == 1   # the second client used the kept answer
    finally:
        first.stop()
    second = FakeDaemon(path, num_ipus=3)   # a new daemon, a new socket at the same path
    try:
        assert DaemonClient(path).system(str(tmp_path)).num_ipus == 3
        assert second.served == 1
    finally:
        second.stop()
