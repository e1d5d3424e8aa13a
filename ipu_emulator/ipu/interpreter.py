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
"""

from __future__ import annotations

import ctypes
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

import numpy as np

from shm import buffer_address as _address
from shm.copy import copy_bytes

from ipu_emulator.errors import DeviceProgramError, ExecutableError
from ipu_emulator.executable import (
    Copy, Execute, Executable, Graph, Instruction, Repeat, StreamIn, StreamOut, Switch,
    numpy_dtype)
from ipu_emulator.ipu._constants import ConstantPlan, plan_constants
from ipu_emulator.ipu._forwarding import forwarded_outputs
from ipu_emulator.ipu._zerocopy import ZeroCopyPlan, plan_zero_copy
from ipu_emulator.settings import IpuSettings
from ipu_emulator.trace import recorder

__all__ = ["Interpreter", "StreamIO", "CallableStreamIO", "ZeroCopyGroup", "ZeroCopyStreamIO"]

_log = logging.getLogger(__name__)

_Step = Callable[["StreamIO"], None]



class StreamIO(Protocol):
    """Where the device's streams come from and go to."""

    def read_input(self, handle: str, dest: memoryview) -> None:
        """Fill ``dest`` (exactly one transfer, ``len(dest)`` bytes) from stream ``handle``."""

    def write_output(self, handle: str, src: memoryview) -> None:
        """Consume one transfer of stream ``handle`` from ``src`` (valid during the call)."""


class ZeroCopyStreamIO(StreamIO, Protocol):
    """A ``StreamIO`` that lends its transfer buffers (optional; see the module docstring).

    For one handle, calls alternate ``acquire_input``/``release_input`` (or
    ``acquire_output``/``publish_output``); a program that fails in between may
    leave an output acquired, and then acquires it again.
    """

    def acquire_input(self, handle: str, nbytes: int) -> memoryview:
        """The next transfer of input ``handle``: ``nbytes`` bytes, valid until release."""

    def release_input(self, handle: str) -> None:
        """Done with the transfer ``acquire_input(handle)`` returned."""

    def acquire_output(self, handle: str, nbytes: int) -> memoryview:
        """A writable buffer of ``nbytes`` bytes for the next transfer of output ``handle``."""

    def publish_output(self, handle: str) -> None:
        """The buffer of ``acquire_output(handle)`` holds the transfer: send it."""


@dataclass(eq=False)
class ZeroCopyGroup:
    """The zero-copy ``StreamIn``s, the ``Execute`` and the ``StreamOut``s of one run.

    A ``StreamIO`` may have ``run_group(group) -> bool``: do the whole run at
    once (acquire one transfer of each input and a buffer of each output, call
    ``fn(*args)`` for ``calls[(input addresses..., output addresses...)] ==
    (binding, fn, args)``, publish the outputs, release the inputs) and return
    True; or do nothing and return False (the steps then run one by one, and
    they add the missing ``calls`` entry). It raises only what ``fn`` raised.
    """

    in_handles: tuple[str, ...]
    in_sizes: tuple[int, ...]
    out_handles: tuple[str, ...]
    out_sizes: tuple[int, ...]
    calls: dict[tuple[int, ...], tuple[Any, Callable[..., Any], tuple[Any, ...]]] = field(
        default_factory=dict)


