"""V-IPU's partition workflow over the daemon: the controller client and IPUoF configs.

The daemon (``ipu-emulator daemon``) plays the V-IPU controller: it holds the
partitions (:mod:`ipu_emulator.daemon.partitions`). This module is what
``ipu-emulator vipu`` and a host process use to find it and talk to it:

- :func:`controller_socket`: the daemon's socket (``IPU_EMULATOR_DAEMON``, else
  ``$IPU_EMULATOR_HOME/daemon.sock``). ``IPUOF_VIPU_API_HOST`` and
  ``IPUOF_VIPU_API_PORT`` are accepted as V-IPU's names for "where the controller
  is", but the emulator's controller is the daemon on this machine, over its unix
  socket: the host must be a loopback name (``localhost``, ``127.0.0.1``,
  ``::1``) and the port a TCP port number (it is not used); anything else is a
  :class:`VipuError` naming the variable, as a remote controller cannot be reached.
- :class:`VipuClient`: create, list, get, remove partitions.
- :func:`ipuof_config`: the IPUoF configuration a job of the partition gets
  (``vipu get partition NAME --ipu-configs``), and :func:`partition_from_env`: the
  partition a host process was given (``IPUOF_VIPU_API_PARTITION_ID``, else the
  file ``IPUOF_CONFIG_PATH``, else the one ``*.conf`` in ``~/.ipuof.conf.d/`` in the
  emulator's form: files there without ``ipuof-config-version`` and ``controller``,
  such as a real IPUoF config, are not the emulator's and are left alone).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

from ipu_emulator.daemon import partitions, socket_protocol as wire
from ipu_emulator.errors import VipuError
from ipu_emulator.system import device_groups
from shm.settings import is_digits

__all__ = ["PARTITION_ENV", "HOST_ENV", "PORT_ENV", "CONFIG_ENV", "CONFIG_DIR",
           "CONFIG_VERSION", "PartitionRef", "VipuClient", "controller_socket",
           "ipuof_config", "device_ids", "partition_from_env", "partitioned_ipus",
           "read_ipuof_config"]

PARTITION_ENV = "IPUOF_VIPU_API_PARTITION_ID"
HOST_ENV = "IPUOF_VIPU_API_HOST"
PORT_ENV = "IPUOF_VIPU_API_PORT"
CONFIG_ENV = "IPUOF_CONFIG_PATH"
CONFIG_DIR = "~/.ipuof.conf.d"
CONFIG_VERSION = 1
_LOOPBACK = ("localhost", "127.0.0.1", "::1", "ip6-localhost")


def controller_socket(environ: Mapping[str, str] | None = None) -> str:
    """The daemon acting as V-IPU controller; checks IPUOF_VIPU_API_HOST/PORT."""
    env = os.environ if environ is None else environ
    host = env.get(HOST_ENV, "")
    if host and host.strip().lower() not in _LOOPBACK:
        raise VipuError(f"{HOST_ENV}={host!r}: the emulator's V-IPU controller is the daemon "
                        f"on this machine; expected a loopback host ({', '.join(_LOOPBACK)}) "
                        "or the variable unset", "config")
    port = env.get(PORT_ENV, "")
    if port and not (is_digits(port) and 1 <= int(port) <= 65535):
        raise VipuError(f"{PORT_ENV}={port!r}: expected a TCP port number 1..65535 (not "
                        "used: the daemon listens on its unix socket)", "config")
    path = env.get(wire.ENV_VAR) or wire.default_socket_path(env)
    return wire.check_socket_path(path)


def device_ids(size: int, reconfigurable: bool) -> list[int]:
    """The device ids Poplar sees in a partition of ``size`` IPUs: every single and
    multi-IPU device of 0..size-1 when reconfigurable, else only the one of all."""
    n = len(device_groups(size))
    return list(range(n)) if reconfigurable else [n - 1]


def ipuof_config(partition: Mapping[str, Any], socket_path: str) -> dict[str, Any]:
    """The IPUoF configuration of ``partition`` (a daemon partition record): what
    ``IPUOF_CONFIG_PATH`` may name. Devices are numbered as Poplar numbers them inside
    the partition (IPUs 0..size-1); ``pool_ipus`` are the daemon's."""
    size = int(partition["size"])
    groups = device_groups(size)
    pool = list(partition["ipus"])
    return {"ipuof-config-version": CONFIG_VERSION, "partition": partition["name"],
            "controller": {"socket": socket_path},
            "reconfigurable": bool(partition["reconfigurable"]), "num_ipus": size,
            "devices": [{"id": d, "ipus": list(groups[d]),
                         "pool_ipus": [pool[i] for i in groups[d]]}
                        for d in device_ids(size, bool(partition["reconfigurable"]))]}


