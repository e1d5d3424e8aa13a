"""A RUN request of a session and its outcome.

The session asks its device to run programs (``Op.RUN``) and waits: a program
that fails because a callback of this session raised is reported as that
callback's failure (``callback_failure``), with the callback's exception as its
cause. A caller an exception (KeyboardInterrupt, a signal handler's) takes away
while it waits *abandons* the run: it goes on on the device, its callbacks are
called as for any run, and the next run waits for it first (:meth:`Runs.settle`),
so that its callbacks' errors are not taken for the next one's.
"""

from __future__ import annotations

import logging
from typing import Any

from host_runtime.devices import Device, wait
from host_runtime.errors import DeviceExecutionError, ModelRuntimeError
from host_runtime.session._streams import StreamTable, callback_failure
from ipu_emulator.ipu_protocol import Op

__all__ = ["Runs"]

_log = logging.getLogger("host_runtime.session._session")


class Runs:
    """The RUN requests of one session (see the module docstring)."""

    __slots__ = ("_streams", "_abandoned")

    def __init__(self, streams: StreamTable) -> None:
        self._streams = streams
        # a run whose caller an exception (KeyboardInterrupt, a signal handler's) took away
        # while it waited: it goes on on the device; the next run waits for it first
        self._abandoned: tuple[Any, str] | None = None

    def settle(self, dev: Device) -> None:
        """Before a run: wait for the one a caller abandoned, if any."""
        if self._abandoned is not None:
            self._finish_abandoned(dev)

    def request(self, dev: Device, progs: list[int], what: str) -> None:
        """RUN ``progs`` on ``dev`` and wait for them (``what``: how errors name them)."""
        self._streams.clear_callback_errors()
        fut = dev.link.request(Op.RUN, list(progs))
        try:
            wait(fut, None, f"{what} on {dev.describe()}", pids=dev.pids(),
                 progress=lambda: dev.link.progress,
                 sync=dev.link.sync_timeout)
        except ModelRuntimeError as exc:
            if not isinstance(exc, DeviceExecutionError):
                raise
            new = self._streams.with_callback_error(exc, what)
            if new is exc:
                raise
            raise new from new.__cause__
        except BaseException:
            # Abandoned (KeyboardInterrupt, a signal handler's exception): the run goes on
            # on the device, its callbacks are called as for any run; the next run waits
            # for it, so that its callbacks' errors are not taken for the next one's.
            self._abandoned = (fut, what)
            raise
        failed = self._streams.take_callback_error()
        if failed is not None:
            raise callback_failure(what, *failed)

    def _finish_abandoned(self, dev: Device) -> None:
        """Wait for the run a caller abandoned (see request); its outcome, which nobody
        waits for any more, is logged (an interrupt of this wait leaves it to the next)."""
        assert self._abandoned is not None
        fut, what = self._abandoned
        try:
            wait(fut, None, f"{what} (abandoned) on {dev.describe()}", pids=dev.pids(),
                 progress=lambda: dev.link.progress, sync=dev.link.sync_timeout)
        except ModelRuntimeError as exc:
            self._abandoned = None
            if not isinstance(exc, DeviceExecutionError):
                raise
            _log.info("an abandoned run of %s failed: %s", what, exc)
        self._abandoned = None
        failed = self._streams.take_callback_error()
        if failed is not None:
            _log.info("an abandoned run of %s: the callback of anchor %r raised %r", what,
                      *failed)
