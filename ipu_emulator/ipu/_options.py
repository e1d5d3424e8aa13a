"""What an IPU process is (``DeviceOptions``: its rings, host and shape) and what it
assumes about the OS process it runs in (``ProcessHooks``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

__all__ = ["IpuShape", "DeviceOptions", "ProcessHooks"]


@dataclass(frozen=True, kw_only=True)
class IpuShape:
    """The IPU an IPU process emulates: its version and memory, and how many IPUs the
    device it runs programs for has (the launcher's ``IpuSpec`` and the process's
    ``DeviceOptions`` both carry it)."""

    ipu_version: int = 21
    tiles_per_ipu: int = 1472
    memory_per_tile: int = 624 * 1024
    num_ipus: int = 1

    @property
    def capacity(self) -> int:
        """The device's memory: ``num_ipus * tiles_per_ipu * memory_per_tile`` bytes."""
        return self.num_ipus * self.tiles_per_ipu * self.memory_per_tile


@dataclass(frozen=True)
class DeviceOptions(IpuShape):
    control: str
    events: str
    host_pid: int
    ipu_id: int = 0
    threads: int = 1
    label: str = ""
    pool: bool = False

    def describe(self) -> str:
        return self.label or (f"ipu {self.ipu_id}" if self.ipu_id >= 0 else "IPU model")


@dataclass(frozen=True)
class ProcessHooks:
    """What :class:`DeviceProcess` assumes about the OS process it runs in.

    The defaults are those of an IPU process of its own (``main()``). A loopback device
    runs the loop on a thread of the host itself and replaces each of them.
    """

    pid: int | None = None
    """The pid READY reports (None: ``os.getpid()``)."""
    host_alive: Callable[[], bool] | None = None
    """Whether the host still lives, asked at most every ``HOST_CHECK`` s; False ends
    ``serve()`` as when the host died. None: a thread watches the host's pidfd (or, where
    it cannot, ``getppid()`` when the host is the parent, else a pid check of
    ``DeviceOptions.host_pid``; see ``_host_watch``)."""
    keep_apart: bool = True
    """Narrow this thread's CPU affinity off the host's CPU while serving (``_placement``)."""
    unlink_on_host_gone: bool = True
    """When the host is gone, unlink every shared-memory object it (and this process)
    created; else only close this side's mappings."""
    title: bool = False
    """Set the process title (what ps and top show) to name this IPU and its host:
    ``ipu-emulator: ipu 3 (host 1234)``. Only ``main()`` does: the title is the whole
    process's, never a host's."""
