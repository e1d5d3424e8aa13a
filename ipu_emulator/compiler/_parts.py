"""The multi-IPU executable of a sharded model: one part per IPU, built from a placement.

:mod:`._sharding` says where each node runs (a :class:`~._sharding.Placement`); this
module turns that into the executable its docstring draws: which IPU reads each host
input and weight (the first that consumes it, forwarding it to the others), the links
between parts, the sync tokens without pipelining, each part's programs and memory,
and the host's view (every anchor, as for a one-IPU executable).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import onnx
from onnx import helper

import ipu_emulator
from ipu_emulator.compiler._onnx import DTYPE_TO_ONNX
from ipu_emulator.compiler._sharding import (Placement, annotate_placement, check_num_ipus,
                                             check_pipelining, node_reads, place_nodes)
from ipu_emulator.compiler._types import (LOAD_PROGRAM, MAIN_PROGRAM, SAVE_PROGRAM, AnchorDesc,
                                          CompileOptions, CompileResult, Target, check_fit)
from ipu_emulator.errors import CompileError
from ipu_emulator.executable import (
    IDLE_ATTR, LINK_PREFIX, SYNC_TENSOR, is_link, parse_link,
    Execute, Executable, Graph, Instruction, Program, Repeat, StreamIn, StreamOut, StreamSpec,
    TensorSig, numpy_dtype, plan_memory)
from shm.errors import echo

if TYPE_CHECKING:  # pragma: no cover
    from ipu_emulator.compiler._prepare import Prepared

__all__ = ["compile_sharded", "describe_parts"]


def _link(src: int, dst: int, tensor: str) -> str:
    return f"{LINK_PREFIX}{src}/{dst}/{tensor}"


@dataclass
class _Part:
    ipu: int
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    node_names: list[str] = field(default_factory=list)
    stages: set[int] = field(default_factory=set)
    host_in: list[str] = field(default_factory=list)       # Main anchors read here
    weights_in: list[str] = field(default_factory=list)    # Load anchors read here
    forward: list[tuple[str, int]] = field(default_factory=list)   # (input, to IPU)
    wforward: list[tuple[str, int]] = field(default_factory=list)  # (weight, to IPU)
    links_in: list[tuple[str, int]] = field(default_factory=list)  # (tensor, from IPU)
    wlinks_in: list[tuple[str, int]] = field(default_factory=list)
    links_out: list[tuple[str, int]] = field(default_factory=list)  # (tensor, to IPU)
    host_out: list[str] = field(default_factory=list)
    graph_inputs: list[str] = field(default_factory=list)
    graph_outputs: list[str] = field(default_factory=list)



def compile_sharded(p: "Prepared", opts: "CompileOptions", target: "Target",
                    per_ipu_memory: int) -> "CompileResult":
    """Compile one prepared model over ``opts.num_ipus`` IPUs."""
    n_ipus = opts.num_ipus
    check_num_ipus(n_ipus, opts.machine_ipus)
    check_fit([p], opts, target, 0, 0, 0, 0)   # max_tensor_size; no tensor above one IPU
    plan = place_nodes(p.device_model.graph, dict(opts.sharding_info or {}),
                       dict(opts.pipelining_info or {}), n_ipus, opts.enable_pipelining)
    check_pipelining(opts, plan)
    parts = _assign(p, plan, n_ipus)
    # sync tokens (sharding without pipelining): each last IPU -> each first IPU
    sinks = [i for i in plan.order if not parts[i].links_out and not parts[i].forward]
    sources = [i for i in plan.order if not parts[i].links_in]
    sync_pairs = [] if opts.enable_pipelining else [
        (s, d) for s in sinks for d in sources if s != d]
    opset = list(p.device_model.opset_import)
    inits = {t.name: t for t in p.device_model.graph.initializer}
    exe_parts = [_idle_part(opts, target, part.ipu) if part.ipu in plan.idle else
                 _part_executable(p, opts, target, part, opset, inits, sync_pairs,
                                  per_ipu_memory)
                 for part in parts]
    exe, anchors = _host_view(p, opts, target, plan, parts, exe_parts)
    output_model = onnx.ModelProto()
    output_model.CopyFrom(p.model)
    annotate_placement(output_model.graph, p.device_model.graph, plan)
    return CompileResult(
        executable=exe, anchors=anchors,
        program_flow={"load": [LOAD_PROGRAM], "main": [MAIN_PROGRAM], "save": [SAVE_PROGRAM]},
        output_model=output_model, models=[p.model], subgraphs={}, fused=False)


def _assign(p: "Prepared", plan: Placement, n_ipus: int) -> list[_Part]:
    """Each IPU's part: its nodes, the host inputs and weights it reads (the first IPU to
    consume one reads it and forwards it), its links in and out, its host outputs."""
    weights = {w.name for w, _ in p.weights}
    inputs = {v.name for v in p.inputs}
    parts = [_Part(i) for i in range(n_ipus)]
    rank = {ipu: r for r, ipu in enumerate(plan.order)}
    consumers: dict[str, list[int]] = {}
    producer_ipu: dict[str, int] = {}
    for k, n in enumerate(p.device_model.graph.node):
        part = parts[plan.ipu[k]]
        part.nodes.append(n)
        part.node_names.append(n.name or f"#{k}:{n.op_type}")
        part.stages.add(plan.stage[k])
        for t in node_reads(n):
            if plan.ipu[k] not in consumers.setdefault(t, []):
                consumers[t].append(plan.ipu[k])
        for t in n.output:
            if t:
                producer_ipu[t] = plan.ipu[k]
    # host inputs (and tensor-data weights): read by their first consumer, forwarded
    for name, users in consumers.items():
        if name in inputs or name in weights:
            users = sorted(users, key=rank.__getitem__)
            owner = parts[users[0]]
            (owner.host_in if name in inputs else owner.weights_in).append(name)
            for u in users:
                parts[u].graph_inputs.append(name)
            for u in users[1:]:
                (owner.forward if name in inputs else owner.wforward).append((name, u))
                (parts[u].links_in if name in inputs else parts[u].wlinks_in).append(
                    (name, owner.ipu))
        elif name in producer_ipu:
            src = producer_ipu[name]
            for u in users:
                if u != src:
                    parts[src].links_out.append((name, u))
                    parts[u].links_in.append((name, src))
                    parts[u].graph_inputs.append(name)
                    if name not in parts[src].graph_outputs:
                        parts[src].graph_outputs.append(name)
    unused = [v.name for v in p.inputs if v.name not in consumers]
    if unused:
        raise CompileError(f"model {echo(p.label, 200)}: inputs {echo(unused, 200)} are not used by any node; "
                           "a sharded model streams each input to the IPU that consumes it")
    for v in p.outputs:
        maker = producer_ipu.get(v.name)
        if maker is None:
            raise CompileError(f"model {echo(p.label, 200)}: output {echo(v.name)} is not produced by a node")
        parts[maker].host_out.append(v.name)
        if v.name not in parts[maker].graph_outputs:
            parts[maker].graph_outputs.append(v.name)
    return parts


def _value_info(p: "Prepared", name: str) -> onnx.ValueInfoProto:
    """A tensor that crosses IPUs, as a part's graph input or output."""
    if name not in p.sizes:
        raise CompileError(f"model {echo(p.label, 200)}: tensor {echo(name)} crosses IPUs but its shape "
                           "is not known after shape inference")
    dtype, shape, _ = p.sizes[name]
    return helper.make_tensor_value_info(name, DTYPE_TO_ONNX[dtype], list(shape))


