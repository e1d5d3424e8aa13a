"""The Session's internal fast path for QueueManager / ModelRunner (CONTRACTS.md section 5).

The caller claims anchors as *direct* and moves transfers through their rings
itself, from its own thread: the session calls no callback for them and the
device posts no event for them (except NEED, to an observer, when asked).
``_start_main_loop`` keeps the Main programs running on the device until
``stop()`` (or ``_stop_main_loop()``), so a request touches only the user's
thread and the IPU process.

``FastPath`` is a mixin of :class:`host_runtime.session._session.Session`; it uses the
session's binding and running internals declared below.
"""

from __future__ import annotations

import concurrent.futures as cf
import weakref
from typing import TYPE_CHECKING, Any, Callable

from shm import (PeerDiedError, Ring, RingInvalidatedError, RingTimeoutError, ShmClosedError,
                 ShmError)
from shm.settings import settings

from host_runtime import popef
from host_runtime.devices._link import wait
from host_runtime.errors import (BadRequestError, DeviceExecutionError, DeviceLostError,
                                 DeviceTimeoutError, InvalidStateError, ModelRuntimeError)
from ipu_emulator.protocol import Op

if TYPE_CHECKING:
    from host_runtime.session._streams import StreamTable
    from host_runtime.devices._manager import Device

__all__ = ["FastPath"]

_STOP_TIMEOUT = settings().stop_timeout


