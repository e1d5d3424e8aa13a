"""A request's path through a replica's rings, described once.

::

    request --lay--> input rings --> IPU process (one Main iteration per transfer)
    request <--take-- output rings <-----------+

A request reaches the device as *transfers* (one Main iteration each: a slot of
every input Main reads) and comes back as the outputs each iteration writes. How
one input of a transfer is laid into its ring is :func:`lay_action`; how one
output is taken back is :func:`take_action` (and the slot's tag). Every way a
request travels runs these steps, and only these:

- a whole request (batching off): :meth:`TransferPath.lay_whole`, once per transfer;
- a partial transfer (dynamic batching): requests' samples are packed into an open
  transfer's slots (:meth:`~TransferPath.open_partial`, :meth:`~TransferPath.pack`),
  which is published when full or flushed (:meth:`~TransferPath.seal`);
- copied or in host shared memory: the :attr:`Lay.HOST` action (the IPU reads the
  input in place and writes the outputs a descriptor names into the request's memory,
  which :meth:`~TransferPath.take` then sees as :data:`TAG_SHARED`);
- read back: :meth:`~TransferPath.take`, transfer by transfer in the replica's order;
- fused: :meth:`~TransferPath.run_fused` is ``lay_whole`` then ``take`` specialised
  for an idle replica and a request whose every input is :attr:`Lay.WRITE` and every
  output :attr:`Take.READ`: no ``Request`` or ``Transfer``, one lock.

Sequence numbers: every transfer has the next number of its replica (``Transfer.seq``,
given by the submitter), every input slot of it carries that number in its tag
(``ipu_protocol.stream_tag``), the IPU process copies it onto the outputs, and
:meth:`~TransferPath.take` checks it on every output: another number is a
``SequenceMismatchError`` (the replica fails as a lost device), never an answer.
A transfer whose laying was interrupted is finished with ``lay_whole(resume=True)``
or ``seal`` again (both leave alone an input already published with its number).

Two of those are fast paths a setting switches off (the general steps then run):
``IPU_EMULATOR_RUNNER_FUSED=0`` (no :meth:`~TransferPath.run_fused`) and
``IPU_EMULATOR_RUNNER_SMALL_IO=0`` (no :attr:`Lay.WRITE` / :attr:`Take.READ`: every
transfer goes through a slot view).

Polling: before a blocking read of an empty output ring, :meth:`~TransferPath.await_output`
polls it briefly. Waking a sleeping process from another CPU costs tens of microseconds
on a VM (measured: a [1,4] execute takes ~110 us blocking, ~70 us with a 30 us poll).
Polling only pays when the answer is near: a moving estimate of how long output waits
take turns polling off while waits are much longer than the budget (a long device
computation). The budget (100 us) also keeps the host where it is: a host that blocks is
woken by the IPU process, and on VMs the wake-up puts it on the IPU process's CPU, where
the two then take turns. The drainer polls with any number of transfers in flight: a
host that blocks is woken by the IPU process's publish, a futex wake the IPU process pays
on its own time (measured with 8 in flight, [64,1024] in ``empty_shared`` memory: about 6%
of the IPU process's time, and 17k futex calls in 3 s against 1k with the host polling).
The IPU process keeps off the host thread's CPU (``ipu_emulator.ipu._placement``), so the
poll takes nothing from it; with waits longer than the budget polling turns itself off.
With transfers queued behind the awaited one, a poll whose ``sched_yield`` ran another
task (the CPU is shared, e.g. 2 replicas' IPU processes hold both CPUs) blocks instead:
the device has work, and a host polling beside it would take its CPU.

The callers (``_submission``, ``_completion``) hold the locks; this module holds no
lock and no request state, only the rings of one session and a moving estimate of
how long output waits take (:meth:`TransferPath.await_output`).
"""

from __future__ import annotations

import enum
import os
import time
from typing import Callable, NamedTuple, Optional, Sequence

import numpy as np

from shm import Ring, RingTimeoutError
from shm import arrays as shm_arrays
from shm.spin import NEVER, PollEstimate, us_to_ns

