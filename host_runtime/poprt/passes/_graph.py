"""Passes over a graph's structure: outputs, dead values, constants, names, order."""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from host_runtime.errors import BadRequestError
from host_runtime.poprt.passes._base import Pass
from host_runtime.poprt._onnx_util import (consumers, copy_model, graph_inputs,
                                          parse_skip_list, prune, subgraphs)
from host_runtime.poprt.passes._types import infer_lenient

__all__ = ["AddCheckpoints", "RemoveOutputs", "ConstantFolding", "EliminateIdentity",
           "EliminateUnusedInitializer", "EliminateDeadend", "ExtractConstantToInitializer",
           "RemoveInitializerFromInput", "RemoveDuplicatedInitializer", "SortGraph",
           "UniqueNameForNodes", "ModelOverview", "ModelIOInfoOverview", "CheckWithFakeData",
           "topological_sort"]

_log = logging.getLogger("poprt.passes")
_NONDETERMINISTIC = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
                     "Multinomial", "Bernoulli", "Dropout"}


def _needs(n: onnx.NodeProto, made: set[str]) -> set[str]:
    """The names produced in the graph that ``n`` (or a sub-graph of it) reads."""
    want = {i for i in n.input if i}
    stack = list(subgraphs(n))
    while stack:
        g = stack.pop()
        for inner in g.node:
            want.update(i for i in inner.input if i)
            stack.extend(subgraphs(inner))
    return want & made


def is_sorted(graph: onnx.GraphProto) -> bool:
    made = {o for n in graph.node for o in n.output if o}
    seen: set[str] = set()
    for n in graph.node:
        if not _needs(n, made) <= seen:
            return False
        seen.update(o for o in n.output if o)
    return True


