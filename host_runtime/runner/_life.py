"""A replica's life: attach and load (a session on a device, Main in a loop), notice a
lost device, reset (``auto_reset``), close.

:class:`ReplicaLife` owns the replica's session, the :class:`TransferPath` over its
rings (a new one after each reset), the watch on its IPU processes and the
replica's error. It sends nothing and completes nothing: when the device is lost
it tells the replica through ``on_lost`` (the replica fails what is in flight).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
import weakref
from typing import Callable, Protocol

import numpy as np

from shm import ExitWatch, PeerDiedError, Ring, describe_process

from ipu_emulator.trace import recorder

from host_runtime._again import again
from host_runtime.errors import (DeviceLostError, DeviceRuntimeError, DeviceTimeoutError,
                                 InvalidStateError, ModelRuntimeError, RecoverableRuntimeError,
                                 RecoveryAction, UnrecoverableRuntimeError)
from host_runtime.runner import _tracing
from host_runtime.runner._batching import TensorSpec
from host_runtime.runner._transfer import RECHECK, PathOptions, TransferPath
from host_runtime.settings import HostSettings

__all__ = ["ReplicaLife", "ReplicaSession", "DirectPath", "DeviceProcesses", "SaveFn",
           "unusable_error"]

_log = logging.getLogger("host_runtime.runner._replica")


class DeviceProcesses(Protocol):
    def pids(self) -> list[int]:
        """The pids of the device's IPU processes."""

    def describe(self) -> str:
        """The device and its IPUs, as messages name them (``device 0 (ipu 3)``)."""


class DirectPath(Protocol):
    """What a replica uses of ``session.direct`` (the session's fast path,
    ``host_runtime.session._fastpath.DirectStreams``)."""

    def input_ring(self, handle: str) -> Ring: ...
    def output_ring(self, handle: str) -> Ring: ...
    def start_main_loop(self) -> cf.Future[None]: ...
    def stop_main_loop(self, timeout: float = ...) -> None: ...
    def failure(self) -> ModelRuntimeError | None: ...
    def translate(self, exc: BaseException) -> BaseException: ...


class ReplicaSession(Protocol):
    """What a replica uses of its ``Session``: exactly these members (the fast path, its
    lifetime, and what the save programs need). ``host_runtime.session.Session``
    implements it; ``ModelRunner`` opens the sessions."""

    @property
    def direct(self) -> DirectPath: ...
    # lifetime
    def device(self) -> DeviceProcesses | None: ...
    def stop(self) -> None: ...
    def stop_within(self, timeout: float, kill_if_hung: bool = False,
                    closing: bool = False) -> None: ...
    def close(self) -> None: ...
    def close_within(self, stop_timeout: float, kill_if_hung: bool) -> None: ...
    # new data for the Load programs' inputs (ModelRunner.update_load_inputs)
    def freeze_input(self, anchor_handle: str, data: memoryview) -> None: ...
    def runLoadPrograms(self) -> None: ...
    # the save programs (ModelRunner's SaveFn)
    def setCallbackForAnchor(self, anchor_handle: str,
                             callback: Callable[[memoryview], None] | None) -> None: ...
    def runSavePrograms(self) -> None: ...


SaveFn = Callable[[ReplicaSession], None]
"""Runs the save programs on a replica's session before it closes."""


