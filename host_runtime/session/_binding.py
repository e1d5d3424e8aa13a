"""What binds a session to one device, and the device calls that make and unmake it.

A :class:`Binding` is made when the session binds (``bindToDevice``, or its first use
with ``LaunchPolicy.Deferred``) and dropped whole when it unbinds or the device is
closed: the device, whether the session owns it, the phase of the session's executable
there (:class:`host_runtime.session._state.Phase`) and the stream modes it was sent.
The Session decides when; the Binding activates (LOAD if needed), stops and lets go.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from host_runtime.devices import ActiveSession, Device, wait
from host_runtime.errors import DeviceLostError, DeviceTimeoutError, ModelRuntimeError
from host_runtime.session._state import Phase, PhaseEvent, next_phase
from host_runtime.session._streams import StreamTable
from ipu_emulator.ipu_protocol import Op

__all__ = ["Binding"]

_log = logging.getLogger("host_runtime.session._session")

LoadFn = Callable[[Device, "Binding", bool], None]
"""Sends LOAD for a binding (``Loader.load``: device, binding, fresh)."""


class Binding:
    """A session bound to one device (see the module docstring)."""

    __slots__ = ("device", "owned", "phase", "modes_sent", "loaded_once")

    def __init__(self, device: Device, owned: bool) -> None:
        self.device = device
        self.owned = owned
        """The session attached the device (or was handed it to own): it closes it on unbind."""
        self.phase = Phase.ATTACHED
        self.modes_sent: list[int] | None = None
        """The stream modes the device was last sent (with a LOAD, or MODES)."""
        self.loaded_once = False
        """A LOAD of the session's executable was sent to the device (it may cache it)."""

    def move(self, event: PhaseEvent) -> None:
        self.phase = next_phase(self.phase, event)

    def active(self, session: ActiveSession) -> bool:
        """Whether ``session`` is loaded and the device's active one, on a live link."""
        dev = self.device
        return (self.phase is not Phase.ATTACHED and dev.link.lost is None
                and dev.isActiveSession(session))

    def activate(self, session: ActiveSession, streams: StreamTable, load: LoadFn) -> None:
        """Make ``session`` the device's active one, loaded (the caller holds the device
        lock): a session another one took the device from is loaded again."""
        dev = self.device
        if not dev.isActiveSession(session):
            self.move(PhaseEvent.DEACTIVATED)
        dev.bind_session(session, streams)
        if self.phase is Phase.ATTACHED:
            self.loaded_once = True
            load(dev, self, False)
            self.move(PhaseEvent.LOAD)

    def reload(self, session: ActiveSession, streams: StreamTable, load: LoadFn) -> None:
        """Load the executable again, afresh, ``session`` the device's active one (the
        caller holds the device lock)."""
        self.device.bind_session(session, streams)
        streams.reset_rings()
        self.loaded_once = True
        load(self.device, self, True)
        self.move(PhaseEvent.LOAD)

    def busy(self) -> bool:
        """Whether another thread holds the device lock (a program may be running).

        Asked without taking it: a lock taken and released here would be left held by an
        interrupt (KeyboardInterrupt, a signal handler's exception) at the return of the
        acquire. The C ``RLock``'s repr says whether it is held, and by which thread."""
        text = repr(self.device.lock)
        return text.startswith("<locked") and f" owner={threading.get_ident()} " not in text

    def stop(self, timeout: float, kill_if_hung: bool, wake: Callable[[], None],
             last: bool = False) -> bool:
        """Send STOP and wait up to ``timeout`` s; ``wake``: wakes a program waiting on a
        stream. ``kill_if_hung``: a device the session owns that does not answer in time
        has its IPU processes killed (else DeviceTimeoutError). ``last``: the device is
        closed next, without another request (``ProcessLink.request``).

        Returns False if the answer was not waited for: the last request to a daemon's
        one-IPU device (``DeviceLink.last_unanswered``). Its release follows; the daemon's
        reset of the process comes after the STOP on its control ring (and restarts one
        that does not answer it), and this host reads no further event
        (``ProcessLink.quiesce``)."""
        dev = self.device
        try:
            fut = dev.link.request(Op.STOP, last=last)
            # wake a program waiting on a stream now, not at its next check of the
            # control ring; reload() resets the rings
            wake()
            if last and dev.link.last_unanswered and not fut.done():
                return False
            wait(fut, timeout, f"stop on {dev.describe()}", pids=dev.pids(),
                 progress=lambda: dev.link.progress,
                 sync=dev.link.sync_timeout)
        except DeviceLostError:
            pass
        except DeviceTimeoutError as exc:
            if not (kill_if_hung and self.owned):
                raise
            _log.warning("%s: %s; killing its IPU processes", dev.describe(), exc)
            dev.kill()
        return True

    def release(self, session: ActiveSession, key: str, timeout: float,
                implicit_save: Callable[[], None] | None) -> None:
        """Let the device forget ``session``: its save programs first (``implicit_save``,
        if it is the active one), UNLOAD of its executable ``key`` (unless the device goes
        with the session). Closing an owned device is the caller's, after this."""
        dev = self.device
        with dev.lock:
            if dev.isAttached() and dev.link.lost is None and dev.link.started:
                if implicit_save is not None and dev.isActiveSession(session):
                    try:
                        implicit_save()
                    except ModelRuntimeError as exc:
                        _log.warning("implicit save programs of %r failed: %s", session, exc)
                # also when another session is active: the device caches ours (not
                # needed when the device goes with this session, closing it drops all,
                # nor if ours was never sent). A device running another session's main
                # loop takes it once that loop ends (the control ring keeps it ahead of
                # any later LOAD): not waited for then, else the device has let go of
                # our executable when this returns
                if self.loaded_once and not (self.owned and set(dev.sessions()) <= {session}):
                    if dev.looping_for_another(session):
                        dev.link.request(Op.UNLOAD, {"key": key})
                    else:
                        try:
                            dev.link.call(Op.UNLOAD, {"key": key}, timeout=timeout)
                        except ModelRuntimeError as exc:
                            _log.debug("unload from %s: %s", dev.describe(), exc)
            dev.forget_session(session)

    def __repr__(self) -> str:
        owned = " (owned)" if self.owned else ""
        return f"<Binding {self.device.describe()}{owned} {self.phase.value}>"
