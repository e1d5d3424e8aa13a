"""Runs an executable's programs over device memory with onnxruntime.

Construction is "loading onto the device": device tensors are mapped as numpy
views over the device memory buffer, one onnxruntime session is created per
graph, and every ``Execute`` gets an IO binding whose inputs and outputs point
straight at device memory. Programs are then compiled into flat lists of
closures, so ``run_program`` does no lookups and no allocation::

    StreamIO.read_input(handle, view)  ->  device tensor  --Execute(ORT, bound)-->  device tensor
                                                                                      |
    StreamIO.write_output(handle, view) <------------------------------------------+

The interpreter knows nothing of rings: the IPU process wires ``StreamIO`` to
shared-memory rings, tests wire it to Python callables. Exceptions raised by
``StreamIO`` propagate unchanged; onnxruntime failures and bad switch indices
raise ``DeviceProgramError``.

Zero-copy streams: a ``StreamIO`` that also has the methods of
``ZeroCopyStreamIO`` (the IPU process's, over ring slots) lets onnxruntime read
input transfers and write output transfers in place, for the streams
``ipu_emulator.ipu._zerocopy.plan_zero_copy`` finds to have no other use::

    acquire_input(h) -> slot --Execute(ORT, bound to the slots)--> slot = acquire_output(h2)
    release_input(h) after the Execute                           publish_output(h2) at StreamOut

Every other stream, and every ``StreamIO`` without those methods, takes the
general path above; the device memory of a zero-copy tensor is not written.

Where an instruction list has the zero-copy ``StreamIn``s of an ``Execute``
right before it and its zero-copy ``StreamOut``s right after it (what the
compiler emits for a Main iteration), the run of them is one step: it first
offers the ``StreamIO`` its ``ZeroCopyGroup`` (``run_group``, optional), which
may do the whole run in one call (the IPU process does it in C when every
transfer is there); else the steps run one by one as above.

Modules: ``_stream_api`` (the ``StreamIO`` protocols), ``_sessions`` (onnxruntime
sessions and weights), ``_steps`` (programs compiled into steps), ``_execute`` (the
Execute steps, general and zero-copy); this one loads and runs.
"""

from __future__ import annotations

import logging
from typing import Mapping

import numpy as np

from ipu_emulator.errors import DeviceProgramError, ExecutableError
from ipu_emulator.executable import Executable, numpy_dtype
from ipu_emulator.ipu._constants import ConstantPlan, plan_constants
from ipu_emulator.ipu._sessions import make_sessions
from ipu_emulator.ipu._stream_api import (
    CallableStreamIO, Step, StreamIO, ZeroCopyGroup, ZeroCopyStreamIO)
from ipu_emulator.ipu._steps import LoopPlan, ProgramCompiler
from ipu_emulator.ipu._zerocopy import ZeroCopyPlan, plan_zero_copy
from ipu_emulator.settings import IpuSettings

__all__ = ["Interpreter", "StreamIO", "CallableStreamIO", "ZeroCopyGroup", "ZeroCopyStreamIO"]

_log = logging.getLogger(__name__)


