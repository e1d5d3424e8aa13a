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

This module places the nodes (:func:`place_nodes`) and reads the sharding options;
:mod:`._parts` builds the executable from the placement.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import onnx
from onnx import helper

from ipu_emulator.compiler._types import CompileOptions, CompileResult
from ipu_emulator.errors import CompileError
from ipu_emulator.executable import LINK_PREFIX, SYNC_TENSOR, is_link, is_sync, parse_link
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
    "check_pipelining",
    "annotate_one_ipu",
    "annotate_placement",
    "is_link",
    "is_sync",
    "parse_link",
    "load_sharding_yaml",
]

_log = logging.getLogger(__name__)

IPU_ATTR = "__ipu_number"
STAGE_ATTR = "__pipeline_stage"


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


def node_reads(node: onnx.NodeProto) -> list[str]:
    """The values ``node`` reads: its inputs, then those its sub-graphs (an ``If``'s
    branches, a ``Loop``'s body) read from the scopes around them."""
    reads = [t for t in node.input if t]
    seen = set(reads)
    for g in _subgraphs(node):
        for t in _outer_reads(g):
            if t not in seen:
                seen.add(t)
                reads.append(t)
    return reads


def _subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    return [g for a in node.attribute for g in ([a.g] if a.HasField("g") else list(a.graphs))]


def _outer_reads(graph: onnx.GraphProto) -> list[str]:
    """Names ``graph``'s nodes (and theirs) read that ``graph`` does not define."""
    defined = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    out: dict[str, None] = {}   # (in order, once each)
    for n in graph.node:
        for t in node_reads(n):
            if t not in defined:
                out[t] = None
        defined.update(o for o in n.output if o)
    return list(out)


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
            stack.extend(producer[t] for t in node_reads(nodes[k]) if t in producer)
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
        for t in node_reads(n):
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


def annotate_one_ipu(result: "CompileResult", p: "Prepared", opts: "CompileOptions") -> None:
    """``num_ipus`` 1 with sharding options: check the placement, record it on the model."""
    check_num_ipus(1, opts.machine_ipus)
    plan = place_nodes(p.device_model.graph, dict(opts.sharding_info or {}),
                       dict(opts.pipelining_info or {}), 1, opts.enable_pipelining)
    check_pipelining(opts, plan)
    model = onnx.ModelProto()
    model.CopyFrom(result.output_model)
    annotate_placement(model.graph, p.device_model.graph, plan)
    result.output_model = model


def check_pipelining(opts: "CompileOptions", plan: Placement) -> None:
    """With pipelining, each step's batches fill the stages evenly (CompileError)."""
    if opts.enable_pipelining and opts.device_iterations % plan.num_stages:
        raise CompileError(
            f"with pipelining, batches_per_step must be a multiple of the number of pipeline "
            f"stages ({plan.num_stages}); got {opts.device_iterations}")


def annotate_placement(graph: onnx.GraphProto, device_graph: onnx.GraphProto,
                       plan: Placement) -> None:
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
