"""Manual sharding and pipelining: one prepared model -> one program set per IPU.

PopRT's manual sharding, as its user guide describes it: *sharding points* are
ONNX node names, each with an IPU number (``sharding_info``) and, for
pipelining, a pipeline stage (``pipelining_info``). Points are taken in
topological order; from each point the graph is walked towards its inputs and
every node reached that has no placement yet joins that point's IPU and stage.
Nodes that no point reaches go to the last IPU and stage.

The result is a *multi-IPU executable*::

    Executable(num_ipus=N, parts=[part 0, ..., part N-1])
      streams/programs: the host's view (every anchor, Main = its StreamIns and
                        StreamOuts); never run, it lets the host and the checks
                        see the anchors as for a one-IPU executable
      parts[k]:         a one-IPU executable that IPU k's process runs:
          load  StreamIn(w) of the weights it owns (+ forwards / receives)
          main  Repeat(K, [(sharding only) StreamIn sync,
                           StreamIn host inputs, StreamOut forwarded inputs,
                           StreamIn links, Execute(its graph),
                           StreamOut links, StreamOut host outputs,
                           (sharding only) StreamOut sync])
          save  StreamOut(w, w_saved) of the weights it owns

A tensor crossing from IPU a to IPU b is a *link*: a stream ``LINK_PREFIX +
"<a>/<b>/<tensor>"`` that is ``out`` on part a and ``in`` on part b. The host
makes one SPSC ring per link (host_runtime.devices._ipu_group), so activations go
straight from one IPU process to the next. Without pipelining, every last IPU
of the chain sends a one-byte *sync* token to every first IPU at the end of an
iteration, and a first IPU takes one at the start of each iteration: the parts
run one after the other per batch. The host puts one token in each sync ring
whenever it (re)starts the links (``is_sync``), so the first iteration runs. With pipelining there is no token: stage s
works on batch i while stage s+1 works on batch i-1, and the rings between the
stages bound how far ahead a stage runs.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import onnx
from onnx import helper

import ipu_emulator
from ipu_emulator.compiler._onnx import DTYPE_TO_ONNX
from ipu_emulator.compiler._types import (LOAD_PROGRAM, MAIN_PROGRAM, SAVE_PROGRAM, AnchorDesc,
                                          CompileOptions, CompileResult, Target, check_fit)
from ipu_emulator.errors import CompileError
from ipu_emulator.executable import (
    IDLE_ATTR, LINK_PREFIX, SYNC_TENSOR, is_link, is_sync, parse_link,
    Execute, Executable, Graph, Instruction, Program, Repeat, StreamIn, StreamOut, StreamSpec,
    TensorSig, numpy_dtype, plan_memory)
from shm.errors import echo

if TYPE_CHECKING:  # pragma: no cover
    from ipu_emulator.compiler._prepare import Prepared

__all__ = [
    "LINK_PREFIX",
    "SYNC_TENSOR",
    "IPU_ATTR",
    "STAGE_ATTR",
    "Placement",
    "place_nodes",
    "check_num_ipus",
    "compile_sharded",
    "annotate_one_ipu",
    "is_link",
    "is_sync",
    "parse_link",
    "load_sharding_yaml",
]

_log = logging.getLogger(__name__)

IPU_ATTR = "__ipu_number"
STAGE_ATTR = "__pipeline_stage"


def _link(src: int, dst: int, tensor: str) -> str:
    return f"{LINK_PREFIX}{src}/{dst}/{tensor}"


@dataclass
class Placement:
    """Where each node of a graph runs."""

    ipu: list[int]                   # per node (graph order)
    stage: list[int]
    num_ipus: int
    pipelining: bool
    order: list[int] = field(default_factory=list)   # IPUs with nodes, in data-flow order
    idle: list[int] = field(default_factory=list)    # IPUs with no node
    rest: tuple[int, int] = (0, 0)   # (IPU, stage) of a node no sharding point reaches

    @property
    def num_stages(self) -> int:
        return len(set(self.stage))


def load_sharding_yaml(path: "str | os.PathLike[str]") -> tuple[dict[str, int], dict[str, int]]:
    """Read ``shard.yaml``: maps ``sharding_info`` (node -> IPU) and ``pipelining_info``
    (node -> stage), or PopRT's list of ``{node, device, stage}`` items. Raises
    CompileError naming the file and the key."""
    from ipu_emulator.yaml_config import ConfigYamlError, load_yaml_file

    p = os.fspath(path)
    try:
        doc = load_yaml_file(p, "sharding config")
    except ConfigYamlError as exc:
        raise CompileError(str(exc)) from None
    if doc is None:
        doc = {}
    if isinstance(doc, list):
        return _sharding_list(doc, f"sharding config {echo(p, 200)}")
    if not isinstance(doc, dict):
        raise CompileError(f"sharding config {echo(p, 200)} must be a list of node/device/stage "
                           "items or a mapping with sharding_info and pipelining_info, got "
                           f"{type(doc).__name__}")
    extra = sorted(set(doc) - {"sharding_info", "pipelining_info"})
    if extra:
        raise CompileError(f"sharding config {echo(p, 200)}: unknown keys {echo(extra, 200)}; expected "
                           "sharding_info and pipelining_info")
    return (check_map(doc.get("sharding_info"), f"sharding config {echo(p, 200)}: sharding_info"),
            check_map(doc.get("pipelining_info"), f"sharding config {echo(p, 200)}: pipelining_info"))


def _sharding_list(items: list[Any], where: str) -> tuple[dict[str, int], dict[str, int]]:
    """PopRT's ``shard.yaml``: ``- {node: <name>, device: <IPU>, stage: <stage>}`` per
    sharding point (``device`` and ``stage`` each optional)."""
    sharding: dict[str, Any] = {}
    stages: dict[str, Any] = {}
    for k, item in enumerate(items):
        at = f"{where}: item {k}"
        if not isinstance(item, dict) or not isinstance(item.get("node"), str):
            raise CompileError(f"{at} must be a mapping with a node name (node) and its IPU "
                               f"(device) and/or pipeline stage (stage), got {echo(item, 200)}")
        extra = sorted(map(str, set(item) - {"node", "device", "stage"}))
        if extra:
            raise CompileError(f"{at}: unknown keys {echo(extra, 200)}; expected node, device "
                               "and stage")
        name = item["node"]
        if name in sharding or name in stages:
            raise CompileError(f"{at}: node {echo(name)} is named twice")
        if "device" not in item and "stage" not in item:
            raise CompileError(f"{at}: node {echo(name)} has neither device nor stage")
        if "device" in item:
            sharding[name] = item["device"]
        if "stage" in item:
            stages[name] = item["stage"]
    return (check_map(sharding, f"{where}: device"), check_map(stages, f"{where}: stage"))


def check_map(v: Any, where: str) -> dict[str, int]:
    """A node name -> non-negative integer map (None is empty)."""
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise CompileError(f"{where} must map node names to integers, got {type(v).__name__}")
    out: dict[str, int] = {}
    for k, n in v.items():
        if not isinstance(k, str) or isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise CompileError(f"{where}: {echo(k)}: {echo(n)} must be a node name and an integer >= 0")
        out[k] = n
    return out


def check_num_ipus(num_ipus: int, machine_ipus: int | None = None) -> None:
    """``num_ipus`` must be a power of two that the machine has."""
    if num_ipus < 1 or num_ipus & (num_ipus - 1):
        raise CompileError(f"num_ipus must be a power of two (1, 2, 4, ...), got {num_ipus}")
    if machine_ipus is None:
        from ipu_emulator.system import load_system_config
        machine_ipus = load_system_config().num_ipus
    if num_ipus > machine_ipus:
        raise CompileError(f"num_ipus {num_ipus} is more than the {machine_ipus} IPUs of this "
                           "machine (IPU_EMULATOR_NUM_IPUS / the system config)")


def place_nodes(graph: onnx.GraphProto, sharding_info: dict[str, int],
                pipelining_info: dict[str, int], num_ipus: int, pipelining: bool) -> Placement:
    """Place every node on an IPU and a stage; check the placement (CompileError)."""
    nodes = list(graph.node)
    by_name: dict[str, int] = {}
    for k, n in enumerate(nodes):
        if n.name:
            by_name.setdefault(n.name, k)
    points = sorted(set(sharding_info) | set(pipelining_info))
    unknown = [n for n in points if n not in by_name]
    if unknown:
        known = sorted(by_name)
        raise CompileError(
            f"sharding points {echo(unknown, 200)} are not node names of the model; it has "
            f"{len(known)} named nodes, e.g. {echo(known[:8], 200)}")
    for name, number in sharding_info.items():
        if number >= num_ipus:
            raise CompileError(f"sharding_info puts node {echo(name)} on IPU {number}, but num_ipus is "
                               f"{num_ipus} (IPU numbers are 0..{num_ipus - 1})")
    if pipelining_info and not pipelining:
        _log.info("pipelining_info given without enable_pipelining: stages are recorded only")
    producer: dict[str, int] = {}
    for k, n in enumerate(nodes):
        for t in n.output:
            if t:
                producer[t] = k
    last_ipu = num_ipus - 1
    rest_ipu, rest_stage = _rest(sharding_info, pipelining_info, num_ipus, pipelining)
    ipu: list[int | None] = [None] * len(nodes)
    stage: list[int] = [0] * len(nodes)
    for name in sorted(points, key=lambda n: by_name[n]):   # graph order is topological
        k0 = by_name[name]
        p_ipu = sharding_info.get(name, last_ipu)
        p_stage = pipelining_info.get(name, p_ipu if pipelining else 0)
        stack = [k0]
        while stack:
            k = stack.pop()
            if ipu[k] is not None:
                continue
            ipu[k], stage[k] = p_ipu, p_stage
            stack.extend(producer[t] for t in nodes[k].input if t in producer)
    for k in range(len(nodes)):
        if ipu[k] is None:
            ipu[k], stage[k] = rest_ipu, rest_stage
    ipus = [int(i) if i is not None else last_ipu for i in ipu]
    if not pipelining:
        stage_out = stage if pipelining_info else [0] * len(nodes)
    else:
        stage_out = stage
    plan = Placement(ipus, stage_out, num_ipus, pipelining,
                     rest=(rest_ipu, rest_stage if pipelining or pipelining_info else 0))
    _check(plan, nodes, producer)
    return plan


def _rest(sharding_info: dict[str, int], pipelining_info: dict[str, int], num_ipus: int,
          pipelining: bool) -> tuple[int, int]:
    """The IPU and stage of the nodes no sharding point reaches. PopRT's rule: the highest
    IPU named + 1 and the highest stage named + 1. When no IPU is left above the highest
    named (PopART would refuse the number), the last IPU and the highest stage named."""
    named = max(sharding_info.values(), default=-1)
    if sharding_info and named + 1 < num_ipus:
        ipu = named + 1
        stage = max(pipelining_info.values()) + 1 if pipelining_info else \
            (ipu if pipelining else 0)
        return ipu, stage
    ipu = num_ipus - 1
    if pipelining_info:
        return ipu, max(pipelining_info.values())
    return ipu, ipu if pipelining else 0


def _label(n: onnx.NodeProto, k: int) -> str:
    return repr(n.name) if n.name else f"#{k} ({n.op_type})"


def _check(plan: Placement, nodes: list[onnx.NodeProto], producer: dict[str, int]) -> None:
    busy = sorted(set(plan.ipu))
    plan.idle = sorted(set(range(plan.num_ipus)) - set(busy))
    if plan.idle:   # held with the device, as on hardware, and given nothing to run
        _log.info("IPU(s) %s of %d hold no node: idle", plan.idle, plan.num_ipus)
    edges: set[tuple[int, int]] = set()
    for k, n in enumerate(nodes):
        for t in n.input:
            j = producer.get(t)
            if j is None:
                continue
            if plan.stage[j] > plan.stage[k]:
                raise CompileError(
                    f"pipeline stages are not ordered along the graph: tensor {echo(t)} flows from "
                    f"node {_label(nodes[j], j)} (stage {plan.stage[j]}) to node "
                    f"{_label(nodes[k], k)} (stage {plan.stage[k]}), an earlier stage")
            if plan.ipu[j] != plan.ipu[k]:
                edges.add((plan.ipu[j], plan.ipu[k]))
    if plan.pipelining:
        where: dict[int, int] = {}
        for k in range(len(nodes)):
            s, i = plan.stage[k], plan.ipu[k]
            if where.setdefault(s, i) != i:
                raise CompileError(f"pipeline stage {s} spans IPUs {where[s]} and {i} (node "
                                   f"{_label(nodes[k], k)}); a stage runs on one IPU")
    # IPUs in data-flow order; a cycle (IPU a feeds b feeds a) cannot run part by part
    indeg = {i: 0 for i in busy}
    for _a, b in edges:
        indeg[b] += 1
    ready = sorted(i for i, d in indeg.items() if d == 0)
    order: list[int] = []
    while ready:
        i = ready.pop(0)
        order.append(i)
        for a, b in sorted(edges):
            if a == i:
                indeg[b] -= 1
                if indeg[b] == 0:
                    ready.append(b)
    if len(order) != len(busy):
        cyc = sorted(i for i in indeg if i not in order)
        raise CompileError(f"tensors flow back and forth between IPUs {cyc} "
                           f"({sorted(e for e in edges if e[0] in cyc and e[1] in cyc)}): each "
                           "IPU's part must run in one go; move the sharding points so data "
                           "flows one way")
    plan.order = order


# -- the executable ------------------------------------------------------------------

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
    dev_graph = p.device_model.graph
    plan = place_nodes(dev_graph, dict(opts.sharding_info or {}),
                       dict(opts.pipelining_info or {}), n_ipus, opts.enable_pipelining)
    if opts.enable_pipelining and opts.device_iterations % plan.num_stages:
        raise CompileError(
            f"with pipelining, batches_per_step must be a multiple of the number of pipeline "
            f"stages ({plan.num_stages}); got {opts.device_iterations}")
    sizes = p.sizes
    weights = {w.name: (w, data) for w, data in p.weights}
    inputs = {v.name: v for v in p.inputs}
    out_names = [v.name for v in p.outputs]
    parts = [_Part(i) for i in range(n_ipus)]
    rank = {ipu: r for r, ipu in enumerate(plan.order)}
    consumers: dict[str, list[int]] = {}
    producer_ipu: dict[str, int] = {}
    for k, n in enumerate(dev_graph.node):
        part = parts[plan.ipu[k]]
        part.nodes.append(n)
        part.node_names.append(n.name or f"#{k}:{n.op_type}")
        part.stages.add(plan.stage[k])
        for t in n.input:
            if t and plan.ipu[k] not in consumers.setdefault(t, []):
                consumers[t].append(plan.ipu[k])
        for t in n.output:
            if t:
                producer_ipu[t] = plan.ipu[k]
    inits = {t.name: t for t in dev_graph.initializer}

    def vi(name: str) -> onnx.ValueInfoProto:
        if name not in sizes:
            raise CompileError(f"model {echo(p.label, 200)}: tensor {echo(name)} crosses IPUs but its shape "
                               "is not known after shape inference")
        dtype, shape, _ = sizes[name]
        return helper.make_tensor_value_info(name, DTYPE_TO_ONNX[dtype], list(shape))

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
    unused = [v for v in inputs if v not in consumers]
    if unused:
        raise CompileError(f"model {echo(p.label, 200)}: inputs {echo(unused, 200)} are not used by any node; "
                           "a sharded model streams each input to the IPU that consumes it")
    for name in out_names:
        maker = producer_ipu.get(name)
        if maker is None:
            raise CompileError(f"model {echo(p.label, 200)}: output {echo(name)} is not produced by a node")
        parts[maker].host_out.append(name)
        if name not in parts[maker].graph_outputs:
            parts[maker].graph_outputs.append(name)

    # sync tokens (sharding without pipelining): each last IPU -> each first IPU
    sinks = [i for i in plan.order if not parts[i].links_out and not parts[i].forward]
    sources = [i for i in plan.order if not parts[i].links_in]
    sync_pairs = [] if opts.enable_pipelining else [
        (s, d) for s in sinks for d in sources if s != d]

    opset = list(p.device_model.opset_import)
    exe_parts: list[Executable] = []
    for part in parts:
        exe_parts.append(_idle_part(opts, target, part.ipu) if part.ipu in plan.idle else
                         _part_executable(p, opts, target, part, opset, inits, vi, sync_pairs,
                                          plan, per_ipu_memory))

    # the host's view: every anchor, Main reads each input and writes each output once
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
    summary = {
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
    exe = Executable(
        name=opts.name,
        programs=[Program("load", tuple(load)),
                  Program("main", (Repeat(opts.device_iterations, tuple(body + outs)),)),
                  Program("save", tuple(save))],
        graphs=[], tensors=tensors, streams=streams, memory_bytes=memory_bytes,
        required_bytes=required, ipu_version=target.version, num_ipus=n_ipus,
        device_iterations=opts.device_iterations, package_hash=ipu_emulator.package_hash(),
        attributes={"models": os.path.basename(p.label), "fused": "0",
                    "constant_bytes": str(sum(int(e.attributes["constant_bytes"])
                                              for e in exe_parts)),
                    "activation_bytes": str(max(int(e.attributes["activation_bytes"])
                                                for e in exe_parts)),
                    "sharding": _clip(json.dumps(summary, separators=(",", ":")))},
        parts=exe_parts)
    exe.validate()
    order = {"input": 1, "output": 2, "weight": 3, "saved": 4}
    anchors.sort(key=lambda a: order[a.kind])
    output_model = onnx.ModelProto()
    output_model.CopyFrom(p.model)
    _annotate(output_model.graph, p.device_model.graph, plan)
    return CompileResult(
        executable=exe, anchors=anchors,
        program_flow={"load": [LOAD_PROGRAM], "main": [MAIN_PROGRAM], "save": [SAVE_PROGRAM]},
        output_model=output_model, models=[p.model], subgraphs={}, fused=False)


def _clip(text: str, limit: int = 60000) -> str:
    return text if len(text) <= limit else text[:limit]


def _annotate(graph: onnx.GraphProto, device_graph: onnx.GraphProto, plan: Placement) -> None:
    """Record the placement on the written model's nodes, as PopRT does."""
    where = {}
    removed = plan.rest   # a node the compile removed: where the rest goes, on a busy IPU
    if removed[0] in plan.idle and plan.order:
        removed = (plan.order[-1], max(plan.stage, default=0))
    for k, n in enumerate(device_graph.node):
        where[tuple(n.output)] = (plan.ipu[k], plan.stage[k])
    for n in graph.node:
        ipu, stage = where.get(tuple(n.output), removed)
        for a in list(n.attribute):
            if a.name in (IPU_ATTR, STAGE_ATTR):
                n.attribute.remove(a)
        n.attribute.extend([helper.make_attribute(IPU_ATTR, ipu),
                            helper.make_attribute(STAGE_ATTR, stage)])


