"""One ``ipu-emulator daemon`` shared by every process of a test run.

The daemon belongs to the machine home; ``<home>/daemon.lock`` (``fcntl.flock``,
held only while the state changes) guards ``<home>/daemon.json``::

    {"pid": <daemon pid>, "socket": "<home>/daemon.sock", "users": [<worker pids>]}

- ``acquire``: under the lock, drop dead users; if the recorded daemon answers,
  add this process to its users; otherwise start one (its own session and
  shared-memory tag, stderr to ``<home>/logs/daemon.log``), wait until it
  answers, record it with this process as its only user.
- ``release``: under the lock, remove this process (and dead ones) from the
  users; the last one stops the daemon (SIGTERM, then SIGKILL after a grace
  period) and removes the record.
- ``stop_recorded``: the end of the run stops whatever a crashed worker left.

A daemon started by another worker is not our child: its exit is seen through
its pid (a zombie counts as gone).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

from ipu_emulator import safe_files

__all__ = ["DaemonHandle", "acquire", "release", "stop_recorded", "connect_existing"]

_log = logging.getLogger(__name__)

_START_TIMEOUT = 120.0   # seconds for a fresh daemon to answer (its IPU processes start)
_STOP_TIMEOUT = 30.0

# Daemons this process started, kept so that their Popen is not collected while they run
# (it would warn) and so that the one who stops them also reaps them.
_started: dict[int, "subprocess.Popen[bytes]"] = {}


@dataclass
class DaemonHandle:
    """The daemon a session uses: its socket and pid; ``owned`` when the run manages it."""

    socket: str
    pid: int
    owned: bool
    home: str | None = None

    def status(self) -> dict[str, Any]:
        """The daemon's ``status`` reply: ``{"ipus": [{"ipu", "state", "holder", "pid"}], ...}``."""
        from ipu_emulator.daemon import socket_protocol as wire

        return wire.request(self.socket, {"op": "status"}, timeout=30.0)


def _hello(socket_path: str, timeout: float = 10.0) -> dict[str, Any] | None:
    from ipu_emulator.daemon import socket_protocol as wire

    try:
        reply = wire.request(socket_path, {"op": "hello"}, timeout=timeout)
    except (OSError, ValueError):
        return None
    return reply if reply.get("ok") else None


def connect_existing(socket_path: str) -> tuple[DaemonHandle, dict[str, Any]]:
    """A daemon the user started (``--ipu-emulator-daemon``); raises if it does not answer."""
    hello = _hello(socket_path)
    if hello is None:
        raise RuntimeError(f"no IPU emulator daemon answers at {socket_path} "
                           "(--ipu-emulator-daemon / ipu_emulator_daemon / IPU_EMULATOR_DAEMON); "
                           "start one with 'ipu-emulator daemon --socket PATH'")
    return DaemonHandle(socket_path, int(hello["daemon_pid"]), owned=False), hello["system"]


@contextmanager
def _locked(home: str) -> Iterator[str]:
    """Hold ``<home>/daemon.lock``; yields the state file's path."""
    # the home checked (ours, private, no symlink); the lock opened O_NOFOLLOW in it
    fd = safe_files.open_private_file(os.path.join(home, "daemon.lock"), os.O_RDWR | os.O_CREAT,
                                      0o600, what="emulator home")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield os.path.join(home, "daemon.json")
    finally:
        os.close(fd)   # drops the lock


def _read(state_path: str) -> dict[str, Any] | None:
    try:
        with open(state_path, encoding="utf-8") as f:
            state = json.load(f)
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) else None


def _write(state_path: str, state: dict[str, Any] | None) -> None:
    if state is None:
        try:
            os.unlink(state_path)
        except FileNotFoundError:
            pass
        return
    safe_files.write_atomic(state_path, json.dumps(state).encode("utf-8"), mode=0o600)


def _gone(pid: int) -> bool:
    import psutil

    try:
        status: str = psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return True
    return bool(status == psutil.STATUS_ZOMBIE)


