"""V-IPU partitions held by the daemon (``ipu-emulator vipu``; ``docs/vipu.md``).

A partition is a named set of the pool's IPUs, made by ``vipu create partition
NAME --size N``: N a power of two (as V-IPU requires), the IPUs an aligned block
of the pool no other partition has (so the partition's IPUs are one of the
pool's multi-IPU devices, as a real partition is one IPU-Link domain). The daemon
keeps its partitions in memory for its life: they outlive the client that made
them and are gone when the daemon stops.

A host attaching with ``"partition": NAME`` may only take that partition's IPUs;
a host attaching without one may not take a partitioned IPU (it is answered busy,
as another job's IPU). A partition is free when none of its IPUs is held, else
busy with its holders' pids; a busy partition cannot be removed.

The wire (requests of :mod:`ipu_emulator.daemon.socket_protocol`)::

    {"op":"partition_create","name":N,"size":S,"reconfigurable":bool}
        -> {"ok":true,"partition":{..}}
    {"op":"partition_list"}                 -> {"ok":true,"partitions":[{..}, ..]}
    {"op":"partition_get","name":N}         -> {"ok":true,"partition":{..}}
    {"op":"partition_remove","name":N}      -> {"ok":true,"partition":{..}}

where a partition is ``{"name","ipus","size","reconfigurable","state","holders",
"created_by"}``; refusals are ``{"ok":false,"error":kind,"message":..}`` with kind
``partition_not_found``, ``partition_exists``, ``partition_in_use``,
``partition_size`` or ``request``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

from ipu_emulator.daemon._pool import PooledIpu

__all__ = ["Partition", "PartitionTable", "NAME_PATTERN", "PARTITION_OPS"]

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
"""A partition's name: letters, digits, ``.``, ``_``, ``-``; 1..64 characters."""

PARTITION_OPS = ("partition_create", "partition_list", "partition_get", "partition_remove")


def _error(kind: str, message: str) -> dict[str, Any]:
    return {"ok": False, "error": kind, "message": message}


@dataclass(frozen=True)
class Partition:
    name: str
    ipus: tuple[int, ...]
    reconfigurable: bool
    created_by: int


class PartitionTable:
    """The daemon's partitions over its pool ``ipus`` (event loop only)."""

    def __init__(self, ipus: Sequence[PooledIpu]) -> None:
        self._pool = ipus
        self._parts: dict[str, Partition] = {}

    def owner_of(self, ipu: int) -> str | None:
        """The partition ``ipu`` belongs to, if any."""
        for p in self._parts.values():
            if ipu in p.ipus:
                return p.name
        return None

    def describe(self, p: Partition) -> dict[str, Any]:
        held = [self._pool[i] for i in p.ipus if self._pool[i].state != "free"]
        holders = sorted({i.holder for i in held if i.holder is not None})
        return {"name": p.name, "ipus": list(p.ipus), "size": len(p.ipus),
                "reconfigurable": p.reconfigurable, "state": "busy" if held else "free",
                "holders": holders, "created_by": p.created_by}

    def check_attach(self, req: dict[str, Any], indices: list[int]) -> dict[str, Any] | None:
        """The refusal of an attach of ``indices`` (with or without ``req["partition"]``),
        or None when the partitions allow it."""
        name = req.get("partition")
        if name is None:
            taken = {i: self.owner_of(i) for i in indices if self.owner_of(i) is not None}
            if not taken:
                return None
            text = ", ".join(f"ipu {i} is in partition {n!r}" for i, n in sorted(taken.items()))
            return {"ok": False, "error": "busy", "busy": {str(i): None for i in taken},
                    "message": f"ipus {indices} are not all free: {text} (set "
                               "IPUOF_VIPU_API_PARTITION_ID to use a partition)"}
        p = self._parts.get(name) if isinstance(name, str) else None
        if p is None:
            return self._not_found(name)
        outside = [i for i in indices if i not in p.ipus]
        if outside:
            return _error("request", f"ipus {outside} are not in partition {name!r} "
                          f"(its ipus are {list(p.ipus)})")
        return None

    def handle(self, op: str, req: dict[str, Any], pid: int) -> dict[str, Any]:
        """Answer one partition request of the client ``pid``."""
        if op == "partition_list":
            return {"ok": True, "partitions": [self.describe(p) for p in
                                               sorted(self._parts.values(),
                                                      key=lambda p: p.ipus)]}
        name = req.get("name")
        if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
            return _error("request", f"a partition name must be 1..64 letters, digits, '.', "
                          f"'_' or '-' (starting with a letter or digit), got {name!r}")
        if op == "partition_create":
            return self._create(name, req.get("size"), req.get("reconfigurable", False), pid)
        p = self._parts.get(name)
        if p is None:
            return self._not_found(name)
        if op == "partition_get":
            return {"ok": True, "partition": self.describe(p)}
        info = self.describe(p)   # partition_remove
        if info["state"] != "free":
            return _error("partition_in_use", f"partition {name!r} is in use by pid(s) "
                          f"{info['holders']} (ipus {list(p.ipus)}); it can be removed once "
                          "they release it")
        del self._parts[name]
        info["state"] = "removed"
        return {"ok": True, "partition": info}

    def _not_found(self, name: Any) -> dict[str, Any]:
        have = ", ".join(repr(n) for n in sorted(self._parts)) or "none"
        return _error("partition_not_found", f"partition {name!r} not found; this daemon's "
                      f"partitions: {have}")

    def _create(self, name: str, size: Any, reconfigurable: Any, pid: int) -> dict[str, Any]:
        if name in self._parts:
            return _error("partition_exists", f"partition {name!r} already exists (ipus "
                          f"{list(self._parts[name].ipus)}); remove it first")
        n = len(self._pool)
        if (not isinstance(size, int) or isinstance(size, bool) or size < 1
                or size & (size - 1)):
            return _error("partition_size", f"partition size must be a power of 2 (1, 2, 4, "
                          f"...), got {size!r}")
        if not isinstance(reconfigurable, bool):
            return _error("request", f"reconfigurable must be a bool, got {reconfigurable!r}")
        if size > n:
            return _error("partition_size", f"cannot create partition {name!r} of size {size}: "
                          f"the daemon's pool has {n} IPU(s)")
        taken = {i for p in self._parts.values() for i in p.ipus}
        for start in range(0, n - size + 1, size):
            block = tuple(range(start, start + size))
            if taken.isdisjoint(block):
                self._parts[name] = Partition(name, block, reconfigurable, pid)
                return {"ok": True, "partition": self.describe(self._parts[name])}
        return _error("partition_size", f"cannot create partition {name!r} of size {size}: no "
                      f"aligned block of {size} IPU(s) of the {n} is outside the other "
                      f"partitions ({', '.join(sorted(self._parts))})")
