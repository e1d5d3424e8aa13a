"""Crafted PopEF files: the seeds' example model with its executable and metadata edited.

``craft(src, dest, main=..., flow=..., anchors=..., programs=...)`` reads the example
model written at ``src`` (``tools.generate_simple_popef.write_simple_popef``), lets a
function rewrite the Main program's iteration body, the program flow or the anchors,
and writes the result with valid checksums (the PopEF ``Writer`` and
``Executable.to_bytes``): only the semantics are broken.

The example's programs: 0 load [StreamIn weights], 1 main [Repeat(1, [StreamIn
tensor_A, StreamIn tensor_B, Execute, StreamOut tensor_C])], 2 save [StreamOut
weights_saved].
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from host_runtime import popef
from ipu_emulator.executable import Executable, Instruction, Program, Repeat

__all__ = ["craft", "load_parts", "A", "B", "C", "EXEC", "CASES"]

Body = tuple[Instruction, ...]


def load_parts(src: Any) -> tuple[popef.Model, Executable]:
    reader = popef.Reader()
    reader.parseFile(src)
    model = popef.ModelBuilder(reader).createModel()
    return model, Executable.from_bytes(model.executable.payload())


def craft(src: Any, dest: Any, *,
          iteration: Callable[[Body], Body] | None = None,
          main: Callable[[Body], Body] | None = None,
          programs: Callable[[list[Program]], list[Program]] | None = None,
          flow: tuple[list[int], list[int], list[int]] | None = None,
          anchors: Callable[[list[popef.Anchor]], list[popef.Anchor]] | None = None) -> Any:
    """Write ``dest``: the model at ``src`` with the given edits (see the module docstring)."""
    model, exe = load_parts(src)
    progs = list(exe.programs)
    if iteration is not None:
        rep = progs[1].body[0]
        assert isinstance(rep, Repeat)
        progs[1] = Program("main", (Repeat(rep.count, iteration(rep.body)),))
    if main is not None:
        progs[1] = Program("main", main(progs[1].body))
    if programs is not None:
        progs = programs(progs)
    exe = dataclasses.replace(exe, programs=progs)
    md = model.metadata
    f = md.programFlow()
    new_flow = popef.ProgramFlow(*flow) if flow is not None else f
    new_anchors = anchors(md.anchors()) if anchors is not None else md.anchors()
    new_md = popef.Metadata(new_anchors, new_flow, md.replicationFactor(), md.numIpus(),
                            md.ipuVersion(), md.executable(), md.isInference(),
                            md.deviceIterations(), md.engineOptions(), md.deviceOptions(),
                            md.subgraphs())
    with popef.Writer(dest) as w:
        w.writeMetadata(new_md)
        w.writeExecutable(exe.name, exe.to_bytes())
        for t in model.tensors:
            w.writeTensorData(t.anchor, t.data)
    return dest


def A(body: Body) -> Instruction:
    return body[0]


def B(body: Body) -> Instruction:
    return body[1]


def EXEC(body: Body) -> Instruction:
    return body[2]


def C(body: Body) -> Instruction:
    return body[3]


def _without_anchor(name: str) -> Callable[[list[popef.Anchor]], list[popef.Anchor]]:
    return lambda anchors: [a for a in anchors if a.name() != name]


# name -> (craft keyword arguments, rule expected, words the message must hold)
CASES: dict[str, tuple[dict[str, Any], str, list[str]]] = {
    "repeat_zero": ({"main": lambda m: (dataclasses.replace(m[0], count=0),)},
                    "repeat-count", ["Main program 1", "count 0"]),
    "empty_main": ({"main": lambda m: ()}, "main-empty", ["Main program 1"]),
    "never_streams_out_C": ({"iteration": lambda b: (A(b), B(b), EXEC(b))},
                            "anchor-programs", ["'tensor_C'", "no program"]),
    "streams_input_twice": ({"iteration": lambda b: (A(b), A(b), B(b), EXEC(b), C(b))},
                            "stream-count", ["'tensor_A'", "2 times", "exactly once"]),
    "streams_output_twice": ({"iteration": lambda b: (A(b), B(b), EXEC(b), C(b), C(b))},
                             "stream-count", ["'tensor_C'", "2 times", "exactly once"]),
    "flow_reordered": ({"flow": ([1], [0], [2])}, "role-load",
                       ["Load program 1", "tensor_C"]),
    "programs_reordered": ({"programs": lambda p: [p[1], p[0], p[2]]}, "role-load",
                           ["Load program 0", "'tensor_C'"]),
    "anchor_inflated": ({"anchors": lambda anchors: [
        popef.Anchor(a.name(), a.handle(), popef.TensorInfo(a.tensorInfo().dataType(),
                                                            [4096, 4096])
                     if a.name() == "tensor_A" else a.tensorInfo(), a.isPerReplica(),
                     a.type(), a.programs()) for a in anchors]},
        "anchor-stream", ["'tensor_A' is F32[4096, 4096] (67108864 bytes)",
                          "'tensor_A' of the executable is F32[1, 4] (16 bytes)"]),
    "anchor_lists_wrong_program": ({"anchors": lambda anchors: [
        popef.Anchor(a.name(), a.handle(), a.tensorInfo(), a.isPerReplica(), a.type(),
                     [2] if a.name() == "tensor_A" else a.programs()) for a in anchors]},
        "anchor-programs", ["'tensor_A'", "[2]", "[1]"]),
    "main_names_missing_program": ({"flow": ([0], [7], [2])}, "program-index",
                                   ["programFlow.main", "program 7", "3 programs"]),
    "no_output_anchor": ({"anchors": _without_anchor("tensor_C")}, "stream-anchor",
                         ["Main program 1", "'tensor_C'", "no INPUT/OUTPUT anchor"]),
    "streams_out_before_execute": ({"iteration": lambda b: (A(b), B(b), C(b), EXEC(b))},
                                   "stream-order", ["'tensor_C'", "before"]),
    "save_streams_in": ({"programs": lambda p: [p[0], p[1], Program("save", (
        *p[2].body, *p[0].body))]}, "role-save", ["Save program 2", "'weights'"]),
}
