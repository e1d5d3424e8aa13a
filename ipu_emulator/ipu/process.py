"""The IPU process: one OS process per emulated IPU, serving its control ring.

::

    host process                          this process
    ------------                          ------------
    control ring  --LOAD/RUN/LOOP/STOP-->  serve(): one request at a time
                                              |
                                              v
                                           Interpreter.run_program(i, io)
                                              |  io.read_input(handle)
    stream ring (in)  ----transfers----->     |    empty + MODE_EVENT: post NEED, wait
                                              |  io.write_output(handle)
    stream ring (out) <---transfers------     |    then MODE_EVENT: post OUT
                                              v
    event ring    <--DONE/ERROR/NEED/OUT--  results, device-side tracebacks

``serve()`` is a loop of named steps: take the next message (``_control``),
dispatch it (LOAD: ``_loading``; RUN/LOOP: ``_scheduling``; HOST: ``_handoff``),
answer DONE or ERROR; an ending (``_ending``: STOP, SHUTDOWN, the host or the
client gone) is caught in one place, ``_serve``, and acted on there.

Idle or blocked, this process sleeps until something happens; nothing wakes it
periodically (an idle IPU costs no CPU): idle, it blocks on the control ring; a
program waiting on a stream blocks on that ring; a control message (STOP, SHUTDOWN,
HOST) reaches it through the control ring's doorbell (``Ring.set_doorbell``), and a
host that stops a program also invalidates its stream rings. The host's liveness is
one ``HostWatch`` (``_host_watch``): a thread on the host's pidfd that interrupts
every ring wait when the host exits, or, where that cannot run (a loopback device, no
pidfds), waits that wake in slices and look. When the host is gone this process
unlinks every shared-memory object it knows of plus every object of this tag whose
name carries the host's pid, then exits: a SIGKILLed host leaves no IPU process and
nothing in /dev/shm.

Pool mode (``--pool``, started by ``ipu-emulator daemon``): the daemon is both the
parent and ``--host-pid``; hosts come and go (``_handoff``).

What the loop assumes about running in an OS process of its own (its pid in READY,
how the host's liveness is checked, moving off the host's CPU, unlinking a dead
host's objects) is a :class:`ProcessHooks`, whose defaults are this process's; only
``main()`` (and ``python -m ipu_emulator``'s ``os._exit``) sets up logging and
signals and exits. A loopback device (:mod:`ipu_emulator.ipu.in_thread`) runs the
same loop on a thread of the host.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback
from typing import Any, Callable

import posix_ipc

from shm import (PeerDiedError, Ring, RingInvalidatedError, RingTimeoutError,
                 ShmError, WaitInterrupted, cleanup, pid_alive)

from ipu_emulator import ipu_protocol, package_hash, titles
from ipu_emulator.ipu._control import ControlWire
from ipu_emulator.ipu._ending import PASSES, Ending, RunEnded
from ipu_emulator.ipu._fault_injection import FaultInjector
from ipu_emulator.ipu._handoff import ClientHandOff
from ipu_emulator.ipu._host_memory import HostMemory
from ipu_emulator.ipu._host_watch import DOORBELL, SLICE, HostWatch
from ipu_emulator.ipu._loading import Executables, Loader
from ipu_emulator.ipu._options import DeviceOptions, ProcessHooks
from ipu_emulator.ipu._placement import KeepApart
from ipu_emulator.ipu._scheduling import Scheduler
from ipu_emulator.ipu._sessions import keep_sessions
from ipu_emulator.ipu._stream_io import _RequestError
from ipu_emulator.ipu_protocol import ErrorKind, Message, Op, Ready, error_body
from ipu_emulator.settings import IpuSettings
from ipu_emulator.trace import recorder

__all__ = ["DeviceOptions", "DeviceProcess", "ProcessHooks", "main"]

_log = logging.getLogger("ipu_emulator.ipu.process")


class DeviceProcess:
    """The main loop of one IPU process. ``serve()`` returns the exit code."""

    def __init__(self, opts: DeviceOptions, hooks: ProcessHooks | None = None) -> None:
        self.opts = opts
        self.hooks = hooks = hooks if hooks is not None else ProcessHooks()
        self.settings = settings = IpuSettings.current()   # its launch's, read once
        self.control = Ring.attach(opts.control)
        self.events = Ring.attach(opts.events, prefault=False)
        # The events ring watches the host itself: a full ring must not block forever on
        # a dead host. The other waits learn it from the host watch.
        self.events.set_peer(opts.host_pid)
        self._watch = watch = HostWatch(opts.host_pid, hooks.host_alive)
        self._bell = watch.threaded          # a control message rings the doorbell
        self._slice = watch.wait_slice
        self.known: set[str] = {opts.control, opts.events}   # names unlinked if the host dies
        self.host_memory = HostMemory()   # host arrays read in place (TAG_SHARED inputs)
        self._executables = Executables(self.host_memory)
        # off the host's CPU while serving it (host pid 0: never)
        self._apart = KeepApart(opts.host_pid if hooks.keep_apart else 0)
        self.keeps_apart = self._apart.enabled
        self._wire = ControlWire(self.control, watch, opts.pool, self._apply_modes)
        self._faults = FaultInjector(self._wire, opts.ipu_id, hooks.pid is None,
                                     self._describe)
        self._loader = Loader(self._options, self._executables, self._faults, self.known,
                              settings)
        self._scheduler = Scheduler(self, self.control, self._wire, watch, self._apart,
                                    self._executables, self._faults, self._describe)
        self._current: Message | None = None   # the request being served
        self.later: list[Callable[[], None]] = []   # run once it is answered (_handoff)
        self._handoff = ClientHandOff(self, self.control, self.events, watch, self._wire,
                                      self._executables, self._faults, self._apart,
                                      self.known)
        self.set_title()

    def _options(self) -> DeviceOptions:
        return self.opts

    def _describe(self) -> str:
        return self.opts.describe()

    def set_title(self) -> None:
        """The process title (ProcessHooks.title): this IPU and the host it serves."""
        if not self.hooks.title:
            return
        o = self.opts
        titles.set_title(titles.ipu(o.ipu_id, self._watch.client, o.host_pid) if o.pool
                         else titles.ipu(o.ipu_id, o.host_pid))

    def as_group_member(self) -> None:
        """Behave as one IPU of several (as a RUN of a sharded executable does): do not
        keep off the host's CPU."""
        self._apart.release()
        self.keeps_apart = False

    # -- wire -----------------------------------------------------------------

    def post(self, msg: Message) -> None:
        ipu_protocol.send(self.events, msg)

    def wait_on(self, fn: Any) -> Any:
        """Call a blocking ring operation until it is done, checking the control ring and
        the host when it is woken (or between slices, without a watch thread).

        With the watch thread, a control message wakes it through the control ring's
        doorbell (its publish sends ``DOORBELL`` to this process, which the watch turns
        into an interrupt of the waits), and the host's exit through the watch."""
        while True:
            try:
                if not self._bell:
                    return fn(self._slice)
                self.control.set_doorbell(DOORBELL)
                try:
                    if self.control.readable():   # came before the doorbell was armed
                        raise RingTimeoutError("a control message is waiting")
                    # while it holds a CPU, the first wait ends after a slice to give the
                    # CPU back (see _placement); then it sleeps until woken
                    return fn(SLICE if self._apart.hold.cpu >= 0 else None)
                finally:
                    self.control.set_doorbell(0)
            except RingTimeoutError:
                self._apart.release()   # idle for a slice: its CPU is free for others
            except WaitInterrupted:
                self._watch.interrupted()
            except RingInvalidatedError:
                # A host that stops invalidates the streams after sending STOP (or
                # SHUTDOWN) to wake this wait at once: the control message wins.
                self._wire.poll()
                raise
            self._watch.check()
            self._wire.poll()

    # -- main loop --------------------------------------------------------------

    def serve(self) -> int:
        """Serve until SHUTDOWN or the host's end; the exit code."""
        ending = self._serve()
        if ending is Ending.HOST_GONE:
            _log.info("host process %d is gone; cleaning up and exiting", self.opts.host_pid)
            if self.hooks.unlink_on_host_gone:
                self.cleanup_host_objects()
            else:
                self.close()
            return 0
        self._say_bye()
        self.close()
        return 0

    def _serve(self) -> Ending:
        """Say READY, then take a message, dispatch it, and again, until the process must
        end: the one place where an ending (``RunEnded``) is caught and acted on."""
        step: Callable[[], None] = self._ready
        while True:
            try:
                step()
                step = self._next_request
                continue
            except ipu_protocol.ProtocolError as exc:
                _log.error("ignoring a malformed control message: %s", exc)
                continue
            except RunEnded as exc:
                ending: Ending | None = exc.ending
            except PeerDiedError as exc:   # a ring's own watch of its peer
                ending = self._watch.ending_of(exc)
            except WaitInterrupted:   # e.g. posting an event when the host died
                ending = self._watch.after_interrupt()
            if ending is None:
                continue
            if ending is Ending.STOPPED and self._current is not None:
                self._scheduler.stopped(self._current)
            elif ending is Ending.CLIENT_GONE:
                self._handoff.drop_client()
            elif ending is not Ending.STOPPED:
                return ending

    def _ready(self) -> None:
        self._loader.interpreter_cls = _import_interpreter()
        o = self.opts
        self.post(Message(Op.READY, body=Ready(
            self.hooks.pid or os.getpid(), package_hash(), o.ipu_id, o.ipu_version,
            o.capacity).body()))

    def _next_request(self) -> None:
        """Take the next message and serve it (SHUTDOWN: RunEnded)."""
        self._current = None
        msg = self._wire.next()
        if msg.op is Op.SHUTDOWN:
            raise RunEnded(Ending.SHUTDOWN)
        self._current = msg
        try:
            self._serve_one(msg)
        finally:
            if self.later:
                self._run_later()

    def _run_later(self) -> None:
        """What the request just answered left to do (``later``), in order."""
        later, self.later = self.later, []
        for fn in later:
            try:
                fn()
            except Exception:   # pragma: no cover - closing a mapping, setting a title
                _log.exception("after the answer: %r failed", fn)

    def _serve_one(self, msg: Message) -> None:
        if recorder.ON:
            self._dispatch_traced(msg)
        else:
            self._dispatch(msg)

    def _say_bye(self) -> None:
        try:
            ipu_protocol.send(self.events, Message(Op.BYE), timeout=0.5)
        except ShmError:
            pass

    def _dispatch_traced(self, msg: Message) -> None:
        """``_dispatch`` as a slice of the timeline (ipu_emulator.trace)."""
        t0 = time.monotonic_ns()
        try:
            self._dispatch(msg)
        finally:
            recorder.ipu(recorder.I_OP, t0, time.monotonic_ns() - t0, int(msg.op), msg.seq)

    def _dispatch(self, msg: Message) -> None:
        """Serve one request and answer it: DONE, or ERROR (MODES is not answered)."""
        op = msg.op
        if op is not Op.HOST:
            self._handoff.idle = False
        try:
            if op is Op.RUN or op is Op.LOOP:
                self._scheduler.run(msg)
            elif op is Op.LOAD:
                self._loader.load(msg.body)
            elif op is Op.MODES:
                self._apply_modes(msg)
                return
            elif op is Op.STOP:
                active = self._executables.active
                if active is not None and not msg.value:
                    active.stopped = True
            elif op is Op.UNLOAD:
                self._executables.unload(str((msg.body or {}).get("key", "")))
            elif op is Op.RESET:
                for key in list(self._executables.cache):
                    self._executables.unload(key)
            elif op is Op.HOST:
                self._handoff.hand_to(msg.value, msg.body)
            elif op is not Op.PING:
                raise _RequestError(ErrorKind.PROTOCOL, f"unexpected control message {op.name}")
        except _RequestError as exc:
            self.post(Message(Op.ERROR, seq=msg.seq, body=error_body(
                exc.kind, str(exc), exc.tb, **getattr(exc, "extra", {}))))
            return
        except PASSES:
            raise
        except Exception as exc:  # a bug or a broken ring: report it, keep serving
            _log.exception("%s failed", op.name)
            self.post(Message(Op.ERROR, seq=msg.seq, body=error_body(
                ErrorKind.PROTOCOL, f"{op.name} failed on {self._describe()}: "
                f"{type(exc).__name__}: {exc}", traceback.format_exc())))
            return
        self.post(Message(Op.DONE, seq=msg.seq))

    def _apply_modes(self, msg: Message) -> None:
        loaded = self._executables.active
        modes = msg.body
        if loaded is None or not isinstance(modes, list):
            return
        for st, mode in zip(loaded.streams, modes):
            if mode in ipu_protocol.MODES:
                st.mode = mode
        loaded.steps.clear()   # which streams a C step may serve depends on their modes

    # -- exit ------------------------------------------------------------------

    def close(self) -> None:
        """Close every mapping of this process: executables (the kept ones last), host
        memory, rings."""
        self._executables.close()
        self._loader.close()
        self.control.close()
        self.events.close()

    def cleanup_host_objects(self) -> None:
        """The host died: unlink everything it (and this process) created."""
        try:
            self.close()
        except Exception:  # pragma: no cover - best effort
            _log.exception("closing mappings")
        host = self.opts.host_pid
        removed = sum(cleanup.unlink_named(name) for name in self.known)
        removed += cleanup.unlink_created_by((host, os.getpid()))
        _log.info("removed %d shared-memory objects of dead host %d", removed, host)