class FastPath:
    """The ``_``-prefixed fast-path methods of Session."""

    _streams: "StreamTable"
    _device: "Device | None"
    _loaded: bool
    _need_load_programs: bool
    _load_ran: bool
    _loop: "cf.Future[None] | None"
    _stop_listeners: list[Callable[[], None]]
    _flow: popef.ProgramFlow

    if TYPE_CHECKING:
        def _require_device(self) -> "Device": ...
        def _wake_streams(self) -> None: ...
        def _activate(self) -> None: ...
        def _check_runnable(self) -> None: ...
        def _anchor(self, handle: str) -> popef.Anchor: ...
        def _send_modes(self, dev: "Device") -> None: ...
        def _run_checked(self, dev: "Device", progs: list[int], what: str) -> None: ...
        def errorIfAnchorsAreNotConnectedToCallbacks(self, progs: Any) -> None: ...
        def _with_callback_error(self, exc: DeviceExecutionError, what: str) -> BaseException: ...


    def _ensure_bound(self) -> Device:
        dev = self._require_device()
        with dev._device_lock:
            self._activate()
        return dev

    def _ring(self, handle: str, kind: popef.TensorType) -> Ring:
        a = self._anchor(handle)
        if a.type() is not kind:
            raise BadRequestError(f"anchor {handle!r} is an {a.type().value.lower()} anchor, "
                                  f"not an {kind.value.lower()}")
        self._ensure_bound()
        return self._streams.rings[a.handle()]

    def _input_ring(self, handle: str) -> Ring:
        """The host (producer) end of an input anchor's ring; binds the session if needed."""
        return self._ring(handle, popef.TensorType.INPUT)

    def _output_ring(self, handle: str) -> Ring:
        """The host (consumer) end of an output anchor's ring; binds the session if needed."""
        return self._ring(handle, popef.TensorType.OUTPUT)

    def _claim_direct(self, handle: str) -> None:
        """The caller services this anchor's ring itself: no callbacks, no events."""
        a = self._anchor(handle)
        self._streams.direct.add(a.handle())
        self._push_modes()

    def _release_direct(self, handle: str) -> None:
        a = self._anchor(handle)
        self._streams.direct.discard(a.handle())
        self._push_modes()

    def _direct_anchors(self) -> set[str]:
        return set(self._streams.direct)

    def _set_need_observer(self, observer: Callable[[str], None] | None) -> None:
        """``observer(handle)`` runs on the service thread when the device waits on an empty
        directly-serviced input ring (for input timeouts and flush)."""
        if observer is not None and not callable(observer):
            raise BadRequestError(f"observer must be callable or None, got {observer!r}")
        self._streams.need_observer = observer
        self._push_modes()

    def _add_stop_listener(self, listener: Callable[[], None]) -> None:
        """``listener()`` runs at the start of stop() (e.g. QueueManager.disconnectAll)."""
        self._stop_listeners.append(listener)

    def _remove_stop_listener(self, listener: Callable[[], None]) -> None:
        try:
            self._stop_listeners.remove(listener)
        except ValueError:
            pass

    def _push_modes(self) -> None:
        dev = self._device
        if (dev is not None and self._loaded and dev._link.lost is None
                and dev.isActiveSession(self)):  # type: ignore[arg-type]
            self._send_modes(dev)

    def _start_main_loop(self) -> "cf.Future[None]":
        """Run Main on the device in a loop until stop(); returns at once.

        The load programs run first (synchronously) if this binding has not run
        them. The future resolves to None when stop() ends the loop, or fails
        with DeviceExecutionError / DeviceLostError.
        """
        dev = self._require_device()
        with dev._device_lock:
            self._activate()
            self._check_runnable()
            main = self._flow.main()
            if not main:
                raise InvalidStateError("the model has no main programs")
            if self._need_load_programs:
                self._run_checked(dev, self._flow.load(), "load programs")
                self._need_load_programs = False
                self._load_ran = True
            self.errorIfAnchorsAreNotConnectedToCallbacks(main)
            self._send_modes(dev)
            self._streams.clear_callback_errors()
            inner = dev._link.request(Op.LOOP, list(main))
            outer: cf.Future[None] = cf.Future()
            # The device link holds ``inner`` (and so this callback) until the loop ends:
            # it refers to the session weakly, so that a dropped session is freed (and
            # closed, which ends the loop) by reference counting.
            ref = weakref.ref(self)

            def done(f: "cf.Future[None]") -> None:
                exc = f.exception()
                session = ref()
                if exc is None:
                    outer.set_result(None)
                elif isinstance(exc, DeviceExecutionError) and session is not None:
                    outer.set_exception(session._with_callback_error(exc, "main loop"))
                else:
                    outer.set_exception(exc)
            inner.add_done_callback(done)
            self._loop = outer
            return outer

    def _stop_main_loop(self, timeout: float = _STOP_TIMEOUT) -> None:
        """End a running main loop but stay runnable (unlike stop()): e.g. to run the save
        programs next. An iteration waiting for input is abandoned; device memory is kept."""
        loop, dev = self._loop, self._device
        if loop is None or loop.done() or dev is None or dev._link.lost is not None:
            return
        fut = dev._link.request(Op.STOP, value=1)
        self._wake_streams()   # wakes the device now (see Session.stop)
        try:
            wait(fut, timeout, f"ending the main loop on {dev.describe()}")
            try:
                wait(loop, timeout, "the main loop to end")
            except ModelRuntimeError:
                pass  # its failure is reported through the loop future
        finally:
            if loop.done():
                self._streams.reset_rings()   # the device is idle: runnable again

    def _main_loop(self) -> "cf.Future[None] | None":
        return self._loop

    def _failure(self) -> ModelRuntimeError | None:
        """The DeviceLostError of the bound device if it died, checked now (a waitpid per
        IPU process: cheap enough to call before every request)."""
        dev = self._device
        return None if dev is None else dev._link.check()

    def _translate(self, exc: BaseException) -> BaseException:
        """Map a wire error met on a stream ring to the host's error hierarchy."""
        if isinstance(exc, ModelRuntimeError):
            return exc
        lost = self._failure()
        if isinstance(exc, PeerDiedError):
            if lost is not None:
                return lost
            dev = self._device
            if dev is not None and exc.pid in dev.pids():
                return dev._link.mark_lost()   # the ring saw it first; get how it died
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
