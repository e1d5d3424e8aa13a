"""What a Session is made with: its model, its configuration, the callback types it takes.

Seed 002, 10.2.4: ``SessionConfig`` (with ``LaunchPolicy``), ``CallbackHandle`` (one
transfer of one anchor) and ``CallbackFactory`` (a handler's factory, told about its
anchor by a ``CallbackInfo``); the model, given or read from PopEF files and checked
(``session_model``), and its executable's header.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from host_runtime import popef
from host_runtime.devices import DeviceWaitConfig
from host_runtime.errors import BadRequestError, PopefError
from host_runtime.popef import check_model
from host_runtime.session.predicates import PopefDataUsagePredicate
from host_runtime.settings import HostSettings
from ipu_emulator.executable import ExecutableError, ExecutableHeader, read_header
from shm.settings import is_digits

__all__ = ["LaunchPolicy", "SessionConfig", "CallbackInfo", "CallbackHandle",
           "CallbackFactory", "DROP_STOP_TIMEOUT", "session_model", "executable_header"]

CallbackHandle = Callable[[memoryview], None]
"""Called with one transfer: writable for inputs, read-only (valid during the call) for outputs."""

DROP_STOP_TIMEOUT = 1.0
"""Seconds a dropped session (or runner) waits for its own device to stop before it kills
the device's IPU processes: ``__del__`` must not block for long."""


class LaunchPolicy(enum.Enum):
    """When a session acquires its device (if not given one with bindToDevice)."""

    Deferred = 0
    """On first use (a run, or a fast-path call)."""
    Immediate = 1
    """In the constructor."""


@dataclass
class SessionConfig:
    """Session configuration; defaults as in the seed."""

    policy: LaunchPolicy = LaunchPolicy.Deferred
    pred_tensor_data: PopefDataUsagePredicate | None = None
    check_package_hash: bool = True
    wait_config: DeviceWaitConfig = field(default_factory=DeviceWaitConfig)
    max_look_ahead: str = "unlimited"
    ring_depth: Callable[[popef.Anchor], int] | None = None
    settings: HostSettings | None = None
    """The knobs the session, its rings and the device it attaches use (``ModelRunner``
    passes its own); None: ``host_runtime.settings.current()`` when the session is made."""
    """Internal (ModelRunner, QueueManager users): slots of each anchor's stream ring, e.g. a
    ``host_runtime.queues._queues.ring_size_multiplier_factory`` function. Main anchors are still
    capped at ``max_look_ahead + 1`` when that is a number; every ring at 64 MiB and 1024
    slots. None: 8 slots for Main anchors ("unlimited") or ``max_look_ahead + 1``, 2 for
    load/save-only anchors."""

    def look_ahead(self) -> int | None:
        """``max_look_ahead`` as a number (None for "unlimited"); BadRequestError if invalid."""
        value = self.max_look_ahead
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
        text = str(value).strip()
        if text == "unlimited":
            return None
        if is_digits(text):
            return int(text)
        raise BadRequestError(
            f'max_look_ahead must be "unlimited" or an unsigned integer, got {value!r}')


@dataclass(frozen=True)
class CallbackInfo:
    """What a CallbackFactory is told about the anchor it makes a callback for."""

    anchor: popef.Anchor

    def name(self) -> str:
        return self.anchor.name()

    def handle(self) -> str:
        return self.anchor.handle()

    def tensorInfo(self) -> popef.TensorInfo:
        return self.anchor.tensorInfo()

    def isInput(self) -> bool:
        return self.anchor.type() is popef.TensorType.INPUT


CallbackFactory = Callable[[CallbackInfo], "CallbackHandle | None"]


def session_model(model: popef.Model | str | Sequence[str]) -> popef.Model:
    """The model a Session is made with (a Model, a PopEF path or a list of them),
    checked against the rules of ipu_emulator.validate (once per Model)."""
    if isinstance(model, popef.Model):
        result = model
    elif isinstance(model, (str, os.PathLike)):
        result = popef.load_model([os.fspath(model)])
    elif isinstance(model, (list, tuple)) and model:
        result = popef.load_model([os.fspath(p) for p in model])
    else:
        raise BadRequestError(
            f"Session needs a popef.Model or a list of PopEF paths, got {model!r}")
    check_model(result)
    return result


def executable_header(model: popef.Model, exe: bytes | memoryview) -> ExecutableHeader:
    """The header of ``model``'s executable ``exe``; PopefError naming it if unreadable."""
    try:
        return read_header(exe)
    except ExecutableError as exc:
        raise PopefError(f"executable {model.executable.name()!r}: {exc}") from exc