def _host_view(p: "Prepared", opts: "CompileOptions", target: "Target", plan: Placement,
               parts: list[_Part], exe_parts: list[Executable]
               ) -> tuple[Executable, list[AnchorDesc]]:
    """The executable the host sees, ``exe_parts`` inside it: every anchor; Main reads each
    input and writes each output once, Load reads each weight, Save writes it back."""
    anchors: list[AnchorDesc] = []
    host_specs: list[tuple[str, str, tuple[int, ...]]] = []
    streams: dict[str, StreamSpec] = {}
    load: list[Instruction] = []
    save: list[Instruction] = []
    body: list[Instruction] = []
    outs: list[Instruction] = []

    def add(name: str, handle: str, direction: str, dtype: str, shape: tuple[int, ...],
            programs: tuple[int, ...], kind: str, data: bytes | None = None) -> None:
        streams[handle] = StreamSpec(direction, dtype, list(shape),
                                     numpy_dtype(dtype).itemsize * _count(shape))
        anchors.append(AnchorDesc(name, handle, direction, dtype, shape, programs, kind,
                                  None, data))

    for v in p.inputs:
        host_specs.append((v.name, v.dtype, v.shape))
        add(v.name, v.name, "in", v.dtype, v.shape, (MAIN_PROGRAM,), "input")
        body.append(StreamIn(v.name, v.name))
    for v in p.outputs:
        host_specs.append((v.name, v.dtype, v.shape))
        add(v.name, v.name, "out", v.dtype, v.shape, (MAIN_PROGRAM,), "output")
        outs.append(StreamOut(v.name, v.name))
    for w, data in p.weights:
        host_specs.append((w.name, w.dtype, w.shape))
        add(w.name, w.name, "in", w.dtype, w.shape, (LOAD_PROGRAM,), "weight", data)
        load.append(StreamIn(w.name, w.name))
        if opts.save_weights:
            add(w.name + "_saved", w.name + "_saved", "out", w.dtype, w.shape,
                (SAVE_PROGRAM,), "saved")
            save.append(StreamOut(w.name, w.name + "_saved"))
    tensors, memory_bytes = plan_memory(host_specs)
    required = max(memory_bytes, sum(e.required_bytes for e in exe_parts))
    exe = Executable(
        name=opts.name,
        programs=[Program("load", tuple(load)),
                  Program("main", (Repeat(opts.device_iterations, tuple(body + outs)),)),
                  Program("save", tuple(save))],
        graphs=[], tensors=tensors, streams=streams, memory_bytes=memory_bytes,
        required_bytes=required, ipu_version=target.version, num_ipus=opts.num_ipus,
        device_iterations=opts.device_iterations, package_hash=ipu_emulator.package_hash(),
        attributes={"models": os.path.basename(p.label), "fused": "0",
                    "constant_bytes": str(sum(int(e.attributes["constant_bytes"])
                                              for e in exe_parts)),
                    "activation_bytes": str(max(int(e.attributes["activation_bytes"])
                                                for e in exe_parts)),
                    "sharding": _clip(json.dumps(_summary(opts, plan, parts, exe_parts),
                                                 separators=(",", ":")))},
        parts=exe_parts)
    exe.validate()
    order = {"input": 1, "output": 2, "weight": 3, "saved": 4}
    anchors.sort(key=lambda a: order[a.kind])
    return exe, anchors