class ReplicaLife:
    """Session, rings and health of one replica (see the module docstring)."""

    def __init__(self, rid: int, open_session: Callable[[], ReplicaSession],
                 inputs: dict[str, TensorSpec], outputs: dict[str, TensorSpec],
                 frozen: dict[str, np.ndarray], dynamic: bool, batch: int, options: PathOptions,
                 auto_reset: bool, on_lost: Callable[[ModelRuntimeError], None],
                 settings: HostSettings, unnumbered: frozenset[str] = frozenset()) -> None:
        self.rid = rid
        self._unnumbered = unnumbered   # outputs that carry no request's number
        self.trace_key = _tracing.life_key()   # this life on the timeline
        self._open_session = open_session
        self._inputs, self._outputs = inputs, outputs
        self._frozen = frozen
        self._dynamic, self._batch, self._options = dynamic, batch, options
        self._auto_reset = auto_reset
        self._on_lost = on_lost
        self.session: ReplicaSession | None = None
        self.path: TransferPath | None = None
        self.loop: cf.Future[None] | None = None
        self.error: ModelRuntimeError | None = None
        self.error_unheard = False     # no request has been failed with error yet
        self.closed = False
        # rerun_load was interrupted: the values it loads (done before the next request)
        self.reloading: dict[str, memoryview] | None = None
        self._close_lock = threading.Lock()
        self._pids = ExitWatch()       # the device's IPU processes (pidfds)
        self._pids_exact = False       # ... every one of them watched by a pidfd
        self._several = False          # ... more than one (see well_but_unpolled)
        self.sync_s = settings.host_sync_timeout   # the bound on a wait for a device's progress
        self._stop_s = settings.stop_timeout
        self.wait_slice = min(RECHECK, self.sync_s)   # an untimed wait looks around this often

    def open(self) -> TransferPath:
        """Attach and load: a session, its rings, Main started in a loop."""
        t0 = time.monotonic_ns()
        s = self._open_session()
        try:
            path = self._start(s)
        except BaseException:
            s.close()
            raise
        dev = s.device()
        self._pids.close()
        self._pids = ExitWatch(dev.pids() if dev is not None else [])
        self._pids_exact = self._pids.exact and bool(self._pids.pids)
        self._several = len(self._pids.pids) > 1
        if recorder.ON:
            _tracing.life("attach and load", self.trace_key, self.rid, t0, s)
        return path

    def _start(self, s: ReplicaSession) -> TransferPath:
        """Main started in a loop on ``s``'s device, and a path over its rings."""
        in_rings = {n: s.direct.input_ring(spec.handle) for n, spec in self._inputs.items()}
        out_rings = {n: s.direct.output_ring(spec.handle) for n, spec in self._outputs.items()}
        loop = s.direct.start_main_loop()
        self.session = s
        self.loop = loop
        self.error = None
        self.path = path = TransferPath(self._inputs, self._outputs, self._frozen, in_rings,
                                        out_rings, self._dynamic, self._batch, self._options,
                                        self.rid, self._unnumbered)
        # The device's service thread holds the loop future: refer back weakly, so that a
        # runner nobody references can be collected (and its __del__ release the IPUs).
        ref = weakref.ref(self)

        def on_loop_end(fut: cf.Future[None]) -> None:
            life = ref()
            if life is not None:
                life._loop_ended(fut)
        loop.add_done_callback(on_loop_end)
        self.reloading = None     # (its values are loaded: a reset's new session loads them too)
        return path

    def rerun_load(self, values: dict[str, memoryview],
                   forget: Callable[[], None]) -> TransferPath:
        """New data for inputs of the Load programs (handle -> bytes), in place: Main's loop
        ends (its rings are reset: ``forget()`` then forgets what was in flight), the
        session feeds ``values`` (constants in shared memory, as frozen inputs are) and
        runs the Load programs again on the same device and IPU processes, then Main loops
        again. Nothing may be in flight (the caller holds the submit lock).

        Interrupted (KeyboardInterrupt, a signal handler's exception), ``reloading`` keeps
        the values (merged with those of an earlier interrupted call): the replica does
        not look well until a call with them (``{}`` given) has finished; every step is
        idempotent."""
        s = self.session
        if s is None or self.closed:
            raise self.closed_error()
        if self.error is not None:
            raise unusable_error(self.rid, self.error, self._auto_reset) from self.error
        if self.reloading is not None:
            values = {**self.reloading, **values}
        self.reloading = values      # first: no call before it
        s.direct.stop_main_loop(self._stop_s)
        forget()
        for handle, data in values.items():
            s.freeze_input(handle, data)
        s.runLoadPrograms()
        return self._start(s)

    def _loop_ended(self, fut: cf.Future[None]) -> None:
        """The device's main loop ended: stop() (normal) or a failure."""
        if fut is not self.loop or self.closed:
            return
        exc = fut.exception()
        if exc is None:
            return
        if isinstance(exc, DeviceRuntimeError) and exc.replica is None:
            # Poplar's classes name the replica too (the device named the IPU and program)
            named = exc.copy_with(f"replica {self.rid}: {exc}", replica=self.rid)
            named.__cause__ = exc.__cause__
            exc = named
        self._on_lost(exc if isinstance(exc, ModelRuntimeError) else DeviceLostError(str(exc)))

    def mark_closed(self) -> bool:
        """Mark the replica closed; False if it already was (close is idempotent)."""
        with self._close_lock:
            if self.closed:
                return False
            self.closed = True
            return True

    def stalled_error(self, what: str) -> DeviceTimeoutError:
        """The device made no progress for the host sync timeout while ``what``."""
        pids = self._pids.pids
        peers = "; ".join(describe_process(p) for p in pids) if pids else "no IPU process known"
        s = self.session
        dev = s.device() if s is not None else None
        where = f"{dev.describe()}: " if dev is not None else ""
        return DeviceTimeoutError(
            f"replica {self.rid}: {where}{what} for {self.sync_s:g} s without progress from "
            f"the device (the host sync timeout, IPU_EMULATOR_HOST_SYNC_TIMEOUT); {peers}")

    def slow_output(self, since: float) -> None:
        """A wait for an output that began at ``since`` (monotonic) is long: raise if the
        replica closed, or if the device made no progress for the host sync timeout."""
        self.raise_if_closed()
        if time.monotonic() - since >= self.sync_s:
            raise self.stalled_error("waiting for the outputs of a request")

    def closed_error(self) -> InvalidStateError:
        return InvalidStateError(f"replica {self.rid}: the ModelRunner was closed")

    def raise_if_closed(self) -> None:
        if self.closed:
            raise self.closed_error()

    def set_error(self, err: ModelRuntimeError, nobody_heard: bool) -> bool:
        """Record the replica's failure (the first one only); True if it was the first.
        ``nobody_heard``: no request in flight hears of it (the next request is told)."""
        if self.error is not None:
            return False
        self.error = err
        self.error_unheard = nobody_heard
        return True

    def looks_well(self) -> bool:
        """The check before each request: open, no earlier failure, and every IPU process
        alive (one poll of their pidfds, ~0.5 us). False: ``usable`` sorts it out."""
        return not (self.closed or self.error is not None or not self._pids_exact
                    or self.reloading is not None or self._pids.dead_pid() is not None)

    def well_but_unpolled(self) -> bool:
        """``looks_well`` without the poll of a device of one IPU process (the fused path
        polls it while the device computes: ``gone``). A device of several is polled
        first: its live first IPU would take a request while a later one is already
        gone, and that request must find the device to reset, not fail in flight."""
        if self._several:
            return self.looks_well()
        return not (self.closed or self.error is not None or not self._pids_exact
                    or self.reloading is not None)

    def gone(self) -> bool:
        """True if an IPU process of the device has exited (one poll, never blocks)."""
        return self._pids.dead_pid() is not None

    def usable(self) -> bool:
        """Raise if the replica cannot take a request; False if it must be reset first
        (``auto_reset``), True if it is well."""
        if self.closed:
            raise InvalidStateError(f"replica {self.rid}: the ModelRunner is closed")
        err = self.error
        if err is None:
            err = self._check_device()
        if err is None:
            return True
        if not self.resets(err):
            if self.error_unheard and err is self.error:
                self.error_unheard = False
                raise again(err)
            raise unusable_error(self.rid, err, self._auto_reset) from err
        return False

    def stalled(self, err: ModelRuntimeError | None,
                fail: Callable[[ModelRuntimeError], None]) -> bool:
        """A wait gave up on the device (``err``, the host sync timeout). With auto_reset
        the replica fails (``fail(err)``: what is in flight hears it, the next request
        resets it): False. Else True: submits first wait for the device to progress."""
        if err is None or not self.resets(err) or self.closed:
            return True
        fail(err)
        return False

    def resets(self, err: BaseException) -> bool:
        """Whether ``auto_reset`` resets the replica after ``err`` (seed 002: after an
        application runtime error, or a recoverable one whose action is IPU_RESET; and
        after the emulator's own failures of a device: a lost IPU process, a program
        that failed, a device stalled past the host sync timeout). Off: never."""
        if not self._auto_reset:
            return False
        if isinstance(err, RecoverableRuntimeError):
            return err.recovery_action is RecoveryAction.IPU_RESET
        return not isinstance(err, UnrecoverableRuntimeError)

    def _check_device(self) -> ModelRuntimeError | None:
        """Notice a dead IPU process before a request is sent to it (~0.3 us)."""
        s = self.session
        if s is None:
            return None
        pid = self._pids.dead_pid()
        if pid is None and self._pids_exact:
            # Every IPU process is alive (pidfds, one poll). Other losses fail the
            # main-loop future, which sets self.error.
            return None
        lost = s.direct.failure()
        if lost is None and pid is not None:
            err = s.direct.translate(PeerDiedError(f"IPU process {pid} died", pid))
            lost = err if isinstance(err, ModelRuntimeError) else DeviceLostError(str(err))
        if lost is not None:
            self._on_lost(lost)
        return lost

    def translate(self, exc: BaseException) -> ModelRuntimeError:
        """A ring's or the link's exception as the runtime error the user gets."""
        if self.error is not None:
            return self.error
        if self.closed:   # a request that raced with close() finds its rings closed
            return self.closed_error()
        if isinstance(exc, ModelRuntimeError):   # e.g. SequenceMismatchError
            return exc
        s = self.session
        err = s.direct.translate(exc) if s is not None else exc
        if isinstance(err, ModelRuntimeError):
            return err
        return DeviceLostError(f"replica {self.rid}: {exc}")

    def invalidate_rings(self) -> None:
        """Wake every thread blocked on one of the rings (the replica failed)."""
        path = self.path
        for ring in (path.rings if path is not None else []):
            try:
                ring.invalidate()
            except Exception:   # already closed with its session: nobody can wait on it
                pass

    def reset(self) -> TransferPath:
        """auto_reset: restart the device (a new session on a fresh device) and reload."""
        # formatted now: a record holding the error would keep its traceback (and the
        # failed requests' memory) alive for as long as a handler keeps the record
        _log.warning("replica %d: auto_reset after %s", self.rid, str(self.error))
        t0 = time.monotonic_ns()
        old = self.session
        self.session = None
        if old is not None:
            # bounded: a hung or stopped IPU process is killed rather than waited for
            limit = min(self.sync_s, self._stop_s)
            try:
                old.stop_within(limit, kill_if_hung=True, closing=True)
            except ModelRuntimeError:
                pass
            finally:
                old.close_within(limit, kill_if_hung=True)
        path = self.open()
        if recorder.ON:
            _tracing.life("reset", self.trace_key, self.rid, t0, self.session)
        return path

    def close(self, save: SaveFn | None, limit: float) -> None:
        """Stop the loop, optionally run the save programs, close the session: within
        ``limit`` s, killing a device that does not stop. ``self.closed`` is set by the
        replica before (it fails what is in flight first)."""
        s = self.session
        if s is None:
            return
        t0 = time.monotonic_ns()
        try:
            healthy = self.error is None and s.direct.failure() is None
            if save is not None and healthy:
                try:
                    s.direct.stop_main_loop(limit)      # stays runnable, device memory kept
                    save(s)
                except ModelRuntimeError as exc:
                    _log.warning("replica %d: save programs failed: %s", self.rid, exc)
                    if isinstance(exc, DeviceTimeoutError):
                        limit = 0.0   # the bound is spent: kill the device, do not wait again
            s.stop_within(limit, kill_if_hung=True, closing=True)
        finally:
            s.close_within(limit, kill_if_hung=True)
            if recorder.ON:
                _tracing.life("close", self.trace_key, self.rid, t0, s)
            self.session = None
            self._pids.close()


