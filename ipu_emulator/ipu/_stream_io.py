"""Stream IO of the IPU process: the interpreter's transfers over the stream rings.

``_RingIO`` is the interpreter's ``StreamIO``/``ZeroCopyStreamIO`` for the
executable that is running: it reads input transfers from, and writes output
transfers to, the active session's stream rings, posts NEED/OUT events for
streams in event mode, resolves inputs sent as host shared memory
(``TAG_SHARED``) and writes redirected outputs there. While it waits for an
input it polls briefly while inputs came quickly (``shm.spin.PollEstimate``),
then blocks through ``StreamHost.wait_on`` (``_input_wait``).

What a transfer's tag means and what each stream does in its mode is
``_iteration``'s plan; ``run_group`` hands the same plan to the C step. The
iteration's sequence number (``_iteration.IterationNumber``) is checked on
every input and copied onto every output, on every path.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Protocol

from shm import Region, Ring, RingInvalidatedError, RingTimeoutError

from ipu_emulator.ipu._host_memory import HostMemory, HostMemoryError
from ipu_emulator.ipu._input_wait import InputWait, WaitHost
from ipu_emulator.ipu._iteration import (HOST_TAG, SLOT_TAG, INPUT_TAGS, InAction,
                                            IterationNumber, SequenceMismatch, StreamPlan,
                                            make_step, numbered, plan_stream)
from ipu_emulator.executable import is_link
from ipu_emulator.ipu_protocol import TAG_KIND_MASK, ErrorKind, Message, Op
from ipu_emulator.trace import recorder


class StreamHost(WaitHost, Protocol):
    """What the stream I/O needs of the IPU process that runs it (``process.DeviceProcess``)."""

    host_memory: HostMemory    # host arrays read in place, outputs written there


__all__ = ["_Loaded", "_RequestError", "_RingIO", "_Stream"]

_NO_STEP = object()
# the members, as plain globals (an attribute of an Enum class costs ~0.1 us)
_IN_SLOT, _IN_HOST, _IN_ABORT = InAction.SLOT, InAction.HOST, InAction.ABORT


class _RequestError(Exception):
    def __init__(self, kind: ErrorKind, message: str, tb: str = "") -> None:
        super().__init__(message)
        self.kind = kind
        self.tb = tb


class _Stream:
    """One stream of the session: its ring, and what it does in its mode (``plan``, see
    _iteration.py; recomputed when the mode is set)."""

    plan: StreamPlan

    def __init__(self, index: int, handle: str, direction: str, nbytes: int,
                 ring: Ring | None, mode: int) -> None:
        self.index = index
        self.handle = handle
        self.direction = direction
        self.nbytes = nbytes
        self.ring = ring
        self.mode = mode
        # the tag of an output: kind | seq << SEQ_SHIFT, or the kind alone (not numbered)
        self.seq_mask = -1 if numbered(handle) else TAG_KIND_MASK
        self.link = int(is_link(handle))   # an IPU-Link to or from another IPU (tracing)

    @property
    def mode(self) -> int:
        return self._mode

    @mode.setter
    def mode(self, mode: int) -> None:
        self._mode = mode
        self.plan = plan_stream(self.direction, mode)

    def __repr__(self) -> str:
        return (f"_Stream({self.index}, {self.handle!r}, {self.direction!r}, {self.nbytes}, "
                f"mode={self._mode})")


class _Loaded:
    """One session's executable on this device, with its streams."""

    def __init__(self, key: str, interp: Any, regions: list[Region]) -> None:
        self.key = key
        self.interp = interp
        self.regions = regions
        self.streams: list[_Stream] = []
        self.by_handle: dict[str, _Stream] = {}
        self.stopped = False
        self.loops_checked: set[tuple[int, ...]] = set()   # main loops validate.check_loop passed
        # interpreter ZeroCopyGroup -> its C step over these streams (None: the group runs
        # step by step); emptied whenever the streams or their modes change
        self.steps: dict[Any, Any] = {}
        # a kept build's (ipu_emulator.ipu._kept): hands the interpreter back instead of
        # closing it
        self.give_back: Callable[[], None] | None = None

    def close_streams(self) -> None:
        self.steps.clear()
        for s in self.streams:
            if s.ring is not None:
                s.ring.close()
        self.streams, self.by_handle = [], {}

    def close(self) -> None:
        self.close_streams()
        if self.interp is not None:
            give_back, self.give_back = self.give_back, None
            if give_back is not None:
                self.interp = None
                give_back()
            else:
                self.interp.close()
                self.interp = None
        for r in self.regions:
            r.close()
        self.regions = []