def _summary(opts: "CompileOptions", plan: Placement, parts: list[_Part],
             exe_parts: list[Executable]) -> dict[str, Any]:
    """What lives where (the executable's ``sharding`` attribute, read by popef_dump)."""
    return {
        "pipelining": bool(opts.enable_pipelining),
        "num_stages": plan.num_stages,
        "order": plan.order,
        "idle": plan.idle,
        "ipus": [{"ipu": pt.ipu, "idle": pt.ipu in plan.idle, "stages": sorted(pt.stages),
                  "nodes": len(pt.nodes),
                  "inputs": pt.host_in + pt.weights_in, "outputs": pt.host_out,
                  "links_in": [f"{t}<-ipu{s}" for t, s in pt.links_in + pt.wlinks_in],
                  "links_out": [f"{t}->ipu{d}" for t, d in pt.links_out + pt.forward +
                                pt.wforward],
                  "required_bytes": e.required_bytes}
                 for pt, e in zip(parts, exe_parts)],
    }


class _PartPrograms:
    """One part's streams and its Load, Main body and Save instructions, in the order the
    module docstring of :mod:`._sharding` draws them."""

    def __init__(self, p: "Prepared", opts: "CompileOptions", part: _Part,
                 sync: list[tuple[int, int]]) -> None:
        self.p = p
        self.streams: dict[str, StreamSpec] = {}
        self.load: list[Instruction] = []
        self.save: list[Instruction] = []
        self.body: list[Instruction] = []
        ipu = part.ipu
        for w in part.weights_in:
            self._in(self.load, w, w)
            if opts.save_weights:
                self._out(self.save, w, w + "_saved")
        for w, dst in part.wforward:
            self._out(self.load, w, _link(ipu, dst, w))
        for w, src in part.wlinks_in:
            self._in(self.load, w, _link(src, ipu, w))
        for s, d in sync:   # a first IPU starts batch i+1 once the last IPUs finished batch i
            if d == ipu:
                self._in(self.body, SYNC_TENSOR, _link(s, d, SYNC_TENSOR))
        for t in part.host_in:
            self._in(self.body, t, t)
        for t, dst in part.forward:
            self._out(self.body, t, _link(ipu, dst, t))
        for t, src in part.links_in:
            self._in(self.body, t, _link(src, ipu, t))
        self.body.append(Execute(0, tuple((t, t) for t in part.graph_inputs),
                                 tuple((t, t) for t in part.graph_outputs)))
        for t, dst in part.links_out:
            self._out(self.body, t, _link(ipu, dst, t))
        for t in part.host_out:
            self._out(self.body, t, t)
        for s, d in sync:
            if s == ipu:
                self._out(self.body, SYNC_TENSOR, _link(s, d, SYNC_TENSOR))

    def _stream(self, handle: str, direction: str, tensor: str) -> None:
        dtype, shape, nbytes = (self.p.sizes[tensor] if tensor != SYNC_TENSOR
                                else ("U8", (1,), 1))
        self.streams[handle] = StreamSpec(direction, dtype, list(shape), nbytes)

    def _in(self, program: list[Instruction], tensor: str, handle: str) -> None:
        self._stream(handle, "in", tensor)
        program.append(StreamIn(handle, tensor))

    def _out(self, program: list[Instruction], tensor: str, handle: str) -> None:
        self._stream(handle, "out", tensor)
        program.append(StreamOut(tensor, handle))


