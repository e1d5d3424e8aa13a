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

Idle or blocked, this process sleeps until something happens; nothing wakes
it periodically (an idle IPU costs no CPU):

- idle, it blocks on the control ring;
- a program waiting on a stream blocks on that ring; a control message (STOP,
  SHUTDOWN, HOST) reaches it through the control ring's doorbell
  (``Ring.set_doorbell``: the publish sends ``_DOORBELL``), and a host that
  stops a program also invalidates its stream rings;
- a thread (``_HostWatch``) blocks on the pidfds of the host and, in pool
  mode, of the host it is lent to, and interrupts every ring wait when one
  exits (``shm.ring.interrupt_all``).

Where that thread cannot run (a loopback device, or no pidfds) the waits
re-check the control ring and the host every ``_SLICE`` seconds instead. One
IPU of several waits the same way: the host stops it after another IPU's
failure with a STOP (the doorbell) and invalidates its IPU-Links. The host's
liveness is also checked between main-loop iterations (``getppid()`` when the
host is our parent, a pid check otherwise; the event ring also watches the
host's pid). When the host is gone this
process unlinks every shared-memory object it knows of plus every object of
this tag whose name carries the host's pid, then exits: a SIGKILLed host
leaves no IPU process and nothing in /dev/shm.

Pool mode (``--pool``, started by ``ipu-emulator daemon``): the daemon is
both the parent and ``--host-pid``; hosts come and go. The daemon hands the
process to a host with ``HOST(value=host pid)`` and takes it back with
``HOST(0)``; in between the process also watches that host, and if it dies
(or a HOST arrives during a program) the process drops the host's executables,
unlinks every object a dead host created, and goes on serving: it stays warm.

What the loop assumes about running in an OS process of its own (its pid in
READY, how the host's liveness is checked, moving off the host's CPU, unlinking
a dead host's objects) is a :class:`ProcessHooks`, whose defaults are this
process's; only ``main()`` (and ``python -m ipu_emulator``'s ``os._exit``) sets
up logging and signals and exits. A loopback device
(:mod:`ipu_emulator.ipu.in_thread`) runs the same loop on a thread of the host.
"""

from __future__ import annotations

import collections
import logging
import mmap
import os
import select
import signal
import threading
import time
import traceback
from dataclasses import dataclass, replace
from typing import Any, Callable

import posix_ipc

from shm import (PeerDiedError, Region, Ring, RingInvalidatedError, RingTimeoutError, ShmError,
                 PeerWatch, WaitInterrupted, WouldBlock, naming, pid_alive)
from shm import ring as ring_waits
from shm.cleanup import list_objects

from ipu_emulator import package_hash, ipu_protocol, titles
from ipu_emulator.ipu._constants import memory_ranges
from ipu_emulator.ipu._host_memory import HostMemory
from ipu_emulator.ipu._placement import KeepApart
from ipu_emulator.ipu._stream_io import _Loaded, _RequestError, _RingIO, _Stream
from ipu_emulator.errors import ExecutableError
from ipu_emulator.executable import body_crc32, is_link, is_sync
from ipu_emulator.faults import Fault, FaultTable
from ipu_emulator.ipu_protocol import ErrorKind, Message, Op, error_body
from ipu_emulator.settings import IpuSettings
from ipu_emulator.trace import recorder

__all__ = ["DeviceOptions", "DeviceProcess", "ProcessHooks"]

_log = logging.getLogger("ipu_emulator.ipu.process")
_monotonic = time.monotonic

_SLICE = 0.1      # seconds between STOP checks while a program waits on a stream, when the
# host is not watched by a thread (a loopback device: ProcessHooks.host_alive)
_HOST_CHECK = 0.25  # seconds between checks that the host is alive
_DOORBELL = signal.SIGURG   # rung by the control ring while a program waits (see wait_on);
# ignored by default: a stale doorbell (this process died armed, its pid reused) harms none
_CACHE = 4        # loaded executables kept per device (sessions sharing it)
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_CRC_APART = 1 << 20   # weights sections this large are checksummed while sessions are made
_PREFAULT_MAX = 512 * 1024   # pre-fault stream rings with transfers up to this size
_PROGRAM_KINDS = {"load": 1, "main": 2, "save": 3}   # program name -> recorder.PROGRAM_KINDS


@dataclass(frozen=True)
class DeviceOptions:
    control: str
    events: str
    host_pid: int
    ipu_id: int = 0
    ipu_version: int = 21
    tiles_per_ipu: int = 1472
    memory_per_tile: int = 624 * 1024
    num_ipus: int = 1
    threads: int = 1
    label: str = ""
    pool: bool = False

    @property
    def capacity(self) -> int:
        return self.num_ipus * self.tiles_per_ipu * self.memory_per_tile


@dataclass(frozen=True)
class ProcessHooks:
    """What :class:`DeviceProcess` assumes about the OS process it runs in.

    The defaults are those of an IPU process of its own (``main()``). A loopback device
    runs the loop on a thread of the host itself and replaces each of them.
    """

    pid: int | None = None
    """The pid READY reports (None: ``os.getpid()``)."""
    host_alive: Callable[[], bool] | None = None
    """Whether the host still lives, asked at most every ``_HOST_CHECK`` s; False ends
    ``serve()`` as when the host died. None: ``getppid()`` when the host is the parent,
    else a pid check of ``DeviceOptions.host_pid``."""
    keep_apart: bool = True
    """Narrow this thread's CPU affinity off the host's CPU while serving (``_placement``)."""
    unlink_on_host_gone: bool = True
    """When the host is gone, unlink every shared-memory object it (and this process)
    created; else only close this side's mappings."""
    title: bool = False
    """Set the process title (what ps and top show) to name this IPU and its host:
    ``ipu-emulator: ipu 3 (host 1234)``. Only ``main()`` does: the title is the whole
    process's, never a host's."""


class _NeverApart:
    """A KeepApart that never looks (see ``_run``)."""

    next_look = float("inf")

    def check(self) -> None:
        pass


_NEVER_APART: Any = _NeverApart()


class _Stopped(Exception):
    """STOP arrived while a program ran."""


class _Shutdown(Exception):
    """SHUTDOWN arrived while a program ran."""


class _HostGone(Exception):
    """The host process died."""


class _ClientGone(_HostGone):
    """Pool mode: the host using this IPU died, or the daemon is taking the IPU back."""


class _FaultError(_RequestError):
    """An injected fault's error: its ERROR body also has ``extra`` (action, ipu, program)."""

    def __init__(self, kind: ErrorKind, message: str, extra: dict[str, Any]) -> None:
        super().__init__(kind, message)
        self.extra = extra


class _FaultyIO:
    """The StreamIO of Main runs under a fault schedule: a run is checked against it
    (``DeviceProcess.fire_fault``) once its inputs are in, as it writes its first output;
    no C steps (each run is seen)."""

    def __init__(self, dev: "DeviceProcess", loaded: _Loaded, io: _RingIO) -> None:
        self._dev = dev
        self._loaded = loaded
        self._io = io
        self._program = -1     # armed: the run of this program has not been checked

    def scheduled(self) -> bool:
        return self._dev.faults_scheduled()

    def arm(self, program: int) -> None:
        self._program = program

    def _check(self) -> None:
        program, self._program = self._program, -1
        if program >= 0:
            self._dev.fire_fault(self._loaded, program)

    @property
    def disconnected(self) -> bool:
        return self._io.disconnected

    def read_input(self, handle: str, dest: memoryview) -> None:
        self._io.read_input(handle, dest)

    def write_output(self, handle: str, src: memoryview) -> None:
        self._check()
        self._io.write_output(handle, src)

    def acquire_input(self, handle: str, nbytes: int) -> memoryview:
        return self._io.acquire_input(handle, nbytes)

    def release_input(self, handle: str) -> None:
        self._io.release_input(handle)

    def acquire_output(self, handle: str, nbytes: int) -> memoryview:
        self._check()
        return self._io.acquire_output(handle, nbytes)

    def publish_output(self, handle: str) -> None:
        self._io.publish_output(handle)

    def forget_redirects(self) -> None:
        self._io.forget_redirects()


class DeviceProcess:
    """The main loop of one IPU process. ``serve()`` returns the exit code."""

    def __init__(self, opts: DeviceOptions, hooks: ProcessHooks | None = None) -> None:
        self.opts = opts
        self.hooks = hooks = hooks if hooks is not None else ProcessHooks()
        self.control = Ring.attach(opts.control)
        self.program_runs = 0   # programs run; also published in the control ring's user word
        self.events = Ring.attach(opts.events, prefault=False)
        # The events ring watches the host (a full ring must not block forever on a dead
        # host). The control and stream rings are waited on in slices instead, with the
        # cheap host check of _check_host between slices.
        self.events.set_peer(opts.host_pid)
        self._parent_is_host = os.getppid() == opts.host_pid
        self._host_watch = PeerWatch(opts.host_pid) if opts.host_pid > 0 else None
        self._next_host_check = 0.0
        self._known: set[str] = {opts.control, opts.events}
        self._pending: collections.deque[Message] = collections.deque()
        self._cache: collections.OrderedDict[str, _Loaded] = collections.OrderedDict()
        self.host_memory = HostMemory()   # host arrays read in place (TAG_SHARED inputs)
        # off the host's CPU while serving it (host pid 0: never)
        self._apart = KeepApart(opts.host_pid if hooks.keep_apart else 0)
        self.keeps_apart = self._apart.enabled
        self._active: _Loaded | None = None
        self._stop_seq: int | None = None
        self._stop_soft = False   # STOP with value 1: end the running loop, stay runnable
        self._interpreter_cls: Any = None
        self._client = 0   # pool mode: the host the daemon handed this IPU to (0: none)
        self._client_watch: PeerWatch | None = None
        # A thread of this process blocked on the host's (and client's) pidfd interrupts
        # every ring wait when one exits: the waits need no periodic wake. Without it
        # (a loopback device, or no pidfds) they check in slices.
        self._watch = _HostWatch.start(opts.host_pid) if hooks.host_alive is None else None
        self._wait_slice: float | None = None if self._watch is not None else _SLICE
        self._slice: float | None = self._wait_slice   # of wait_on (see _run)
        # fault schedules (ipu_emulator.faults): the daemon's (HOST) and the host's (LOAD)
        self._daemon_faults: list[FaultTable] = []
        self._host_faults: list[FaultTable] = []
        self._set_title()

    def _set_title(self) -> None:
        """The process title (ProcessHooks.title): this IPU and the host it serves."""
        if not self.hooks.title:
            return
        o = self.opts
        titles.set_title(titles.ipu(o.ipu_id, self._client, o.host_pid) if o.pool
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
        the host when it is woken (or between slices, see _SLICE).

        Without slices, a control message wakes it through the control ring's doorbell
        (``Ring.set_doorbell``: its publish sends ``_DOORBELL`` to this process, which
        _HostWatch turns into an interrupt of the waits), and the host's exit through
        _HostWatch."""
        bell = self._slice is None and self._watch is not None
        while True:
            try:
                if not bell:
                    return fn(self._slice)
                self.control.set_doorbell(_DOORBELL)
                try:
                    if self.control.readable():   # came before the doorbell was armed
                        raise RingTimeoutError("a control message is waiting")
                    # while it holds a CPU, the first wait ends after a slice to give the
                    # CPU back (see _placement); then it sleeps until woken
                    return fn(_SLICE if self._apart.hold.cpu >= 0 else None)
                finally:
                    self.control.set_doorbell(0)
            except RingTimeoutError:
                self._apart.release()   # idle for a slice: its CPU is free for others
            except WaitInterrupted:
                self._interrupted()
            except RingInvalidatedError:
                # A host that stops invalidates the streams after sending STOP (or
                # SHUTDOWN) to wake this wait at once: the control message wins.
                self.poll_control()
                raise
            self._check_host()
            self.poll_control()

    def _interrupted(self) -> None:
        """A ring wait was interrupted (_HostWatch): raise _HostGone or _ClientGone, or,
        if neither is gone (a stale wake), let the waits block again."""
        ring_waits.resume_all()   # first: an exit after the check below interrupts again
        self._next_host_check = 0.0
        self._check_host()

    def _check_host(self) -> None:
        """Raise _HostGone if the host died (at most one real check per _HOST_CHECK s).

        In embedded mode the host is our parent, and its death re-parents us: a getppid()
        is enough. Otherwise (a daemon started us) ask the OS about the host's pid.
        """
        now = time.monotonic()
        if now < self._next_host_check:
            return
        self._next_host_check = now + _HOST_CHECK
        host = self.opts.host_pid
        if self.hooks.host_alive is not None:
            alive = self.hooks.host_alive()
        else:
            alive = (os.getppid() == host if self._parent_is_host
                     else self._host_watch is None or self._host_watch.alive())
        if not alive:
            raise _HostGone()
        if self._client_watch is not None and not self._client_watch.alive():
            raise _ClientGone()

    def _take_ending(self, msg: Message) -> None:
        """Raise for a control message that ends what runs: _Stopped (STOP), _Shutdown
        (SHUTDOWN), _ClientGone (HOST in pool mode, which then runs next)."""
        if msg.op is Op.STOP:
            self._stop_seq = msg.seq
            self._stop_soft = bool(msg.value)
            raise _Stopped()
        if msg.op is Op.SHUTDOWN:
            raise _Shutdown()
        if msg.op is Op.HOST and self.opts.pool:
            # what the previous host still had queued is void; HOST runs next
            self._pending.clear()
            self._pending.append(msg)
            raise _ClientGone()

    def poll_control(self) -> None:
        """Take control messages that arrived; raise _Stopped/_Shutdown for STOP/SHUTDOWN."""
        control = self.control
        while True:
            if not control.readable() and control.is_valid():   # without WouldBlock's cost
                return
            try:
                view, tag = control.try_acquire_read()
            except WouldBlock:
                return
            try:
                msg = ipu_protocol.decode(view, tag)
            finally:
                self.control.release()
            self._take_ending(msg)
            if msg.op is Op.MODES:
                self._apply_modes(msg)
            else:
                self._pending.append(msg)

    def _next(self) -> Message:
        if self._pending:
            return self._pending.popleft()
        while True:
            try:
                return ipu_protocol.receive(self.control, timeout=(
                    None if self._watch is not None else _HOST_CHECK))
            except RingTimeoutError:
                self._check_host()
            except WaitInterrupted:
                self._interrupted()

    # -- main loop --------------------------------------------------------------

    def serve(self) -> int:
        try:
            self._interpreter_cls = _import_interpreter()
            self.post(Message(Op.READY, body={
                "pid": self.hooks.pid or os.getpid(), "package_hash": package_hash(),
                "ipu_id": self.opts.ipu_id, "ipu_version": self.opts.ipu_version,
                "capacity": self.opts.capacity}))
            while True:
                try:
                    msg = self._next()
                    if msg.op is Op.SHUTDOWN:
                        break
                    if recorder.ON:
                        self._dispatch_traced(msg)
                    else:
                        self._dispatch(msg)
                except ipu_protocol.ProtocolError as exc:
                    _log.error("ignoring a malformed control message: %s", exc)
                except _ClientGone:
                    self._drop_client()
                except PeerDiedError as exc:
                    if not (self._client and exc.pid == self._client):
                        raise
                    self._drop_client()
                except WaitInterrupted:   # e.g. posting an event when the host died
                    try:
                        self._interrupted()
                    except _ClientGone:
                        self._drop_client()
        except _Shutdown:
            pass
        except (_HostGone, PeerDiedError):
            _log.info("host process %d is gone; cleaning up and exiting", self.opts.host_pid)
            if self.hooks.unlink_on_host_gone:
                self._cleanup_host_objects()
            else:
                self.close()
            return 0
        self._say_bye()
        self.close()
        return 0

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
        op = msg.op
        try:
            if op is Op.LOAD:
                self._load(msg)
            elif op is Op.MODES:
                self._apply_modes(msg)
                return
            elif op is Op.RUN or op is Op.LOOP:
                if self._run(msg):
                    return  # STOPPED already posted
            elif op is Op.STOP:
                if self._active is not None and not msg.value:
                    self._active.stopped = True
            elif op is Op.UNLOAD:
                self._unload(str((msg.body or {}).get("key", "")))
            elif op is Op.RESET:
                for key in list(self._cache):
                    self._unload(key)
            elif op is Op.PING:
                pass
            elif op is Op.HOST:
                self._set_host(msg.value, msg.body)
            else:
                raise _RequestError(ErrorKind.PROTOCOL, f"unexpected control message {op.name}")
        except _RequestError as exc:
            self.post(Message(Op.ERROR, seq=msg.seq, body=error_body(
                exc.kind, str(exc), exc.tb, **getattr(exc, "extra", {}))))
            return
        except (_Stopped, _Shutdown, _HostGone, PeerDiedError, WaitInterrupted):
            raise
        except Exception as exc:  # a bug or a broken ring: report it, keep serving
            _log.exception("%s failed", op.name)
            self.post(Message(Op.ERROR, seq=msg.seq, body=error_body(
                ErrorKind.PROTOCOL, f"{op.name} failed on {self._describe()}: "
                f"{type(exc).__name__}: {exc}", traceback.format_exc())))
            return
        self.post(Message(Op.DONE, seq=msg.seq))

    # -- requests ----------------------------------------------------------------

    def _load(self, msg: Message) -> None:
        body = msg.body or {}
        name = body.get("spec_region")
        if not isinstance(name, str):
            raise _RequestError(ErrorKind.PROTOCOL, "LOAD needs a 'spec_region' name")
        self._host_faults = self._fault_tables(body.get("faults"), self._host_faults)
        self._known.add(name)
        try:
            region = Region.attach(name, prefault=False)
        except (ShmError, OSError, posix_ipc.Error) as exc:
            raise _RequestError(ErrorKind.PROTOCOL, f"cannot open load spec {name}: {exc}") from None
        try:
            spec = ipu_protocol.decode_load_spec(region.buf)
        except ipu_protocol.ProtocolError as exc:
            region.close()
            raise _RequestError(ErrorKind.PROTOCOL, str(exc)) from None
        key = spec["key"]
        loaded = self._cache.pop(key, None)
        if loaded is not None and (spec["fresh"] or not loaded.regions
                                   or loaded.regions[0].name != name):
            loaded.close()
            loaded = None
        if loaded is None:
            try:
                loaded = self._build(spec, region)
            except BaseException:
                region.close()
                raise
        else:
            region.close()
            loaded.close_streams()
        try:
            self._attach_streams(loaded, spec["streams"])
            _check_streams(loaded)
        except BaseException:
            loaded.close()
            raise
        loaded.stopped = False
        self._cache[key] = loaded
        self._active = loaded
        while len(self._cache) > _CACHE:
            _, old = self._cache.popitem(last=False)
            old.close()

    def _build(self, spec: dict[str, Any], region: Region) -> _Loaded:
        from ipu_emulator.executable import Executable, read_header

        t0 = _monotonic()
        off, size = spec["executable_offset"], spec["executable_size"]
        data = bytes(region.buf[off:off + size])
        try:
            header = read_header(data)
        except ExecutableError as exc:
            raise _RequestError(ErrorKind.EXECUTABLE, str(exc)) from None
        runtime_hash = package_hash()
        if spec["check_package_hash"] and header.package_hash != runtime_hash:
            raise _RequestError(ErrorKind.PACKAGE_HASH,
                                f"package hash {header.package_hash} differs from runtime "
                                f"hash {runtime_hash}")
        o = self.opts
        need = max(header.memory_bytes, header.required_bytes)
        if need > o.capacity:
            raise _RequestError(
                ErrorKind.MEMORY,
                f"executable {header.name!r} needs {need} bytes of device memory, but "
                f"{self._describe()} has {o.num_ipus} IPU(s) x {o.tiles_per_ipu} tiles x "
                f"{o.memory_per_tile} bytes per tile = {o.capacity} bytes")
        if header.ipu_version != o.ipu_version:
            raise _RequestError(
                ErrorKind.REQUEST, f"executable {header.name!r} was compiled for "
                f"ipu{header.ipu_version}, but {self._describe()} is ipu{o.ipu_version}")
        if header.num_ipus > o.num_ipus:
            raise _RequestError(
                ErrorKind.REQUEST, f"executable {header.name!r} needs {header.num_ipus} "
                f"IPUs, but {self._describe()} has {o.num_ipus}")
        regions = [region]
        constants: dict[str, memoryview] | None = None
        consts = spec.get("constants")
        if consts:   # constant streams: one read-only region for every replica (_constants)
            c_name = consts["region"]
            self._known.add(c_name)
            try:
                c_region = Region.attach(c_name, prefault=False, readonly=True)
            except (ShmError, OSError, posix_ipc.Error) as exc:
                raise _RequestError(ErrorKind.PROTOCOL, f"cannot open the constants region "
                                    f"{c_name}: {exc}") from None
            buf = c_region.buf
            if any(c["offset"] + c["nbytes"] > len(buf) for c in consts["streams"]):
                c_region.close()
                raise _RequestError(ErrorKind.PROTOCOL, f"constants region {c_name} of "
                                    f"{len(buf)} bytes is shorter than its streams")
            regions.append(c_region)
            constants = {c["handle"]: buf[c["offset"]:c["offset"] + c["nbytes"]]
                         for c in consts["streams"]}
        weights: memoryview | None = None
        w_file = spec.get("weights_file")
        file_map = None
        trusted = False   # the file the host read and checks: no second checksum here
        if w_file:   # with prepacking: prepacked by onnxruntime from where it lies (no copy
            # first); the mapping stays while onnxruntime may read it, its pages let go
            file_map, weights, trusted = _map_weights_file(w_file,
                                                           header.total_length - size)
        w_name = spec.get("weights_region")
        if w_name:   # shared by every replica: mapped read-only, used where it lies
            self._known.add(w_name)
            try:
                w_region = Region.attach(w_name, prefault=False, readonly=True)
            except (ShmError, OSError, posix_ipc.Error) as exc:
                raise _RequestError(ErrorKind.PROTOCOL,
                                    f"cannot open the weights region {w_name}: {exc}") from None
            weights = w_region.buf[:max(0, header.total_length - size)]
            regions.append(w_region)
        # the checksum over large weights is computed while onnxruntime loads them
        crc = _Checksum(data, weights) if weights is not None and len(weights) >= _CRC_APART \
            and not trusted else None
        try:
            exe = Executable.from_bytes(data, weights=weights,
                                        checksum=crc is None and not trusted)
        except ExecutableError as exc:
            if crc is not None:
                crc.result()   # it reads the weights: done before they are unmapped
            for r in regions[1:]:
                r.close()
            if file_map is not None:
                _unmap(file_map, weights)
            raise _RequestError(ErrorKind.EXECUTABLE, str(exc)) from None
        memory = None
        mem_name = spec["memory_region"]
        if mem_name:
            self._known.add(mem_name)
            try:
                mem_region = Region.attach(mem_name, prefault=False)
            except (ShmError, OSError, posix_ipc.Error) as exc:
                raise _RequestError(ErrorKind.PROTOCOL,
                                    f"cannot open device memory {mem_name}: {exc}") from None
            regions.append(mem_region)
            try:   # the pages it will touch, allocated now: /dev/shm full is named here
                mem_region.back(memory_ranges(exe, constants))
            except ShmError as exc:
                for r in regions[1:]:
                    r.close()
                if file_map is not None:
                    _unmap(file_map, weights)
                raise _RequestError(ErrorKind.SHM_FULL, f"device memory {mem_name}: {exc}"
                                    ) from None
            memory = mem_region.buf[:exe.memory_bytes]
        prepack = True if file_map is not None else spec.get("prepack")
        kwargs: dict[str, Any] = {} if prepack is None else {"prepack": prepack}
        if file_map is not None:
            kwargs["weights_kept"] = True
        if constants is not None:
            kwargs["constants"] = constants
        t1 = _monotonic()
        interp = None
        try:
            interp = self._interpreter_cls(exe, device_memory=memory, num_threads=o.threads,
                                           **kwargs)
        except Exception as exc:
            for r in regions[1:]:
                r.close()
            raise _RequestError(ErrorKind.PROGRAM, f"cannot prepare the executable: {exc}",
                                traceback.format_exc()) from None
        finally:
            got = crc.result() if crc is not None else header.body_crc32
            if trusted and not _same_file(w_file or {}):   # changed while read: check it
                assert weights is not None
                got = body_crc32(data, weights)
            if file_map is not None:
                del exe
                if interp is not None and getattr(interp, "uses_weights", False):
                    _drop_pages(file_map)   # held by the interpreter's views (read again)
                else:
                    _unmap(file_map, weights)
        assert interp is not None
        if got != header.body_crc32:
            interp.close()
            for r in regions[1:]:
                r.close()
            raise _RequestError(ErrorKind.EXECUTABLE, f"body checksum mismatch: computed "
                                f"{got:#010x}, header says {header.body_crc32:#010x} (damaged)")
        _log.debug("executable %r: decoded in %.3f s, sessions made in %.3f s",
                   header.name, t1 - t0, _monotonic() - t1)
        if w_name and not getattr(interp, "uses_weights", True):
            # onnxruntime took its own (prepacked) copy: the shared one is not needed here
            del exe, weights
            w_region.close()
            regions.remove(w_region)
        return _Loaded(spec["key"], interp, regions)

    def _attach_streams(self, loaded: _Loaded, streams: list[dict[str, Any]]) -> None:
        exe_streams = loaded.interp.executable.streams
        constant = _constant_handles(loaded)
        loaded.steps.clear()
        for i, s in enumerate(streams):
            self._known.add(s["ring"])
            try:
                # a constant stream's ring is never read: its pages are never touched
                ring = Ring.attach(s["ring"], prefault=s["nbytes"] <= _PREFAULT_MAX
                                   and s["handle"] not in constant)
            except (ShmError, OSError, posix_ipc.Error) as exc:
                raise _RequestError(ErrorKind.PROTOCOL,
                                    f"cannot open the ring of stream {s['handle']!r}: {exc}") from None
            if s["handle"] in exe_streams:
                want = exe_streams[s["handle"]]
                if want.direction != s["direction"] or want.nbytes != s["nbytes"]:
                    ring.close()
                    raise _RequestError(
                        ErrorKind.PROTOCOL, f"stream {s['handle']!r}: the host offers "
                        f"{s['direction']} x {s['nbytes']} bytes, the executable has "
                        f"{want.direction} x {want.nbytes} bytes")
            if ring.slot_size < s["nbytes"]:
                ring.close()
                raise _RequestError(ErrorKind.PROTOCOL, f"stream {s['handle']!r}: ring slots of "
                                    f"{ring.slot_size} bytes, transfers of {s['nbytes']}")
            st = _Stream(i, s["handle"], s["direction"], s["nbytes"], ring, s["mode"])
            loaded.streams.append(st)
            loaded.by_handle[st.handle] = st

    def _apply_modes(self, msg: Message) -> None:
        loaded = self._active
        modes = msg.body
        if loaded is None or not isinstance(modes, list):
            return
        for st, mode in zip(loaded.streams, modes):
            if mode in ipu_protocol.MODES:
                st.mode = mode
        loaded.steps.clear()   # which streams a C step may serve depends on their modes

    def _run(self, msg: Message) -> bool:
        """Run RUN/LOOP; True if a STOP ended it (STOPPED and the STOP's DONE were posted)."""
        loaded = self._active
        if loaded is None or loaded.interp is None:
            raise _RequestError(ErrorKind.STATE, f"{self._describe()} has no executable loaded")
        if loaded.stopped:
            raise _RequestError(ErrorKind.STATE,
                                f"{self._describe()} was stopped; reload the executable first")
        programs = msg.body
        n = loaded.interp.num_programs()
        if not isinstance(programs, list) or not all(isinstance(p, int) for p in programs):
            raise _RequestError(ErrorKind.PROTOCOL, "RUN needs a list of program indices")
        bad = [p for p in programs if not 0 <= p < n]
        if bad:
            raise _RequestError(ErrorKind.REQUEST, f"program indices {bad} do not exist; "
                                f"the executable has programs 0..{n - 1}")
        loop = msg.op is Op.LOOP
        if loop:
            _check_loop(loaded, programs)
        io = _RingIO(self, loaded)
        control_readable = self.control.readable
        apart = self._apart
        # the host writes the id of its thread that submits into its input rings
        constant = _constant_handles(loaded)   # rings the host never writes
        hinted = [st.ring for st in loaded.streams if st.direction == "in" and st.ring is not None
                  and st.handle not in constant]
        apart.hint = hinted[0].user_word if hinted else None
        self._slice = self._wait_slice
        if loaded.interp.executable.attributes.get("keep_apart") == "0":
            # one IPU of several (compiler._sharding): the IPUs of a pipeline must spread
            # over the CPUs, not all leave the host's one
            apart.release()
            apart = _NEVER_APART
        # polls block at once when a yield ran another task, unless keeping apart
        self.keeps_apart = apart is self._apart and self._apart.enabled
        # A loop of one program may run it many times per turn (C steps back to back, until
        # the next check below is due or a control message arrives).
        many = loop and len(programs) == 1 and not recorder.ON   # traced: each run a slice
        run_one = self._run_one_traced if recorder.ON else self._run_one
        main = [p for p in programs
                if loop or loaded.interp.executable.programs[p].name.lower() == "main"]
        faulty = _FaultyIO(self, loaded, io) if main else None
        try:
            while True:
                if faulty is not None and faulty.scheduled():
                    # a schedule of faults: Main runs one at a time, each checked once its
                    # inputs are in (at its first output: _FaultyIO)
                    for p in programs:
                        if p in main:
                            faulty.arm(p)
                            run_one(loaded, p, faulty)   # type: ignore[arg-type]
                        else:
                            run_one(loaded, p, io)
                elif many:
                    due = min(self._next_host_check, apart.next_look, _monotonic() + _HOST_CHECK)
                    run_one(loaded, programs[0], io, int(due * 1e9))
                else:
                    for p in programs:
                        run_one(loaded, p, io)
                if not loop:
                    return False
                if io.disconnected:
                    self.poll_control()   # a STOP that came with the disconnection wins
                    # Dummy data "until the run returns": a loop never returns, so it ends
                    # here instead of spinning on disconnected streams.
                    raise _RequestError(ErrorKind.STATE, "the main loop ended: its streams were "
                                        "disconnected (invalidated) by the host")
                now = _monotonic()
                if now >= self._next_host_check:
                    self._check_host()
                    self.poll_control()     # also notices an invalidated control ring
                elif control_readable():
                    self.poll_control()
                if now >= apart.next_look:
                    apart.check()
        except _Stopped:
            self._apart.release()
            loaded.stopped = not self._stop_soft
            self.post(Message(Op.STOPPED, seq=msg.seq))
            self.post(Message(Op.DONE, seq=self._stop_seq or 0))
            self._stop_seq = None
            return True

    def _run_one(self, loaded: _Loaded, index: int, io: _RingIO,
                 deadline_ns: int | None = None) -> None:
        """Run program ``index`` once; with ``deadline_ns``, as many times as it can be done
        without waiting before that time of the monotonic clock (at least once)."""
        try:
            try:
                runs = 0 if deadline_ns is None else loaded.interp.run_program_many(
                    index, io, deadline_ns)
                if not runs:
                    loaded.interp.run_program(index, io)
                    runs = 1
                # programs run, for whoever holds the control ring (the daemon's /metrics)
                self.program_runs += runs
                self.control.set_user_word(self.program_runs)
            finally:
                io.forget_redirects()   # left by a failed iteration: must not steer the next
        except (_Stopped, _Shutdown, _HostGone, PeerDiedError, _RequestError, WaitInterrupted):
            raise
        except Exception as exc:
            inner = _unwrap(exc)
            if isinstance(inner, (_Stopped, _Shutdown, _HostGone, PeerDiedError, _RequestError,
                                  WaitInterrupted)):
                raise inner from None
            raise _RequestError(ErrorKind.PROGRAM,
                                f"program {index} failed: {type(exc).__name__}: {exc}",
                                traceback.format_exc()) from None

    # -- faults (ipu_emulator.faults) ----------------------------------------------------

    def _fault_tables(self, names: Any, old: list[FaultTable],
                      hosts: bool = True) -> list[FaultTable]:
        """The fault tables ``names`` lists (attached; ``old`` ones reused, others closed).
        ``hosts``: a host's, unlinked with its other objects if it dies (never the
        daemon's)."""
        names = [n for n in names if isinstance(n, str)] if isinstance(names, list) else []
        keep = {t.name: t for t in old}
        tables = []
        for name in names:
            table = keep.pop(name, None)
            if table is None:
                try:
                    table = FaultTable.attach(name)
                except Exception as exc:
                    raise _RequestError(ErrorKind.PROTOCOL, f"cannot open the fault table "
                                        f"{name}: {exc}") from None
                if hosts:
                    self._known.add(name)
            tables.append(table)
        for table in keep.values():
            table.close()
        return tables

    def faults_scheduled(self) -> bool:
        """Main runs are checked one by one: the host gave a fault table (its plan may
        change at any time, and a run already waiting for its inputs must see a change),
        or the daemon's lists a fault (checked at each turn of a loop: a fault the daemon
        adds applies from the run after the one waiting then)."""
        return bool(self._host_faults) or any(t.faults() for t in self._daemon_faults)

    def fire_fault(self, loaded: _Loaded, program: int) -> None:
        """A Main run of ``program`` has its inputs: apply the fault that fires on it."""
        has_link = any(is_link(st.handle) and not is_sync(st.handle)
                       and st.direction == "out" for st in loaded.streams)
        ipu = self.opts.ipu_id
        hit: tuple[int, Fault] | None = None
        for table in self._daemon_faults + self._host_faults:
            found = table.fire(ipu, has_link)
            if found is not None and hit is None:
                hit = found
        if hit is None:
            return
        index, fault = hit
        kind = fault.kind
        what = (f"program {program} ({loaded.interp.executable.programs[program].name}) "
                f"(injected fault {index}: {fault.describe()})")
        _log.warning("%s: injecting %s", self._describe(), what)
        extra: dict[str, Any] = {"ipu": ipu, "program": program}
        if kind == "slow":
            # slept in slices: a STOP or SHUTDOWN meanwhile is taken at once
            end = _monotonic() + fault.delay_ms / 1000.0
            while (left := end - _monotonic()) > 0:
                time.sleep(min(left, 0.05))
                if self.control.readable():
                    self.poll_control()
            return
        if kind == "hang":
            self._hang()
        if kind == "crash":
            if self.hooks.pid is None:   # an IPU process of its own (never a host's thread)
                logging.shutdown()
                os.kill(os.getpid(), signal.SIGKILL)
            raise _FaultError(ErrorKind.PROGRAM, f"a crash of {what} (a loopback device "
                              "cannot die)", extra)
        if kind == "application_error":
            raise _FaultError(ErrorKind.APPLICATION, f"application runtime error in {what}",
                              extra)
        if kind == "unrecoverable_error":
            raise _FaultError(ErrorKind.UNRECOVERABLE, f"unrecoverable runtime error in "
                              f"{what}", extra)
        action = "LINK_RESET" if kind == "link_down" else fault.action
        cause = ("the IPU-Link to the next IPU went down in " if kind == "link_down"
                 else "recoverable runtime error in ")
        raise _FaultError(ErrorKind.RECOVERABLE, f"{cause}{what}; recovery action {action}",
                          dict(extra, action=action))

    def _hang(self) -> None:
        """An injected hang: answer nothing until the host stops or resets this IPU (STOP,
        SHUTDOWN, HOST) or goes away."""
        while True:
            try:
                msg = ipu_protocol.receive(self.control, timeout=(
                    None if self._watch is not None else _HOST_CHECK))
            except RingTimeoutError:
                self._check_host()
                continue
            except WaitInterrupted:
                self._interrupted()
                continue
            self._take_ending(msg)
            _log.info("hung: ignoring %s", msg.op.name)

    def _run_one_traced(self, loaded: _Loaded, index: int, io: _RingIO,
                        deadline_ns: int | None = None) -> None:
        """``_run_one`` as a slice of the timeline (ipu_emulator.trace)."""
        t0 = time.monotonic_ns()
        before = self.program_runs
        programs = loaded.interp.executable.programs if loaded.interp is not None else []
        kind = _PROGRAM_KINDS.get(programs[index].name, 0) if index < len(programs) else 0
        try:
            self._run_one(loaded, index, io, deadline_ns)
        finally:
            recorder.ipu(recorder.I_PROGRAM, t0, time.monotonic_ns() - t0, index, kind,
                         self.program_runs - before)

    def _unload(self, key: str) -> None:
        loaded = self._cache.pop(key, None)
        if loaded is not None:
            if self._active is loaded:
                self._active = None
            loaded.close()
        self.host_memory.sweep()

    def _describe(self) -> str:
        o = self.opts
        return o.label or (f"ipu {o.ipu_id}" if o.ipu_id >= 0 else "IPU model")

    # -- pool mode ---------------------------------------------------------------

    def _set_host(self, pid: int, body: Any) -> None:
        """HOST: forget the previous host, reset the control ring, serve ``pid`` (0: none).

        ``body`` may give ``num_ipus`` (the size of the device the host attached, which
        sets this process's memory capacity) and ``label``. The daemon sends HOST only
        while no host uses the rings and waits for its DONE, so this process is the only
        one touching the control ring here.
        """
        if not self.opts.pool:
            raise _RequestError(ErrorKind.PROTOCOL, "HOST is only for IPU processes a "
                                "daemon owns (--pool)")
        body = body if isinstance(body, dict) else {}
        num_ipus, label = body.get("num_ipus", 1), body.get("label", "")
        if (pid < 0 or not isinstance(num_ipus, int) or not 1 <= num_ipus <= 64
                or not isinstance(label, str)):
            raise _RequestError(ErrorKind.PROTOCOL, f"HOST needs a pid >= 0, num_ipus in "
                                f"1..64 and a str label, got {pid}, {num_ipus!r}, {label!r}")
        self._drop_client()
        self._daemon_faults = self._fault_tables(body.get("faults"), self._daemon_faults,
                                                 hosts=False)
        self.opts = replace(self.opts, num_ipus=num_ipus, label=label)
        self.control.reset()
        self._client = pid
        self._client_watch = PeerWatch(pid) if pid > 0 else None
        if self._watch is not None:
            self._watch.set_client(pid)
        self._apart.host_pid = pid or self.opts.host_pid
        self.events.set_peer(pid or self.opts.host_pid)
        self._set_title()
        _log.info("%s now serves host %s", self._describe(), pid or "(none)")

    def _drop_client(self) -> None:
        """Close every executable of the current host; unlink its objects if it is dead."""
        old, self._client = self._client, 0
        self._client_watch = None
        if self._watch is not None:
            self._watch.set_client(0)
        ring_waits.resume_all()   # the waits the client's exit interrupted block again
        self._set_title()
        # what that host had queued is void; a HOST already taken off the ring still runs
        self._pending = collections.deque(m for m in self._pending if m.op is Op.HOST)
        self._stop_seq = None
        for loaded in self._cache.values():
            loaded.close()
        self._cache.clear()
        self.host_memory.close()
        self._active = None
        for table in self._host_faults:
            table.close()
        self._host_faults = []
        self.events.set_peer(self.opts.host_pid)
        stale = self._known - {self.opts.control, self.opts.events}
        self._known = {self.opts.control, self.opts.events}
        if old and not pid_alive(old):
            removed = sum(_unlink_ring_or_region(name) for name in stale)
            removed += _unlink_objects_of((old,), all_tags=True)
            _log.info("host %d died: removed %d of its shared-memory objects", old, removed)

    # -- exit ------------------------------------------------------------------

    def close(self) -> None:
        """Close every mapping of this process: executables, host memory, rings."""
        for loaded in self._cache.values():
            loaded.close()
        self._cache.clear()
        self.host_memory.close()
        self._active = None
        self.control.close()
        self.events.close()

    def _cleanup_host_objects(self) -> None:
        """The host died: unlink everything it (and this process) created."""
        try:
            self.close()
        except Exception:  # pragma: no cover - best effort
            _log.exception("closing mappings")
        host = self.opts.host_pid
        me = os.getpid()
        removed = 0
        for name in self._known:
            removed += _unlink_ring_or_region(name)
        removed += _unlink_objects_of((host, me))
        _log.info("removed %d shared-memory objects of dead host %d", removed, host)


class _HostWatch:
    """A thread of the IPU process blocked on the pidfds of its host and (pool mode) the
    host it is lent to; when one exits it interrupts every ring wait of the process
    (``shm.ring.interrupt_all``), so the main loop blocks on its rings with no periodic
    wake and still learns at once that its host is gone."""

    def __init__(self, host_fd: int) -> None:
        self._host_fd = host_fd
        self._client_fd = -1
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        # the control ring's doorbell: the signal's number lands in the pipe (written by
        # the interpreter's own C handler, so it is never lost between a check and a wait)
        signal.signal(_DOORBELL, lambda signum, frame: None)
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        threading.Thread(target=self._run, name="ipu-host-watch", daemon=True).start()

    @classmethod
    def start(cls, host_pid: int) -> "_HostWatch | None":
        """The watch of ``host_pid``, or None where pidfds are missing or this is not the
        main thread (the waits then check the host and the control ring in slices)."""
        if host_pid <= 0 or threading.current_thread() is not threading.main_thread():
            return None
        try:
            return cls(os.pidfd_open(host_pid))
        except (AttributeError, OSError):
            return None

    def set_client(self, pid: int) -> None:
        """Watch ``pid`` as the host this IPU is lent to (0: none) instead of the last."""
        fd = -1
        if pid > 0:
            try:
                fd = os.pidfd_open(pid)
            except OSError:   # gone already: the client check sees it
                fd = -1
        with self._lock:
            old, self._client_fd = self._client_fd, fd
        try:
            os.write(self._wake_w, b"x")   # the thread takes the new set
        except BlockingIOError:   # full: it wakes anyway
            pass
        if old >= 0:
            os.close(old)

    def _run(self) -> None:
        fired: set[int] = set()   # exits already reported (until the set changes)
        while True:
            with self._lock:
                fds = [fd for fd in (self._host_fd, self._client_fd)
                       if fd >= 0 and fd not in fired]
            poller = select.poll()
            poller.register(self._wake_r, select.POLLIN)
            for fd in fds:
                poller.register(fd, select.POLLIN)
            try:
                ready = poller.poll()
            except OSError:   # a descriptor closed meanwhile by set_client: look again
                continue
            bell = False
            for fd, _ in ready:
                if fd == self._wake_r:
                    got = os.read(self._wake_r, 512)
                    bell = bell or _DOORBELL in got
                    if b"x" in got:
                        fired.clear()
                else:
                    fired.add(fd)
                    bell = True
            if bell:
                try:
                    ring_waits.interrupt_all()
                except Exception:   # pragma: no cover - never let this thread die
                    _log.exception("interrupting the ring waits failed")


def _unlink_objects_of(pids: tuple[int, ...], all_tags: bool = False) -> int:
    """Unlink every object of this tag (or of every tag) created by one of ``pids``."""
    removed = 0
    for obj in list_objects(naming.current_tag(), all_tags=all_tags):
        if obj.pid in pids:
            removed += _unlink(obj.name, obj.is_semaphore)
    return removed


def _unlink(name: str, is_semaphore: bool) -> int:
    try:
        if is_semaphore:
            posix_ipc.unlink_semaphore(name)
        else:
            posix_ipc.unlink_shared_memory(name)
        return 1
    except (posix_ipc.ExistentialError, OSError):
        return 0


class _Checksum:
    """The body checksum of an executable, computed on a thread of its own (zlib lets go
    of the GIL, as onnxruntime does while it makes a session)."""

    def __init__(self, data: bytes, weights: memoryview) -> None:
        from ipu_emulator.executable import body_crc32

        self._value = 0
        self._error: BaseException | None = None

        def run() -> None:
            try:
                self._value = body_crc32(data, weights)
            except BaseException as exc:   # reported by result()
                self._error = exc
        self._thread = threading.Thread(target=run, name="ipu-checksum", daemon=True)
        self._thread.start()

    def result(self) -> int:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


def _same_file(spec: dict[str, Any]) -> bool:
    """The file at the spec's path is still the one the host read (its identity)."""
    try:
        return _identity(os.stat(spec["path"])) == list(spec.get("identity") or [None])
    except OSError:
        return False


def _identity(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]


def _map_weights_file(spec: dict[str, Any], expected: int
                      ) -> tuple[mmap.mmap, memoryview, bool]:
    """A read-only mapping of the weights section in the host's PopEF file, and whether
    the file is the one the host read (its identity: the host checks its checksum)."""
    path, offset, length = spec["path"], spec["offset"], spec["length"]
    if length != expected:
        raise _RequestError(ErrorKind.PROTOCOL, f"weights file span of {length} bytes; the "
                            f"executable's weights section has {expected}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise _RequestError(ErrorKind.PROTOCOL, f"cannot open the weights file {path}: {exc}"
                            ) from None
    try:
        st = os.fstat(fd)
        same = bool(spec.get("identity")) and _identity(st) == spec["identity"]
        if st.st_size < offset + length:
            raise _RequestError(ErrorKind.EXECUTABLE, f"the weights file {path} is shorter "
                                f"than [{offset}, +{length}): changed since the host read it")
        base = offset - offset % mmap.ALLOCATIONGRANULARITY
        # populated at once: the checksum and onnxruntime read every page of it
        mm = mmap.mmap(fd, offset + length - base, flags=mmap.MAP_SHARED | _MAP_POPULATE,
                       prot=mmap.PROT_READ, offset=base)
    except OSError as exc:
        raise _RequestError(ErrorKind.PROTOCOL, f"cannot map the weights file {path}: {exc}"
                            ) from None
    finally:
        os.close(fd)
    return mm, memoryview(mm)[offset - base:offset - base + length], same


def _drop_pages(mm: mmap.mmap) -> None:
    """Let go of the pages of a read-only file mapping this process read (they are the
    page cache's: a later read maps them again), so that they count as this process's
    memory only where it reads them again."""
    try:
        mm.madvise(mmap.MADV_DONTNEED)
    except (OSError, AttributeError, ValueError):
        _log.debug("cannot drop the pages of the weights file mapping", exc_info=True)


def _unmap(mm: mmap.mmap, view: memoryview | None) -> None:
    try:
        if view is not None:
            view.release()
        mm.close()
    except BufferError:   # a view still alive somewhere: unmapped when it dies
        _log.debug("weights file mapping still in use; unmapped when its views die")


def _unlink_ring_or_region(name: str) -> int:
    return (_unlink(name, False) + _unlink(name + ".free", True) + _unlink(name + ".full", True))


def _constant_handles(loaded: _Loaded) -> set[str]:
    """The constant streams of ``loaded`` (``ipu_emulator.ipu._constants``): their rings are
    never read, nor written by the host."""
    plan = getattr(loaded.interp, "constants", None)
    return set(plan.shared) | set(plan.copied) if plan is not None else set()


def _check_streams(loaded: _Loaded) -> None:
    """Every stream the host connected is one some program transfers (ipu_emulator.validate):
    else the host would wait on it forever."""
    from ipu_emulator.validate import RuleError, check_loaded_streams

    try:
        check_loaded_streams(loaded.interp.executable,
                             [(s.handle, s.direction) for s in loaded.streams])
    except RuleError as exc:
        raise _RequestError(ErrorKind.PROGRAM, f"DeviceProgramError: executable "
                            f"{loaded.interp.executable.name!r} cannot serve this host: "
                            f"{exc}") from None


def _check_loop(loaded: _Loaded, programs: list[int]) -> None:
    """A main loop of ``programs`` transfers something on every path of an iteration,
    streams out an output, and no stream twice (ipu_emulator.validate): else it would spin,
    or wait for what the host will not send, forever. Checked once per LOOP, so the
    iterations themselves (the C steps) pay nothing."""
    from ipu_emulator.validate import RuleError, check_loop

    checked = loaded.loops_checked
    key = tuple(programs)
    if key in checked:
        return
    try:
        check_loop(loaded.interp.executable, programs, loaded.by_handle)
    except RuleError as exc:
        raise _RequestError(ErrorKind.PROGRAM, f"DeviceProgramError: main loop of programs "
                            f"{programs} refused: {exc}") from None
    checked.add(key)


def _unwrap(exc: BaseException) -> BaseException:
    seen = 0
    while exc.__cause__ is not None and seen < 8:
        exc = exc.__cause__
        seen += 1
    return exc


def _import_interpreter() -> Any:
    from ipu_emulator.ipu.interpreter import Interpreter
    return Interpreter


def main(argv: list[str] | None = None) -> int:
    """``python -m ipu_emulator --control NAME --events NAME --host-pid PID ...``"""
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
    settings = IpuSettings.current()   # its launch's, from its environment
    logging.basicConfig(
        level=settings.device_log_level,
        format=f"%(asctime)s ipu{a.ipu_id}[{os.getpid()}] %(levelname)s %(name)s: %(message)s")
    _log.debug("settings: %s", settings)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the host decides when we stop
    if a.trace_buffer:
        try:
            recorder.start_ipu(a.trace_buffer, a.ipu_id)
        except (ShmError, OSError, ValueError, posix_ipc.Error) as exc:
            _log.warning("not recording a timeline: %s", exc)
    opts = DeviceOptions(control=a.control, events=a.events, host_pid=a.host_pid,
                         ipu_id=a.ipu_id, ipu_version=a.ipu_version, tiles_per_ipu=a.tiles,
                         memory_per_tile=a.memory_per_tile, num_ipus=a.num_ipus,
                         threads=a.threads, label=a.label, pool=a.pool)
    try:
        dev = DeviceProcess(opts, ProcessHooks(title=True))
    except Exception as exc:
        if not pid_alive(opts.host_pid):   # the host died before we could attach
            _log.info("host %d died before this IPU process started", opts.host_pid)
            _unlink_objects_of((opts.host_pid, os.getpid()))
            return 0
        _log.error("cannot attach the control and event rings: %s", exc)
        return 70
    try:
        return dev.serve()
    except Exception:
        _log.exception("IPU process failed")
        if not pid_alive(opts.host_pid):
            dev._cleanup_host_objects()
        return 70