class Interpreter:
    """Loads ``exe`` onto a device memory buffer and runs its programs.

    ``device_memory`` must be a writable buffer of at least ``exe.memory_bytes``
    bytes (e.g. a shared-memory region's ``buf``); without it the interpreter
    allocates its own. ``num_threads`` is onnxruntime's intra-op thread count.
    ``zero_copy``: compute in the transfer buffers a ``ZeroCopyStreamIO`` lends (default:
    the setting ``zero_copy``, off for measurements).

    Weights: a graph's initializers that the executable keeps in its weights section
    (``Graph.external``, ``exe.weights``: in an IPU process a read-only mapping of a
    region that every replica of the model maps) are handed to onnxruntime as views.
    ``prepack`` (default: the setting ``prepack``) chooses what onnxruntime does with
    them:

    - on (speed): it takes its own copy, prepacked where its kernels prefer another
      layout (MatMul, Conv); once the sessions are made the interpreter lets go of
      ``exe.weights`` (``uses_weights`` is False), so one copy per IPU process remains;
    - off (memory): it computes with them where they lie, not copied: one copy for
      every IPU process that maps the same region (MatMul and Conv a few times slower).

    ``weights_kept`` (with prepacking on): ``exe.weights`` stays valid for as long as the
    interpreter holds it (a read-only mapping of a file that is not changed). Where every
    weight in it is aligned (64 bytes), onnxruntime prepacks from it where it lies instead
    of copying it first, and reads an initializer it did not prepack there too;
    ``uses_weights`` is then True (the caller keeps the mapping; its pages may be dropped
    from memory, they are read again). Else it copies them as without the option.

    ``constants`` (handle -> bytes): constant streams, whose value is given here instead
    of read from the stream (in an IPU process a read-only region every replica maps). A
    tensor only they fill and no program writes is those bytes (its StreamIns are
    dropped, device memory is not written); one a program writes is copied from them at
    each of its StreamIns (``ipu_emulator.ipu._constants``, ``self.constants``).

    ``validated``: ``exe`` was validated already and not changed since
    (``Executable.from_bytes`` validates what it decodes): not checked again.
    """

    def __init__(self, exe: Executable, device_memory: memoryview | bytearray | None = None,
                 num_threads: int = 1, zero_copy: bool | None = None,
                 prepack: bool | None = None, weights_kept: bool = False,
                 constants: Mapping[str, memoryview] | None = None,
                 validated: bool = False) -> None:
        if not validated:
            exe.validate()
        self.executable = exe
        self._memory = mem = _device_memory(exe, device_memory)
        consts = dict(constants or {})
        self.constants: ConstantPlan = plan_constants(exe, consts)
        """The constant streams (their values in ``constants``, never read from a stream):
        which tensors are those values, read in place, and which get a copy (written by a
        program); see ``ipu_emulator.ipu._constants``."""
        self._const = consts
        self.arrays, self._views = _map_tensors(exe, mem, self.constants, consts)
        if prepack is None or zero_copy is None:   # the settings' (read only then)
            settings = IpuSettings.current()
            prepack = settings.prepack if prepack is None else prepack
            zero_copy = settings.zero_copy if zero_copy is None else zero_copy
        built = make_sessions(exe, num_threads, prepack, weights_kept)
        self._sessions = built.sessions
        self._weights = built.keep   # OrtValues over exe.weights, kept for the sessions
        self.uses_weights = bool(self._weights) and built.in_place
        """Whether the sessions may compute with ``exe.weights`` where it lies (else it was
        copied and is let go: the caller may unmap it)."""
        if not self.uses_weights:
            self._weights.clear()
            exe.weights = b""
        self.zero_copy: ZeroCopyPlan = plan_zero_copy(exe, frozenset(consts))
        self._zc_views: dict[str, memoryview] = {}     # input handle -> acquired transfer
        self._zc_deferred: list[str] = []   # inputs whose Execute ran, released after a publish
        compiler = ProgramCompiler(exe, self.arrays, self._views, self._sessions, consts,
                                   self.constants.shared, self.zero_copy, self._zc_views,
                                   self._zc_deferred)
        # program -> its LoopPlan when it is just one zero-copy group: see run_program_many
        self._loop_plans: dict[int, LoopPlan] = {}
        self._programs: list[list[Step]] = [compiler.compile(p.body) for p in exe.programs]
        self._programs_zc = self._programs
        if zero_copy and (self.zero_copy.input_tensors or self.zero_copy.output_tensors):
            self._programs_zc = [compiler.compile(p.body, True) for p in exe.programs]
            for k, p in enumerate(exe.programs):
                plan = compiler.loop_plan(p.body)
                if plan is not None:
                    self._loop_plans[k] = plan
        self._closed = False

    # -- public -----------------------------------------------------------------

    @property
    def memory(self) -> memoryview:
        return self._memory

    def num_programs(self) -> int:
        return len(self._programs)

    @property
    def closed(self) -> bool:
        return self._closed

    def holds_transfers(self) -> bool:
        """Whether zero-copy transfers are acquired (a run under way, or cut short without
        its cleanup)."""
        return bool(self._zc_views)

    def run_program(self, index: int, io: StreamIO) -> None:
        """Run program ``index`` once (a Main program repeats its device iterations)."""
        if self._closed:
            raise DeviceProgramError(f"interpreter of {self.executable.name!r} is closed")
        if not 0 <= index < len(self._programs):
            raise DeviceProgramError(
                f"program {index} does not exist; executable {self.executable.name!r} has "
                f"programs 0..{len(self._programs) - 1}")
        if getattr(io, "acquire_input", None) is None:
            for step in self._programs[index]:
                step(io)
            return
        try:
            for step in self._programs_zc[index]:
                step(io)
        finally:
            if self._zc_views:   # a failure between a zero-copy StreamIn and its StreamOut
                self._release_held(io)  # type: ignore[arg-type]

    def run_program_many(self, index: int, io: StreamIO, deadline_ns: int) -> int:
        """Run program ``index`` again and again while its iterations can be done at once.

        For a program that is one ``ZeroCopyGroup`` (in a ``Repeat``) and a ``StreamIO``
        with ``run_groups`` (the IPU process's: C steps back to back until
        ``deadline_ns`` of the monotonic clock or a control message). Returns how many
        whole runs of the program were done: 0 means none (run it with ``run_program``).
        """
        plan = self._loop_plans.get(index)
        run_groups = getattr(io, "run_groups", None)
        if plan is None or run_groups is None or self._closed:
            return 0
        group, count, fused, where = plan
        try:
            n = run_groups(group, count, deadline_ns)
        except Exception as exc:
            raise DeviceProgramError(f"{where}: {exc}") from exc
        rest = -n % count   # they stopped inside a run of the program: finish it
        try:
            for _ in range(rest):
                fused(io)
        finally:
            if self._zc_views:
                self._release_held(io)  # type: ignore[arg-type]
        return int((n + rest) // count)

    def _release_held(self, io: ZeroCopyStreamIO) -> None:
        held = list(self._zc_views)
        self._zc_views.clear()      # the compiled steps hold these two objects
        self._zc_deferred.clear()
        for h in held:
            try:
                io.release_input(h)
            except Exception:   # the program's own error is the one to report
                _log.debug("releasing input %r after a failure", h, exc_info=True)

    def tensor(self, name: str) -> np.ndarray:
        """The numpy view of a device tensor (for tests and diagnostics)."""
        try:
            return self.arrays[name]
        except KeyError:
            raise KeyError(f"no device tensor {name!r}; have {sorted(self.arrays)}") from None

    def close(self) -> None:
        """Drop the sessions and the views of device memory (idempotent)."""
        if self._closed:
            return
        self._closed = True
        # Drop every reference into device memory so its owner can unmap it.
        self._programs = []
        self._programs_zc = []
        self._loop_plans.clear()
        self._zc_views.clear()
        self._zc_deferred.clear()
        self._sessions = []
        self._weights = []
        self._const = {}
        self.arrays = {}
        self._views = {}
        self._memory = memoryview(b"")

    def __enter__(self) -> "Interpreter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _device_memory(exe: Executable, device_memory: memoryview | bytearray | None
                   ) -> memoryview:
    """``device_memory`` as a writable flat byte view of at least ``exe.memory_bytes``
    (a new buffer if None)."""
    if device_memory is None:
        device_memory = bytearray(max(exe.memory_bytes, 1))
    mem = memoryview(device_memory)
    if mem.readonly:
        raise ValueError("device memory must be writable")
    if mem.ndim != 1 or mem.itemsize != 1:
        mem = mem.cast("B")
    if len(mem) < exe.memory_bytes:
        raise ValueError(f"device memory of {len(mem)} bytes is smaller than the "
                         f"{exe.memory_bytes} bytes executable {exe.name!r} needs")
    return mem


