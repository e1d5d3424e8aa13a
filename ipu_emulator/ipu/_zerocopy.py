"""Which streams of an executable may bypass device memory (zero-copy streams).

The general path of a Main iteration copies every transfer twice on the
device: ring slot -> device tensor (``StreamIn``), then onnxruntime reads the
tensor; onnxruntime writes a device tensor, then it is copied into a ring
slot (``StreamOut``). When a stream's tensor has no other use, onnxruntime can
read the input slot and write the output slot directly instead::

    StreamIn(h, X) ... Execute(g, inputs=[(x, X)]) ...      X used nowhere else
    Execute(g, outputs=[(y, Y)]) ... StreamOut(Y, h2) ...    Y used nowhere else

A stream qualifies when, in the whole executable (every program):

- its handle appears in exactly one ``StreamIn``/``StreamOut``;
- its tensor is used exactly twice: by that stream instruction and by one
  ``Execute`` input (or output) entry, and both sit in the same instruction
  list (e.g. one ``Repeat`` body or one ``Switch`` branch), the ``StreamIn``
  before the ``Execute`` (the ``Execute`` before the ``StreamOut``);
- the ONNX name is not both a graph input and a graph output (those are
  copied by the interpreter, never bound);
- the tensor is not empty;
- it is not a constant stream (``ipu_emulator.ipu._constants``: its value is in
  shared memory, the ring is never read).

Anything else (``Switch`` indices, ``Copy``, tensors read by another program
such as Load-streamed weights or a Save program, tensors read twice) keeps
the general path, so device memory holds what those readers expect. The
device memory of a zero-copy tensor is simply not written.

This is the one place that decides zero-copy against copy; what each transfer
of an iteration is subject to on the wire (tags, redirects, modes) is
``_iteration.py``.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from ipu_emulator.executable import (
    Copy, Execute, Executable, Instruction, Repeat, StreamIn, StreamOut, Switch)

__all__ = ["ZeroCopyPlan", "plan_zero_copy"]


@dataclass(frozen=True)
class ZeroCopyPlan:
    """Handles of the streams that bypass device memory, and their tensors."""

    inputs: dict[str, str] = field(default_factory=dict)    # handle -> device tensor
    outputs: dict[str, str] = field(default_factory=dict)   # handle -> device tensor

    @property
    def input_tensors(self) -> dict[str, str]:
        """device tensor -> handle, for the inputs."""
        return {t: h for h, t in self.inputs.items()}

    @property
    def output_tensors(self) -> dict[str, str]:
        """device tensor -> handle, for the outputs."""
        return {t: h for h, t in self.outputs.items()}


def _bodies(body: tuple[Instruction, ...]) -> list[tuple[Instruction, ...]]:
    """``body`` and every instruction list nested in it."""
    out, stack = [], [body]
    while stack:
        b = stack.pop()
        out.append(b)
        for i in b:
            if isinstance(i, Repeat):
                stack.append(i.body)
            elif isinstance(i, Switch):
                stack.extend(i.branches)
    return out


def plan_zero_copy(exe: Executable, constant: frozenset[str] = frozenset()) -> ZeroCopyPlan:
    """The streams of ``exe`` that may bypass device memory (see the module docstring);
    ``constant``: handles of constant streams (never zero-copy)."""
    bodies = [b for p in exe.programs for b in _bodies(p.body)]
    handle_uses: collections.Counter[str] = collections.Counter()
    tensor_uses: collections.Counter[str] = collections.Counter()
    for b in bodies:
        for i in b:
            if isinstance(i, StreamIn):
                handle_uses[i.handle] += 1
                tensor_uses[i.tensor] += 1
            elif isinstance(i, StreamOut):
                handle_uses[i.handle] += 1
                tensor_uses[i.tensor] += 1
            elif isinstance(i, Execute):
                for _, t in (*i.inputs, *i.outputs):
                    tensor_uses[t] += 1
            elif isinstance(i, Switch):
                tensor_uses[i.index] += 1
            elif isinstance(i, Copy):
                tensor_uses[i.src] += 1
                tensor_uses[i.dst] += 1

    def single(handle: str, tensor: str) -> bool:
        return (handle_uses[handle] == 1 and tensor_uses[tensor] == 2
                and exe.tensors[tensor].nbytes > 0)

    inputs: dict[str, str] = {}
    outputs: dict[str, str] = {}
    for b in bodies:
        for p, i in enumerate(b):
            if not isinstance(i, Execute):
                continue
            g = exe.graphs[i.graph]
            in_names = {s.name for s in g.inputs}
            out_names = {s.name for s in g.outputs}
            for onnx_name, t in i.inputs:
                if onnx_name in out_names:
                    continue
                for q in range(p):
                    s = b[q]
                    if (isinstance(s, StreamIn) and s.tensor == t and single(s.handle, t)
                            and s.handle not in constant):
                        inputs[s.handle] = t
            for onnx_name, t in i.outputs:
                if onnx_name in in_names:
                    continue
                for q in range(p + 1, len(b)):
                    s = b[q]
                    if isinstance(s, StreamOut) and s.tensor == t and single(s.handle, t):
                        outputs[s.handle] = t
    return ZeroCopyPlan(inputs, outputs)