def topological_sort(graph: onnx.GraphProto) -> onnx.GraphProto:
    """Order ``graph``'s nodes so that each comes after the producers of its inputs, keeping
    the given order where it allows (names from outside the graph count as available).
    Raises on a cycle."""
    import heapq

    nodes = list(graph.node)
    made = {o for n in nodes for o in n.output if o}
    producer = {o: k for k, n in enumerate(nodes) for o in n.output if o}
    waiting = [0] * len(nodes)
    readers: dict[int, list[int]] = {}
    for k, n in enumerate(nodes):
        deps = {producer[name] for name in _needs(n, made)} - {k}
        waiting[k] = len(deps)
        for d in deps:
            readers.setdefault(d, []).append(k)
    ready = [k for k, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        k = heapq.heappop(ready)
        order.append(k)
        for r in readers.get(k, []):
            waiting[r] -= 1
            if waiting[r] == 0:
                heapq.heappush(ready, r)
    if len(order) != len(nodes):
        left = [nodes[k].name or nodes[k].op_type for k in range(len(nodes)) if waiting[k]][:5]
        raise BadRequestError(f"graph {graph.name!r} has a cycle through {left}")
    out = onnx.GraphProto()
    out.CopyFrom(graph)
    del out.node[:]
    out.node.extend(nodes[k] for k in order)
    return out


class AddCheckpoints(Pass):
    """Make the intermediate tensors named in ``checkpoints`` graph outputs too."""

    def __init__(self, checkpoints: Any = None) -> None:
        super().__init__()
        self.checkpoints = parse_skip_list(checkpoints, "checkpoints")

    def run(self, onnx_model: onnx.ModelProto) -> onnx.ModelProto:
        model = infer_lenient(copy_model(onnx_model))
        g = model.graph
        known = {o for n in g.node for o in n.output} | {vi.name for vi in g.input}
        info = {vi.name: vi for vi in list(g.value_info) + list(g.input)}
        have = {o.name for o in g.output}
        for name in self.checkpoints:
            if name not in known:
                raise BadRequestError(f"checkpoint {name!r} is not a tensor of the model")
            if name in have:
                continue
            vi = info.get(name)
            g.output.append(vi if vi is not None else onnx.ValueInfoProto(name=name))
            have.add(name)
        return model


class RemoveOutputs(Pass):
    """Remove the outputs named in ``outputs`` and the nodes only they needed."""

    def __init__(self, outputs: Any = None) -> None:
        super().__init__()
        self.outputs = parse_skip_list(outputs, "outputs")

    def run(self, onnx_model: onnx.ModelProto) -> onnx.ModelProto:
        model = copy_model(onnx_model)
        g = model.graph
        have = [o.name for o in g.output]
        unknown = [o for o in self.outputs if o not in have]
        if unknown:
            raise BadRequestError(f"remove_outputs names {unknown}, which are not outputs; the "
                                  f"outputs are {have}")
        if len(set(self.outputs)) == len(have):
            raise BadRequestError("remove_outputs would remove every output of the model")
        keep = [o for o in g.output if o.name not in self.outputs]
        del g.output[:]
        g.output.extend(keep)
        return prune(model)


class EliminateDeadend(Pass):
    """Remove nodes no graph output depends on (and initializers no node reads)."""

    def run(self, onnx_model: onnx.ModelProto) -> onnx.ModelProto:
        return prune(copy_model(onnx_model))


class EliminateUnusedInitializer(Pass):
    """Remove initializers no node reads."""

    def run(self, onnx_model: onnx.ModelProto) -> onnx.ModelProto:
        model = copy_model(onnx_model)
        g = model.graph
        used = set(consumers(g)) | {o.name for o in g.output}
        inits = [t for t in g.initializer if t.name in used]
        del g.initializer[:]
        g.initializer.extend(inits)
        return model


class EliminateIdentity(Pass):
    """Remove Identity nodes of the main graph (not those that make a graph output)."""

    def run(self, onnx_model: onnx.ModelProto) -> onnx.ModelProto:
        model = copy_model(onnx_model)
        g = model.graph
        outs = {o.name for o in g.output}
        for n in [n for n in g.node if n.op_type == "Identity"]:
            if n.output[0] in outs:
                continue
            src, dst = n.input[0], n.output[0]
            g.node.remove(n)
            _rename(g, dst, src)
        return model


def _rename(g: onnx.GraphProto, old: str, new: str) -> None:
    for n in g.node:
        n.input[:] = [new if i == old else i for i in n.input]
        for sg in subgraphs(n):
            _rename(sg, old, new)


class ExtractConstantToInitializer(Pass):
    """Constant nodes of the main graph become initializers."""

    def run(self, onnx_model: onnx.ModelProto) -> onnx.ModelProto:
        from host_runtime.poprt._onnx_util import constant_value

        model = copy_model(onnx_model)
        g = model.graph
        for n in [n for n in g.node if n.op_type == "Constant"]:
            value = constant_value(g, n.output[0])
            if value is None:
                continue
            g.node.remove(n)
            g.initializer.append(numpy_helper.from_array(np.asarray(value), n.output[0]))
        return model


class RemoveInitializerFromInput(Pass):
    """Initializers listed among the graph inputs (old exporters) are removed from them."""

    def run(self, onnx_model: onnx.ModelProto) -> onnx.ModelProto:
        model = copy_model(onnx_model)
        g = model.graph
        ins = graph_inputs(g)
        del g.input[:]
        g.input.extend(ins)
        return model


class RemoveDuplicatedInitializer(Pass):
    """Initializers with equal type, shape and bytes are merged into one."""

    def run(self, onnx_model: onnx.ModelProto) -> onnx.ModelProto:
        model = copy_model(onnx_model)
        g = model.graph
        outs = {o.name for o in g.output} | {vi.name for vi in g.input}
        seen: dict[tuple[int, tuple[int, ...], bytes], str] = {}
        keep = []
        for t in g.initializer:
            arr = numpy_helper.to_array(t)
            key = (t.data_type, tuple(arr.shape), arr.tobytes())
            first = seen.get(key)
            if first is None or t.name in outs:
                seen.setdefault(key, t.name)
                keep.append(t)
            else:
                _rename(g, t.name, first)
        del g.initializer[:]
        g.initializer.extend(keep)
        return model


class SortGraph(Pass):
    """Sort the nodes of every graph topologically."""

    def run(self, onnx_model: onnx.ModelProto) -> onnx.ModelProto:
        if self._sorted(onnx_model.graph):
            return onnx_model
        model = copy_model(onnx_model)
        model.graph.CopyFrom(self.traverse_graph(
            model.graph, lambda g, _m: g if is_sorted(g) else topological_sort(g)))
        return model

    def _sorted(self, graph: onnx.GraphProto) -> bool:
        return is_sorted(graph) and all(self._sorted(g) for n in graph.node
                                        for g in subgraphs(n))


class UniqueNameForNodes(Pass):
    """Give every node a name unique in the model (unnamed or repeated names)."""

    def run(self, onnx_model: onnx.ModelProto) -> onnx.ModelProto:
        model = copy_model(onnx_model)
        used: Counter[str] = Counter()

        def transform(g: onnx.GraphProto, _main: bool) -> onnx.GraphProto:
            for k, n in enumerate(g.node):
                base = n.name or f"{n.op_type}_{k}"
                name = base
                while used[name]:
                    name = f"{base}_{used[base]}"
                    used[base] += 1
                used[name] += 1
                n.name = name
            return g

        model.graph.CopyFrom(self.traverse_graph(model.graph, transform))
        return model


class ConstantFolding(Pass):
    """Compute the main graph's nodes whose inputs are all constants and store their
    outputs as initializers (none larger than ``max_tensor_size`` bytes; -1: no limit)."""

    def __init__(self, max_tensor_size: int = -1) -> None:
        super().__init__()
        self.max_tensor_size = int(max_tensor_size)

    def run(self, onnx_model: onnx.ModelProto) -> onnx.ModelProto:
        from onnx.reference import ReferenceEvaluator

        model = copy_model(onnx_model)
        g = model.graph
        consts = {t.name: numpy_helper.to_array(t) for t in g.initializer}
        inputs = {vi.name for vi in graph_inputs(g)}
        outs = {o.name for o in g.output}
        opsets = list(model.opset_import)
        folded: list[onnx.NodeProto] = []
        for n in list(g.node):
            if n.op_type in _NONDETERMINISTIC or any(True for _ in subgraphs(n)) or n.domain \
                    not in ("", "ai.onnx") or any(o in outs for o in n.output):
                continue
            if not all((i == "" or (i in consts and i not in inputs)) for i in n.input):
                continue
            try:
                sub = helper.make_graph([n], "fold", [], [onnx.ValueInfoProto(name=o)
                                                          for o in n.output if o])
                ev = ReferenceEvaluator(helper.make_model(sub, opset_imports=opsets))
                values = ev.run(None, {i: consts[i] for i in n.input if i})
            except Exception as exc:  # noqa: BLE001 - not foldable: left to run
                _log.debug("constant_folding: %s not folded: %s", n.name or n.op_type, exc)
                continue
            arrays = [np.asarray(v) for v in values]
            if self.max_tensor_size >= 0 and any(a.nbytes > self.max_tensor_size
                                                 for a in arrays):
                continue
            for o, a in zip([o for o in n.output if o], arrays):
                consts[o] = a
                g.initializer.append(numpy_helper.from_array(a, o))
            folded.append(n)
        for n in folded:
            g.node.remove(n)
        return prune(model) if folded else model


def _describe(vi: onnx.ValueInfoProto) -> str:
    tt = vi.type.tensor_type
    dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?")
            for d in tt.shape.dim]
    return f"{vi.name}: {onnx.TensorProto.DataType.Name(tt.elem_type)}{dims}"


