"""A RUN request of a session and its outcome.

Before a RUN the device gets the session's constant inputs and stream modes as they
are now (:class:`host_runtime.session._loading.Loader`); Main, on a binding whose load
programs have not run since its LOAD, runs them first (:meth:`Runs.prime`).
The session asks its device to run programs (``Op.RUN``) and waits: a program
that fails because a callback of this session raised is reported as that
callback's failure (``callback_failure``), with the callback's exception as its
cause. A caller an exception (KeyboardInterrupt, a signal handler's) takes away
while it waits *abandons* the run: it goes on on the device, its callbacks are
called as for any run, and the next run waits for it first,
so that its callbacks' errors are not taken for the next one's.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from host_runtime.devices import Device, wait
from host_runtime.errors import DeviceExecutionError, InvalidStateError, ModelRuntimeError
from host_runtime.session._binding import Binding
from host_runtime.session._loading import Loader
from host_runtime.session._state import Phase, PhaseEvent
from host_runtime.session._streams import StreamTable
from ipu_emulator.ipu_protocol import Op

__all__ = ["Runs"]

_log = logging.getLogger("host_runtime.session._session")


class Runs:
    """The RUN requests of one session (see the module docstring)."""

    __slots__ = ("_streams", "_loader", "_abandoned", "_ahead")

    def __init__(self, streams: StreamTable, loader: Loader) -> None:
        self._streams = streams
        self._loader = loader
        # load programs sent ahead of Main's loop (prepare_main), and their binding: waited
        # for by finish_main
        self._ahead: tuple[Any, Binding] | None = None
        # a run whose caller an exception (KeyboardInterrupt, a signal handler's) took away
        # while it waited: it goes on on the device; the next run waits for it first
        self._abandoned: tuple[Any, str] | None = None

    def prime(self, dev: Device, binding: Binding, ahead: bool = False) -> None:
        """Before Main: run the load programs if they have not run since the LOAD.
        ``ahead``: where no callback of this session can run in them or in Main, send them
        and go on (:meth:`finish_main` waits for them)."""
        if self._ahead is not None:   # sent ahead of a loop that did not start: wait now
            self.finish_main(dev)
        if binding.phase is Phase.LOADED:
            flow = self._streams.flow
            progs = flow.load()
            if ahead and progs and not self._streams.serviced(list(progs) + list(flow.main())):
                self._streams.check_connected(progs)
                self._ahead = (self._start(dev, binding, progs), binding)
                return
            self.run(dev, binding, progs, "load programs")
            binding.move(PhaseEvent.LOAD_PROGRAMS_RAN)

    def prepare_main(self, dev: Device, binding: Binding) -> list[int]:
        """Before the main loop: the load programs if they have not run since the LOAD
        (sent ahead of the loop where they can be, see :meth:`prime`), the Main anchors
        checked connected, the constants and modes sent; the Main programs."""
        main = self._streams.flow.main()
        if not main:
            raise InvalidStateError("the model has no main programs")
        self.prime(dev, binding, ahead=True)
        self._streams.check_connected(main)
        self._loader.sync_constants(dev, binding, main)
        self._loader.send_modes(dev, binding)
        return list(main)

    def run(self, dev: Device, binding: Binding, progs: list[int], what: str) -> None:
        """Run ``progs`` (none: nothing), their anchors checked connected first."""
        if not progs:
            return
        self._streams.check_connected(progs)
        self.send(dev, binding, progs, what)

    def finish_main(self, dev: Device) -> None:
        """After Main's LOOP was sent: wait for the load programs sent ahead of it (their
        error raised as a run's; the loop, sent after them, is the caller's to stop)."""
        self._loader.settle()   # a LOAD the fast path sent: its error comes first
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            fut, binding = ahead
            self._finish(dev, fut, "load programs")
            binding.move(PhaseEvent.LOAD_PROGRAMS_RAN)

    def send(self, dev: Device, binding: Binding, progs: Sequence[int], what: str) -> None:
        """RUN ``progs`` on ``dev`` and wait for them (``what``: how errors name them),
        after the LOAD and an abandoned run, with the constant inputs and modes brought up
        to date."""
        self._loader.settle()
        self._finish(dev, self._start(dev, binding, progs), what)

    def _start(self, dev: Device, binding: Binding, progs: Sequence[int]) -> Any:
        """RUN ``progs`` (after an abandoned run, with the constants and modes brought up to
        date); its future."""
        if self._abandoned is not None:
            self._finish_abandoned(dev)
        self._loader.sync_constants(dev, binding, progs)
        self._loader.send_modes(dev, binding)
        self._streams.clear_callback_errors()
        return dev.link.request(Op.RUN, list(progs))

    def _finish(self, dev: Device, fut: Any, what: str) -> None:
        """Wait for the run of ``fut``; its failure (or a callback's) raised."""
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
            try:
                raise new from new.__cause__
            finally:   # (this frame holding the error it raised: a reference cycle)
                del new
        except BaseException:
            # Abandoned (KeyboardInterrupt, a signal handler's exception): the run goes on
            # on the device, its callbacks are called as for any run; the next run waits
            # for it, so that its callbacks' errors are not taken for the next one's.
            self._abandoned = (fut, what)
            raise
        failed = self._streams.callback_failure(what)
        if failed is not None:
            try:
                raise failed
            finally:   # (this frame holding the error it raised: a reference cycle)
                del failed

    def _finish_abandoned(self, dev: Device) -> None:
        """Wait for the run a caller abandoned (see send); its outcome, which nobody
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
