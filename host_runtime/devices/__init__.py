"""Devices: the IPUs a host attaches (DeviceManager, Device, wait strategies) and the links to their IPU processes (embedded or through the daemon)."""

from __future__ import annotations

from host_runtime.devices._manager import Device, DeviceConstraints, DeviceManager, DeviceWaitConfig, DeviceWaitStrategy

__all__ = ["Device", "DeviceConstraints", "DeviceManager", "DeviceWaitConfig", "DeviceWaitStrategy"]