from ipu_emulator.trace import recorder

from host_runtime.errors import SequenceMismatchError
from host_runtime.memory import PARALLEL_MIN_BYTES, SHARED_MIN_BYTES, copy_bytes, shared_location
from host_runtime.runner import _tracing
from host_runtime.runner._batching import TensorSpec
from host_runtime.runner._requests import Request, Transfer
from host_runtime.settings import HostSettings
from ipu_emulator.ipu_protocol import (SEQ_SHIFT, TAG_KIND_MASK, TAG_SHARED,
                                       host_memory_descriptor)

__all__ = ["NotTaken", "Lay", "Take", "lay_action", "take_action", "published_in", "consumed_from",
           "TransferPath", "PathOptions", "Acquire", "READ_MAX", "RECHECK"]

READ_MAX = 4096
"""Outputs up to this size (bytes) are read with ring.read() (a copy, then the slot is free)."""
RECHECK = 1.0
"""Seconds a wait with no deadline at all sleeps before it looks whether the replica closed."""
_ONE_CPU = len(os.sched_getaffinity(0)) < 2

_DESCRIPTORS = 256
"""Most host-memory descriptors a replica keeps made (see _Descriptors)."""

Redirects = Sequence[tuple[str, str, int, int]]
"""(output handle, region, offset, nbytes) of each output the IPU writes into host memory."""

Acquire = Callable[[Ring], memoryview]
"""A free slot of a ring; the caller's way of making room while it is full (it drains)."""


class Lay(enum.IntEnum):
    """How one input of a transfer reaches its ring."""

    SKIP = 0     # not given, not frozen (validate_io_params off): the device does not read it
    FROZEN = 1   # the frozen value (ModelRunnerConfig.frozen_inputs)
    WRITE = 2    # small, whole, contiguous: acquire, copy and publish in one ring call
    HOST = 3     # whole, contiguous, in host shared memory: a descriptor; read in place
    COPY = 4     # whole, contiguous: one copy into a slot
    SLICE = 5    # one transfer of several, or not contiguous: a numpy copy into a slot


class Take(enum.IntEnum):
    """How one output of a transfer comes back (a slot tagged TAG_SHARED: nothing to copy,
    the IPU wrote it into the request's memory)."""

    READ = 1     # small: ring.read copies it out and frees the slot in one call
    SLOT = 2     # a view of the slot, copied into the request's memory, then released


def lay_action(spec: TensorSpec, src: np.ndarray | None, frozen: bool, whole: bool,
               small_io: bool) -> Lay:
    """How input ``spec`` of a transfer is laid (``whole``: the request is one transfer)."""
    if src is None:
        return Lay.FROZEN if frozen else Lay.SKIP
    if not whole or not src.flags.c_contiguous:
        return Lay.SLICE
    nbytes = spec.nbytes
    if nbytes >= SHARED_MIN_BYTES and shared_location(src) is not None:
        return Lay.HOST
    if small_io and 0 < nbytes < SHARED_MIN_BYTES:
        return Lay.WRITE
    return Lay.COPY


def take_action(spec: TensorSpec, small_io: bool) -> Take:
    """How output ``spec`` of a transfer is taken back."""
    return Take.READ if small_io and spec.nbytes <= READ_MAX else Take.SLOT


class NotTaken(Exception):
    """``run_fused``: the device was found gone right after the inputs were laid, and it
    had taken none of them: the request never reached it (the caller treats it as one
    not yet sent)."""


def published_in(ring: Ring, seq: int) -> bool:
    """Whether the last transfer published on input ``ring`` is number ``seq``."""
    last = ring.last_published_tag()
    return last is not None and last >> SEQ_SHIFT == seq


def consumed_from(ring: Ring, seq: int) -> bool:
    """Whether the last output read from ``ring`` belongs to transfer ``seq``."""
    last = ring.last_read_tag()
    return last is not None and last >> SEQ_SHIFT == seq