def _part_executable(p: "Prepared", opts: "CompileOptions", target: "Target", part: _Part,
                     opset: list[onnx.OperatorSetIdProto], inits: dict[str, onnx.TensorProto],
                     sync_pairs: list[tuple[int, int]], per_ipu_memory: int) -> Executable:
    """The one-IPU executable IPU ``part.ipu``'s process runs; CompileError if it does not
    fit in one IPU's memory."""
    from ipu_emulator.compiler._prepare import _peak_activations

    used = {t for n in part.nodes for t in node_reads(n)}
    part_inits = [inits[t] for t in sorted(used) if t in inits]
    g = helper.make_graph(part.nodes, f"{p.device_model.graph.name or 'model'}_ipu{part.ipu}",
                          [_value_info(p, t) for t in part.graph_inputs],
                          [_value_info(p, t) for t in part.graph_outputs],
                          initializer=part_inits)
    model = helper.make_model(g, opset_imports=opset)
    model.ir_version = p.device_model.ir_version
    sig = {}
    for t in part.graph_inputs + part.graph_outputs:
        dtype, shape, _ = p.sizes[t]
        sig[t] = TensorSig(t, dtype, tuple(shape))
    graph = Graph(tuple(sig[t] for t in part.graph_inputs),
                  tuple(sig[t] for t in part.graph_outputs), model.SerializeToString())
    specs: list[tuple[str, str, tuple[int, ...]]] = []
    for t in dict.fromkeys(part.graph_inputs + part.graph_outputs):
        dtype, shape, _ = p.sizes[t]
        specs.append((t, dtype, tuple(shape)))
    sync = [(s, d) for s, d in sync_pairs if part.ipu in (s, d)]
    prog = _PartPrograms(p, opts, part, sync)
    if sync:
        specs.append((SYNC_TENSOR, "U8", (1,)))
    tensors, memory_bytes = plan_memory(specs)
    constants = sum(p.sizes[t.name][2] for t in part_inits if t.name in p.sizes)
    activations = _peak_activations(model, p.sizes)
    required = memory_bytes + constants + activations
    if required > per_ipu_memory:
        raise CompileError(
            f"IPU {part.ipu}'s part of model {echo(p.label, 200)} ({len(part.nodes)} nodes) needs "
            f"{required} bytes (device tensors {memory_bytes}, constants {constants}, peak "
            f"activations {activations}) but one {target.name} IPU has {per_ipu_memory} bytes; "
            "move sharding points so the parts are smaller, or use more IPUs")
    return Executable(
        name=f"{opts.name[:100]}.ipu{part.ipu}",
        programs=[Program("load", tuple(prog.load)),
                  Program("main", (Repeat(opts.device_iterations, tuple(prog.body)),)),
                  Program("save", tuple(prog.save))],
        graphs=[graph], tensors=tensors, streams=prog.streams, memory_bytes=memory_bytes,
        required_bytes=required, ipu_version=target.version, num_ipus=1,
        device_iterations=opts.device_iterations, package_hash=ipu_emulator.package_hash(),
        attributes={"ipu": str(part.ipu), "keep_apart": "0", "stages": ",".join(map(str, sorted(part.stages))),
                    "nodes": _clip(",".join(part.node_names)),
                    "constant_bytes": str(constants), "activation_bytes": str(activations)})


