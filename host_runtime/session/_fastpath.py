"""The Session's internal fast path for QueueManager / ModelRunner (docs/design.md section 8).

``session.direct`` is the session's :class:`DirectStreams`. The caller claims
anchors (``claim``) and moves their transfers through the rings itself
(``input_ring`` / ``output_ring``), from its own thread: the session calls no
callback for them and the device posts no event for them. ``start_main_loop``
keeps the Main programs running on the device until ``session.stop()`` (or
``stop_main_loop()``), so a request touches only the user's thread and the IPU
process.

The session owns its ``DirectStreams`` and gives it the stream table; what it
needs of the session (binding, the checks and load programs before Main) is the
:class:`SessionCore` protocol, an object that holds the session weakly.
"""

from __future__ import annotations

import concurrent.futures as cf
import weakref
from typing import TYPE_CHECKING, Protocol

from shm import (PeerDiedError, Ring, RingInvalidatedError, RingTimeoutError, ShmClosedError,
                 ShmError)

from host_runtime import popef
from host_runtime.devices import Answer, wait
from host_runtime.errors import (BadRequestError, DeviceExecutionError, DeviceLostError,
                                 DeviceTimeoutError, InvalidStateError, ModelRuntimeError)
from host_runtime.session._streams import StreamTable
from ipu_emulator.ipu_protocol import Op

if TYPE_CHECKING:
    from host_runtime.devices import Device

__all__ = ["DirectStreams", "SessionCore"]

class SessionCore(Protocol):
    """What :class:`DirectStreams` needs of the session that owns it, over a weak
    reference: once the session is gone, ``device()`` is None, ``wake_streams()`` does
    nothing and the others raise InvalidStateError."""

    def device(self) -> "Device | None":
        """The bound device, if any."""

    def require_device(self) -> "Device":
        """The bound device; attaches one (LaunchPolicy.Deferred) if there is none."""

    def activate(self) -> None:
        """Make the session the device's active one, loaded (device lock held)."""

    def prepare_main(self, dev: "Device") -> list[int]:
        """Activate, check the session is runnable, run the load programs if this binding
        has not, check the Main anchors are connected, send the stream modes; the Main
        programs (device lock held)."""

    def finish_main(self, dev: "Device") -> None:
        """After the LOOP: wait for the load programs prepare_main sent ahead of it."""

    def push_modes(self) -> None:
        """Send the stream modes now if the session is loaded and active."""

    def wake_streams(self) -> None:
        """After a STOP: invalidate the rings a device program may wait on."""


