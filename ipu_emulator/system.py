"""The emulated machine: its IPUs, their version, tiles and memory, and who holds them.

Like ``/dev/ipu*`` on a real host, the set of emulated IPUs is machine-wide:
every process of the machine (with the same ``IPU_EMULATOR_HOME``) sees the
same IPUs, and attaching one is exclusive across all of them.

Configuration, later sources overriding earlier ones:

1. defaults: 4 IPUs of ``ipu21``, 1472 tiles, 624 KiB per tile;
2. the YAML (or JSON) file named by ``$IPU_EMULATOR_CONFIG``, with keys
   ``num_ipus``, ``ipu_version``, ``tiles_per_ipu``, ``memory_per_tile``,
   ``compute_threads``;
3. environment variables ``IPU_EMULATOR_NUM_IPUS``, ``IPU_EMULATOR_IPU_VERSION``,
   ``IPU_EMULATOR_TILES_PER_IPU``, ``IPU_EMULATOR_MEMORY_PER_TILE``,
   ``IPU_EMULATOR_COMPUTE_THREADS`` (or the same knobs of
   ``ipu_emulator.settings.IpuSettings`` in an ``override`` block).

Every one is read when the machine is asked for (``load_system_config``,
``emulator_home``): they say which machine, and change at run time under tests.

Exclusive attach uses one lock file per IPU in ``<home>/locks`` with
``fcntl.flock``: the kernel drops the lock when its holder dies, so a crashed
host never leaves an IPU taken. The holder writes its pid into the file so
that "busy" errors can say who holds it. Locks belong to the open file
description: a forked child shares them, a second attach in the same process
does not (it conflicts, as it must).

Device ids follow Poplar's numbering: ids ``0..n-1`` are the single IPUs, then
come the aligned pairs, then the aligned groups of four, and so on.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import weakref
from dataclasses import dataclass
from typing import Mapping

from ipu_emulator import safe_files
from ipu_emulator.errors import SystemConfigError, UnsafePathError
from ipu_emulator.settings import IpuSettings
from shm import limits
from shm.errors import echo
from shm.settings import SettingsError, is_digits

_log = logging.getLogger(__name__)

__all__ = [
    "MAX_IPUS",
    "SystemConfig",
    "SystemConfigError",
    "IpuLocks",
    "load_system_config",
    "emulator_home",
    "private_dir",
    "device_groups",
    "IPU_VERSIONS",
]

IPU_VERSIONS: dict[str, int] = {"ipu2": 2, "ipu21": 21}
_DEFAULT_TILES = 1472
_DEFAULT_MEMORY_PER_TILE = 624 * 1024
MAX_IPUS = 64
"""The most IPUs a machine (the daemon's pool, or this host's own) has."""


@dataclass(frozen=True)
class SystemConfig:
    """The emulated machine."""

    num_ipus: int = 4
    ipu_version: str = "ipu21"
    tiles_per_ipu: int = _DEFAULT_TILES
    memory_per_tile: int = _DEFAULT_MEMORY_PER_TILE
    compute_threads: int = 1
    home: str = ""

    def __post_init__(self) -> None:
        if self.ipu_version not in IPU_VERSIONS:
            raise SystemConfigError(
                f"ipu_version must be one of {sorted(IPU_VERSIONS)}, got {echo(self.ipu_version)}")
        for name, lo, hi in (("num_ipus", 0, MAX_IPUS), ("tiles_per_ipu", 1, 1 << 20),
                             ("memory_per_tile", 1, 1 << 32), ("compute_threads", 1, 256)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
                raise SystemConfigError(f"{name} must be an integer in [{lo}, {hi}], got {echo(value)}")

    @property
    def ipu_version_number(self) -> int:
        """2 for ``ipu2``, 21 for ``ipu21`` (what ``ipuHardwareVersion()`` returns)."""
        return IPU_VERSIONS[self.ipu_version]

    @property
    def memory_per_ipu(self) -> int:
        return self.tiles_per_ipu * self.memory_per_tile

    @property
    def lock_dir(self) -> str:
        return os.path.join(self.home, "locks")

    @property
    def log_dir(self) -> str:
        return os.path.join(self.home, "logs")


def _read(name: str, environ: Mapping[str, str] | None) -> object:
    """Knob ``name`` of the machine now (from ``environ`` if given); SystemConfigError."""
    try:
        return IpuSettings.read(name, environ)
    except SettingsError as exc:
        raise SystemConfigError(str(exc)) from None


def emulator_home(environ: Mapping[str, str] | None = None) -> str:
    """``$IPU_EMULATOR_HOME`` (an absolute path: a relative one is refused by its knob;
    empty means unset), else
    ``~/.ipu_emulator`` if usable, else ``/tmp/ipu_emulator-<uid>``. Every folder the
    emulator writes in the home, and the home itself, is checked when it is written
    (``ipu_emulator.safe_files``): a symlink, a folder of another user or one others
    may write is refused with ``UnsafePathError``."""
    home = _read("home", environ)
    if isinstance(home, str) and home:
        return os.path.normpath(home)
    user_home = os.path.expanduser("~")
    if user_home and user_home != "~" and os.access(user_home, os.W_OK):
        return os.path.join(user_home, ".ipu_emulator")
    return private_dir(f"/tmp/ipu_emulator-{os.getuid()}")


def private_dir(path: str) -> str:
    """``path``, a folder only this user can write, created with mode 0700 if missing.

    For a home in a shared folder such as /tmp, where another user could have made
    the name first: a symlink, or a folder owned by another user, is refused
    (``SystemConfigError``, from ``safe_files``' checks); our own folder that others may
    write is made 0700 (on its descriptor).
    """
    for attempt in range(2):
        try:
            os.close(safe_files.open_private_dir(path, what="emulator home"))
            return path
        except UnsafePathError as exc:
            if attempt == 0 and _make_private(path):
                continue
            raise SystemConfigError(f"{exc}; or set IPU_EMULATOR_HOME") from None
        except OSError as exc:
            raise SystemConfigError(f"cannot create the emulator home {echo(path, 200)}: "
                                    f"{exc.strerror or exc}; set IPU_EMULATOR_HOME") from None
    raise AssertionError("unreachable")   # pragma: no cover


def _make_private(path: str) -> bool:
    """Our own folder at ``path`` that others may write made 0700; True if it was."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid() or not st.st_mode & 0o022:
            return False
        _log.warning("the emulator home %s was writable by others (mode %o): made 0700",
                     path, stat.S_IMODE(st.st_mode))
        os.fchmod(fd, 0o700)
        return True
    finally:
        os.close(fd)


def _parse_int(name: str, text: object) -> int:
    if isinstance(text, bool):
        raise SystemConfigError(f"{name} must be an integer, got {echo(text)}")
    if isinstance(text, int):
        return text
    s = str(text).strip()
    units = {"kib": 1024, "k": 1024, "mib": 1024 ** 2, "m": 1024 ** 2}
    low = s.lower()
    for suffix, factor in units.items():
        if low.endswith(suffix) and is_digits(low[: -len(suffix)].strip()):
            return int(low[: -len(suffix)]) * factor
    if is_digits(s[1:] if s[:1] in "+-" else s):
        return int(s)
    raise SystemConfigError(f"{name} must be an integer, got {echo(text)}")


_KEYS = ("num_ipus", "ipu_version", "tiles_per_ipu", "memory_per_tile", "compute_threads")


def load_system_config(environ: Mapping[str, str] | None = None) -> SystemConfig:
    """The machine as configured by ``$IPU_EMULATOR_CONFIG`` and ``IPU_EMULATOR_*`` variables."""
    values: dict[str, object] = {}
    path = _read("config", environ)
    if isinstance(path, str) and path:
        values.update(_read_config_file(path))
    for key in _KEYS:
        value = _read(key, environ)
        if value is not None:
            values[key] = value
    kwargs: dict[str, object] = {}
    for key, value in values.items():
        if key == "ipu_version":
            v = str(value).strip().lower()
            kwargs[key] = {"2": "ipu2", "21": "ipu21"}.get(v, v)
        else:
            kwargs[key] = _parse_int(key, value)
    return SystemConfig(home=emulator_home(environ), **kwargs)  # type: ignore[arg-type]


def _read_config_file(path: str) -> dict[str, object]:
    from ipu_emulator.yaml_config import ConfigYamlError, load_yaml_file  # also reads JSON

    try:
        data = load_yaml_file(path, "IPU_EMULATOR_CONFIG file")
    except ConfigYamlError as exc:
        raise SystemConfigError(str(exc)) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SystemConfigError(
            f"IPU_EMULATOR_CONFIG file {echo(path, 200)} must hold a mapping, got {type(data).__name__}")
    unknown = sorted(set(map(str, data)) - set(_KEYS))
    if unknown:
        raise SystemConfigError(
            f"IPU_EMULATOR_CONFIG file {echo(path, 200)} has unknown keys {echo(unknown, 200)}; expected some of {list(_KEYS)}")
    return {str(k): v for k, v in data.items()}


def device_groups(num_ipus: int) -> list[tuple[int, ...]]:
    """IPU sets by device id: singles, then aligned pairs, fours, ... (Poplar's numbering)."""
    groups: list[tuple[int, ...]] = []
    size = 1
    while size <= num_ipus:
        for start in range(0, num_ipus - size + 1, size):
            groups.append(tuple(range(start, start + size)))
        size *= 2
    return groups


def _lock_path(lock_dir: str, ipu: int) -> str:
    return os.path.join(lock_dir, f"ipu{ipu}.lock")


def _read_holder(dir_fd: int, name: str) -> int | None:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                     dir_fd=dir_fd)
    except OSError:
        return None
    try:
        text = os.read(fd, 32).decode("ascii", "replace").strip()
        return int(text) if is_digits(text) else None
    except OSError:
        return None
    finally:
        os.close(fd)


