"""Names of our shared-memory objects.

Every POSIX shared-memory segment and semaphore this project creates is named

    /ipuemu_<tag>_<pid>_<token>_<kind>

- ``tag``: a namespace, the setting ``shm_tag`` (``IPU_EMULATOR_SHM_TAG``, default
  ``g``; read at each name made, see ``shm.settings``). Test workers set their own
  so that leak probes and cleanup of parallel test processes do not see each
  other's objects. Child processes inherit it.
- ``pid``: the creating process. ``ipu-emulator cleanup`` removes objects whose
  creator is dead.
- ``token``: random, so names cannot be guessed or collide.
- ``kind``: what it is (``region``, ``ring``, ``ctl``, ``evt``, ``mem``...).

Semaphores appear in /dev/shm as ``sem.<name without slash>``.
"""

from __future__ import annotations

import os
import re
import secrets
from typing import NamedTuple

from .settings import ShmSettings

__all__ = ["PREFIX", "current_tag", "new_name", "parse_name", "ParsedName", "SHM_DIR"]

PREFIX = "ipuemu"
SHM_DIR = "/dev/shm"
_NAME_RE = re.compile(
    r"^/?(?:sem\.)?" + PREFIX + r"_(?P<tag>[A-Za-z0-9]{1,16})_(?P<pid>\d+)_(?P<token>[0-9a-f]+)_(?P<kind>[A-Za-z0-9.]+)$")

_KIND_RE = re.compile(r"^[A-Za-z0-9.]{1,24}$")


class ParsedName(NamedTuple):
    tag: str
    pid: int
    token: str
    kind: str


def current_tag() -> str:
    """The tag of names made now (SettingsError, a ValueError, for a bad one)."""
    tag: str = ShmSettings.read("shm_tag")
    return tag


def new_name(kind: str, token: str | None = None) -> str:
    """A fresh object name of this process, with a leading slash."""
    if not _KIND_RE.match(kind):
        raise ValueError(f"kind must be 1-24 letters, digits or dots, got {kind!r}")
    tok = token if token is not None else secrets.token_hex(6)
    return f"/{PREFIX}_{current_tag()}_{os.getpid()}_{tok}_{kind}"


def parse_name(name: str) -> ParsedName | None:
    """Parse a name as found in /dev/shm (or with a leading slash); None if not ours."""
    m = _NAME_RE.match(name)
    if not m:
        return None
    return ParsedName(m["tag"], int(m["pid"]), m["token"], m["kind"])