def _mismatch(rid: int, name: str, tag: int, seq: int) -> SequenceMismatchError:
    """The error of output ``name`` of replica ``rid`` read with ``tag`` for transfer ``seq``."""
    got = tag >> SEQ_SHIFT
    return SequenceMismatchError(
        f"replica {rid}: output {name!r} read from the device carries transfer {got}, "
        f"expected transfer {seq}: the replica's streams are out of step, so none of its "
        "results can be trusted", expected=seq, got=got)


def _bytes_view(arr: np.ndarray) -> memoryview:
    """A flat byte memoryview of a C-contiguous array (no copy)."""
    if arr.size == 0:   # a zero-size tensor: memoryview cannot cast zeros in its shape
        return memoryview(bytearray())
    return memoryview(arr).cast("B")  # type: ignore[arg-type]


class PathOptions(NamedTuple):
    """The fast paths a runner takes and how it polls (its settings, taken when it is made)."""

    fused: bool = True
    small_io: bool = True
    spin_us: float = 100.0      # runner_spin_us: longest poll of an output ring (0: never)
    yielded_us: float = 5.0     # yielded_us: a sched_yield() that took longer ran another
                                # task on this CPU (0: never give up)

    @staticmethod
    def of(settings: HostSettings) -> "PathOptions":
        return PathOptions(settings.runner_fused, settings.runner_small_io,
                           settings.runner_spin_us, settings.yielded_us)


class _Descriptors(dict[tuple[tuple[str, int], int, Redirects], bytes]):
    """Host-memory descriptors, each made once per combination (a request reuses its
    arrays, and the IPU process keys its cache of resolved descriptors by these bytes)."""

    def of(self, loc: tuple[str, int], nbytes: int, redirects: Redirects) -> bytes:
        """The descriptor of ``nbytes`` at ``loc`` that redirects ``redirects``."""
        key = (loc, nbytes, tuple(redirects))
        desc = self.get(key)
        if desc is None:
            if len(self) >= _DESCRIPTORS:
                self.clear()
            desc = self[key] = host_memory_descriptor(loc[0], loc[1], nbytes, redirects)
        return desc


class _In(NamedTuple):
    name: str
    spec: TensorSpec
    ring: Ring
    frozen: Optional[memoryview]     # the frozen value's bytes, if frozen
    small: bool                      # a whole contiguous transfer of it is Lay.WRITE
    shared: bool                     # ... is Lay.HOST if it lies in host shared memory


class _Out(NamedTuple):
    name: str
    spec: TensorSpec
    ring: Ring
    take: Take
    shape: tuple[int, ...]           # the whole transfer's result (fused)
    # Its transfers carry the request's number, else 0: those of a model with no input
    # streams, and ``unnumbered`` ones, made on an IPU of a sharded model that no input
    # reaches (``ipu_emulator.validate.unnumbered_outputs``).
    numbered: bool


def _write_plan(inputs: list[_In]) -> tuple[tuple[str, object], ...]:
    """``run_fused``'s inputs written in one C call (``shm.arrays.write_arrays``): (name,
    ring core) of each, in laying order; () if one is frozen or has no C core."""
    plan = tuple((i.name, i.ring.c_handle()) for i in inputs)
    if any(i.frozen is not None or core is None for i, (_, core) in zip(inputs, plan)):
        return ()
    return plan


