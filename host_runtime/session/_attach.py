"""Attaching a session's device while the session makes its rings.

Attaching waits on another process (a daemon's answer, IPU processes starting) for
most of its time; making the rings and regions a session loads with is this
process's own work and needs no device. :func:`attach_meanwhile` does the work while
the attach waits: the attach tells when it starts waiting on another process
(``host_runtime.devices.waiting_elsewhere``: its request to the daemon sent, or the
IPU processes launched) and the work runs there, in the same thread; an attach that
never waits elsewhere has the work run after it. One thread: the work never
contends with the attach for the interpreter, and runs in the caller's context.

:func:`attach_loading` is that for a session's loader: the work makes its rings and
regions and its LOAD's spec, and that LOAD, ready before the device is, is sent as
the device's first request (:mod:`host_runtime.devices._first`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from host_runtime.devices import Device, FirstRequest, first_request, when_waiting
from ipu_emulator.ipu_protocol import Op

if TYPE_CHECKING:  # pragma: no cover
    from host_runtime.session._loading import Loader

__all__ = ["attach_meanwhile", "attach_loading"]


class _Work:
    """The work, run once; its error kept for after the attach."""

    def __init__(self, work: Callable[[], None]) -> None:
        self._work: Callable[[], None] | None = work
        self.error: BaseException | None = None

    def run(self) -> None:
        work, self._work = self._work, None
        if work is None:
            return
        try:
            work()
        except BaseException as exc:   # raised once the attach is over (the device closed)
            self.error = exc


def attach_meanwhile(attach: Callable[[], Device], work: Callable[[], None]) -> Device:
    """``attach()``, running ``work()`` while it waits on another process (else after it);
    the device attached.

    If ``work`` raises, the attached device is closed and that error raised (also when
    the attach failed too); else ``attach``'s error is raised (the work is not done if
    the attach failed before it waited anywhere)."""
    done = _Work(work)
    try:
        with when_waiting(done.run):
            dev = attach()
    except BaseException:
        _raise_work_error(done)   # (an attach that failed before waiting: no work done)
        raise
    done.run()
    if done.error is not None:
        dev.close()   # nothing of it outlives the error
        _raise_work_error(done)
    return dev


def _raise_work_error(done: _Work) -> None:
    error, done.error = done.error, None
    if error is not None:
        try:
            raise error
        finally:
            del error   # no cycle: the traceback holds this frame


def attach_loading(attach: Callable[[], Device], loader: "Loader") -> Device:
    """:func:`attach_meanwhile` with ``loader``'s rings and regions made meanwhile; its
    LOAD, if ready by the time the device's control ring is open, is sent first."""
    first = FirstRequest()

    def work() -> None:
        loader.ensure_resources(None)
        body = loader.first_load()
        if body is not None:
            first.ready(Op.LOAD, body)
    with first_request(first):
        return attach_meanwhile(attach, work)
