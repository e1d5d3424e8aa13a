"""A daemon under test: ``ipu-emulator daemon`` as a subprocess with its own socket,
home, shared-memory tag and small pool; helpers for host subprocesses.

The daemon runs under its own tag, so the autouse leak probe (which watches
this test process's tag) does not see its rings; :meth:`DaemonRig.stop`
checks them itself: after SIGTERM nothing of the daemon's tag is left.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil

from ipu_emulator.daemon import socket_protocol as wire
from tests._helpers import processes

REPO = Path(__file__).resolve().parents[1]


def shm_entries(tag: str | None = None, pid: int | None = None) -> set[str]:
    """Our /dev/shm entries of ``tag`` and/or created by ``pid``."""
    from shm.cleanup import list_objects

    return {o.entry for o in list_objects(tag, all_tags=tag is None)
            if pid is None or o.pid == pid}


class DaemonRig:
    """``ipu-emulator daemon --socket <base>/d.sock --num-ipus N`` in the background
    (machine home ``<base>/home`` unless ``home`` is given: two rigs may share one)."""

    def __init__(self, base: Path, num_ipus: int = 2, args: tuple[str, ...] = (),
                 home: Path | None = None, **env: str) -> None:
        self.base = base
        self.socket = str(base / "d.sock")
        self.tag = "d" + secrets.token_hex(4)
        self.env = dict(os.environ, IPU_EMULATOR_SHM_TAG=self.tag,
                        IPU_EMULATOR_HOME=str(home if home is not None else base / "home"), **env)
        self.env.pop(wire.ENV_VAR, None)
        self.lines: list[str] = []
        self._ready = threading.Event()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tools.cli", "daemon", "--socket", self.socket,
             "--num-ipus", str(num_ipus), *args], cwd=REPO, env=self.env,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if not self._ready.wait(180) or self.proc.poll() is not None:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError("the daemon did not start:\n" + "\n".join(self.lines))
        self.pool_pids = [ipu["pid"] for ipu in self.status()["ipus"]]

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))
            if " serving " in line:
                self._ready.set()
        self._ready.set()   # exited: let the constructor see it

    def status(self) -> dict:
        return wire.request(self.socket, {"op": "status"})

    def host_env(self) -> dict[str, str]:
        """The environment of a host process using this daemon (this test's tag)."""
        return dict(os.environ, **{wire.ENV_VAR: self.socket})

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """SIGTERM (or ``sig``); the daemon must exit 0 leaving no IPU process and nothing
        in /dev/shm."""
        if self.proc.poll() is not None:
            return
        procs = processes(self.pool_pids)
        self.proc.send_signal(sig)
        rc = self.proc.wait(60)
        self._reader.join(10)
        assert rc == 0, "\n".join(self.lines)
        _, alive = psutil.wait_procs(procs, timeout=10)
        assert not alive, f"IPU processes still running after the daemon stopped: {alive}"
        assert shm_entries(self.tag) == set(), "the daemon left shared-memory objects"
        assert not os.path.exists(self.socket)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
