"""A host process inside a V-IPU partition (``IPUOF_VIPU_API_PARTITION_ID`` or an IPUoF
config file; ``docs/vipu.md``): which devices it may ask for, and its named errors.

Inside a partition of N IPUs, Poplar numbers the IPUs 0..N-1 and derives the
device ids from them (singles, then aligned pairs, fours, ...: the same
``device_groups`` as the whole machine). A partition that is not reconfigurable
is one device of all N IPUs; a reconfigurable one offers every device of its IPUs.
"""

from __future__ import annotations

from typing import Any, TypeVar

from host_runtime.devices._daemon_client import DaemonAttachment
from host_runtime.errors import BadRequestError, PartitionBusyError, PartitionTooSmallError
from ipu_emulator.errors import VipuError
from ipu_emulator.system import SystemConfig, device_groups
from ipu_emulator.vipu import PartitionRef, device_ids, partition_from_env, partitioned_ipus

__all__ = ["given_partition", "candidates", "check_device", "too_few", "busy", "cut",
           "kept_for_jobs"]

_Hold = TypeVar("_Hold")


def given_partition() -> PartitionRef | None:
    """The partition this process was given (environment, IPUoF config), or None."""
    try:
        return partition_from_env()
    except VipuError as exc:
        raise BadRequestError(str(exc)) from None


def candidates(name: str, size: int, reconfigurable: bool, num_ipus: int
               ) -> list[tuple[int, tuple[int, ...]]]:
    """The devices of ``num_ipus`` IPUs the partition offers (device id, IPUs), or
    PartitionTooSmallError naming the partition, its size and the request."""
    allowed = device_ids(size, reconfigurable)
    groups = device_groups(size)
    found = [(d, groups[d]) for d in allowed if len(groups[d]) == num_ipus]
    if found:
        return found
    if num_ipus > size:
        raise PartitionTooSmallError(
            f"V-IPU partition {name!r} has {size} IPU(s); asked for a device of {num_ipus} "
            f"IPU(s): create a partition of --size {num_ipus} or more", partition=name)
    raise PartitionTooSmallError(
        f"V-IPU partition {name!r} is not reconfigurable: it is one device of {size} IPUs; "
        f"asked for a device of {num_ipus} IPU(s): create it with --reconfigurable to use its "
        "IPUs as smaller devices", partition=name)


def check_device(name: str, size: int, reconfigurable: bool, device_id: int) -> None:
    """``getSpecificDevice(device_id)``: the partition must offer that device."""
    allowed = device_ids(size, reconfigurable)
    if device_id not in allowed:
        raise PartitionTooSmallError(
            f"V-IPU partition {name!r} ({size} IPU(s), "
            f"{'reconfigurable' if reconfigurable else 'not reconfigurable'}) offers device "
            f"id(s) {allowed}; asked for device {device_id}", partition=name)


def too_few(name: str, size: int, count: int, num_ipus: int) -> PartitionTooSmallError:
    """``count`` devices of ``num_ipus`` IPUs do not fit the partition."""
    return PartitionTooSmallError(
        f"V-IPU partition {name!r} has {size} IPU(s); asked for {count} devices of {num_ipus} "
        f"IPU(s) ({count * num_ipus} IPUs)", partition=name)


def busy(name: str, what: str, detail: str) -> PartitionBusyError:
    """The partition's IPUs are held by another process."""
    return PartitionBusyError(f"V-IPU partition {name!r} is in use: asked for {what}; "
                              f"{detail}", partition=name)


def cut(held: list[tuple[int, tuple[int, ...], _Hold]], n: int
        ) -> list[tuple[int, tuple[int, ...], _Hold]]:
    """The one device reserved in ``held`` (a partition that is one device, attached whole
    as Poplar attaches a replicated graph to it) as devices of ``n`` IPUs each, numbered
    as Poplar numbers them; they share its hold: the IPUs go back at the last one's close."""
    ((_, ipus, hold),) = held
    assert isinstance(hold, DaemonAttachment)
    groups = device_groups(len(ipus))
    parts = [ipus[k:k + n] for k in range(0, len(ipus), n)]
    hold.share(len(parts))
    return [(groups.index(part), part, hold) for part in parts]


def kept_for_jobs(system: SystemConfig, ipus: Any, found: dict[int, str]
                  ) -> dict[int, int | None]:
    """The IPUs of ``ipus`` that a daemon on ``system``'s home keeps in partitions, as busy
    ones (holder unknown; their partitions added to ``found``): a host starting its own
    IPU processes leaves them to the partitions' jobs."""
    parts = partitioned_ipus(system.home, system.num_ipus)
    taken = {i: parts[i] for i in ipus if i in parts}
    found.update(taken)
    return dict.fromkeys(taken)

