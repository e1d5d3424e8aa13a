"""The emulated machine of a test run: its folder, its home, its shared-memory tags.

One pytest run (the xdist controller and all its workers, or one plain
process) owns one *run folder*, ``<tmp>/ipuemu-pytest-<uid>-<token>``::

    run folder                 made by the first process that needs it, removed by the
    |                          controller (or the plain process) at the end of the run
    +-- home/                  IPU_EMULATOR_HOME of every worker: one machine, so the
    |   +-- locks/ logs/       workers share (and wait for) its IPUs
    |   +-- daemon.lock        the shared daemon's file lock (see daemon.py)
    |   +-- daemon.json        its pid, socket and the pids of the workers using it
    |   +-- daemon.sock
    +-- popef/<hash>/          compile_onnx's cache

Each process has its own shared-memory tag, ``p<token><worker>``, so that one
worker's leak check never sees another worker's objects; the shared daemon's
tag is ``p<token>d``. The controller hands the folder to its workers through
``workerinput`` (``pytest_configure_node``); a worker without it derives the
folder from xdist's ``testrunuid``, which all workers of a run share.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import stat
import tempfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:  # pragma: no cover
    from host_runtime.devices import DeviceManager
    from ipu_emulator.system import SystemConfig

__all__ = ["IpuMachine", "RunFolder", "shm_entries", "remove_shm_entries", "ENV_VARS"]

# The variables that make a machine; a session sets them and restores them at its end.
ENV_VARS = ("IPU_EMULATOR_HOME", "IPU_EMULATOR_SHM_TAG", "IPU_EMULATOR_NUM_IPUS",
            "IPU_EMULATOR_IPU_VERSION", "IPU_EMULATOR_DAEMON")

_TOKEN_RE = re.compile(r"^[0-9a-f]{6,12}$")


def shm_entries(tag: str) -> set[str]:
    """Our /dev/shm entries (segments and semaphores) of ``tag``."""
    from shm.cleanup import list_objects

    return {o.entry for o in list_objects(tag)}


def remove_shm_entries(entries: set[str]) -> None:
    """Unlink /dev/shm entries (best effort: another process may have removed them)."""
    from shm.naming import SHM_DIR

    for entry in entries:
        try:
            os.unlink(os.path.join(SHM_DIR, entry))
        except OSError:
            pass


class RunFolder:
    """The folder one pytest run's processes share; made on first use (``path()``)."""

    def __init__(self, token: str, base: str | None = None) -> None:
        if not _TOKEN_RE.match(token):
            raise ValueError(f"run token must be 6-12 hex digits, got {token!r}")
        self.token = token
        base = base or tempfile.gettempdir()
        self.location = os.path.join(base, f"ipuemu-pytest-{os.getuid()}-{token}")

    @classmethod
    def new(cls) -> "RunFolder":
        return cls(secrets.token_hex(3))

    @classmethod
    def for_testrun(cls, testrunuid: str) -> "RunFolder":
        """The folder of an xdist run, from the ``testrunuid`` its workers share."""
        digits = "".join(c for c in testrunuid.lower() if c in "0123456789abcdef")[:6]
        return cls(digits.ljust(6, "0"))

    def exists(self) -> bool:
        return os.path.isdir(self.location)

    def path(self, *parts: str) -> str:
        """``location/parts``, making the run folder (mode 0700, ours, not a link) if needed."""
        try:
            os.mkdir(self.location, 0o700)
        except FileExistsError:
            st = os.lstat(self.location)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                raise RuntimeError(f"{self.location} exists but is not a folder of this user; "
                                   "remove it") from None
        return os.path.join(self.location, *parts)

    def remove(self) -> None:
        shutil.rmtree(self.location, ignore_errors=True)

    def shm_tag(self, worker: str) -> str:
        """``p<token><worker>``: ``gw3`` -> ``3``, the controller or a plain run -> ``m``."""
        suffix = worker[2:] if worker.startswith("gw") and worker[2:].isdigit() else "m"
        return f"p{self.token}{suffix}"[:16]

    @property
    def daemon_tag(self) -> str:
        return f"p{self.token}d"


@dataclass(frozen=True)
class IpuMachine:
    """An emulated machine for a test session: what ``ipu_machine`` returns.

    ``home`` and ``shm_tag`` are this process's ``IPU_EMULATOR_HOME`` and
    ``IPU_EMULATOR_SHM_TAG``; ``daemon`` is the socket hosts attach through
    (``IPU_EMULATOR_DAEMON``), or None in embedded mode (IPU processes are this
    process's children).
    """

    home: str
    shm_tag: str
    num_ipus: int
    ipu_version: str
    daemon: str | None = None
    run_folder: RunFolder | None = field(default=None, compare=False, repr=False)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "IpuMachine":
        """The machine the environment describes (as ``DeviceManager()`` would see it)."""
        from ipu_emulator.system import load_system_config
        from shm.naming import current_tag

        from host_runtime.settings import HostSettings

        system = load_system_config(environ)
        # a tag the mapping does not give is this process's
        tag = (HostSettings.read("shm_tag", environ) if environ is not None
               and HostSettings.knob("shm_tag").env in environ else current_tag())
        daemon = HostSettings.read("daemon", environ) or None
        num_ipus, version = system.num_ipus, system.ipu_version
        if daemon:   # the machine is the daemon's pool
            from tools.pytest_plugin.daemon import connect_existing

            _, pool = connect_existing(daemon)
            num_ipus, version = int(pool["num_ipus"]), str(pool["ipu_version"])
        return cls(home=system.home, shm_tag=tag, num_ipus=num_ipus, ipu_version=version,
                   daemon=daemon)

    def environ(self) -> dict[str, str]:
        """The variables that put a process on this machine (for ``subprocess`` env)."""
        env = {"IPU_EMULATOR_HOME": self.home, "IPU_EMULATOR_SHM_TAG": self.shm_tag,
               "IPU_EMULATOR_NUM_IPUS": str(self.num_ipus),
               "IPU_EMULATOR_IPU_VERSION": self.ipu_version}
        if self.daemon:
            env["IPU_EMULATOR_DAEMON"] = self.daemon
        return env

    def system(self) -> "SystemConfig":
        """The machine's ``SystemConfig`` (IPUs, version, tiles, memory, lock folder)."""
        from ipu_emulator.system import load_system_config

        env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
        env.update(self.environ())
        return load_system_config(env)

    def device_manager(self) -> "DeviceManager":
        """A ``DeviceManager`` of this machine (through its daemon, if it has one)."""
        from host_runtime.devices import DeviceManager

        if self.daemon:
            return DeviceManager(daemon=self.daemon)
        return DeviceManager(self.system())

    def shm_objects(self) -> set[str]:
        """This process's (and its IPU processes') objects in /dev/shm."""
        return shm_entries(self.shm_tag)
