"""Session: links a model to a device and services its streams (seed 002, 10.2.4; seed 003).

::

    user thread                      device service thread          IPU process
    -----------                      ---------------------          -----------
    runMainPrograms() --RUN------------------------------------->   Main program
                                                                      input ring empty:
                                     <-------------------NEED(i)--    post NEED, wait
                                     callback(slot view) -> publish -> read slot
                                                                      output written:
                                     <--------------------OUT(i)--    publish, post OUT
                                     callback(read-only view), release
                      <----------------------------------DONE-----    program finished

One SPSC ring per anchor (slot = one transfer, ``sizeInBytes``), created by
the session when it is first bound; input rings are produced by the host,
output rings by the device. PopEF tensor/feed data is bound to its anchors
automatically unless ``SessionConfig.pred_tensor_data`` says USE_USER_DATA.

Two sessions may share a device: binding the other one runs this one's save
programs, and this one's load programs run again before its next Main.

Its state (:mod:`host_runtime.session._state`, the diagram) is a life (open,
stopped, closed) and, while it is bound, a ``Binding`` to one device (attached,
loaded, primed; :mod:`host_runtime.session._binding`), dropped whole when the
session unbinds. What it puts on the device and the LOAD are
:mod:`host_runtime.session._loading`; a RUN and its outcome
:mod:`host_runtime.session._running`; the seed's anchor and callback methods
:mod:`host_runtime.session._anchors`; its configuration :mod:`host_runtime.session._config`.

The fast path for ``QueueManager`` / ``ModelRunner`` (docs/design.md
section 8) is ``session.direct``, a :class:`host_runtime.session._fastpath.DirectStreams`
the session owns: the caller claims anchors as *direct* and reads/writes their
rings itself, and ``direct.start_main_loop()`` keeps Main running on the device
until ``stop()``. The per-anchor callbacks and servicing live in
:mod:`host_runtime.session._streams`, the rings in :mod:`host_runtime.session._rings`. The session reaches its device through
``Device.link`` / ``Device.lock`` and is, for the device, an ``ActiveSession``
(:mod:`host_runtime.devices._manager`).
"""

from __future__ import annotations

import logging
import secrets
import weakref
from functools import partial
from typing import Any, Callable, Sequence

from host_runtime import popef
from host_runtime._fork import check_owner, current_pid, foreign
from host_runtime.devices import Device, DeviceManager
from host_runtime.errors import BadRequestError, InvalidStateError
from host_runtime.session._anchors import AnchorsAndCallbacks
from host_runtime.session._attach import attach_loading
from host_runtime.session._binding import Binding
from host_runtime.session._config import (DROP_STOP_TIMEOUT, CallbackFactory, CallbackHandle,
                                          CallbackInfo, LaunchPolicy, SessionConfig,
                                          executable_header, session_model)
from host_runtime.session._fastpath import DirectStreams
from host_runtime.session._loading import Loader
from host_runtime.session._running import Runs
from host_runtime.session._state import Call, Life, LifeEvent, Phase, PhaseEvent
from host_runtime.session._streams import StreamTable
from host_runtime.settings import HostSettings
from ipu_emulator.faults import table_for as fault_table_for

__all__ = [
    "LaunchPolicy",
    "SessionConfig",
    "CallbackInfo",
    "CallbackHandle",
    "CallbackFactory",
    "Session",
]

_log = logging.getLogger(__name__)

class _FastPathSide:
    """What the session's fast path needs of it (``SessionCore``), holding the session
    weakly: the session owns its DirectStreams, which owns this."""

    __slots__ = ("_ref",)

    def __init__(self, session: "Session") -> None:
        self._ref = weakref.ref(session)

    def _session(self) -> "Session":
        session = self._ref()
        if session is None:
            raise InvalidStateError("the session is closed")
        return session

    def device(self) -> Device | None:
        session = self._ref()
        return None if session is None else session.device()

    def require_device(self) -> Device:
        # the fast path's LOAD is waited for by the next run, not here: its runs follow it
        loader = self._session()._loader
        loader.defer = True
        try:
            return self._session()._require_device()
        finally:
            loader.defer = False

    def activate(self) -> None:
        self._session()._activate()

    def prepare_main(self, dev: Device) -> list[int]:
        return self._session()._prepare_main(dev)

    def finish_main(self, dev: Device) -> None:
        self._session()._runs.finish_main(dev)   # (device lock held)

    def push_modes(self) -> None:
        self._session()._push_modes()

    def wake_streams(self) -> None:
        session = self._ref()
        if session is not None:
            session._wake_streams()