_RECOVER = {
    RecoveryAction.IPU_RESET: "set ModelRunnerConfig.auto_reset = True to reset the IPU "
                              "automatically, or close the runner and make a new one",
    RecoveryAction.LINK_RESET: "reset the IPU-Links: close the runner and make a new one",
    RecoveryAction.PARTITION_RESET: "reset the partition: close the runner and make a new one",
    RecoveryAction.FULL_RESET: "reset the system: close the runner and make a new one",
}


def unusable_error(rid: int, err: ModelRuntimeError, auto_reset: bool) -> ModelRuntimeError:
    """What a request to replica ``rid`` raises after ``err`` failed it and nothing reset
    it: Poplar's classes as themselves (the same class and recovery action), other
    failures as ``DeviceLostError``; the caller raises it from ``err``."""
    if isinstance(err, RecoverableRuntimeError):
        how = _RECOVER[err.recovery_action]
    elif isinstance(err, UnrecoverableRuntimeError):
        how = "close the runner and make a new one"
    elif isinstance(err, DeviceRuntimeError):
        how = _RECOVER[RecoveryAction.IPU_RESET]
    else:
        return DeviceLostError(
            f"replica {rid} is unusable after an earlier failure ({err}); set "
            "ModelRunnerConfig.auto_reset = True to restart the device automatically")
    return err.copy_with(f"replica {rid} is unusable after an earlier "
                         f"{type(err).__name__} ({err}); {how}", replica=rid)