class ModelOverview(Pass):
    """Print the model's inputs, outputs and op counts (the model is unchanged)."""

    def __init__(self, use_print: bool = True, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.use_print = use_print

    def overview(self, model: onnx.ModelProto) -> str:
        ops = Counter(n.op_type for n in model.graph.node)
        lines = ["inputs:"] + [f"  {_describe(vi)}" for vi in graph_inputs(model.graph)]
        lines += ["outputs:"] + [f"  {_describe(vi)}" for vi in model.graph.output]
        lines += ["ops:"] + [f"  {k}: {v}" for k, v in sorted(ops.items())]
        return "\n".join(lines)

    def run(self, onnx_model: onnx.ModelProto) -> onnx.ModelProto:
        text = self.overview(onnx_model)
        if self.use_print:
            print(text)
        else:
            _log.info("%s", text)
        return onnx_model


class ModelIOInfoOverview(ModelOverview):
    """Print the model's inputs and outputs (the model is unchanged)."""

    def overview(self, model: onnx.ModelProto) -> str:
        lines = ["inputs:"] + [f"  {_describe(vi)}" for vi in graph_inputs(model.graph)]
        lines += ["outputs:"] + [f"  {_describe(vi)}" for vi in model.graph.output]
        return "\n".join(lines)


class CheckWithFakeData(Pass):
    """Run ``origin_model`` and the model given on the same random inputs with onnxruntime
    and raise if an output differs (beyond fp16's precision when the types differ)."""

    def __init__(self, origin_model: onnx.ModelProto) -> None:
        super().__init__()
        self.origin_model = origin_model

    def run(self, onnx_model: onnx.ModelProto) -> onnx.ModelProto:
        from host_runtime.poprt._check import compare_with_onnxruntime

        compare_with_onnxruntime(self.origin_model, onnx_model)
        return onnx_model
