"""PopRT's ``DeviceManager`` and ``Device``: snake_case wrappers of model_runtime's.

``DeviceManager().get_device(num_ipus)`` attaches a device of the emulated machine
(waiting as PopRT's default ``DeviceWaitConfig``: up to 1 s); ``ipu_hardware_version()``
is a string, ``"ipu21"`` (C600) or ``"ipu2"`` (M2000, Bow). A ``Device`` keeps its IPUs
until ``close()`` or until it is dropped; ``device()`` is the model_runtime ``Device``.
``ReplicaIdToDevice`` maps replica ids to devices for ``LightRunnerConfig``.
"""

from __future__ import annotations

from typing import Any, Optional


from host_runtime import devices as _mr
from host_runtime.errors import BadRequestError

from host_runtime.poprt.runtime._config import DeviceWaitConfig

__all__ = ["Device", "DeviceManager", "ReplicaIdToDevice"]


class Device:
    """An attached device (PopRT's ``Device``, over a model_runtime ``Device``)."""

    def __init__(self, device: _mr.Device) -> None:
        if not isinstance(device, _mr.Device):
            raise BadRequestError(f"Device wraps a model_runtime Device, got {device!r}")
        self._device = device

    def device(self) -> _mr.Device:
        """The model_runtime ``Device`` (what a model_runtime ``ModelRunnerConfig`` takes)."""
        return self._device

    def ipu_version(self) -> str:
        return f"ipu{self._device.ipuVersion()}"

    ipuVersion = ipu_version

    @property
    def id(self) -> int:
        return self._device.id

    def num_ipus(self) -> int:
        return self._device.numIpus()

    def is_attached(self) -> bool:
        return self._device.isAttached()

    def close(self) -> None:
        """Release the IPUs (idempotent); a runner using the device must be stopped first."""
        self._device.close()

    def __repr__(self) -> str:
        return f"poprt.runtime.Device({self._device.describe()})"


class ReplicaIdToDevice(dict):  # type: ignore[type-arg]
    """``{replica_id: Device}`` (PopRT's ``ReplicaIdToDevice``)."""

    def __setitem__(self, replica_id: int, device: Any) -> None:
        if isinstance(replica_id, bool) or not isinstance(replica_id, int) or replica_id < 0:
            raise BadRequestError(f"ReplicaIdToDevice: a replica id is an int >= 0, "
                                  f"got {replica_id!r}")
        if not isinstance(device, (Device, _mr.Device)):
            raise BadRequestError(f"ReplicaIdToDevice[{replica_id}]: expected a Device, "
                                  f"got {type(device).__name__}")
        dict.__setitem__(self, replica_id, device)


def model_runtime_devices(mapping: dict[int, Any]) -> dict[int, _mr.Device]:
    """A ``replica_to_device`` of PopRT devices (or model_runtime ones) as the engine takes it."""
    out: dict[int, _mr.Device] = {}
    for rid, dev in mapping.items():
        if isinstance(dev, Device):
            dev = dev.device()
        if not isinstance(dev, _mr.Device):
            raise BadRequestError(f"replica_to_device[{rid}]: expected a Device, "
                                  f"got {type(dev).__name__}")
        out[rid] = dev
    return out


class DeviceManager:
    """Finds and attaches devices of the emulated machine (PopRT's ``DeviceManager``)."""

    def __init__(self) -> None:
        self._manager = _mr.DeviceManager()

    def get_device(self, num_ipus: int, wait_config: Optional[DeviceWaitConfig] = None
                   ) -> Device:
        """A device of ``num_ipus`` IPUs (DeviceUnavailableError when none is free)."""
        return Device(self._manager.getDevice(
            num_ipus, wait_config=wait_config if wait_config is not None else DeviceWaitConfig()))

    def get_num_devices(self) -> int:
        """How many devices the machine has (single IPUs and their groups); inside a V-IPU
        partition, how many it offers (one, of all its IPUs, unless reconfigurable)."""
        return len(self._manager.device_ids)

    def get_specific_device(self, device_id: int,
                            wait_config: Optional[DeviceWaitConfig] = None) -> Device:
        """Device ``device_id`` (DeviceUnavailableError when it is attached elsewhere)."""
        return Device(self._manager.getSpecificDevice(
            device_id, wait_config=wait_config if wait_config is not None else DeviceWaitConfig()))

    def ipu_hardware_version(self) -> str:
        """``"ipu21"`` (C600 cards) or ``"ipu2"`` (M2000, Bow); ``""`` without IPUs."""
        v = self._manager.ipuHardwareVersion()
        return f"ipu{v}" if v else ""