class TransferPath:
    """The rings of one replica's session and the steps of the module docstring."""

    def __init__(self, inputs: dict[str, TensorSpec], outputs: dict[str, TensorSpec],
                 frozen: dict[str, np.ndarray], in_rings: dict[str, Ring],
                 out_rings: dict[str, Ring], dynamic: bool, batch: int,
                 options: PathOptions, rid: int = 0,
                 unnumbered: frozenset[str] = frozenset()) -> None:
        """``inputs``: every Main input, in the order Main reads them (see ``_Out``)."""
        self.rid = rid
        self.dynamic = dynamic
        self.batch = batch
        self.small_io = options.small_io
        self.frozen = frozen
        self.in_specs = inputs
        fb = {n: _bytes_view(np.ascontiguousarray(a)) for n, a in frozen.items()}
        # last-read first: the device wakes once, on the first stream Main reads
        self.inputs = [_In(n, s, in_rings[n], fb.get(n),
                           options.small_io and 0 < s.nbytes < SHARED_MIN_BYTES,
                           s.nbytes >= SHARED_MIN_BYTES)
                       for n, s in reversed(inputs.items())]
        self._descriptors = _Descriptors()
        self.numbered = bool(self.inputs)   # (none: no output carries a number)
        self.outputs = {n: _Out(n, s, out_rings[n], take_action(s, options.small_io),
                                s.shape_for(s.batch), self.numbered and n not in unnumbered)
                        for n, s in outputs.items()}
        self.all_outputs = tuple(outputs.values())
        self.rings = [*in_rings.values(), *out_rings.values()]
        # an output large enough for host shared memory (see redirects)
        self.may_redirect = any(s.nbytes >= SHARED_MIN_BYTES for s in outputs.values())
        # run_fused's requests: whole transfers, every input Lay.WRITE, every output Take.READ
        self.fusable = (options.fused and options.small_io and not dynamic
                        and not self.may_redirect
                        and all(0 < s.nbytes < SHARED_MIN_BYTES for s in inputs.values())
                        and all(0 < s.nbytes <= READ_MAX for s in outputs.values()))
        self._write_plan = _write_plan(self.inputs) if self.fusable else ()
        self.fused_taken = 0             # outputs run_fused has read (-1: still writing)
        self.t_laid = 0                  # when run_fused had written its inputs (perf_counter ns)
        self.t_first = 0                 # tracing: when run_fused read its first output
        # when to poll an output ring before blocking (await_output): on one CPU a poll that
        # finds the CPU shared blocks; on several the IPU process moves off the host's CPU.
        # With transfers queued behind, a poll finding its CPU shared blocks on any machine
        # (2 replicas on 2 CPUs: a polling host took half of one, 1.23 -> 0.60x)
        yielded = us_to_ns(options.yielded_us, NEVER)
        self._shared_ns = yielded if _ONE_CPU else NEVER
        self._queued_shared_ns = yielded
        self._est = PollEstimate(us_to_ns(options.spin_us), self._shared_ns)

    def hint_thread(self, tid: int) -> None:
        """Tell the IPU process which thread submits (ipu_emulator.ipu._placement)."""
        for i in self.inputs:
            i.ring.set_user_word(tid)

    # ------------------------------------------------------------------ lay
    def lay_input(self, i: _In, src: np.ndarray | None, action: Lay, t: int, tag: int,
                  redirects: Redirects, acquire: Acquire) -> bool:
        """Lay transfer ``t`` of input ``i`` (``src``: the request's tensor) in a slot
        tagged ``tag`` (its number); True if it carried ``redirects`` (a descriptor names
        them, once per transfer)."""
        spec, ring = i.spec, i.ring
        nbytes = spec.nbytes
        if action is Lay.SKIP:
            return False
        if action is Lay.WRITE:
            try:
                ring.write(src, tag, 0.0)   # acquire, copy, publish: one call
                return False
            except RingTimeoutError:        # full: a slot as COPY does (acquire drains)
                action = Lay.COPY
        view = acquire(ring)
        if action is Lay.FROZEN:
            assert i.frozen is not None
            view[:nbytes] = i.frozen
        elif action is Lay.HOST:
            assert src is not None
            loc = shared_location(src)
            assert loc is not None
            desc = self._descriptors.of(loc, nbytes, redirects)
            if len(desc) <= nbytes:
                view[:len(desc)] = desc
                ring.publish(len(desc), TAG_SHARED | tag)
                return True
            copy_bytes(view[:nbytes], _bytes_view(src))    # a descriptor too long: copied
        elif action is Lay.COPY:
            assert src is not None
            copy_bytes(view[:nbytes], _bytes_view(src))
        else:     # SLICE
            assert src is not None
            slot = np.frombuffer(view, spec.dtype, nbytes // spec.dtype.itemsize
                                 ).reshape(spec.shape)
            b = spec.batch
            slot[...] = src[spec.index(t * b, (t + 1) * b)] if spec.batch_dim is not None else src
            del slot
        ring.publish(nbytes, tag)
        return False

    def lay_whole(self, tr: Transfer, req: Request, t: int, transfers: int,
                  redirects: Redirects, acquire: Acquire,
                  resume: bool = False) -> None:
        """Lay ``tr``, transfer ``t`` of ``transfers`` of a whole request, into the input
        rings, every slot tagged with ``tr.seq``.

        ``resume``: finish a transfer whose laying was interrupted (KeyboardInterrupt, a
        signal handler's exception): an input already published with ``tr``'s number is
        left alone, the others are copied (a slot held by the interrupted write is the
        one ``acquire`` returns), so that the device's iteration completes."""
        inputs = req.inputs
        whole = transfers == 1
        small = self.small_io and not resume
        seq = tr.seq
        tag = seq << SEQ_SHIFT
        for i in self.inputs:
            src = inputs.get(i.name)
            if resume:
                if published_in(i.ring, seq):
                    continue
                redirects = ()
            elif whole and src is not None and src.flags.c_contiguous:
                if i.small:
                    try:                     # Lay.WRITE (lay_action's decision), inline
                        i.ring.write(src, tag, 0.0)
                        continue
                    except RingTimeoutError:   # full: lay_input takes a slot (and makes room)
                        pass
                elif i.shared:   # Lay.HOST (lay_action's decision) if in host shared memory
                    loc = shared_location(src)
                    if loc is not None:
                        desc = self._descriptors.of(loc, i.spec.nbytes, redirects)
                        if len(desc) <= i.spec.nbytes:
                            view = acquire(i.ring)
                            view[:len(desc)] = desc
                            i.ring.publish(len(desc), TAG_SHARED | tag)
                            redirects = ()
                            continue
            action = lay_action(i.spec, src, i.frozen is not None, whole, small)
            if resume and action is Lay.HOST:
                action = Lay.COPY
            if self.lay_input(i, src, action, t, tag, redirects, acquire):
                redirects = ()

    def redirects(self, req: Request) -> Redirects:
        """(handle, region, offset, nbytes) of the outputs of a one-transfer request whose
        memory is host shared memory: the IPU writes them there."""
        if not self.may_redirect:
            return ()
        found = []
        for spec in req.outputs_per_transfer[0]:
            dest = req.dests.get(spec.name)
            if dest is not None and dest.nbytes == spec.nbytes and spec.nbytes >= SHARED_MIN_BYTES:
                loc = shared_location(dest)
                if loc is not None:
                    found.append((spec.handle, loc[0], loc[1], spec.nbytes))
        return tuple(found)

    # -- partial transfers (dynamic batching) -----------------------------------------
    def open_partial(self, acquire: Acquire) -> Transfer:
        """A transfer whose input slots are held open (frozen inputs filled) for packing."""
        tr = Transfer([], self.all_outputs, t_open=time.monotonic())
        for i in reversed(self.inputs):     # the order Main reads them
            spec = i.spec
            view = acquire(i.ring)
            slot = np.frombuffer(view, spec.dtype, spec.nbytes // spec.dtype.itemsize
                                 ).reshape(spec.shape)
            fz = self.frozen.get(i.name)
            if fz is not None:
                slot[...] = fz
            tr.slots[i.name] = slot
        return tr

    def pack(self, tr: Transfer, req: Request, start: int, count: int) -> None:
        """Samples ``start:start+count`` of ``req`` into ``tr``'s next ``count`` places."""
        at = tr.samples
        for name, src in req.inputs.items():
            spec = self.in_specs[name]
            tr.slots[name][spec.index(at, at + count)] = src[spec.index(start, start + count)]
        tr.segments.append((req, start, count, at))
        tr.samples = at + count

    def seal(self, tr: Transfer, pad: bool) -> None:
        """Publish ``tr``'s slots tagged with its number (``pad``: zeros after its
        samples, frozen inputs kept). Idempotent (an interrupted seal is sealed again):
        an input already published with ``tr``'s number is left alone."""
        seq = tr.seq
        tag = seq << SEQ_SHIFT
        for i in reversed(self.inputs):
            slot = tr.slots.get(i.name)
            if slot is None or published_in(i.ring, seq):
                continue
            spec = i.spec
            if pad and tr.samples < self.batch and i.frozen is None:
                slot[spec.index(tr.samples, self.batch)] = 0
            i.ring.publish(spec.nbytes, tag)
        tr.slots = {}

    # ------------------------------------------------------------------ take
    def await_output(self, ring: Ring, queued: bool = False) -> int:
        """Before a blocking read of an empty ``ring``: poll it briefly (see "Polling" in
        the module docstring; ``queued``: transfers are in flight behind this one); returns
        when it started (perf_counter ns) for :meth:`waited`."""
        t0 = time.perf_counter_ns()
        est = self._est
        est.shared_ns = self._queued_shared_ns if queued else self._shared_ns
        est.poll(ring.readable)   # shm.spin.PollEstimate: the host's and device's one rule
        return t0

    def waited(self, t0: int) -> None:
        """An output wait that started at ``t0`` (0: the output was there) ended."""
        self._est.record(0 if t0 == 0 else time.perf_counter_ns() - t0)

    def take(self, tr: Transfer, timeout: float, queued: bool = False) -> None:
        """Read ``tr``'s outputs into its requests' memory (RingTimeoutError after
        ``timeout`` s without one; ``tr.next_output`` says how far it got).

        An output not there yet is polled for before the read blocks (see "Polling" in the
        module docstring); ``queued``: transfers are in flight behind ``tr``."""
        dynamic = self.dynamic
        outputs = tr.outputs
        seq = tr.seq if self.numbered else 0
        while tr.next_output < len(outputs):
            index = tr.next_output
            spec = outputs[index]
            o = self.outputs[spec.name]
            ring = o.ring
            read = o.take is Take.READ
            view: memoryview | bytes
            if ring.readable():
                view, tag = ring.read(timeout) if read else ring.acquire_read(timeout)
                self._est.record(0)
            else:
                t0 = self.await_output(ring, queued)
                view, tag = ring.read(timeout) if read else ring.acquire_read(timeout)
                self.waited(t0)
            if recorder.ON and index == 0:
                tr.t_first = time.perf_counter_ns()
            try:
                if tag >> SEQ_SHIFT != (seq if o.numbered else 0):
                    raise _mismatch(self.rid, spec.name, tag, seq if o.numbered else 0)
                if tag & TAG_KIND_MASK != TAG_SHARED:   # else the IPU wrote it into the
                    self.copy_out(tr, spec, view, dynamic)   # request's memory
            finally:
                if not read:
                    ring.release()
            tr.next_output = index + 1
        if recorder.ON:   # the timeline: when its requests' outputs were read, its number
            _tracing.drained(tr, time.perf_counter_ns())

    def output_ring_of(self, name: str) -> Ring:
        """The ring of output ``name``."""
        return self.outputs[name].ring

    def output_ring(self, tr: Transfer, index: int) -> Ring:
        """The ring of output ``index`` of ``tr``."""
        return self.outputs[tr.outputs[index].name].ring

    @staticmethod
    def copy_out(tr: Transfer, spec: TensorSpec, view: memoryview | bytes, dynamic: bool) -> None:
        """Output ``spec`` of ``tr`` (``view``) into the memory of each request it carries."""
        segs = tr.segments
        if len(segs) == 1 and not dynamic:
            req = segs[0][0]
            dest = req.dests.get(spec.name)
            if dest is None:
                return
            nbytes = spec.nbytes
            if dest.nbytes == nbytes and dest.flags.c_contiguous:
                if 0 < nbytes < PARALLEL_MIN_BYTES:   # copy_bytes' one copy, without its calls
                    memoryview(dest).cast("B")[:] = view[:nbytes]  # type: ignore[arg-type]
                elif nbytes:
                    copy_bytes(_bytes_view(dest), view[:nbytes])
                return
        slot = np.frombuffer(view, spec.dtype, spec.nbytes // spec.dtype.itemsize
                             ).reshape(spec.shape)
        f = 1 if dynamic else spec.batch
        for req, rs, cnt, ss in segs:
            dest = req.dests.get(spec.name)
            if dest is None:
                continue
            if spec.batch_dim is None:
                dest[...] = slot
            else:
                dest[spec.index(rs * f, (rs + cnt) * f)] = slot[spec.index(ss * f, (ss + cnt) * f)]

    # ------------------------------------------------------------------ fused
    def run_fused(self, inputs: dict[str, np.ndarray], seq: int, acquire: Acquire,
                  slow: Callable[[float], None], slice_s: float, gone: Callable[[], bool],
                  meanwhile: Callable[[], None]) -> dict[str, np.ndarray]:
        """``lay_whole`` + ``take`` of a plain one-transfer request, number ``seq``, on an
        idle replica (``fusable``; the caller holds the submit lock and checked it is
        idle): every input Lay.WRITE (or FROZEN), every output Take.READ into a new array.

        ``slow(since)`` runs each ``slice_s`` an output is late (``since``: when the wait
        began, monotonic): it raises if the replica closed or the device made no progress
        for too long. ``fused_taken``: -1 while laying, then the outputs read (how far it
        got: what an interrupted caller abandons).

        ``gone()`` (the device's IPU processes polled) and ``meanwhile()`` (the monitor
        records the request before) run once the inputs are laid, while the device
        computes: off the request's path. Gone with none of the inputs taken: NotTaken
        (the caller resets and sends it again, as a request sent after the exit); after
        taking one, the outputs' wait fails as for any request in flight."""
        self.fused_taken = -1
        tag = seq << SEQ_SHIFT      # TAG_DATA, numbered
        # in one C call (shm.arrays.write_arrays), then any it could not write one by one
        laid = shm_arrays.write_arrays(inputs, self._write_plan, tag) if self._write_plan else 0
        for i in self.inputs[laid:] if laid else self.inputs:
            arr = inputs.get(i.name)
            if arr is None:
                self.lay_input(i, None, Lay.FROZEN if i.frozen is not None else Lay.SKIP,
                               0, tag, [], acquire)
                continue
            if not arr.flags.c_contiguous:
                arr = np.ascontiguousarray(arr)
            try:
                i.ring.write(arr, tag, 0.0)        # Lay.WRITE, inline
            except RingTimeoutError:               # full: as lay_input does
                self.lay_input(i, arr, Lay.COPY, 0, tag, [], acquire)
        self.t_laid = time.perf_counter_ns()
        if gone() and all(i.ring.readable() for i in self.inputs if published_in(i.ring, seq)):
            raise NotTaken
        meanwhile()
        return self.take_fused(seq, slow, slice_s)

    def take_fused(self, seq: int, slow: Callable[[float], None], slice_s: float
                   ) -> dict[str, np.ndarray]:
        """``run_fused``'s reading: each output of transfer ``seq`` (Take.READ) into a new
        array; ``fused_taken`` counts them."""
        tag = seq << SEQ_SHIFT if self.numbered else 0
        results = {}
        self.fused_taken = 0
        first = recorder.ON    # tracing: note when the first output is read
        for o in self.outputs.values():
            ring = o.ring
            t0 = 0 if ring.readable() else self.await_output(ring)
            since = 0.0
            while True:
                try:
                    data, got = ring.read(slice_s)   # no redirects: never TAG_SHARED
                    break
                except RingTimeoutError:   # a long computation, closed, or a stalled device?
                    since = since or time.monotonic() - slice_s
                    slow(since)
            if first:
                self.t_first = time.perf_counter_ns()
                first = False
            if got != (tag if o.numbered else 0):
                raise _mismatch(self.rid, o.name, got, seq if o.numbered else 0)
            self._est.record(time.perf_counter_ns() - t0 if t0 else 0)
            # writable, over a copy of the message (cheaper than np.empty and a copy)
            results[o.name] = np.ndarray(o.shape, o.spec.dtype, bytearray(data))
            self.fused_taken += 1
        return results
