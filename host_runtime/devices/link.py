"""The internal interfaces between a device's link and the sessions that use it.

``DeviceLink`` is what a Session (and its fast path, ``session.direct``) may ask of the
link of a device (``Device.link``): requests to the device's IPU process(es), and
whether the device is lost. Two classes implement it:

- :class:`host_runtime.devices._link.ProcessLink`: the control/event rings of one IPU
  process (a one-IPU device);
- :class:`host_runtime.devices._ipu_group.GroupLink`: a device of several IPUs (one
  ``ProcessLink`` per IPU process, one request to all of them once a multi-IPU
  executable is loaded).

``StreamServicer`` is what the link calls, on its service thread, for the NEED / OUT
events of the active session's streams (the session's
:class:`host_runtime.session._streams.StreamTable`).

Internal: not in ``host_runtime.__all__``.
"""

from __future__ import annotations

import concurrent.futures as cf
from typing import Any, Protocol

from host_runtime.errors import DeviceLostError
from ipu_emulator.ipu_protocol import Op

__all__ = ["DeviceLink", "StreamServicer"]


class StreamServicer(Protocol):
    """Services the stream events of the device's active session (on the link's service
    thread: keep it short, it delays every other event of the device)."""

    def on_need(self, index: int) -> None:
        """The device waits on the empty input ring of stream ``index``: fill one slot."""

    def on_out(self, index: int) -> None:
        """The device published a transfer on the output ring of stream ``index``."""


class DeviceLink(Protocol):
    """Requests to, and the liveness of, the IPU process(es) of one device."""

    description: str
    """Names the device in errors ("device 0 (ipu 0)")."""

    def start(self) -> None:
        """Wait until every IPU process is ready; start serving events (idempotent)."""

    def close(self, timeout: float = 1.0) -> None:
        """Stop serving events; fail what is pending (idempotent)."""

    def quiesce(self, timeout: float = 1.0) -> None:
        """End the event service before a daemon's rings go back to the daemon (without
        the answer of a request sent as the last)."""

    def take_first(self) -> "tuple[Op, Any, cf.Future[None]] | None":
        """The request the IPU process was sent before the link was made, if any
        (:mod:`host_runtime.devices._first`): its op, body and answer; once."""

    @property
    def last_unanswered(self) -> bool:
        """The answer of a request sent as the last need not be waited for: a daemon's
        one-IPU device (:meth:`quiesce` ends the event service without it; the daemon's
        reset follows it on the control ring)."""

    def wake(self) -> None:
        """Wake the event service at once (the IPU processes have exited)."""

    @property
    def lost(self) -> DeviceLostError | None:
        """The DeviceLostError once a process of the device died (then for ever)."""

    def check(self) -> DeviceLostError | None:
        """Like ``lost``, but polls the processes first (a waitpid each: ~us)."""

    def mark_lost(self) -> DeviceLostError:
        """Declare the device lost (a ring saw a process die); fail what is pending."""

    @property
    def started(self) -> bool:
        """Whether ``start()`` ran."""

    @property
    def pid(self) -> int:
        """The pid of the device's first IPU process (the peer of its host rings)."""

    def pids(self) -> list[int]:
        """The pids of every IPU process of the device."""

    @property
    def sync_timeout(self) -> float:
        """The host sync timeout (seconds), read when the device was made."""

    @property
    def progress(self) -> float:
        """``time.monotonic()`` of the device's last event (its progress, for the host
        sync timeout)."""

    def set_servicer(self, servicer: StreamServicer | None) -> None:
        """Who services stream events (held weakly: the session owns it)."""

    def request(self, op: Op, body: Any = None, value: int = 0,
                last: bool = False) -> "cf.Future[None]":
        """Send a request; the future resolves on its DONE, fails on ERROR or loss.
        ``last``: no request follows before the device is closed (its answer is the last
        event read)."""

    def call(self, op: Op, body: Any = None, timeout: float | None = None) -> None:
        """``request`` and wait for it (DeviceTimeoutError after ``timeout`` s, or after the
        host sync timeout without an event from the device)."""

    def notify(self, op: Op, body: Any = None) -> None:
        """Send a message that is not answered (MODES)."""
