"""Devices: the IPUs a host attaches (DeviceManager, Device, wait strategies) and the links to their IPU processes (embedded or through the daemon)."""

from __future__ import annotations

from host_runtime.devices._device import Device
from host_runtime.devices._manager import DeviceManager
from host_runtime.devices._wait import DeviceConstraints, DeviceWaitConfig, DeviceWaitStrategy
from host_runtime.devices._wait import when_waiting as when_waiting, waiting_elsewhere as waiting_elsewhere

# for the other packages of host_runtime (not part of the public surface)
from host_runtime.devices._manager import ActiveSession as ActiveSession
from host_runtime.devices._ipu_group import ShardedLoad as ShardedLoad, paced_by_requests as paced_by_requests, main_reads as main_reads, paced as paced
from host_runtime.devices._link import Answer as Answer, wait as wait
from host_runtime.devices._first import FirstRequest as FirstRequest, first_request as first_request
from host_runtime.devices._shm_space import check_room as check_room, filled_region as filled_region, free_bytes as free_bytes, load_spec_region as load_spec_region, ring_bytes as ring_bytes, translated as translated

from ipu_emulator import trace as _trace

# IPU_EMULATOR_TRACE=FILE: record a timeline of this program (docs/tracing.md), from its
# first use of the runtime (every runner, session and device imports this package)
_trace.start_from_settings()

__all__ = ["Device", "DeviceConstraints", "DeviceManager", "DeviceWaitConfig", "DeviceWaitStrategy"]
