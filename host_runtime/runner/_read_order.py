"""The order in which a model's Main programs read their input streams.

The device waits for the first input it reads that is not there yet: that is the
tensor a ``flush_callback`` is told about (seed 001, 3.7), and the order in which a
host publishes a transfer's inputs (last-read first, so that the device wakes once).
"""

from __future__ import annotations

import logging

from host_runtime import popef
from host_runtime.errors import PopefError
from host_runtime.popef import decoded_programs
from host_runtime.runner._batching import TensorSpec
from ipu_emulator.errors import IpuEmulatorError
from ipu_emulator.executable import Instruction, Repeat, StreamIn, Switch
from ipu_emulator.validate import unnumbered_outputs

__all__ = ["main_read_order", "unnumbered_outputs_of"]

_log = logging.getLogger(__name__)


def main_read_order(model: popef.Model) -> list[str]:
    """Anchor names of the input streams the Main programs read, first read first.

    Programs in ``programFlow().main()`` order, instructions in order, loops and every
    branch of a switch in place. Inputs Main never reads are not listed. An executable
    that cannot be decoded gives the anchors' order (the session reports the damage).
    """
    md = model.metadata
    by_handle = {a.handle(): a.name() for a in md.anchors()
                 if a.type() is popef.TensorType.INPUT}
    try:
        # the programs only: no checksum over (nor copy of) the graphs and weights
        exe = decoded_programs(model.executable)
    except (IpuEmulatorError, PopefError) as exc:   # damaged: the session reports it
        _log.debug("read order of %r: executable not decodable (%s); anchor order used",
                   md.executable(), exc)
        main = set(md.programFlow().main())
        return [a.name() for a in md.anchors() if a.type() is popef.TensorType.INPUT
                and main.intersection(a.programs())]
    order: list[str] = []
    seen: set[str] = set()

    def visit(body: tuple[Instruction, ...]) -> None:
        for i in body:
            if isinstance(i, StreamIn):
                name = by_handle.get(i.handle)
                if name is not None and name not in seen:
                    seen.add(name)
                    order.append(name)
            elif isinstance(i, Repeat):
                visit(i.body)
            elif isinstance(i, Switch):
                for branch in i.branches:
                    visit(branch)

    for p in md.programFlow().main():
        if 0 <= p < len(exe.programs):
            visit(exe.programs[p].body)
    del visit   # it refers to itself through its closure: a cycle left for the collector
    return order


def unnumbered_outputs_of(model: popef.Model, outputs: dict[str, TensorSpec],
                          numbered: set[str]) -> frozenset[str]:
    """The names of ``outputs`` whose transfers carry no request's number, the host
    writing the input streams ``numbered`` with each request: on a sharded model, those
    of an IPU that reads none of them (``ipu_emulator.validate.unnumbered_outputs``).
    None on one IPU, nor for a model that cannot be decoded (the session reports it)."""
    try:
        exe = decoded_programs(model.executable)
    except (IpuEmulatorError, PopefError):
        return frozenset()
    if not exe.parts:
        return frozenset()
    handles = unnumbered_outputs([p.programs for p in exe.parts], numbered)
    return frozenset(n for n, spec in outputs.items() if spec.handle in handles)
