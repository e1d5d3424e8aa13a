"""Loopback devices: Devices whose IPUs are served by threads of this process.

Internal (for tests; not in ``host_runtime.__all__``). A loopback device is an
ordinary :class:`~host_runtime.devices.Device` whose IPU connections are
:class:`~ipu_emulator.ipu.in_thread.LoopbackIpu`: the IPU process's loop on a
thread, over the same control, event and stream rings. Session, QueueManager and
ModelRunner (``ModelRunnerConfig(replica_to_device={0: dev})``) run unchanged on
it, without starting any process.

- ``loopback_manager(system=None)``: a ``DeviceManager`` whose every device
  (``getDevice``, ``createIpuModelDevice``, ...) is a loopback one.
- ``loopback_device(model_or_num_ipus=1, ...)``: a private loopback IPU model
  device (no machine lock): for a ``popef.Model``, of its IPU count and version.
- ``loopback_ipus(device)`` / ``is_loopback(device)``: its ``LoopbackIpu``s (whose
  ``kill()`` emulates a SIGKILL of the IPU process).
"""

from __future__ import annotations

from host_runtime.devices._manager import Device, DeviceManager
from host_runtime.popef.model import Model
from ipu_emulator.ipu.in_thread import LoopbackIpu, launch_loopback
from ipu_emulator.system import SystemConfig

__all__ = ["loopback_manager", "loopback_device", "loopback_ipus", "is_loopback", "LoopbackIpu"]


def loopback_manager(system: SystemConfig | None = None) -> DeviceManager:
    """A DeviceManager whose devices' IPUs are threads of this process (never a daemon's)."""
    return DeviceManager(system, launcher=launch_loopback)


def loopback_device(model_or_num_ipus: Model | int = 1, ipu_version: int = 21,
                    tiles_per_ipu: int = 0, system: SystemConfig | None = None) -> Device:
    """A private loopback IPU model device; close it (or use ``with``) when done.

    ``model_or_num_ipus``: a ``popef.Model`` (its IPU count and version) or a number of
    IPUs (of ``ipu_version``); ``tiles_per_ipu`` 0 means the machine's (1472).
    """
    manager = loopback_manager(system)
    if isinstance(model_or_num_ipus, Model):
        return manager.createIpuModelDevice(model_or_num_ipus, tiles_per_ipu=tiles_per_ipu)
    return manager.createIpuModelDevice(model_or_num_ipus, ipu_version=ipu_version,
                                        tiles_per_ipu=tiles_per_ipu)


def loopback_ipus(device: Device) -> list[LoopbackIpu]:
    """The loopback IPUs of ``device`` (primary first; empty if it has other IPUs): e.g.
    ``loopback_ipus(dev)[0].kill()`` to lose the device."""
    procs = device.processes
    ipus = [p for p in procs if isinstance(p, LoopbackIpu)]
    return ipus if len(ipus) == len(procs) else []


def is_loopback(device: Device) -> bool:
    """Whether every IPU of ``device`` is a loopback one."""
    return bool(loopback_ipus(device))