class Session(AnchorsAndCallbacks):
    """Links a model to a device: loads it, runs its programs, services its streams.

    The seed's anchor and callback methods are :class:`AnchorsAndCallbacks`'s. Besides
    the seed's API, marked "Internal": ``direct`` (the fast path of QueueManager
    and ModelRunner) and what a Device calls on its sessions (``main_loop_running``,
    ``deactivate``, ``device_detached``: the ``devices._manager.ActiveSession`` protocol).
    """

    def __init__(self, model: popef.Model | str | Sequence[str],
                 config: SessionConfig | None = None) -> None:
        self._owner_pid = current_pid()   # fork: see host_runtime._fork
        self._config = config if config is not None else SessionConfig()
        if not isinstance(self._config, SessionConfig):
            raise BadRequestError(f"config must be a SessionConfig, got {config!r}")
        self._settings = (self._config.settings if self._config.settings is not None
                          else HostSettings.current())
        # the fault schedule its IPUs follow (ipu_emulator.faults), kept for the session's life
        fault_table = fault_table_for(self._settings.faults)
        self._model = session_model(model)
        exe = self._model.executable.payload()
        self._header = executable_header(self._model, exe)
        self._streams = StreamTable(self._model, self._config.pred_tensor_data,
                                    self._config.look_ahead(), self._config.ring_depth,
                                    self._settings)
        self._flow = self._streams.flow
        self._direct = DirectStreams(self._streams, _FastPathSide(self),
                                     self._settings.stop_timeout)
        self._queue_managers: list[Any] = []
        self._key = secrets.token_hex(8)
        self._loader = Loader(exe, self._header, self._key, self._streams, self._config,
                              self._settings, fault_table)
        self._runs = Runs(self._streams, self._loader)
        self._binding: Binding | None = None   # None: unbound
        self._life = Life.OPEN
        if self._config.policy is LaunchPolicy.Immediate:
            self._acquire_device()

    # -- the seed's API: device -------------------------------------------------------------

    def bindToDevice(self, device: Device) -> None:
        """Bind to ``device`` and load the executable onto it (unbinding any previous device)."""
        self._check_open()
        if not isinstance(device, Device):
            raise BadRequestError(f"bindToDevice expects a Device, got {device!r}")
        self._bind(device, owned=False)

    def unloadFromDevice(self) -> None:
        """Unload from the bound device (its save programs run first if they can)."""
        self._check_open()
        if self._binding is None:
            raise InvalidStateError("unloadFromDevice: the session is not bound to a device")
        self._unbind(run_save=True)

    def runLoadPrograms(self) -> None:
        """Run the load programs (copy weights and constants to the device)."""
        self._run(self._flow.load(), "load programs", phase="load")

    def runMainPrograms(self) -> None:
        """Run the main programs (after the load programs, if this binding has not run them)."""
        self._run(self._flow.main(), "main programs", phase="main")

    def runSavePrograms(self) -> None:
        """Run the save programs (copy chosen device tensors back to the host)."""
        self._run(self._flow.save(), "save programs", phase="save")

    def runPrograms(self, progs: Sequence[int]) -> None:
        """Run the given programs once each, in order (no implicit load)."""
        items = list(progs)
        if not all(isinstance(p, int) and not isinstance(p, bool) for p in items):
            raise BadRequestError(f"runPrograms expects a list of program indices, got {progs!r}")
        self._run(items, f"programs {items}", phase=None)

    def stop(self) -> None:
        """Send the stop signal: running programs end; nothing runs until reload()."""
        self.stop_within(self._settings.stop_timeout)

    def stop_within(self, timeout: float, kill_if_hung: bool = False,
                    closing: bool = False) -> None:
        """Internal (ModelRunner): stop(), waiting up to ``timeout`` s for the device (and
        at most the host sync timeout without an answer). ``kill_if_hung`` (close, or a
        dropped owner): a device of ours that does not answer in time has its IPU
        processes killed instead. ``closing``: close follows; if the device goes with
        this session, the STOP is the last request it is sent."""
        check_owner(self._owner_pid, "Session")
        if self._life is Life.CLOSED:
            return
        self._disconnect_queues()
        self._life = self._life.after(LifeEvent.STOP)
        b = self._binding
        if b is not None and b.active(self):
            last = closing and b.owned and set(b.device.sessions()) <= {self}
            answered = b.stop(timeout, kill_if_hung, self._wake_streams, last=last)
            self._direct.loop_stopped(answered)   # (a loop whose start was cut short too)

    def _wake_streams(self) -> None:
        """After a STOP: invalidate the stream rings (and a sharded model's IPU-Links, which
        are reset before each run) so that a program waiting on one takes the STOP now."""
        self._streams.invalidate_rings()
        self._loader.wake_links()

    def reload(self) -> None:
        """Load the executable again on the bound device (after stop(), or to start afresh)."""
        self._check_open()
        b = self._binding
        if b is None:
            raise InvalidStateError("reload: the session is not bound to a device")
        if self._direct.loop_running():
            raise InvalidStateError("reload: the main loop is running; stop() the session first")
        with b.device.lock:
            b.reload(self, self._streams, self._loader.load)
            self._life = self._life.after(LifeEvent.RELOAD)

    def isStopped(self) -> bool:
        return self._life is not Life.OPEN   # stop() (or close()), and no reload() since

    # -- internal: the fast path ----------------------------------------------------------

    @property
    def direct(self) -> DirectStreams:
        """Internal (QueueManager, ModelRunner): the session's fast path: claim anchors,
        their rings, the main loop, failures (:mod:`host_runtime.session._fastpath`)."""
        check_owner(self._owner_pid, "Session")
        return self._direct

    def createQueueManager(self, *args: Any, **kwargs: Any) -> Any:
        """Create a QueueManager for this session (arguments as QueueManager's, after the
        session). The session owns it: stop() disconnects its queues."""
        self._check_open()
        from host_runtime.queues import QueueManager

        qm = QueueManager(self, *args, **kwargs)
        self._queue_managers.append(qm)
        return qm

    # -- the seed's API: the model and its device -------------------------------------------------

    def model(self) -> popef.Model:
        return self._model

    def device(self) -> Device | None:
        """The bound device, if any."""
        b = self._binding
        return None if b is None else b.device

    def config(self) -> SessionConfig:
        return self._config

    # -- lifetime ---------------------------------------------------------------------------------

    def _disconnect_queues(self) -> None:
        """Wake every QueueManager reader/writer of this session (stop and close)."""
        for qm in list(self._queue_managers):
            try:
                qm.disconnectAll()
            except Exception:
                _log.exception("disconnecting %r failed", qm)

    def close(self) -> None:
        """Stop, unload (no implicit save), destroy the rings; idempotent.

        Bounded: a device that does not answer within the host sync timeout (a stopped or
        stuck IPU process) is killed if the session attached it itself; a device of the
        caller's is left to the caller (DeviceTimeoutError naming its IPU processes), the
        session's own resources are released either way."""
        self.close_within(self._settings.stop_timeout, kill_if_hung=True)

    def close_within(self, stop_timeout: float, kill_if_hung: bool) -> None:
        """Internal (ModelRunner): close(), stopping within ``stop_timeout`` s (see
        ``stop_within``). In a process forked from the session's creator it only marks
        this process's copy closed: nothing of the creator's is stopped or unlinked."""
        if self._life is Life.CLOSED:
            _release(self._streams, self._loader)   # (what a close an interrupt cut short left)
            return
        if foreign(self._owner_pid):
            self._life = self._life.after(LifeEvent.CLOSE)
            return
        try:
            self._disconnect_queues()
            b = self._binding
            if (b is not None and b.busy()) or self._direct.loop_running():
                # a program of ours may be running on another thread
                self.stop_within(stop_timeout, kill_if_hung, closing=True)
            if self._binding is not None:   # no save; rings and regions go as the IPUs go back
                self._unbind(False, meanwhile=partial(_release, self._streams, self._loader))
        finally:
            self._life = self._life.after(LifeEvent.CLOSE)
            _release(self._streams, self._loader)

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Dropped: nothing can use the session any more. Close it now (or finish a close
        # an interrupt cut short), without blocking for long on a device that does not answer.
        if getattr(self, "_life", None) is not None:
            try:
                self.close_within(DROP_STOP_TIMEOUT, kill_if_hung=True)
            except Exception:
                pass

    def __repr__(self) -> str:
        b = self._binding
        where = b.device.describe() if b is not None else "unbound"
        return f"<Session {self._header.name!r} {where}>"

    # -- binding ----------------------------------------------------------------------------------

    def _check_open(self) -> None:
        check_owner(self._owner_pid, "Session")
        self._life.refuse(Call.USE)

    def _bind(self, device: Device, owned: bool) -> None:
        """Bind to ``device`` (unbinding a previous one) and load onto it."""
        b = self._binding
        if b is not None and b.device is not device:
            self._unbind(run_save=True)
            b = None
        if b is None:
            self._binding = Binding(device, owned)
        with device.lock:
            self._activate()

    def _acquire_device(self) -> Device:
        self._loader.share_weights()   # while the IPU process starts (its template may be starting)
        manager = DeviceManager(settings=self._settings)
        # rings and regions made while the device attaches; then LOAD first (_attach)
        dev = attach_loading(
            lambda: manager.getDevice(self._model, wait_config=self._config.wait_config),
            self._loader)
        try:
            self._bind(dev, owned=True)
        except BaseException:
            self._binding = None
            dev.close()
            raise
        return dev

    def adopt_device(self, device: Device) -> None:
        """Internal (ModelRunner): bind to ``device`` and own it, as if this session had
        attached it: the session closes it when it unbinds or closes (ModelRunner attaches
        its replicas' devices all at once, then hands one to each replica's session)."""
        self.bindToDevice(device)
        b = self._binding
        if b is not None:
            b.owned = True

    def _require_device(self) -> Device:
        self._check_open()
        b = self._binding
        return self._acquire_device() if b is None else b.device

    def _activate(self) -> Binding:
        """Make this session the device's active one, loaded; its binding. Caller holds
        the device lock."""
        b = self._binding
        assert b is not None
        b.activate(self, self._streams, self._loader.load)
        return b

    def _push_modes(self) -> None:
        """Send the stream modes now if loaded and active (they change with claims)."""
        b = self._binding
        if b is not None and b.active(self):
            self._loader.send_modes(b.device, b)

    def _unbind(self, run_save: bool, meanwhile: Callable[[], None] | None = None) -> None:
        b = self._binding
        if b is None:
            return
        try:
            b.release(self, self._key, self._settings.stop_timeout,
                      self._implicit_save if run_save else None)
        finally:
            self._binding = None   # all that bound it to the device goes with it
            if b.owned:
                b.device.close_then(meanwhile)

    # -- internal: for the device (host_runtime.devices._manager.ActiveSession) -----------------

    def main_loop_running(self) -> bool:
        """Internal (Device): whether this session's main loop runs on its device."""
        return self._direct.loop_running()

    def deactivate(self, implicit_save: bool) -> None:
        """Internal (Device): another session takes the device (called under its lock)."""
        b = self._binding
        if self._direct.loop_running():
            raise InvalidStateError(
                f"{b.device.describe() if b else 'the device'} is running the main loop of "
                "another session; stop() that session (or end its loop) before binding this one")
        if implicit_save:
            self._implicit_save()
        if b is not None:
            b.move(PhaseEvent.DEACTIVATED)

    def device_detached(self, dev: Device) -> None:
        """Internal (Device): Device.close() calls this for each session bound to it."""
        b = self._binding
        if b is not None and b.device is dev:
            self._binding = None

    def _implicit_save(self) -> None:
        b = self._binding
        save = self._flow.save()
        if (b is None or b.phase is not Phase.PRIMED or self._life is not Life.OPEN or not save
                or b.device.link.lost is not None or self._direct.loop_running()):
            return
        if self._streams.not_connected(save):
            _log.debug("skipping implicit save programs of %r: anchors not connected", self)
            return
        self._runs.send(b.device, b, save, "implicit save programs")

    # -- running ----------------------------------------------------------------------------------

    def _run(self, progs: list[int], what: str, phase: str | None) -> None:
        dev = self._require_device()
        with dev.lock:
            b = self._activate()
            self._check_runnable()
            if phase == "main":
                self._runs.prime(dev, b)
            self._runs.run(dev, b, progs, what)
            if phase == "load":
                b.move(PhaseEvent.LOAD_PROGRAMS_RAN)

    def _check_runnable(self) -> None:
        self._life.refuse(Call.RUN)
        self._direct.require_idle()

    def _prepare_main(self, dev: Device) -> list[int]:
        """Before the main loop (DirectStreams.start_main_loop, device lock held): activate,
        check runnable, run the load programs if this binding has not, check the Main
        anchors are connected, send the modes; the Main programs."""
        b = self._activate()
        self._check_runnable()
        return self._runs.prepare_main(dev, b)

    # -- internal: for ModelRunner ----------------------------------------------------------------

    def memory_per_replica(self) -> int:
        """Internal (ModelRunner): bytes of /dev/shm a session of this model takes besides
        its weights and rings (its executable and device memory regions)."""
        return self._loader.memory_per_replica()

    def weights_bytes(self) -> int:
        """Internal (ModelRunner): bytes of the executable's weights section (0: none)."""
        return self._loader.weights_bytes()


def _release(streams: StreamTable, loader: Loader) -> None:
    """A session's close: destroy its rings, release its regions (idempotent: each is
    forgotten only once released, so a close an interrupt cut short is finished by the
    next ``close()``, or when the session is dropped)."""
    streams.close()
    loader.close()
