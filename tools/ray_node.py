"""``ipu-emulator ray-node``: start or stop one node of a Ray cluster of emulated IPUs.

``start`` runs a daemon of ``--ipus`` IPUs in the background, then ``ray start`` with the
custom resource ``IPU`` and the daemon's socket in the raylet's environment (so every
worker of the node attaches through this node's daemon); ``stop`` runs ``ray stop`` and
stops the daemon. Loopback (127.0.0.1) unless ``--node-ip-address`` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket as socketlib
import subprocess
import sys
import time

from ipu_emulator import cluster, safe_files
from ipu_emulator.system import emulator_home, private_dir

_STATE = "ray-node.json"


def _state_path(home: str) -> str:
    return os.path.join(home, _STATE)


def _wait_for_daemon(path: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise cluster.NodeStartError(
                f"the node's daemon exited with status {proc.returncode} before serving "
                f"{path} (its log: {path}.log)")
        s = socketlib.socket(socketlib.AF_UNIX)
        try:
            s.connect(path)
            return
        except OSError:
            time.sleep(0.05)   # polling for a socket another process makes, bounded
        finally:
            s.close()
    _stop_child(proc)   # SIGTERM first: it removes what it made in /dev/shm
    raise cluster.NodeStartError(f"the node's daemon did not serve {path} within "
                                   f"{timeout:g} s (its log: {path}.log)")


def start(args: argparse.Namespace) -> int:
    home = private_dir(emulator_home(os.environ))   # (a planted link or others' folder: refused)
    sock = os.path.abspath(args.socket or os.path.join(home, "ray-node-daemon.sock"))
    cmd = cluster.ray_start_command(ipus=args.ipus, head=args.head, address=args.address,
                                    port=args.port, num_cpus=args.num_cpus,
                                    node_ip=args.node_ip_address,
                                    object_store_memory=args.object_store_memory)
    log = _open_log(sock + ".log")
    try:
        daemon = subprocess.Popen(
            [sys.executable, "-m", "tools.cli", "daemon", "--socket", sock,
             "--num-ipus", str(args.ipus)], stdin=subprocess.DEVNULL, stdout=log,
            stderr=log, start_new_session=True)
    finally:
        os.close(log)
    _wait_for_daemon(sock, daemon, args.timeout)
    safe_files.write_atomic(_state_path(home), json.dumps(
        {"daemon_pid": daemon.pid, "socket": sock}).encode(), mode=0o600)
    rc = subprocess.call(cmd, env=cluster.node_environment(sock))
    if rc != 0:
        _stop_child(daemon)
        os.unlink(_state_path(home))
        print(f"ipu-emulator ray-node: 'ray start' failed (exit {rc}); the daemon stopped",
              file=sys.stderr)
        return rc
    print(f"node up: {args.ipus} IPUs (resource {cluster.IPU_RESOURCE!r}), daemon {sock}")
    return 0


def _open_log(path: str) -> int:
    """The daemon's log, appended to: a regular file of this user, never a link planted
    at its name (``UnsafePathError``)."""
    folder, name = os.path.split(os.path.abspath(path))
    dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd = safe_files.open_in(dfd, name, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600, path)
    finally:
        os.close(dfd)
    return fd


def _stop_child(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    """Stop the daemon this process started (and reap it): SIGTERM, then SIGKILL."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _stop_daemon(pid: int, timeout: float = 30.0) -> None:
    """Stop the daemon an earlier ``start`` left running (not our child: its parent
    exited, so it is reaped by another): SIGTERM, polled, then SIGKILL."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)   # polling another session's process for its exit, bounded
    os.kill(pid, signal.SIGKILL)


def stop(args: argparse.Namespace) -> int:
    home = emulator_home(os.environ)
    rc = subprocess.call(cluster.ray_stop_command())
    try:
        with open(_state_path(home)) as f:
            state = json.load(f)
    except FileNotFoundError:
        print(f"ipu-emulator ray-node: no node daemon recorded in {home}", file=sys.stderr)
        return rc
    _stop_daemon(int(state["daemon_pid"]))
    os.unlink(_state_path(home))
    return rc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ipu-emulator ray-node", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    up = sub.add_parser("start", help="start this machine's daemon and Ray node")
    up.add_argument("--ipus", type=int, required=True, help="IPUs this node offers")
    up.add_argument("--head", action="store_true", help="start the cluster's head node")
    up.add_argument("--address", help="join the cluster whose head is at HOST:PORT")
    up.add_argument("--port", type=int, help="the head's port (default Ray's)")
    up.add_argument("--num-cpus", type=int, help="CPUs the node offers (default Ray's)")
    up.add_argument("--node-ip-address", default=cluster.LOOPBACK,
                    help="address the node binds (default 127.0.0.1)")
    up.add_argument("--object-store-memory", type=int, metavar="BYTES",
                    help="the node's Ray object store (default Ray's: a share of memory)")
    up.add_argument("--socket", help="the daemon's socket (default "
                    "$IPU_EMULATOR_HOME/ray-node-daemon.sock)")
    up.add_argument("--timeout", type=float, default=60.0,
                    help="seconds to wait for the daemon to serve")
    sub.add_parser("stop", help="ray stop (every Ray process of this machine), then stop "
                   "the node's daemon")
    args = parser.parse_args(argv)
    return start(args) if args.what == "start" else stop(args)
