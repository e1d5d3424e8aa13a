"""Remove shared-memory objects whose creating process is dead.

Every object of ours is named ``ipuemu_<tag>_<pid>_<token>_<kind>`` (in
/dev/shm; named semaphores, which older versions made, as ``sem.ipuemu_...``), so the
creator of each is known.
A process killed by a signal leaves its objects behind; this module finds
them and removes them. Objects of live processes are never touched.
"""

from __future__ import annotations

import logging
import os
from typing import NamedTuple

from . import _registry, naming
from ._packed import segment_of
from .liveness import pid_alive

__all__ = ["ShmObject", "list_objects", "remove_dead", "unlink_named", "unlink_created_by"]

_log = logging.getLogger(__name__)


class ShmObject(NamedTuple):
    entry: str      # the file name in /dev/shm
    name: str       # the POSIX name (leading slash, no "sem.")
    is_semaphore: bool
    tag: str
    pid: int
    kind: str


def list_objects(tag: str | None = None, all_tags: bool = False,
                 shm_dir: str = naming.SHM_DIR) -> list[ShmObject]:
    """Our objects in /dev/shm: of ``tag`` (default: the current tag), or of every tag."""
    want = None if all_tags else (tag if tag is not None else naming.current_tag())
    try:
        entries = sorted(os.listdir(shm_dir))
    except FileNotFoundError:
        return []
    found = []
    for entry in entries:
        parsed = naming.parse_name(entry)
        if parsed is None or (want is not None and parsed.tag != want):
            continue
        is_sem = entry.startswith("sem.")
        posix_name = "/" + (entry[4:] if is_sem else entry)
        found.append(ShmObject(entry, posix_name, is_sem, parsed.tag, parsed.pid, parsed.kind))
    return found


def remove_dead(tag: str | None = None, *, all_tags: bool = False,
                dry_run: bool = False) -> list[str]:
    """Unlink our objects whose creator is dead; return their /dev/shm entry names.

    ``tag`` None means the current tag (``IPU_EMULATOR_SHM_TAG``);
    ``all_tags`` covers every tag. With ``dry_run`` nothing is removed and
    the names that would be are returned.
    """
    removed = []
    alive: dict[int, bool] = {}
    for obj in list_objects(tag, all_tags):
        if obj.pid not in alive:
            alive[obj.pid] = pid_alive(obj.pid)
        if alive[obj.pid]:
            continue
        if dry_run:
            removed.append(obj.entry)
            continue
        try:
            if _registry.unlink_name(obj.name, "sem" if obj.is_semaphore else "shm"):
                removed.append(obj.entry)
        except OSError as exc:
            _log.warning("could not remove %s: %s", obj.entry, exc)
    if removed and not dry_run:
        _log.info("removed %d shared-memory objects of dead processes", len(removed))
    return removed


def _unlink(name: str, is_semaphore: bool) -> int:
    try:
        return int(_registry.unlink_name(name, "sem" if is_semaphore else "shm"))
    except OSError:
        return 0


def unlink_named(name: str) -> int:
    """Unlink the region or ring named ``name`` (one segment: a ring's semaphores are
    inside it; a packed ring's, its whole segment) if it exists; the number of objects
    removed (0 or 1)."""
    return _unlink(segment_of(name)[0], False)


def unlink_created_by(pids: tuple[int, ...], *, all_tags: bool = False) -> int:
    """Unlink every object of the current tag (or of every tag) created by one of
    ``pids``; the number removed."""
    return sum(_unlink(obj.name, obj.is_semaphore)
               for obj in list_objects(all_tags=all_tags) if obj.pid in pids)