def _import_interpreter() -> Any:
    from ipu_emulator.ipu.interpreter import Interpreter
    return Interpreter


def _parse_args(argv: list[str] | None) -> tuple[DeviceOptions, str]:
    """The command line: the IPU's options and the trace buffer to record into ("": none)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m ipu_emulator",
                                     description="one emulated IPU process")
    parser.add_argument("--control", required=True)
    parser.add_argument("--events", required=True)
    parser.add_argument("--host-pid", type=int, required=True)
    parser.add_argument("--ipu-id", type=int, default=0)
    parser.add_argument("--ipu-version", type=int, choices=(2, 21), default=21)
    parser.add_argument("--tiles", type=int, default=1472)
    parser.add_argument("--memory-per-tile", type=int, default=624 * 1024)
    parser.add_argument("--num-ipus", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--label", default="")
    parser.add_argument("--pool", action="store_true",
                        help="owned by a daemon (--host-pid): hosts change through HOST messages")
    parser.add_argument("--trace-buffer", default="",
                        help="record a timeline into this trace buffer (ipu_emulator.trace)")
    a = parser.parse_args(argv)
    return DeviceOptions(control=a.control, events=a.events, host_pid=a.host_pid,
                         ipu_id=a.ipu_id, ipu_version=a.ipu_version, tiles_per_ipu=a.tiles,
                         memory_per_tile=a.memory_per_tile, num_ipus=a.num_ipus,
                         threads=a.threads, label=a.label, pool=a.pool), a.trace_buffer


def main(argv: list[str] | None = None) -> int:
    """``python -m ipu_emulator --control NAME --events NAME --host-pid PID ...``"""
    opts, trace_buffer = _parse_args(argv)
    settings = IpuSettings.current()   # its launch's, from its environment
    logging.basicConfig(
        level=settings.device_log_level,
        format=f"%(asctime)s ipu{opts.ipu_id}[{os.getpid()}] %(levelname)s %(name)s: "
               "%(message)s")
    _log.debug("settings: %s", settings)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the host decides when we stop
    if trace_buffer:
        try:
            recorder.start_ipu(trace_buffer, opts.ipu_id)
        except (ShmError, OSError, ValueError, posix_ipc.Error) as exc:
            _log.warning("not recording a timeline: %s", exc)
    if opts.pool:   # lent to host after host: the next may load the same executable
        keep_sessions()
    try:
        dev = DeviceProcess(opts, ProcessHooks(title=True))
    except Exception as exc:
        if not pid_alive(opts.host_pid):   # the host died before we could attach
            _log.info("host %d died before this IPU process started", opts.host_pid)
            cleanup.unlink_created_by((opts.host_pid, os.getpid()))
            return 0
        _log.error("cannot attach the control and event rings: %s", exc)
        return 70
    try:
        return dev.serve()
    except Exception:
        _log.exception("IPU process failed")
        if not pid_alive(opts.host_pid):
            dev.cleanup_host_objects()
        return 70