def _map_tensors(exe: Executable, mem: memoryview, plan: ConstantPlan,
                 consts: Mapping[str, memoryview]
                 ) -> tuple[dict[str, np.ndarray], dict[str, memoryview]]:
    """Each device tensor as a numpy array and its bytes: a view of ``mem`` at its offset,
    or the bytes of the constant that is its value (``plan.shared``, read-only). Checks
    the size of every constant (``ExecutableError``)."""
    raw = np.frombuffer(mem, dtype=np.uint8)
    arrays: dict[str, np.ndarray] = {}
    views: dict[str, memoryview] = {}
    shared = plan.shared_tensors
    for name, t in exe.tensors.items():
        dt = numpy_dtype(t.dtype)
        h = shared.get(name)
        if h is not None:   # the constant's bytes themselves (read-only), not a copy
            view = _constant_view(consts[h], t.nbytes, h, name)
            arrays[name] = np.frombuffer(view, dtype=dt).reshape(t.shape)
            views[name] = view
            continue
        arrays[name] = raw[t.offset:t.offset + t.nbytes].view(dt).reshape(t.shape)
        views[name] = mem[t.offset:t.offset + t.nbytes]
    for h, names in plan.copied.items():
        for name in names:
            _constant_view(consts[h], exe.tensors[name].nbytes, h, name)
    return arrays, views


def _constant_view(value: memoryview, nbytes: int, handle: str, tensor: str) -> memoryview:
    """The read-only bytes of constant stream ``handle`` for device tensor ``tensor``."""
    view = memoryview(value)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    if len(view) != nbytes:
        raise ExecutableError(f"constant stream {handle!r} has {len(view)} bytes; its device "
                              f"tensor {tensor!r} has {nbytes}")
    return view.toreadonly()