class _RingIO:
    """StreamIO of the interpreter over the active session's stream rings."""

    def __init__(self, dev: StreamHost, loaded: _Loaded) -> None:
        self._dev = dev
        self._loaded = loaded
        self.disconnected = False   # a stream ring was invalidated (the host disconnected it)
        # poll an empty input ring before blocking while inputs came quickly
        self._wait = InputWait(dev)
        self._held_in: dict[str, Ring] = {}        # zero-copy inputs acquired, not released
        self._lent_out: dict[str, _Stream] = {}    # zero-copy outputs acquired, not published
        self._scratch_bufs: dict[str, bytearray] = {}
        self._redirect: dict[str, memoryview] = {}   # output handle -> host memory (this iteration)
        self._resolved = dev.host_memory.resolved     # descriptor bytes -> resolved (a cache)
        streams = loaded.interp.executable.streams if loaded.interp is not None else {}
        dev.host_memory.set_writes(frozenset(h for h, s in streams.items()
                                             if s.direction == "out"))
        self._lent_host: set[str] = set()             # outputs lent as host memory, not published
        self._it = IterationNumber()                  # the iteration's sequence number
        control = getattr(dev, "control", None)   # C runs of Main stop when it has a message
        self._watch = control.c_handle() if isinstance(control, Ring) else None

    # -- a whole Main iteration's run in one C call (interpreter.ZeroCopyGroup) --

    def run_group(self, group: Any) -> bool:
        """Do ``group``'s StreamIns, Execute and StreamOuts in one C call, if every
        transfer is there at once (see _iteration.make_step), or after a short poll for the
        inputs (see InputWait.poll); False: nothing was done."""
        entry = self._step(group)
        if entry is None:
            return False
        step, inputs_there = entry
        it = self._it
        # (it.current() and it.stepped(), written out: this is the hot path of an iteration)
        if step.run(it.seq if it.reading else 0):
            it.seq = step.seq
            it.reading = not group.out_handles
            it.begun = True
            return True
        if inputs_there is None or inputs_there():
            return False   # the inputs are there but the step declined: the Python path
        t0 = time.perf_counter_ns()
        wait = self._wait
        if not wait.poll(inputs_there) or not step.run(it.seq if it.reading else 0):
            return False
        it.stepped(step.seq, bool(group.out_handles))
        wait.est.record(time.perf_counter_ns() - t0)
        return True

    def run_groups(self, group: Any, unit: int, deadline_ns: int) -> int:
        """``group`` run after run in C while every transfer is there at once, in units of
        ``unit`` runs, until the monotonic clock reaches ``deadline_ns`` or a control
        message arrives; the number of runs done (it may end inside a unit)."""
        entry = self._step(group)
        if entry is None:
            return 0
        self._it.ended()   # a program starts: no iteration in progress
        # between runs, the next inputs are polled for in C while they come back to back
        # and this process keeps off the host's CPU (see InputWait.c_poll_ns)
        return entry[0].run_many(unit, deadline_ns, self._watch,  # type: ignore[no-any-return]
                                 self._wait.c_poll_ns())

    def _step(self, group: Any) -> tuple[Any, Callable[[], bool] | None] | None:
        """(C step, inputs-there test or None: do not poll) of ``group``, or None."""
        if self._redirect:   # outputs an earlier input of this iteration sent to the host
            return None
        steps = self._loaded.steps
        entry = steps.get(group, _NO_STEP)
        if entry is _NO_STEP:
            entry = steps[group] = self._make_step(group)
        return entry  # type: ignore[no-any-return]

    def _make_step(self, group: Any) -> Any:
        """(C step, inputs-there test or None) of ``group`` over this session's streams,
        or None: the Python path serves it (see _iteration.make_step)."""
        by_handle = self._loaded.by_handle
        ins = []
        outs = []
        for h, n in zip(group.in_handles, group.in_sizes):
            s = by_handle.get(h)
            if s is None or s.ring is None:
                return None
            ins.append((s.ring, n, s.plan))
        for h, n in zip(group.out_handles, group.out_sizes):
            s = by_handle.get(h)
            if s is None or s.ring is None:
                return None
            outs.append((s.ring, n, h, s.plan))
        return make_step(ins, outs, self._resolved, group.calls)

    def _stream(self, handle: str) -> _Stream:
        try:
            return self._loaded.by_handle[handle]
        except KeyError:
            raise _RequestError(ErrorKind.PROTOCOL,
                                f"stream {handle!r} has no ring in the load spec") from None

    def _read(self, s: _Stream, ring: Ring) -> tuple[memoryview, int]:
        """The next transfer of input stream ``s`` (acquired; the caller releases it)."""
        if ring.readable():   # cheaper than try_acquire_read's WouldBlock when empty
            try:
                return ring.acquire_read(0)   # its inlined fast path
            except RingTimeoutError:   # published, but the post is not there yet
                pass
        return self._wait.read_slow(ring, s.index, s.plan.need_event, not self._it.begun)

    def _kind(self, handle: str, tag: int) -> int:
        """The kind of an input's tag, its sequence number checked (see IterationNumber)."""
        try:
            return self._it.take(tag, handle)
        except SequenceMismatch as exc:
            raise _RequestError(ErrorKind.PROTOCOL, str(exc)) from None

    def _check_transfer(self, handle: str, view: memoryview, action: InAction,
                        nbytes: int) -> None:
        if action is _IN_ABORT:
            raise _RequestError(ErrorKind.CALLBACK,
                                f"the host could not produce input {handle!r}")
        if len(view) != nbytes:
            raise _RequestError(
                ErrorKind.PROGRAM, f"input stream {handle!r}: the host wrote {len(view)} "
                f"bytes, one transfer is {nbytes} bytes")

    def read_input(self, handle: str, dest: memoryview) -> None:
        s = self._stream(handle)
        out = _flat(dest)
        ring = s.ring
        if ring is None or s.plan.null:
            out[:] = bytes(len(out))
            return
        try:
            view, tag = self._read(s, ring)
        except RingInvalidatedError:  # disconnected: feed dummy data until the run returns
            self.disconnected = True
            out[:] = bytes(len(out))
            return
        t0 = time.monotonic_ns() if recorder.ON else 0
        try:
            action = INPUT_TAGS[self._kind(handle, tag)]
            if action is _IN_HOST:
                view = self._host_view(handle, view, len(out))
                action = _IN_SLOT
            self._check_transfer(handle, view, action, len(out))
            out[:] = view
        finally:
            ring.release()
            if t0:
                recorder.ipu(recorder.I_IN, t0, time.monotonic_ns() - t0, self._it.seq,
                             s.index, s.link)

    def write_output(self, handle: str, src: memoryview) -> None:
        s = self._stream(handle)
        ring = s.ring
        self._it.reading = False   # the iteration's inputs are read
        if ring is None or s.plan.null or self.disconnected:
            # disconnected: this iteration computed on dummy inputs (an IPU-Link or host
            # stream was invalidated, e.g. another IPU of the device failed): whatever
            # output rings are still open, nothing of it may reach them
            return
        t0 = time.monotonic_ns() if recorder.ON else 0
        data = _flat(src)
        if self._redirect:
            host = self._redirected(handle, len(data))
            if host is not None:
                host[:] = data
                if t0:    # before the publish: the host sees it after the slice ends
                    self._traced_out(s, t0)
                self._publish_redirected(s)
                return
        dev = self._dev
        try:
            view = dev.wait_on(ring.acquire_write)
        except RingInvalidatedError:
            self.disconnected = True
            return
        view[:len(data)] = data
        if t0:    # before the publish: the host sees it after the slice ends
            self._traced_out(s, t0)
        ring.publish(len(data), self._it.tag(SLOT_TAG) & s.seq_mask)
        if s.plan.out_event:
            dev.post(Message(Op.OUT, index=s.index))

    def _traced_out(self, s: _Stream, t0: int) -> None:
        """Output ``s`` of this iteration, published, as a slice from ``t0``."""
        recorder.ipu(recorder.I_OUT, t0, time.monotonic_ns() - t0, self._it.seq, s.index,
                     s.link)

    # -- zero-copy streams (interpreter.ZeroCopyStreamIO): onnxruntime uses the slots --

    def _scratch(self, handle: str, nbytes: int) -> memoryview:
        """Zeros for a null or disconnected input; a sink for such an output."""
        buf = self._scratch_bufs.get(handle)
        if buf is None or len(buf) != nbytes:
            buf = self._scratch_bufs[handle] = bytearray(nbytes)
        return memoryview(buf)

    def acquire_input(self, handle: str, nbytes: int) -> memoryview:
        s = self._loaded.by_handle.get(handle) or self._stream(handle)
        ring = s.ring
        if ring is None or s.plan.null:
            return self._scratch(handle, nbytes)
        try:
            if ring.readable():   # _read's fast path, written out
                try:
                    view, tag = ring.acquire_read(0)
                except RingTimeoutError:   # published, but the post is not there yet
                    view, tag = self._wait.read_slow(ring, s.index, s.plan.need_event,
                                                     not self._it.begun)
            else:
                view, tag = self._wait.read_slow(ring, s.index, s.plan.need_event,
                                                 not self._it.begun)
        except RingInvalidatedError:
            self.disconnected = True
            return self._scratch(handle, nbytes)
        try:
            action = INPUT_TAGS[self._kind(handle, tag)]
        except BaseException:
            ring.release()
            raise
        if action is _IN_HOST:
            got = self._resolved.get(view.tobytes())   # HostMemory.resolve's cache, first
            if got is not None and len(got[0]) == nbytes:
                view = got[0]
                for out_handle, out_view in got[1]:
                    self._redirect[out_handle] = out_view
            else:
                try:
                    view = self._host_view(handle, view, nbytes)
                except BaseException:
                    ring.release()
                    raise
        elif action is _IN_ABORT or len(view) != nbytes:
            try:
                self._check_transfer(handle, view, action, nbytes)
            finally:
                ring.release()
        self._held_in[handle] = ring   # the slot (data or descriptor) until release_input
        if recorder.ON:
            recorder.ipu(recorder.I_IN, time.monotonic_ns(), 0, self._it.seq, s.index, s.link)
        return view

    def _host_view(self, handle: str, descriptor: memoryview, nbytes: int) -> memoryview:
        """The transfer an InAction.HOST slot points to, in the host's shared memory.

        Outputs the descriptor redirects are written into host memory by this
        Main iteration (see acquire_output and write_output).
        """
        try:
            view, outputs = self._dev.host_memory.resolve(descriptor, nbytes)
        except HostMemoryError as exc:
            raise _RequestError(ErrorKind.PROTOCOL, f"input stream {handle!r}: {exc}") from None
        for out_handle, out_view in outputs:
            self._redirect[out_handle] = out_view
        return view

    def run_began(self, t0: int) -> int | None:
        """(Traced) When the program run started at ``t0`` began: ``t0``, or when its first
        transfer came after it waited idle for it; None: it ended still waiting (no run)."""
        wait, self._it.begun = self._wait, False   # (for the next run)
        if wait.idle_since is not None:
            wait.idle_since = None
            return None
        return max(t0, wait.idle_until)

    def forget_redirects(self) -> None:
        """Drop the host memory this iteration's outputs were to go to (what a failed
        iteration left; nothing after a whole one)."""
        if self._redirect:
            self._redirect.clear()
        if self._lent_host:
            self._lent_host.clear()

    def _redirected(self, handle: str, nbytes: int) -> memoryview | None:
        """The host memory this iteration's output ``handle`` goes to, if redirected."""
        view = self._redirect.pop(handle, None)
        if view is not None and len(view) != nbytes:
            raise _RequestError(ErrorKind.PROTOCOL, f"output stream {handle!r}: the host "
                                f"gave {len(view)} bytes of memory, one transfer is {nbytes}")
        return view

    def _publish_redirected(self, s: _Stream) -> None:
        """Tell the host that output ``s`` of this iteration is in its memory."""
        ring = s.ring
        assert ring is not None
        tag = self._it.tag(HOST_TAG) & s.seq_mask
        try:
            try:
                ring.write(b"", tag, 0)
            except RingTimeoutError:   # the host has not released a slot yet
                self._dev.wait_on(functools.partial(ring.write, b"", tag))
        except RingInvalidatedError:
            self.disconnected = True
            return
        if s.plan.out_event:
            self._dev.post(Message(Op.OUT, index=s.index))

    def release_input(self, handle: str) -> None:
        ring = self._held_in.pop(handle, None)
        if ring is not None:
            ring.release()

    def acquire_output(self, handle: str, nbytes: int) -> memoryview:
        s = self._loaded.by_handle.get(handle) or self._stream(handle)
        ring = s.ring
        self._it.reading = False   # the iteration's inputs are read
        if ring is None or s.plan.null or self.disconnected:   # dropped (see write_output)
            return self._scratch(handle, nbytes)
        if self._redirect:
            host = self._redirected(handle, nbytes)
            if host is not None:
                self._lent_out[handle] = s
                self._lent_host.add(handle)
                return host
        try:
            if ring.writable():
                try:
                    view = ring.acquire_write(0)   # its inlined fast path
                except RingTimeoutError:   # released, but the post is not there yet
                    view = self._dev.wait_on(ring.acquire_write)
            else:
                view = self._dev.wait_on(ring.acquire_write)
        except RingInvalidatedError:
            self.disconnected = True
            return self._scratch(handle, nbytes)
        self._lent_out[handle] = s
        return view[:nbytes]

    def publish_output(self, handle: str) -> None:
        s = self._lent_out.pop(handle, None)
        if s is None or s.ring is None:   # null or disconnected: the transfer is dropped
            return
        if recorder.ON:
            self._traced_out(s, time.monotonic_ns())
        if self._lent_host and handle in self._lent_host:
            self._lent_host.discard(handle)
            self._publish_redirected(s)
            return
        s.ring.publish(s.nbytes, self._it.tag(SLOT_TAG) & s.seq_mask)
        if s.plan.out_event:
            self._dev.post(Message(Op.OUT, index=s.index))


def _flat(buf: memoryview) -> memoryview:
    """A flat byte view of ``buf``; a zero-size tensor's (zeros in its shape) is empty."""
    mv = memoryview(buf)
    if mv.nbytes == 0:
        return memoryview(bytearray())
    return mv.cast("B")
