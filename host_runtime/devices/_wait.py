"""How a :class:`DeviceManager` waits for a device (``DeviceWaitStrategy``,
``DeviceWaitConfig``), what the device must offer (``DeviceConstraints``), and who is
told when an attach starts waiting on another process (:func:`waiting_elsewhere`)."""

from __future__ import annotations

import contextlib
import contextvars
import enum
from datetime import timedelta
from typing import Any, Callable, Iterator

from host_runtime.errors import BadRequestError

__all__ = ["DeviceWaitStrategy", "DeviceWaitConfig", "DeviceConstraints", "when_waiting",
           "waiting_elsewhere"]

_when_waiting: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar(
    "ipu_emulator_when_waiting", default=None)


@contextlib.contextmanager
def when_waiting(callback: Callable[[], None]) -> Iterator[None]:
    """Within the block, ``callback()`` runs (once, in this thread) the first time an
    attach waits on another process (``host_runtime.session._attach``: the session's own
    work runs while the daemon answers or the IPU processes start)."""
    token = _when_waiting.set(callback)
    try:
        yield
    finally:
        _when_waiting.reset(token)


def waiting_elsewhere() -> None:
    """The attach now waits on another process (a daemon's answer, a busy device, IPU
    processes starting): run what :func:`when_waiting` was given, once."""
    callback = _when_waiting.get()
    if callback is not None:
        _when_waiting.set(None)
        callback()


class DeviceWaitStrategy(enum.Enum):
    """How to wait for a device to become available."""

    NO_WAIT = 0
    """Fail at once if no device is free."""
    WAIT_WITH_TIMEOUT = 1
    """Retry every ``sleepTime`` until ``timeout`` has passed."""
    WAIT_FOREVER = 2
    """Retry every ``sleepTime`` until a device is free."""


def _as_timedelta(value: Any, what: str) -> timedelta:
    if isinstance(value, timedelta):
        td = value
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        td = timedelta(seconds=value)
    else:
        raise BadRequestError(f"{what} must be a datetime.timedelta (or seconds), got {value!r}")
    if td < timedelta(0):
        raise BadRequestError(f"{what} must not be negative, got {td}")
    return td


class DeviceWaitConfig:
    """How ``DeviceManager`` waits for a device. Defaults: NO_WAIT, 0 s, 15 s.

    The C++ constructors, spelt positionally or with keywords:

    - ``DeviceWaitConfig()``: NO_WAIT;
    - ``DeviceWaitConfig(strategy, timeout=timedelta(0), sleepTime=timedelta(seconds=15))``
      (``strategy=`` may be a keyword too);
    - ``DeviceWaitConfig(timeout, sleepTime=timedelta(seconds=15))``: WAIT_WITH_TIMEOUT, and so
      is ``DeviceWaitConfig(timeout=..., sleepTime=...)`` without a strategy.

    Durations are ``timedelta`` or seconds. ``sleepTime`` alone (no strategy, no timeout) is
    refused: it would mean NO_WAIT, which never sleeps.
    """

    __slots__ = ("strategy", "timeout", "sleepTime")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        names = ("strategy", "timeout", "sleepTime")
        if set(kwargs) - set(names):
            raise BadRequestError(
                "DeviceWaitConfig takes (strategy, timeout, sleepTime) or (timeout, sleepTime); "
                f"unexpected keyword(s) {sorted(set(kwargs) - set(names))}")
        if args and not isinstance(args[0], DeviceWaitStrategy):
            # DeviceWaitConfig(timeout, sleepTime): the C++ WAIT_WITH_TIMEOUT constructor
            if len(args) > 2 or "strategy" in kwargs or "timeout" in kwargs \
                    or (len(args) == 2 and "sleepTime" in kwargs):
                raise BadRequestError(
                    "DeviceWaitConfig(timeout, sleepTime) takes at most those two arguments, "
                    f"got {args!r} {kwargs!r}")
            if not isinstance(args[0], (timedelta, int, float)) or isinstance(args[0], bool):
                raise BadRequestError(
                    "strategy must be a DeviceWaitStrategy (or the first argument a timeout: "
                    f"timedelta or seconds), got {args[0]!r}")
            values = {"strategy": DeviceWaitStrategy.WAIT_WITH_TIMEOUT, "timeout": args[0]}
            if len(args) == 2:
                values["sleepTime"] = args[1]
        else:
            if len(args) > 3:
                raise BadRequestError(
                    "DeviceWaitConfig(strategy, timeout, sleepTime) takes at most three "
                    f"arguments, got {len(args)}")
            values = dict(zip(names, args))
        for k, v in kwargs.items():
            if k in values:
                raise BadRequestError(f"DeviceWaitConfig got {k} twice")
            values[k] = v
        if "strategy" not in values:
            if "timeout" in values:
                values["strategy"] = DeviceWaitStrategy.WAIT_WITH_TIMEOUT
            elif "sleepTime" in values:
                raise BadRequestError(
                    "DeviceWaitConfig(sleepTime=...) without a strategy or a timeout would mean "
                    "NO_WAIT, which never sleeps; give the strategy (DeviceWaitStrategy."
                    "WAIT_WITH_TIMEOUT or WAIT_FOREVER) or a timeout")
        strategy = values.get("strategy", DeviceWaitStrategy.NO_WAIT)
        if not isinstance(strategy, DeviceWaitStrategy):
            raise BadRequestError(f"strategy must be a DeviceWaitStrategy, got {strategy!r}")
        self.strategy: DeviceWaitStrategy = strategy
        self.timeout: timedelta = _as_timedelta(values.get("timeout", timedelta(0)), "timeout")
        self.sleepTime: timedelta = _as_timedelta(values.get("sleepTime", timedelta(seconds=15)),
                                                  "sleepTime")

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, DeviceWaitConfig) and self.strategy == other.strategy
                and self.timeout == other.timeout and self.sleepTime == other.sleepTime)

    def __repr__(self) -> str:
        return (f"DeviceWaitConfig({self.strategy.name}, timeout={self.timeout!r}, "
                f"sleepTime={self.sleepTime!r})")


class DeviceConstraints:
    """Requirements the device must meet (remote buffers: every emulated IPU has them)."""

    __slots__ = ("requiresRemoteBuffersSupport",)

    def __init__(self, requiresRemoteBuffersSupport: bool = False) -> None:
        self.requiresRemoteBuffersSupport = bool(requiresRemoteBuffersSupport)

    def __bool__(self) -> bool:
        return self.requiresRemoteBuffersSupport

    def __repr__(self) -> str:
        return f"DeviceConstraints(requiresRemoteBuffersSupport={self.requiresRemoteBuffersSupport})"