class DirectStreams:
    """The fast path of one session (see the module docstring)."""

    def __init__(self, streams: StreamTable, session: SessionCore,
                 stop_timeout: float = 30.0) -> None:
        self._streams = streams
        self._stop_timeout = stop_timeout   # stop_main_loop's default (the setting)
        self._session = session   # holds the session weakly: the session owns this object
        self._loop: cf.Future[None] | None = None
        self._unhooked: cf.Future[None] | None = None   # _loop, its LOOP's answer not hooked
        self._reset_due = False   # a stop of the loop left the rings to reset (settle_rings)

    # -- rings --------------------------------------------------------------------------

    def _ring(self, handle: str, kind: popef.TensorType) -> Ring:
        a = self._streams.anchor(handle)
        if a.type() is not kind:
            raise BadRequestError(f"anchor {handle!r} is an {a.type().value.lower()} anchor, "
                                  f"not an {kind.value.lower()}")
        session = self._session
        dev = session.require_device()
        with dev.lock:
            session.activate()
        return self._streams.rings[a.handle()]

    def input_ring(self, handle: str) -> Ring:
        """The host (producer) end of an input anchor's ring; binds the session if needed."""
        return self._ring(handle, popef.TensorType.INPUT)

    def output_ring(self, handle: str) -> Ring:
        """The host (consumer) end of an output anchor's ring; binds the session if needed."""
        return self._ring(handle, popef.TensorType.OUTPUT)

    def claim(self, handle: str) -> None:
        """The caller services this anchor's ring itself: no callbacks, no events."""
        a = self._streams.anchor(handle)
        self._streams.direct.add(a.handle())
        self._session.push_modes()

    # -- the main loop ------------------------------------------------------------------

    def start_main_loop(self) -> "cf.Future[None]":
        """Run Main on the device in a loop until stop(); returns at once.

        The load programs run first (synchronously) if this binding has not run
        them. The future resolves to None when stop() ends the loop, or fails
        with DeviceExecutionError / DeviceLostError.
        """
        session = self._session
        dev = session.require_device()
        with dev.lock:
            main = session.prepare_main(dev)
            self._streams.clear_callback_errors()
            outer: cf.Future[None] = Answer()
            # Recorded first (no check between the two stores): from here on the device
            # may loop. An interrupt (KeyboardInterrupt, a signal handler's exception) may
            # come before the LOOP goes, as it goes or after: until the loop's answer is
            # hooked to ``outer``, stop() / stop_main_loop() end it whichever it was
            # (:meth:`loop_stopped`), and nothing runs Load while Main may loop.
            self._loop, self._unhooked = outer, outer
            # The device link holds the LOOP's answer (and so this callback) until the loop
            # ends: it refers to the streams weakly, so that a dropped session is freed (and
            # closed, which ends the loop) by reference counting.
            ref = weakref.ref(self._streams)

            def done(f: "cf.Future[None]") -> None:
                exc = f.exception()
                streams = ref()
                if exc is not None and isinstance(exc, DeviceExecutionError) \
                        and streams is not None:
                    exc = streams.with_callback_error(exc, "main loop")
                _settle(outer, exc)
            dev.link.request(Op.LOOP, main).add_done_callback(done)
            self._unhooked = None
            # the load programs, if sent ahead of the loop: their failure is raised here
            # (the loop then runs until stop() or close(), as after any start)
            session.finish_main(dev)
            return outer

    def loop_stopped(self, answered: bool = True) -> None:
        """A STOP was answered: the device ran what was sent before it, a LOOP among them
        has ended. A loop whose start was cut short (its answer never hooked) ends here;
        so does every loop if the STOP was the device's last request, not waited for
        (``answered`` False: no further answer comes)."""
        outer, self._unhooked = self._unhooked, None
        if not answered:
            outer = self._loop
        if outer is not None:
            _settle(outer, None)

    def require_idle(self) -> None:
        """Before a run: refused while a main loop started here may run; the rings reset
        if a stop of the loop left them to (it was cut short before it reset them)."""
        if self.loop_running():
            raise InvalidStateError("the main loop is running; stop() it before running programs")
        self.settle_rings()

    def loop_running(self) -> bool:
        """Whether a main loop started here has not ended yet."""
        loop = self._loop
        return loop is not None and not loop.done()

    def stop_main_loop(self, timeout: float | None = None) -> None:
        """End a running main loop but stay runnable (unlike stop()): e.g. to run the save
        programs next. An iteration waiting for input is abandoned; device memory is kept.
        ``timeout``: seconds to wait for the device (None: the setting ``stop_timeout``)."""
        if timeout is None:
            timeout = self._stop_timeout
        loop = self._loop
        dev = self._session.device()
        if loop is None or loop.done() or dev is None or dev.link.lost is not None:
            self.settle_rings()   # (a stop of it cut short before it reset them)
            return
        self._reset_due = True    # first: from here on the rings are to be reset
        fut = dev.link.request(Op.STOP, value=1)
        self._session.wake_streams()   # wakes the device now (see Session.stop)
        try:
            wait(fut, timeout, f"ending the main loop on {dev.describe()}", pids=dev.pids(),
                 progress=lambda: dev.link.progress,
                 sync=dev.link.sync_timeout)
            self.loop_stopped()
            try:
                wait(loop, timeout, "the main loop to end", pids=dev.pids(),
                     progress=lambda: dev.link.progress, sync=dev.link.sync_timeout)
            except ModelRuntimeError:
                pass  # its failure is reported through the loop future
        finally:
            self.settle_rings()   # once the loop has ended, the device is idle: runnable again

    def settle_rings(self) -> None:
        """Reset the rings if a stop of the main loop left them to reset (invalidated, or
        with an abandoned iteration's slots) and the loop has ended. A stop cut short (an
        interrupt) leaves it to the next stop or run; resetting is idempotent."""
        if self._reset_due and not self.loop_running():
            self._streams.reset_rings()
            self._reset_due = False

    # -- failures -----------------------------------------------------------------------

    def _device(self) -> "Device | None":
        return self._session.device()

    def failure(self) -> ModelRuntimeError | None:
        """The DeviceLostError of the bound device if it died, checked now (a waitpid per
        IPU process: cheap enough to call before every request)."""
        dev = self._device()
        return None if dev is None else dev.link.check()

    def translate(self, exc: BaseException) -> BaseException:
        """Map a wire error met on a stream ring to the host's error hierarchy."""
        if isinstance(exc, ModelRuntimeError):
            return exc
        lost = self.failure()
        if isinstance(exc, PeerDiedError):
            if lost is not None:
                return lost
            dev = self._device()
            if dev is not None and exc.pid in dev.pids():
                return dev.link.mark_lost()   # the ring saw it first; get how it died
            name = dev.describe() if dev is not None else "the device"
            return DeviceLostError(f"{name}: IPU process {exc.pid} died")
        if isinstance(exc, RingInvalidatedError):
            return InvalidStateError(f"the stream was disconnected (session stopped): {exc}")
        if isinstance(exc, RingTimeoutError):
            return DeviceTimeoutError(str(exc))
        if isinstance(exc, ShmClosedError):
            return InvalidStateError(f"the session is closed: {exc}")
        if isinstance(exc, ShmError):
            return InvalidStateError(str(exc))
        return exc


def _settle(fut: "cf.Future[None]", exc: BaseException | None) -> None:
    """Resolve ``fut`` (None: with None) unless it is resolved already."""
    if fut.done():
        return
    try:
        if exc is None:
            fut.set_result(None)
        else:
            fut.set_exception(exc)
    except cf.InvalidStateError:   # resolved meanwhile, by the other of its two settlers
        pass