# Locks held by this process, for the fork hook below.
_held: "weakref.WeakSet[IpuLocks]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """A forked child closes its copies of the parent's lock descriptors at once. A flock
    belongs to the open file, which the copies share: the child must never unlock it (nor
    truncate the holder's pid), and while its copy stayed open the parent's release (a
    close) would not free the IPU."""
    for locks in list(_held):
        locks._forget_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


class IpuLocks:
    """Exclusive hold on a set of IPUs (all or none). ``release()`` is idempotent."""

    def __init__(self, ipus: tuple[int, ...], fds: list[int], lock_dir: str) -> None:
        self.ipus = ipus
        self.lock_dir = lock_dir
        self._fds = fds
        self._pid = os.getpid()
        _held.add(self)

    def _forget_in_child(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            try:
                os.close(fd)   # this process's descriptor: the parent's lock stays
            except OSError:   # pragma: no cover
                pass

    @classmethod
    def try_acquire(cls, lock_dir: str, ipus: tuple[int, ...]) -> "IpuLocks | dict[int, int | None]":
        """The locks, or if any IPU is held: ``{ipu: holder pid or None}`` of the busy ones."""
        fds: list[int] = []
        busy: dict[int, int | None] = {}
        dir_fd = -1
        try:
            # out of descriptors at the second lock file: the first is closed again (its
            # IPU would stay held for the life of this process), and the error is named
            with limits.named_errors(f"opening the lock files of ipus {list(ipus)} in {lock_dir}"):
                # the folder (and the home above it) checked: ours, private, no symlink;
                # each lock file opened O_NOFOLLOW relative to it
                dir_fd = safe_files.open_private_dir(lock_dir, what="lock folder",
                                                     check_parent=True)
                for ipu in ipus:
                    name = os.path.basename(_lock_path(lock_dir, ipu))
                    fd = safe_files.open_in(dir_fd, name, os.O_RDWR | os.O_CREAT, 0o600,
                                            _lock_path(lock_dir, ipu))
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    except OSError as exc:
                        os.close(fd)
                        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                            raise
                        busy[ipu] = _read_holder(dir_fd, name)
                        continue
                    fds.append(fd)
                if not busy:
                    pid = f"{os.getpid()}\n".encode()
                    for fd in fds:
                        os.ftruncate(fd, 0)
                        os.pwrite(fd, pid, 0)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        finally:
            if dir_fd >= 0:
                os.close(dir_fd)
        if busy:
            for fd in fds:  # all or none: closing drops the locks we did get
                os.close(fd)
            return busy
        return cls(ipus, fds, lock_dir)

    def release(self) -> None:
        fds, self._fds = self._fds, []
        mine = os.getpid() == self._pid   # a forked child only drops its copies
        for fd in fds:
            if mine:
                try:
                    os.ftruncate(fd, 0)
                except OSError:
                    pass
            os.close(fd)

    @property
    def held(self) -> bool:
        return bool(self._fds)

    def __enter__(self) -> "IpuLocks":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        try:
            self.release()
        except Exception:
            pass
