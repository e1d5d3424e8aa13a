"""Ray as the engine past one machine: every node runs a daemon and offers its IPUs to Ray
as the custom resource ``IPU``.

Ray places work (an actor or task that asks for ``{"IPU": n}`` runs on a node with n
IPUs unclaimed); the node's daemon assigns the IPUs. The node's raylet is started with
``IPU_EMULATOR_DAEMON`` naming its own daemon's socket, and every worker it starts
inherits that environment, so unchanged Model Runtime code in an actor attaches through
its own node's daemon (never another node's shared memory). A dead actor's connection to
the daemon closes with its process, and the daemon takes its IPUs back.

Ray is optional (``pip install 'ipu-emulator[ray]'``): nothing here imports it until a
node is started.
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any, Mapping

from ipu_emulator.daemon import socket_protocol as wire
from ipu_emulator.errors import IpuEmulatorError

__all__ = ["IPU_RESOURCE", "RayMissingError", "NodeStartError", "require_ray", "node_environment",
           "ray_start_command", "ray_stop_command", "LOOPBACK", "SETUP_HOOK"]

IPU_RESOURCE = "IPU"
"""The custom resource a node offers: one unit per IPU of its daemon's pool."""

LOOPBACK = "127.0.0.1"

SETUP_HOOK = "ipu_emulator.run.install"
"""A job's ``runtime_env={"worker_process_setup_hook": SETUP_HOOK}``: its Ray workers map
Graphcore's module names (``import model_runtime``, ``popef``, ``poprt``) onto this
project before its code runs, as ``ipu-emulator run`` does for a program."""


class RayMissingError(IpuEmulatorError, RuntimeError):
    """Ray is not installed where a cluster node or a Ray test was asked for."""


class NodeStartError(IpuEmulatorError, RuntimeError):
    """A cluster node's daemon did not start (the message names its log)."""


def require_ray() -> Any:
    """The ``ray`` module, or :class:`RayMissingError` saying how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise RayMissingError(
            f"a Ray cluster node needs Ray: pip install 'ipu-emulator[ray]' ({exc})") from None
    return ray


def node_environment(socket: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a node's raylet (and so of every worker it starts): ``base``
    (default this process's) with the node's daemon socket and Ray's usage report off."""
    if not os.path.isabs(socket):
        raise ValueError(f"the daemon socket must be an absolute path, got {socket!r}")
    env = dict(os.environ if base is None else base)
    env[wire.ENV_VAR] = socket
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    return env


def _ray_exe() -> list[str]:
    exe = shutil.which("ray", path=os.path.dirname(sys.executable)) or shutil.which("ray")
    if exe is None:
        raise RayMissingError("the 'ray' command is not on PATH: pip install "
                              "'ipu-emulator[ray]'")
    return [exe]


def ray_start_command(*, ipus: int, head: bool, address: str | None = None,
                      port: int | None = None, num_cpus: int | None = None,
                      node_ip: str = LOOPBACK, object_store_memory: int | None = None
                      ) -> list[str]:
    """``ray start`` for a node offering ``ipus`` IPUs: the head (``port``, default Ray's)
    or a worker joining ``address`` (host:port); bound to ``node_ip`` (loopback unless
    told), dashboard off; its object store ``object_store_memory`` bytes (default Ray's)."""
    if ipus < 1:
        raise ValueError(f"a node offers at least 1 IPU, got {ipus}")
    if object_store_memory is not None and object_store_memory < 1:
        raise ValueError(f"--object-store-memory must be a positive number of bytes, got "
                         f"{object_store_memory}")
    if head == (address is not None):
        raise ValueError("a node is either the head (no address) or joins one (--address "
                         f"HOST:PORT); got head={head}, address={address!r}")
    cmd = [*_ray_exe(), "start", "--node-ip-address", node_ip,
           "--resources", f'{{"{IPU_RESOURCE}": {ipus}}}']
    if head:
        cmd += ["--head", "--include-dashboard=false"]
        if port is not None:
            cmd += ["--port", str(port)]
    else:
        assert address is not None
        cmd += ["--address", address]
    if num_cpus is not None:
        cmd += ["--num-cpus", str(num_cpus)]
    if object_store_memory is not None:
        cmd += ["--object-store-memory", str(object_store_memory)]
    return cmd


def ray_stop_command() -> list[str]:
    """``ray stop``: the Ray processes of this machine."""
    return [*_ray_exe(), "stop"]