def _start(home: str, env: dict[str, str], num_ipus: int, ipu_version: str) -> dict[str, Any]:
    socket_path = os.path.join(home, "daemon.sock")
    log_path = os.path.join(home, "logs", "daemon.log")
    argv = [sys.executable, "-m", "tools.cli", "daemon", "--socket", socket_path,
            "--num-ipus", str(num_ipus), "--ipu-version", ipu_version]
    # The daemon runs the code this process runs (installed or not).
    import tools

    root = os.path.dirname(os.path.dirname(os.path.abspath(tools.__file__)))
    env = dict(env, PYTHONPATH=os.pathsep.join(
        p for p in (root, env.get("PYTHONPATH", "")) if p))
    log = safe_files.open_log(log_path)
    try:
        # cwd: the home, not the suite's folder, whose own "tools" package would shadow ours
        proc = subprocess.Popen(argv, env=env, cwd=home, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=log, start_new_session=True, close_fds=True)
    finally:
        os.close(log)
    deadline = time.monotonic() + _START_TIMEOUT
    while _hello(socket_path, timeout=5.0) is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            with open(log_path, "rb") as f:
                tail = f.read()[-2000:].decode(errors="replace")
            raise RuntimeError(f"the shared IPU emulator daemon did not start "
                               f"(exit status {proc.returncode}); {log_path}:\n{tail}")
        time.sleep(0.02)
    _started[proc.pid] = proc
    _log.info("started the shared IPU emulator daemon (pid %d) at %s", proc.pid, socket_path)
    return {"pid": proc.pid, "socket": socket_path, "users": []}


def acquire(home: str, env: dict[str, str], num_ipus: int, ipu_version: str) -> DaemonHandle:
    """Use the run's daemon of machine ``home``, starting it if none is running.

    ``env``: the daemon's environment (the machine's home, its own shared-memory tag).
    """
    me = os.getpid()
    with _locked(home) as state_path:
        state = _read(state_path)
        if state is not None and (_gone(int(state["pid"])) or _hello(state["socket"]) is None):
            _stop(state)   # dead or not answering: replace it
            state = None
        if state is None:
            state = _start(home, env, num_ipus, ipu_version)
        state["users"] = [p for p in state["users"] if not _gone(p) and p != me] + [me]
        _write(state_path, state)
    return DaemonHandle(state["socket"], int(state["pid"]), owned=True, home=home)


def release(handle: DaemonHandle) -> None:
    """This process stops using the run's daemon; the last user stops it."""
    if not handle.owned or handle.home is None:
        return
    me = os.getpid()
    with _locked(handle.home) as state_path:
        state = _read(state_path)
        if state is None or int(state["pid"]) != handle.pid:
            return
        state["users"] = [p for p in state["users"] if p != me and not _gone(p)]
        if state["users"]:
            _write(state_path, state)
            return
        _stop(state)
        _write(state_path, None)


def stop_recorded(home: str) -> None:
    """Stop the daemon recorded in ``home`` whatever its users (the end of the run)."""
    if not os.path.isdir(home):
        return
    with _locked(home) as state_path:
        state = _read(state_path)
        if state is not None:
            _stop(state)
            _write(state_path, None)


def _stop(state: dict[str, Any]) -> None:
    pid = int(state["pid"])
    try:
        _stop_pid(pid)
    finally:
        proc = _started.pop(pid, None)
        if proc is not None:
            proc.wait()


def _stop_pid(pid: int) -> None:
    if _gone(pid):
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + _STOP_TIMEOUT
    while not _gone(pid):
        if time.monotonic() > deadline:
            _log.warning("the shared IPU emulator daemon (pid %d) ignored SIGTERM for %.0f s; "
                         "killing it", pid, _STOP_TIMEOUT)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            break
        time.sleep(0.01)
    _log.info("stopped the shared IPU emulator daemon (pid %d)", pid)