def _part_executable(p: "Prepared", opts: "CompileOptions", target: "Target", part: _Part,
                     opset: list[onnx.OperatorSetIdProto], inits: dict[str, onnx.TensorProto],
                     vi: Any, sync_pairs: list[tuple[int, int]], plan: Placement,
                     per_ipu_memory: int) -> Executable:
    from ipu_emulator.compiler._prepare import _peak_activations

    used = {t for n in part.nodes for t in n.input if t}
    part_inits = [inits[t] for t in sorted(used) if t in inits]
    g = helper.make_graph(part.nodes, f"{p.device_model.graph.name or 'model'}_ipu{part.ipu}",
                          [vi(t) for t in part.graph_inputs], [vi(t) for t in part.graph_outputs],
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
    streams: dict[str, StreamSpec] = {}

    def stream(handle: str, direction: str, tensor: str) -> None:
        dtype, shape, nbytes = p.sizes[tensor] if tensor != SYNC_TENSOR else ("U8", (1,), 1)
        streams[handle] = StreamSpec(direction, dtype, list(shape), nbytes)

    load: list[Instruction] = []
    save: list[Instruction] = []
    for w in part.weights_in:
        stream(w, "in", w)
        load.append(StreamIn(w, w))
        if opts.save_weights:
            stream(w + "_saved", "out", w)
            save.append(StreamOut(w, w + "_saved"))
    for w, dst in part.wforward:
        stream(_link(part.ipu, dst, w), "out", w)
        load.append(StreamOut(w, _link(part.ipu, dst, w)))
    for w, src in part.wlinks_in:
        stream(_link(src, part.ipu, w), "in", w)
        load.append(StreamIn(_link(src, part.ipu, w), w))
    body: list[Instruction] = []
    sync = [(s, d) for s, d in sync_pairs if part.ipu in (s, d)]
    for s, d in sync:   # a first IPU starts batch i+1 once the last IPUs finished batch i
        if d == part.ipu:
            stream(_link(s, d, SYNC_TENSOR), "in", SYNC_TENSOR)
            body.append(StreamIn(_link(s, d, SYNC_TENSOR), SYNC_TENSOR))
    for t in part.host_in:
        stream(t, "in", t)
        body.append(StreamIn(t, t))
    for t, dst in part.forward:
        stream(_link(part.ipu, dst, t), "out", t)
        body.append(StreamOut(t, _link(part.ipu, dst, t)))
    for t, src in part.links_in:
        stream(_link(src, part.ipu, t), "in", t)
        body.append(StreamIn(_link(src, part.ipu, t), t))
    body.append(Execute(0, tuple((t, t) for t in part.graph_inputs),
                        tuple((t, t) for t in part.graph_outputs)))
    for t, dst in part.links_out:
        stream(_link(part.ipu, dst, t), "out", t)
        body.append(StreamOut(t, _link(part.ipu, dst, t)))
    for t in part.host_out:
        stream(t, "out", t)
        body.append(StreamOut(t, t))
    if sync:
        specs.append((SYNC_TENSOR, "U8", (1,)))
        for s, d in sync:
            if s == part.ipu:
                stream(_link(s, d, SYNC_TENSOR), "out", SYNC_TENSOR)
                body.append(StreamOut(SYNC_TENSOR, _link(s, d, SYNC_TENSOR)))
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
        programs=[Program("load", tuple(load)),
                  Program("main", (Repeat(opts.device_iterations, tuple(body)),)),
                  Program("save", tuple(save))],
        graphs=[graph], tensors=tensors, streams=streams, memory_bytes=memory_bytes,
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


def annotate_one_ipu(result: "CompileResult", p: "Prepared", opts: "CompileOptions") -> None:
    """``num_ipus`` 1 with sharding options: check the placement, record it on the model."""
    check_num_ipus(1, opts.machine_ipus)
    plan = place_nodes(p.device_model.graph, dict(opts.sharding_info or {}),
                       dict(opts.pipelining_info or {}), 1, opts.enable_pipelining)
    if opts.enable_pipelining and opts.device_iterations % plan.num_stages:
        raise CompileError(
            f"with pipelining, batches_per_step must be a multiple of the number of pipeline "
            f"stages ({plan.num_stages}); got {opts.device_iterations}")
    model = onnx.ModelProto()
    model.CopyFrom(result.output_model)
    _annotate(model.graph, p.device_model.graph, plan)
    result.output_model = model
