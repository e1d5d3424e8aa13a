"""Programs compiled into flat lists of steps (closures over device memory, bound IO
bindings and stream handles), so that a run does no lookups and no allocation.

``ProgramCompiler.compile`` turns an instruction list into steps; with zero-copy on, each
run of [zero-copy StreamIns, Execute, zero-copy StreamOuts] becomes one fused step that
first offers the ``StreamIO`` its ``ZeroCopyGroup`` (``run_group``); ``loop_plan`` says
whether a whole program is one such group (in a Repeat), which a ``StreamIO`` with
``run_groups`` may run back to back (``Interpreter.run_program_many``).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ipu_emulator.errors import DeviceProgramError, ExecutableError
from ipu_emulator.executable import (
    Copy, Execute, Executable, Instruction, Repeat, StreamIn, StreamOut, Switch)
from ipu_emulator.ipu._execute import checked, execute_step, execute_zc_step
from ipu_emulator.ipu._forwarding import forwarded_outputs
from ipu_emulator.ipu._stream_api import Step, StreamIO, ZeroCopyGroup
from ipu_emulator.ipu._zerocopy import ZeroCopyPlan

__all__ = ["LoopPlan", "ProgramCompiler"]

LoopPlan = tuple[ZeroCopyGroup, int, Step, str]
"""(group, count, fused step, error prefix): a program that is one fused group, or a
Repeat of ``count`` >= 1 of one."""


class ProgramCompiler:
    """Compiles the programs of ``exe`` loaded over the device tensors ``arrays`` (their
    bytes: ``views``) with the onnxruntime ``sessions`` of its graphs.

    ``constants`` (handle -> bytes): constant streams; ``shared``: those whose tensor is
    the value itself (their StreamIns are dropped). ``zc_views`` and ``zc_deferred``
    are the interpreter's: the zero-copy steps share them (acquired input transfers,
    inputs to release after the next publish).
    """

    def __init__(self, exe: Executable, arrays: dict[str, np.ndarray],
                 views: dict[str, memoryview], sessions: list[Any],
                 constants: Mapping[str, memoryview], shared: Mapping[str, object],
                 zero_copy: ZeroCopyPlan, zc_views: dict[str, memoryview],
                 zc_deferred: list[str]) -> None:
        self._exe = exe
        self._arrays = arrays
        self._views = views
        self._sessions = sessions
        self._const = constants
        self._shared = shared
        self._zero_copy = zero_copy
        self._zc_in = zero_copy.input_tensors     # tensor -> handle
        self._zc_out = zero_copy.output_tensors
        self._zc_views = zc_views
        self._zc_deferred = zc_deferred
        # per graph: outputs that are an input forwarded unchanged (copied here, not by ort)
        self._forwarded = [forwarded_outputs(g) for g in exe.graphs]
        self._groups: dict[int, ZeroCopyGroup] = {}   # id(Execute) -> its group
        self._fused_steps: dict[ZeroCopyGroup, tuple[Step, str]] = {}

    def strip(self, body: tuple[Instruction, ...]) -> tuple[Instruction, ...]:
        """``body`` without the StreamIns of shared constants (their tensor is the value)."""
        shared = self._shared
        if not shared:
            return body
        return tuple(i for i in body if not (isinstance(i, StreamIn) and i.handle in shared))

    def compile(self, body: tuple[Instruction, ...], zc: bool = False) -> list[Step]:
        """The steps of ``body``; ``zc``: with zero-copy streams, fused into groups."""
        body = self.strip(body)
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

    def loop_plan(self, body: tuple[Instruction, ...]) -> LoopPlan | None:
        """The ``LoopPlan`` of ``body`` (compiled with zero-copy first), or None."""
        body = self.strip(body)
        count = 1
        if len(body) == 1 and isinstance(body[0], Repeat):
            count, body = body[0].count, body[0].body
        execs = [i for i in body if isinstance(i, Execute)]
        group = self._groups.get(id(execs[0])) if len(execs) == 1 else None
        if group is None or group not in self._fused_steps or count < 1 \
                or len(body) != len(group.in_handles) + 1 + len(group.out_handles):
            return None
        return (group, count, *self._fused_steps[group])

    def _fused(self, group: ZeroCopyGroup, steps: list[Step], i: Execute) -> Step:
        where = f"executable {self._exe.name!r}: graph {i.graph} failed in onnxruntime"

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

    def _step(self, i: Instruction, zc: bool) -> Step:
        if isinstance(i, (StreamIn, StreamOut)):
            return self._transfer(i, zc)
        if isinstance(i, Execute):
            if zc and (any(t in self._zc_in for _, t in i.inputs)
                       or any(t in self._zc_out for _, t in i.outputs)):
                step, group = execute_zc_step(
                    i, self._sessions[i.graph], self._exe.graphs[i.graph], self._arrays,
                    self._forwarded[i.graph], self._zc_in, self._zc_out, self._zc_views,
                    self._zc_deferred, self._exe.name)
                self._groups[id(i)] = group
                return step
            return execute_step(i, self._sessions[i.graph], self._exe.graphs[i.graph],
                                self._arrays, self._forwarded[i.graph], self._exe.name)
        return self._control(i, zc)

    def _transfer(self, i: StreamIn | StreamOut, zc: bool) -> Step:
        """The step of a StreamIn or a StreamOut."""
        if zc and isinstance(i, StreamIn) and i.handle in self._zero_copy.inputs:
            handle, nbytes, views = i.handle, self._views[i.tensor].nbytes, self._zc_views

            def stream_in_zc(io: Any) -> None:
                v = io.acquire_input(handle, nbytes)
                views[handle] = v   # held from here: released even if the check fails
                if v.nbytes != nbytes or not v.c_contiguous:
                    checked(v, nbytes, handle)
            return stream_in_zc
        if zc and isinstance(i, StreamOut) and i.handle in self._zero_copy.outputs:
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
            dst = self._arrays[i.tensor].reshape(-1).view(np.uint8)
            src = np.frombuffer(self._const[i.handle], np.uint8, dst.nbytes)

            def constant_in(io: StreamIO) -> None:
                np.copyto(dst, src)
            return constant_in
        if isinstance(i, StreamIn):
            handle, view = i.handle, self._views[i.tensor]

            def stream_in(io: StreamIO) -> None:
                io.read_input(handle, view)
            return stream_in
        handle, view = i.handle, self._views[i.tensor]
        readonly = view.toreadonly()

        def stream_out(io: StreamIO) -> None:
            io.write_output(handle, readonly)
        return stream_out

    def _control(self, i: Instruction, zc: bool) -> Step:
        """The step of a Repeat, a Switch or a Copy."""
        if isinstance(i, Repeat):
            steps, count = self.compile(i.body, zc), i.count

            def repeat(io: StreamIO) -> None:
                for _ in range(count):
                    for step in steps:
                        step(io)
            return repeat
        if isinstance(i, Switch):
            branches = [self.compile(b, zc) for b in i.branches]
            index_arr = self._arrays[i.index].reshape(-1)
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
            src = self._arrays[i.src].reshape(-1).view(np.uint8)
            dst = self._arrays[i.dst].reshape(-1).view(np.uint8)

            def copy(io: StreamIO) -> None:
                np.copyto(dst, src)
            return copy
        raise ExecutableError(f"not an instruction: {i!r:.80}")
