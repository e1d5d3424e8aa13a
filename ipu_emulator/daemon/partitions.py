"""V-IPU partitions held by the daemon (``ipu-emulator vipu``; ``docs/vipu.md``).

A partition is a named set of the pool's IPUs, made by ``vipu create partition
NAME --size N``: N a power of two (as V-IPU requires), the IPUs an aligned block
of the pool no other partition has (so the partition's IPUs are one of the
pool's multi-IPU devices, as a real partition is one IPU-Link domain). The daemon
keeps its partitions in its home (``partitions.json``, rewritten whole at each
change, private to its user), as a V-IPU controller keeps them: they outlive the
client that made them and the daemon itself; a daemon started on that home takes
them back, less any that no longer fits its pool (a smaller ``--num-ipus``: logged).

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

import json
import logging
import os
import re
from dataclasses import dataclass
from typing import Any, Sequence

from ipu_emulator.daemon._pool import PooledIpu
from ipu_emulator.safe_files import UnsafePathError, open_private_file, write_atomic

__all__ = ["Partition", "PartitionTable", "NAME_PATTERN", "PARTITION_OPS", "read_kept"]

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
"""A partition's name: letters, digits, ``.``, ``_``, ``-``; 1..64 characters."""

PARTITION_OPS = ("partition_create", "partition_list", "partition_get", "partition_remove")

FILE_NAME = "partitions.json"
"""The file in the daemon's home that keeps its partitions."""

_log = logging.getLogger("ipu_emulator.daemon.server")


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

    def __init__(self, ipus: Sequence[PooledIpu], path: str | None = None) -> None:
        self._pool = ipus
        self._parts: dict[str, Partition] = {}
        self._path = path   # where they are kept (None: in memory only)
        if path is not None:
            for p in read_kept(path, len(ipus)):
                self._parts[p.name] = p

    def _save(self) -> None:
        if self._path is None:
            return
        doc = {"version": 1, "partitions": [
            {"name": p.name, "ipus": list(p.ipus), "reconfigurable": p.reconfigurable,
             "created_by": p.created_by} for p in sorted(self._parts.values(),
                                                         key=lambda p: p.ipus)]}
        write_atomic(self._path, (json.dumps(doc, indent=1) + "\n").encode(), mode=0o600)

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
        if "partition_ipus" in req and req["partition_ipus"] != list(p.ipus):
            # the host read another partition of that name (removed and made again since)
            return {"ok": False, "error": "partition_changed", "partition": self.describe(p),
                    "message": f"partition {name!r} is now ipus {list(p.ipus)}, not "
                               f"{req['partition_ipus']!r:.80}"}
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
        self._save()
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
        blocks = [tuple(range(start, start + size)) for start in range(0, n - size + 1, size)]
        outside = [b for b in blocks if taken.isdisjoint(b)]
        # unused IPUs, as V-IPU allocates: none a job outside the partitions holds now
        unused = [b for b in outside if not any(self._in_use(i) for i in b)]
        if unused:
            block = unused[0]
            self._parts[name] = Partition(name, block, reconfigurable, pid)
            try:
                self._save()
            except OSError as exc:   # not kept: not made
                del self._parts[name]
                return _error("failed", f"cannot keep partition {name!r} in "
                              f"{self._path}: {exc}")
            return {"ok": True, "partition": self.describe(self._parts[name])}
        others = f" ({', '.join(sorted(self._parts))})" if self._parts else ""
        if outside:
            held = sorted({i for b in outside for i in b if self._in_use(i)})
            text = ", ".join(f"ipu {i} by pid {self._pool[i].holder}" for i in held)
            return _error("partition_size", f"cannot create partition {name!r} of size "
                          f"{size}: every aligned block of {size} IPU(s) outside the other "
                          f"partitions{others} has IPUs in use by jobs outside any partition "
                          f"({text}); retry once they release them")
        return _error("partition_size", f"cannot create partition {name!r} of size {size}: no "
                      f"aligned block of {size} IPU(s) of the {n} is outside the other "
                      f"partitions{others}")

    def _in_use(self, ipu: int) -> bool:
        """``ipu`` is held by a host (or being attached to one) now."""
        return self._pool[ipu].state in ("attaching", "held")


def read_kept(path: str, pool: int) -> list[Partition]:
    """The partitions kept at ``path`` that fit a pool of ``pool`` IPUs (none if there is
    no file); what cannot be taken back is logged and left out."""
    try:
        fd = open_private_file(path, os.O_RDONLY, what="daemon home")
    except FileNotFoundError:
        return []
    except (OSError, UnsafePathError) as exc:
        _log.warning("cannot read the partitions kept in %s (%s): starting with none", path,
                     exc)
        return []
    try:
        with os.fdopen(fd, "rb") as f:
            doc = json.loads(f.read(1 << 20))
        entries = doc["partitions"] if doc.get("version") == 1 else None
        if not isinstance(entries, list):
            raise ValueError(f"expected version 1 and a list of partitions, got "
                             f"{str(doc)[:100]}")
    except (OSError, ValueError, KeyError, AttributeError, TypeError) as exc:
        _log.warning("the partitions file %s is unreadable (%s): starting with none", path,
                     exc)
        return []
    kept: list[Partition] = []
    taken: set[int] = set()
    for e in entries:
        p = _entry(e)
        n = len(p.ipus) if p is not None else 0
        if (p is None or n & (n - 1) or p.ipus[0] % n
                or p.ipus != tuple(range(p.ipus[0], p.ipus[0] + n)) or p.ipus[-1] >= pool
                or not taken.isdisjoint(p.ipus) or any(k.name == p.name for k in kept)):
            _log.warning("partition %.200r of %s left out: not an aligned block of a power "
                         "of two of this pool's %d IPUs outside the others", e, path, pool)
            continue
        taken.update(p.ipus)
        kept.append(p)
    return kept


def _entry(e: Any) -> Partition | None:
    if not isinstance(e, dict):
        return None
    name, ipus = e.get("name"), e.get("ipus")
    reconf, by = e.get("reconfigurable", False), e.get("created_by", 0)
    if (not isinstance(name, str) or not NAME_PATTERN.fullmatch(name)
            or not isinstance(ipus, list) or not ipus
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ipus)
            or not isinstance(reconf, bool) or not isinstance(by, int)):
        return None
    return Partition(name, tuple(ipus), reconf, by)