def _idle_part(opts: "CompileOptions", target: "Target", ipu: int) -> Executable:
    """IPU ``ipu`` holds no node: a part marked idle, with nothing in it. The host loads
    nothing on that IPU and runs nothing there (host_runtime.devices._ipu_group); the
    executable's checks refuse an idle mark on a part that has anything to run."""
    return Executable(
        name=f"{opts.name[:100]}.ipu{ipu}",
        programs=[Program("load", ()), Program("main", ()), Program("save", ())],
        graphs=[], tensors={}, streams={}, memory_bytes=0, required_bytes=0,
        ipu_version=target.version, num_ipus=1, device_iterations=opts.device_iterations,
        package_hash=ipu_emulator.package_hash(),
        attributes={IDLE_ATTR: "1", "ipu": str(ipu), "nodes": "", "stages": "",
                    "constant_bytes": "0", "activation_bytes": "0"})


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _clip(text: str, limit: int = 60000) -> str:
    return text if len(text) <= limit else text[:limit]


def describe_parts(exe: Executable) -> dict[str, Any] | None:
    """Which nodes, anchors and tensors live on which IPU and stage (popef_dump), or None
    for a one-IPU executable."""
    if not exe.parts:
        return None
    summary: dict[str, Any] = {}
    try:
        summary = json.loads(exe.attributes.get("sharding", "{}"))
    except ValueError:
        pass
    ipus = []
    for k, part in enumerate(exe.parts):
        anchors_in: list[str] = []
        anchors_out: list[str] = []
        links_in: list[str] = []
        links_out: list[str] = []
        for h, s in part.streams.items():
            if is_link(h):
                src, dst, tensor = parse_link(h)
                (links_out if s.direction == "out" else links_in).append(
                    f"{tensor} -> ipu {dst}" if s.direction == "out" else f"{tensor} <- ipu {src}")
            else:
                (anchors_in if s.direction == "in" else anchors_out).append(h)
        nodes = [n for n in part.attributes.get("nodes", "").split(",") if n]
        ipus.append({"ipu": k, "idle": part.idle, "stages": part.attributes.get("stages", ""), "nodes": nodes,
                     "anchors_in": anchors_in, "anchors_out": anchors_out,
                     "links_in": links_in, "links_out": links_out,
                     "tensors": sorted(part.tensors), "required_bytes": part.required_bytes})
    return {"pipelining": bool(summary.get("pipelining", False)),
            "num_stages": int(summary.get("num_stages", 1)), "ipus": ipus}
