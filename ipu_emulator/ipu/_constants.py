"""Constant streams: inputs whose value the host put once into shared memory.

Some streams carry a value that is the same for every transfer and every replica:
PopEF tensor data a Load program streams in, a runner's frozen inputs (of Load or
Main). The host puts each such value once into a read-only shared-memory region
(one per content per host process) and names it in LOAD (``ipu_protocol``: the load
spec's ``constants``); the IPU process never reads those streams' rings. What
becomes of the tensor a constant stream fills depends on what the programs do
with it::

    StreamIn(h, T); T only read (Execute input, StreamOut, Copy src, Switch index)
        -> shared: T *is* the region's bytes (mapped read-only), the StreamIn is dropped:
           no copy in this process's device memory, the same pages in every replica
    anything in any program writes T (an Execute output, a Copy into it, a StreamIn of
    another stream into it), or h fills several tensors
        -> copied: T stays in device memory (this replica's own copy); each StreamIn(h, T)
           copies the region's bytes into it (a Load run restores the value)

"Writes" is read from the instructions of every program of the executable, the
``StreamIn(h, T)`` themselves excepted; when in doubt (an instruction this module
does not know) a tensor counts as written. A tensor whose size is not the
constant's is refused by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator

from ipu_emulator.executable import (
    Copy, Execute, Executable, Instruction, Repeat, StreamIn, StreamOut, Switch)

__all__ = ["ConstantPlan", "memory_ranges", "plan_constants"]


@dataclass(frozen=True)
class ConstantPlan:
    """What each constant stream fills: shared tensors and copied ones."""

    shared: dict[str, str] = field(default_factory=dict)   # handle -> tensor (read in place)
    copied: dict[str, tuple[str, ...]] = field(default_factory=dict)   # handle -> tensors

    @property
    def shared_tensors(self) -> dict[str, str]:
        """tensor -> handle, of the shared tensors."""
        return {t: h for h, t in self.shared.items()}


def _walk(body: Iterable[Instruction]) -> Iterator[Instruction]:
    for i in body:
        yield i
        if isinstance(i, Repeat):
            yield from _walk(i.body)
        elif isinstance(i, Switch):
            for b in i.branches:
                yield from _walk(b)


def plan_constants(exe: Executable, handles: Iterable[str]) -> ConstantPlan:
    """Which of the constant streams ``handles`` fill a tensor that no program writes
    (shared) and which fill one that a program writes (copied); see the module docstring.
    A handle no program streams in is in neither."""
    wanted = set(handles)
    fills: dict[str, set[str]] = {h: set() for h in wanted}    # handle -> tensors it fills
    writers: dict[str, set[object]] = {}                       # tensor -> what writes it
    for p in exe.programs:
        for i in _walk(p.body):
            if isinstance(i, StreamIn):
                if i.handle in wanted:
                    fills[i.handle].add(i.tensor)
                writers.setdefault(i.tensor, set()).add(("in", i.handle))
            elif isinstance(i, Execute):
                for _, t in i.outputs:
                    writers.setdefault(t, set()).add("execute")
            elif isinstance(i, Copy):
                writers.setdefault(i.dst, set()).add("copy")
            elif isinstance(i, (StreamOut, Repeat, Switch)):
                pass   # reads only (a Switch reads its index)
            else:   # unknown: everything it might touch counts as written
                for t in exe.tensors:
                    writers.setdefault(t, set()).add("unknown")
    shared: dict[str, str] = {}
    copied: dict[str, tuple[str, ...]] = {}
    for h in sorted(wanted):
        tensors = fills[h]
        if not tensors:
            continue
        if len(tensors) == 1:
            (t,) = tensors
            if writers.get(t, set()) == {("in", h)}:
                shared[h] = t
                continue
        copied[h] = tuple(sorted(tensors))
    return ConstantPlan(shared, copied)


def memory_ranges(exe: Executable, constants: Iterable[str] | None
                  ) -> list[tuple[int, int]]:
    """``(offset, length)`` of the device memory an interpreter of ``exe`` with these
    ``constants`` (stream handles) reads or writes (every tensor not read in place from
    the constants), merged: what must be backed in /dev/shm before it runs."""
    shared = plan_constants(exe, constants or ()).shared_tensors
    return _ranges([(t.offset, t.nbytes) for name, t in exe.tensors.items()
                    if name not in shared and t.nbytes])


def _ranges(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(offset, length)`` spans merged where they touch or overlap, in order."""
    out: list[tuple[int, int]] = []
    for a, n in sorted(spans):
        if out and a <= out[-1][0] + out[-1][1]:
            start, length = out[-1]
            out[-1] = (start, max(length, a + n - start))
        else:
            out.append((a, n))
    return out