@dataclass(frozen=True)
class PartitionRef:
    """A partition a host process was given: its name, the daemon's socket, and where
    the name and the socket came from (for messages)."""
    name: str
    socket: str
    source: str
    socket_source: str = wire.ENV_VAR


def read_ipuof_config(path: str) -> PartitionRef:
    """The partition an IPUoF config file (as ``ipuof_config`` writes) names."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, ValueError) as exc:
        raise VipuError(f"cannot read the IPUoF config {path}: {exc}", "config") from None
    name = obj.get("partition") if isinstance(obj, dict) else None
    ctl = obj.get("controller") if isinstance(obj, dict) else None
    sock = ctl.get("socket") if isinstance(ctl, dict) else None
    if not isinstance(name, str) or not isinstance(sock, str):
        raise VipuError(f"the IPUoF config {path} has no 'partition' name and "
                        "'controller.socket'; write it with 'ipu-emulator vipu get partition "
                        "NAME --ipu-configs --output FILE'", "config")
    return PartitionRef(name, sock, f"IPUoF config {path}", f"the IPUoF config {path}")


def _is_ours(path: str) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(obj, dict) and "ipuof-config-version" in obj and "controller" in obj


def partition_from_env(environ: Mapping[str, str] | None = None) -> PartitionRef | None:
    """The partition this process was given, or None (no V-IPU setting)."""
    env = os.environ if environ is None else environ
    name = env.get(PARTITION_ENV, "")
    if name:
        return PartitionRef(name, controller_socket(env), PARTITION_ENV,
                            wire.ENV_VAR if env.get(wire.ENV_VAR) else "the default socket")
    path = env.get(CONFIG_ENV, "")
    if path:
        return read_ipuof_config(path)
    home = env.get("HOME") or os.path.expanduser("~")
    # the emulator's configs only: a real IPUoF config (RDMA addresses) there is not ours
    folder = os.path.join(home, ".ipuof.conf.d")
    try:   # (listed, not globbed: this runs for every DeviceManager)
        names = sorted(n for n in os.listdir(folder)
                       if n.endswith(".conf") and not n.startswith("."))
    except OSError:   # none (the common case), or not a folder we may read
        names = []
    found = [f for f in (os.path.join(folder, n) for n in names) if _is_ours(f)]
    if len(found) > 1:
        raise VipuError(f"{CONFIG_DIR} holds {len(found)} IPUoF configs ({', '.join(found)}); "
                        f"choose one with {CONFIG_ENV}", "config")
    return read_ipuof_config(found[0]) if found else None


class VipuClient:
    """Partition requests to the daemon at ``socket`` (each on its own connection)."""

    def __init__(self, socket: str, timeout: float = 30.0) -> None:
        self.socket = socket
        self.timeout = timeout

    def _call(self, what: str, message: dict[str, Any]) -> dict[str, Any]:
        try:
            reply = wire.request(self.socket, message, self.timeout)
        except (OSError, ValueError) as exc:
            raise VipuError(f"{what}: cannot reach the V-IPU controller (the IPU emulator "
                            f"daemon) at {self.socket}: {exc}; start it with 'ipu-emulator "
                            "daemon'", "unreachable") from None
        if reply.get("ok") is not True:
            raise VipuError(f"{what}: failed: {reply.get('message')}",
                            str(reply.get("error", "request")))
        return reply

    def create(self, name: str, size: int, reconfigurable: bool = False) -> dict[str, Any]:
        reply = self._call(f"create partition ({name})",
                           {"op": "partition_create", "name": name, "size": size,
                            "reconfigurable": reconfigurable})
        return dict(reply["partition"])

    def list(self) -> list[dict[str, Any]]:
        return [dict(p) for p in self._call("list partitions",
                                            {"op": "partition_list"})["partitions"]]

    def get(self, name: str) -> dict[str, Any]:
        return dict(self._call(f"get partition ({name})",
                               {"op": "partition_get", "name": name})["partition"])

    def remove(self, name: str) -> dict[str, Any]:
        return dict(self._call(f"remove partition ({name})",
                               {"op": "partition_remove", "name": name})["partition"])


def partitioned_ipus(home: str, pool: int) -> dict[int, str]:
    """The IPUs of the partitions a daemon on ``home`` keeps, ``{ipu: partition name}``
    (none without its file): a host that starts its own IPU processes on that home leaves
    them to the partitions' jobs, as a daemon's host without a partition does."""
    path = os.path.join(home, partitions.FILE_NAME)
    if not os.path.exists(path):
        return {}
    return {i: p.name for p in partitions.read_kept(path, pool) for i in p.ipus}