class CallableStreamIO:
    """A ``StreamIO`` over dicts of per-handle callables (tests, in-process stand-ins).

    ``inputs[handle](dest)`` fills ``dest``; ``outputs[handle](src)`` consumes ``src``.
    """

    def __init__(self, inputs: dict[str, Callable[[memoryview], None]] | None = None,
                 outputs: dict[str, Callable[[memoryview], None]] | None = None) -> None:
        self.inputs = dict(inputs or {})
        self.outputs = dict(outputs or {})

    def read_input(self, handle: str, dest: memoryview) -> None:
        try:
            fn = self.inputs[handle]
        except KeyError:
            raise KeyError(f"no input callable for stream {handle!r}; have "
                           f"{sorted(self.inputs)}") from None
        fn(dest)

    def write_output(self, handle: str, src: memoryview) -> None:
        try:
            fn = self.outputs[handle]
        except KeyError:
            raise KeyError(f"no output callable for stream {handle!r}; have "
                           f"{sorted(self.outputs)}") from None
        fn(src)


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
    """

    def __init__(self, exe: Executable, device_memory: memoryview | bytearray | None = None,
                 num_threads: int = 1, zero_copy: bool | None = None,
                 prepack: bool | None = None, weights_kept: bool = False,
                 constants: Mapping[str, memoryview] | None = None) -> None:
        import onnxruntime as ort  # deferred: importing it costs ~0.2 s

        exe.validate()
        self.executable = exe
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
        self._memory = mem
        raw = np.frombuffer(mem, dtype=np.uint8)
        self.arrays: dict[str, np.ndarray] = {}
        self._views: dict[str, memoryview] = {}
        consts = dict(constants or {})
        self.constants: ConstantPlan = plan_constants(exe, consts)
        """The constant streams (their values in ``constants``, never read from a stream):
        which tensors are those values, read in place, and which get a copy (written by a
        program); see ``ipu_emulator.ipu._constants``."""
        self._const = consts
        shared = self.constants.shared_tensors
        for name, t in exe.tensors.items():
            dt = numpy_dtype(t.dtype)
            h = shared.get(name)
            if h is not None:   # the constant's bytes themselves (read-only), not a copy
                view = _constant_view(consts[h], t.nbytes, h, name)
                self.arrays[name] = np.frombuffer(view, dtype=dt).reshape(t.shape)
                self._views[name] = view
                continue
            arr = raw[t.offset:t.offset + t.nbytes].view(dt).reshape(t.shape)
            self.arrays[name] = arr
            self._views[name] = mem[t.offset:t.offset + t.nbytes]
        for h, names in self.constants.copied.items():
            for name in names:
                _constant_view(consts[h], exe.tensors[name].nbytes, h, name)

        settings = IpuSettings.current()
        prepack = settings.prepack if prepack is None else prepack

        def options() -> Any:
            so = ort.SessionOptions()
            so.intra_op_num_threads = max(1, int(num_threads))
            so.inter_op_num_threads = 1
            so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
            so.log_severity_level = 4   # failures surface as exceptions, not log lines
            # A spinning ORT worker steals the core another device process needs.
            so.add_session_config_entry("session.intra_op.allow_spinning", "0")
            so.add_session_config_entry("session.inter_op.allow_spinning", "0")
            if not prepack:
                so.add_session_config_entry("session.disable_prepacking", "1")
            return so
        self._ort = ort
        self._sessions: list[object] = []
        self._weights: list[object] = []   # OrtValues over exe.weights, kept for the sessions
        # prepacked from where they lie (no copy first): only where the caller keeps them
        # and every weight is aligned (else onnxruntime would compute with a copy anyway)
        in_place = not prepack or (weights_kept and _aligned(exe))
        for k, g in enumerate(exe.graphs):
            try:
                opts = options()
                if g.external:
                    _add_weights(ort, opts, g, exe.weights, self._weights, in_place=in_place)
                sess = ort.InferenceSession(g.model, opts, providers=["CPUExecutionProvider"])
            except Exception as exc:
                raise DeviceProgramError(
                    f"executable {exe.name!r}: graph {k} cannot be loaded by onnxruntime: "
                    f"{exc}") from exc
            _check_interface(exe.name, k, g, sess)
            self._sessions.append(sess)
        self.uses_weights = bool(self._weights) and in_place
        """Whether the sessions may compute with ``exe.weights`` where it lies (else it was
        copied and is let go: the caller may unmap it)."""
        if not self.uses_weights:
            self._weights.clear()
            exe.weights = b""
        # per graph: outputs that are an input forwarded unchanged (copied here, not by ort)
        self._forwarded = [forwarded_outputs(g) for g in exe.graphs]
        self.zero_copy: ZeroCopyPlan = plan_zero_copy(exe, frozenset(consts))
        self._zc_in = self.zero_copy.input_tensors     # tensor -> handle
        self._zc_out = self.zero_copy.output_tensors
        self._zc_views: dict[str, memoryview] = {}     # input handle -> acquired transfer
        self._zc_deferred: list[str] = []   # inputs whose Execute ran, released after a publish
        self._groups: dict[int, ZeroCopyGroup] = {}   # id(Execute) -> its group (see _compile)
        # program -> (group, count, fused step, error prefix) when it is just that group
        # (in a Repeat of count): see run_program_many
        self._loop_plans: dict[int, tuple[ZeroCopyGroup, int, _Step, str]] = {}
        self._fused_steps: dict[ZeroCopyGroup, tuple[_Step, str]] = {}
        self._programs: list[list[_Step]] = [self._compile(p.body) for p in exe.programs]
        self._programs_zc = self._programs
        if zero_copy is None:
            zero_copy = settings.zero_copy
        if zero_copy and (self._zc_in or self._zc_out):
            self._programs_zc = [self._compile(p.body, True) for p in exe.programs]
            for k, p in enumerate(exe.programs):
                plan = self._loop_plan(self._strip(p.body))
                if plan is not None:
                    self._loop_plans[k] = plan
        self._closed = False

    # -- public -----------------------------------------------------------------

    @property
    def memory(self) -> memoryview:
        return self._memory

    def num_programs(self) -> int:
        return len(self._programs)

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
        self._groups.clear()
        self._loop_plans.clear()
        self._fused_steps.clear()
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

    # -- compiling programs into closures -----------------------------------------

    def _strip(self, body: tuple[Instruction, ...]) -> tuple[Instruction, ...]:
        """``body`` without the StreamIns of shared constants (their tensor is the value)."""
        shared = self.constants.shared
        if not shared:
            return body
        return tuple(i for i in body if not (isinstance(i, StreamIn) and i.handle in shared))

    def _compile(self, body: tuple[Instruction, ...], zc: bool = False) -> list[_Step]:
        body = self._strip(body)
        steps = [self._step(i, zc) for i in body]
        if not zc:
            return steps
        # Fuse each [zero-copy StreamIns, Execute, zero-copy StreamOuts] run into one step,
        # from the last so that earlier indices stay valid.
        for p in reversed(range(len(body))):
            i = body[p]
            if not isinstance(i, Execute) or (group := self._groups.get(id(i))) is None:
                continue
            a, b = p - len(group.in_handles), p + 1 + len(group.out_handles)
            ins, outs = body[max(a, 0):p], body[p + 1:b]
            if (a >= 0 and b <= len(body)
                    and all(isinstance(s, StreamIn) for s in ins)
                    and {s.handle for s in ins} == set(group.in_handles)   # type: ignore[union-attr]
                    and all(isinstance(s, StreamOut) for s in outs)
                    and {s.handle for s in outs} == set(group.out_handles)):  # type: ignore[union-attr]
                steps[a:b] = [self._fused(group, steps[a:b], i)]
        return steps

    def _loop_plan(self, body: tuple[Instruction, ...]
                   ) -> tuple[ZeroCopyGroup, int, _Step, str] | None:
        """(group, count, fused step, error prefix) if ``body`` is one fused group, or a
        Repeat of count >= 1 of one."""
        count = 1
        if len(body) == 1 and isinstance(body[0], Repeat):
            count, body = body[0].count, body[0].body
        execs = [i for i in body if isinstance(i, Execute)]
        group = self._groups.get(id(execs[0])) if len(execs) == 1 else None
        if group is None or group not in self._fused_steps or count < 1 \
                or len(body) != len(group.in_handles) + 1 + len(group.out_handles):
            return None
        return (group, count, *self._fused_steps[group])

    def _fused(self, group: ZeroCopyGroup, steps: list[_Step], i: Execute) -> _Step:
        where = f"executable {self.executable.name!r}: graph {i.graph} failed in onnxruntime"

        def fused(io: Any) -> None:
            run_group = getattr(io, "run_group", None)
            if run_group is not None:
                try:
                    if run_group(group):
                        return
                except Exception as exc:
                    raise DeviceProgramError(f"{where}: {exc}") from exc
            for step in steps:
                step(io)
        self._fused_steps[group] = (fused, where)
        return fused

    def _step(self, i: Instruction, zc: bool = False) -> _Step:
        if zc and isinstance(i, StreamIn) and i.handle in self.zero_copy.inputs:
            handle, nbytes, views = i.handle, self._views[i.tensor].nbytes, self._zc_views

            def stream_in_zc(io: Any) -> None:
                v = io.acquire_input(handle, nbytes)
                views[handle] = v   # held from here: released even if the check fails
                if v.nbytes != nbytes or not v.c_contiguous:
                    _checked(v, nbytes, handle)
            return stream_in_zc
        if zc and isinstance(i, StreamOut) and i.handle in self.zero_copy.outputs:
            handle, views, deferred = i.handle, self._zc_views, self._zc_deferred

            def stream_out_zc(io: Any) -> None:
                io.publish_output(handle)
                # inputs of the Execute that wrote it: released off the host's critical path
                if deferred:
                    for h in deferred:
                        if views.pop(h, None) is not None:
                            io.release_input(h)
                    deferred.clear()
            return stream_out_zc
        if isinstance(i, StreamIn) and i.handle in self._const:
            # a constant a program writes: this device's copy, restored at each Load run
            dst = self.arrays[i.tensor].reshape(-1).view(np.uint8)
            src = np.frombuffer(self._const[i.handle], np.uint8, dst.nbytes)

            def constant_in(io: StreamIO) -> None:
                np.copyto(dst, src)
            return constant_in
        if isinstance(i, StreamIn):
            handle, view = i.handle, self._views[i.tensor]

            def stream_in(io: StreamIO) -> None:
                io.read_input(handle, view)
            return stream_in
        if isinstance(i, StreamOut):
            handle, view = i.handle, self._views[i.tensor]
            readonly = view.toreadonly()

            def stream_out(io: StreamIO) -> None:
                io.write_output(handle, readonly)
            return stream_out
        if isinstance(i, Execute):
            if zc and (any(t in self._zc_in for _, t in i.inputs)
                       or any(t in self._zc_out for _, t in i.outputs)):
                return self._execute_zc(i)
            return self._execute(i)
        if isinstance(i, Repeat):
            steps, count = self._compile(i.body, zc), i.count

            def repeat(io: StreamIO) -> None:
                for _ in range(count):
                    for step in steps:
                        step(io)
            return repeat
        if isinstance(i, Switch):
            branches = [self._compile(b, zc) for b in i.branches]
            index_arr = self.arrays[i.index].reshape(-1)
            name = i.index

            def switch(io: StreamIO) -> None:
                k = int(index_arr[0])
                if not 0 <= k < len(branches):
                    raise DeviceProgramError(
                        f"switch index {name!r} is {k}; expected 0..{len(branches) - 1}")
                for step in branches[k]:
                    step(io)
            return switch
        if isinstance(i, Copy):
            src = self.arrays[i.src].reshape(-1).view(np.uint8)
            dst = self.arrays[i.dst].reshape(-1).view(np.uint8)

            def copy(io: StreamIO) -> None:
                np.copyto(dst, src)
            return copy
        raise ExecutableError(f"not an instruction: {i!r:.80}")

    def _execute(self, i: Execute) -> _Step:
        sess = self._sessions[i.graph]
        graph: Graph = self.executable.graphs[i.graph]
        binding = sess.io_binding()  # type: ignore[attr-defined]
        for onnx_name, tname in i.inputs:
            arr = self.arrays[tname]
            binding.bind_input(onnx_name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)
        # outputs that are an input (forwarded, or the same name: onnxruntime does not write
        # those into a bound buffer) are copied after the run instead of bound
        copies: list[tuple[np.ndarray, np.ndarray]] = []   # (destination, source) bytes
        bound = 0
        for onnx_name, tname in i.outputs:
            arr = self.arrays[tname]
            src = self._source_of(i, onnx_name, graph)
            if src is not None:
                copies.append((_bytes_of(arr), _bytes_of(self.arrays[src])))
                continue
            binding.bind_output(onnx_name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)
            bound += 1
        run, run_args = _runner(sess, binding)
        gid, exe_name = i.graph, self.executable.name

        def execute(io: StreamIO) -> None:
            t0 = time.monotonic_ns() if recorder.ON else 0
            if bound:
                try:
                    run(*run_args)
                except Exception as exc:
                    raise DeviceProgramError(f"executable {exe_name!r}: graph {gid} failed in "
                                             f"onnxruntime: {exc}") from exc
            for dst, src in copies:
                copy_bytes(dst, src)
            if t0:
                recorder.ipu(recorder.I_COMPUTE, t0, time.monotonic_ns() - t0, gid)
        return execute

    def _source_of(self, i: Execute, output: str, graph: Graph) -> str | None:
        """The device tensor bound to the input that ONNX output ``output`` of ``i``'s graph
        is a copy of (the same name, or forwarded by an Identity), else None."""
        name = output if any(s.name == output for s in graph.inputs) \
            else self._forwarded[i.graph].get(output)
        return None if name is None else dict(i.inputs).get(name)

    def _execute_zc(self, i: Execute) -> _Step:
        """An Execute whose zero-copy inputs/outputs are bound to the transfers' buffers.

        Ring slots are a fixed set of buffers, so the combinations of buffer
        addresses repeat: one fully bound IO binding per combination is kept
        (binding costs ~0.7 us per tensor, a dict lookup ~0.1 us).
        """
        sess = self._sessions[i.graph]
        graph: Graph = self.executable.graphs[i.graph]
        fixed_in: list[tuple[str, np.ndarray]] = []
        zc_in: list[tuple[str, str, np.ndarray]] = []     # (onnx name, handle, device array)
        zc_in_index: dict[str, int] = {}                  # device tensor -> index in zc_in
        for onnx_name, tname in i.inputs:
            arr = self.arrays[tname]
            h = self._zc_in.get(tname)
            if h is None:
                fixed_in.append((onnx_name, arr))
            else:
                zc_in_index[tname] = len(zc_in)
                zc_in.append((onnx_name, h, arr))
        fixed_out: list[tuple[str, np.ndarray]] = []
        zc_out: list[tuple[str, str, np.ndarray]] = []
        # outputs that are a copy of an input (see _execute): (output's place, input's
        # place), each a zero-copy transfer's index in the key or, if negative, a device
        # tensor (~index into ``fixed``)
        copies: list[tuple[int, int, int]] = []
        fixed: list[np.ndarray] = []
        for onnx_name, tname in i.outputs:
            arr = self.arrays[tname]
            src = self._source_of(i, onnx_name, graph)
            if src is not None:
                if src in zc_in_index:
                    from_ = zc_in_index[src]
                else:
                    from_ = ~len(fixed)
                    fixed.append(_bytes_of(self.arrays[src]))
                if tname in self._zc_out:
                    to = len(zc_in) + len(zc_out)
                    zc_out.append((onnx_name, self._zc_out[tname], arr))
                else:
                    to = ~len(fixed)
                    fixed.append(_bytes_of(arr))
                copies.append((to, from_, arr.nbytes))
                continue
            h = self._zc_out.get(tname)
            if h is None:
                fixed_out.append((onnx_name, arr))
            else:
                zc_out.append((onnx_name, h, arr))
        copied = {to for to, _, _ in copies}
        computed = bool(fixed_out) or any(len(zc_in) + k not in copied for k in range(len(zc_out)))
        in_handles = [h for _, h, _ in zc_in]
        out_specs = [(h, arr.nbytes) for _, h, arr in zc_out]
        group = ZeroCopyGroup(tuple(in_handles), tuple(arr.nbytes for _, _, arr in zc_in),
                              tuple(h for h, _ in out_specs), tuple(n for _, n in out_specs))
        cache = group.calls
        self._groups[id(i)] = group
        gid, exe_name = i.graph, self.executable.name

        def place(key: tuple[int, ...], where: int, nbytes: int) -> np.ndarray:
            return fixed[~where] if where < 0 else _bytes_at(key[where], nbytes)

        def bind(key: tuple[int, ...]) -> tuple[Any, Callable[..., Any], tuple[Any, ...]]:
            if len(cache) >= _BINDING_CACHE:
                cache.clear()
            b = sess.io_binding()  # type: ignore[attr-defined]
            for name, arr in fixed_in:
                b.bind_input(name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)
            for (name, _, arr), ptr in zip(zc_in, key):
                b.bind_input(name, "cpu", 0, arr.dtype, list(arr.shape), ptr)
            for name, arr in fixed_out:
                b.bind_output(name, "cpu", 0, arr.dtype, list(arr.shape), arr.ctypes.data)
            for k, ((name, _, arr), ptr) in enumerate(zip(zc_out, key[len(zc_in):])):
                if len(zc_in) + k not in copied:
                    b.bind_output(name, "cpu", 0, arr.dtype, list(arr.shape), ptr)
            run, args = _runner(sess, b)
            if copies:   # copied here, after onnxruntime computes the other outputs (if any)
                pairs = [(place(key, to, n), place(key, from_, n)) for to, from_, n in copies]
                entry = (b, _run_and_copy, (run if computed else None, args, pairs))
            else:
                entry = (b, run, args)
            cache[key] = entry
            return entry

        views, deferred = self._zc_views, self._zc_deferred
        # With zero-copy outputs, the inputs are released after the first of them is
        # published (the host waits for that publish, not for the releases).
        defer = bool(in_handles and out_specs)

        def execute_zc(io: Any) -> None:
            ran = False
            try:
                ptrs = list(map(_address, map(views.__getitem__, in_handles)))
                for h, n in out_specs:
                    v = io.acquire_output(h, n)
                    if v.nbytes != n or not v.c_contiguous:
                        _checked(v, n, h)
                    ptrs.append(_address(v))
                key = tuple(ptrs)
                entry = cache.get(key)
                if entry is None:
                    entry = bind(key)
                t0 = time.monotonic_ns() if recorder.ON else 0
                try:
                    entry[1](*entry[2])
                except Exception as exc:
                    raise DeviceProgramError(f"executable {exe_name!r}: graph {gid} failed in "
                                             f"onnxruntime: {exc}") from exc
                if t0:
                    recorder.ipu(recorder.I_COMPUTE, t0, time.monotonic_ns() - t0, gid)
                ran = True
            finally:
                if ran and defer:
                    deferred.extend(in_handles)
                else:
                    for h in in_handles:
                        if views.pop(h, None) is not None:
                            io.release_input(h)
        return execute_zc


def _constant_view(value: memoryview, nbytes: int, handle: str, tensor: str) -> memoryview:
    """The read-only bytes of constant stream ``handle`` for device tensor ``tensor``."""
    view = memoryview(value)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    if len(view) != nbytes:
        raise ExecutableError(f"constant stream {handle!r} has {len(view)} bytes; its device "
                              f"tensor {tensor!r} has {nbytes}")
    return view.toreadonly()


def _add_weights(ort: Any, so: Any, graph: Graph, weights: bytes | memoryview,
                 keep: list[object], in_place: bool) -> None:
    """Give onnxruntime ``graph``'s external initializers as views of ``weights`` (``keep``
    keeps them for as long as the session may read them). ``in_place``: onnxruntime
    computes with them as they are; else it copies them while the session is made."""
    if in_place:   # without it onnxruntime copies initializers given as external data
        so.add_session_config_entry("session.use_external_initializer_file_buffers_directly",
                                    "1")
    raw = np.frombuffer(weights, dtype=np.uint8)
    names, values = [], []
    for w in graph.external:
        arr = raw[w.offset:w.offset + w.nbytes].view(numpy_dtype(w.dtype)).reshape(w.shape)
        if in_place and arr.ctypes.data % 64:   # a section inside a bytes object or a file
            # at an odd offset: computed with, so aligned (else onnxruntime copies it anyway)
            arr = arr.copy()
        names.append(w.name)
        values.append(ort.OrtValue.ortvalue_from_numpy(arr))
        keep.append(arr)
    keep.extend(values)
    so.add_external_initializers(names, values)


def _aligned(exe: Executable) -> bool:
    """Every external weight of ``exe`` lies 64-aligned in ``exe.weights``."""
    if not len(exe.weights):
        return False
    base = np.frombuffer(exe.weights, dtype=np.uint8).ctypes.data
    return all((base + w.offset) % 64 == 0 for g in exe.graphs for w in g.external)


_BINDING_CACHE = 256
"""Most fully bound IO bindings kept per zero-copy Execute."""


def _runner(sess: Any, binding: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """``(fn, args)`` such that ``fn(*args)`` is ``sess.run_with_iobinding(binding)``.

    Uses onnxruntime's C-level objects when they are there (the Python wrapper
    adds ~0.5 us of checks per run), else the public method.
    """
    raw_sess = getattr(sess, "_sess", None)
    raw_binding = getattr(binding, "_iobinding", None)
    run = getattr(raw_sess, "run_with_iobinding", None)
    if run is not None and raw_binding is not None:
        return run, (raw_binding, None)
    return sess.run_with_iobinding, (binding,)


def _run_and_copy(run: Callable[..., Any] | None, args: tuple[Any, ...],
                  pairs: list[tuple[np.ndarray, np.ndarray]]) -> None:
    """An Execute with outputs copied from inputs: onnxruntime computes the others
    (``run`` is None when there are none), then each ``(destination, source)`` copy."""
    if run is not None:
        run(*args)
    for dst, src in pairs:
        copy_bytes(dst, src)


def _bytes_of(arr: np.ndarray) -> np.ndarray:
    """The bytes of a C-contiguous device tensor, flat."""
    return arr.reshape(-1).view(np.uint8)


def _bytes_at(address: int, nbytes: int) -> np.ndarray:
    """``nbytes`` bytes of a transfer buffer at ``address`` (valid as long as its slot is
    mapped: the same lifetime as onnxruntime's binding to it)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(address))


def _checked(view: memoryview, nbytes: int, handle: str) -> memoryview:
    """A lent transfer buffer must be exactly one contiguous transfer."""
    if view.nbytes != nbytes or not view.c_contiguous:
        raise DeviceProgramError(
            f"stream {handle!r}: the stream lent a buffer of {view.nbytes} bytes"
            f"{'' if view.c_contiguous else ' (not contiguous)'}; one transfer is "
            f"{nbytes} bytes")
    return view


_ORT_TYPES = {
    "tensor(bool)": "BOOL", "tensor(float16)": "F16", "tensor(float)": "F32",
    "tensor(double)": "F64", "tensor(int8)": "S8", "tensor(uint8)": "U8", "tensor(int16)": "S16",
    "tensor(uint16)": "U16", "tensor(int32)": "S32", "tensor(uint32)": "U32",
    "tensor(int64)": "S64", "tensor(uint64)": "U64",
}


def _check_interface(exe_name: str, k: int, graph: Graph, sess: object) -> None:
    """The ONNX model must have exactly the interface the executable declares."""
    for kind, declared, actual in (("input", graph.inputs, sess.get_inputs()),  # type: ignore[attr-defined]
                                   ("output", graph.outputs, sess.get_outputs())):  # type: ignore[attr-defined]
        want = {s.name: s for s in declared}
        have = {a.name: a for a in actual}
        if set(want) != set(have):
            raise ExecutableError(
                f"executable {exe_name!r}: graph {k} declares {kind}s {sorted(want)} but its "
                f"ONNX model has {sorted(have)}")
        for name, sig in want.items():
            a = have[name]
            dims_ok = len(a.shape) == len(sig.shape) and all(
                not isinstance(d, int) or d == e for d, e in zip(a.shape, sig.shape))
            if _ORT_TYPES.get(a.type) != sig.dtype or not dims_ok:
                raise ExecutableError(
                    f"executable {exe_name!r}: graph {k} {kind} {name!r} is declared "
                    f"{sig.dtype}{list(sig.shape)} but the ONNX model has {a.type}{a.shape}")
