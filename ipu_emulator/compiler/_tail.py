"""A model's non-tensor tail, computed on the host.

Classifiers converted from scikit-learn end in ``ZipMap``: their scores become a sequence
of maps (class -> probability), which the IPU cannot stream, and classifiers with string
labels give string tensors, which it has no type for. When the only part of a model the
IPU cannot hold is such a tail of ``ai.onnx.ml`` ops (nodes whose sequences, maps or
strings feed only the graph outputs), the compiler cuts it off: the IPU computes the rest,
the tail's tensor inputs become outputs of the compiled model (a graph input the tail
reads passes through an ``Identity``, as ``<name>__to_host``), and the tail is a small
ONNX model of its own that the host runs with onnxruntime on each result
(``host_runtime.runner``), as onnxruntime computes it. In an fp16 model the tail still
computes in fp32 (ai.onnx.ml ops take no fp16): its fp16 inputs are cast back. The executable carries it in its attributes (``ipu_emulator.host_tail``).
"""

from __future__ import annotations

import logging
from typing import TypeVar

import onnx
from onnx import helper

from ipu_emulator import host_tail
from ipu_emulator.compiler._onnx import DTYPE_TO_ONNX
from ipu_emulator.errors import CompileError

__all__ = ["split_tail", "finish_tail", "tail_attributes"]

_log = logging.getLogger(__name__)

ML_DOMAIN = "ai.onnx.ml"
_M = TypeVar("_M", onnx.NodeProto, onnx.ValueInfoProto, onnx.TensorProto)


def _on_device(tp: onnx.TypeProto | None) -> bool:
    """A value the IPU can hold: a tensor of a type other than string."""
    return tp is not None and tp.WhichOneof("value") == "tensor_type" and \
        tp.tensor_type.elem_type != onnx.TensorProto.STRING


def _tail_nodes(g: onnx.GraphProto, types: dict[str, onnx.TypeProto], wanted: list[str]
                ) -> set[int]:
    """Indices of the nodes that make the values ``wanted``, back through every value
    the IPU cannot hold."""
    producer = {o: k for k, node in enumerate(g.node) for o in node.output if o}
    tail: set[int] = set()
    stack = [producer[n] for n in wanted if n in producer]
    while stack:
        k = stack.pop()
        if k in tail:
            continue
        tail.add(k)
        for name in g.node[k].input:
            if name and name in producer and not _on_device(types.get(name)):
                stack.append(producer[name])
    return tail


def split_tail(model: onnx.ModelProto, label: str) -> onnx.ModelProto | None:
    """Cut ``model``'s non-tensor tail off (in place) and return it as a model of its own;
    None when every graph output is a tensor the IPU can hold. A model whose non-tensor
    values also feed the tensor part is left alone (refused later by name). A graph
    input the tail reads reaches it through an ``Identity`` on the IPU."""
    g = model.graph
    wanted = [vi.name for vi in g.output if not _on_device(vi.type)]
    if not wanted:
        return None
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:
        return None
    ig = inferred.graph
    types = {vi.name: vi.type for vi in list(ig.input) + list(ig.value_info) + list(ig.output)}
    inits = {t.name: t for t in g.initializer}
    tail = _tail_nodes(g, types, wanted)
    if any(g.node[k].domain != ML_DOMAIN for k in tail):
        return None   # a tail is of ai.onnx.ml ops (ZipMap, classifiers, label encoders)
    made = {o for k in tail for o in g.node[k].output if o}
    if any(k not in tail and made.intersection(node.input) for k, node in enumerate(g.node)):
        return None   # the tensor part reads the tail: not a tail
    nodes = [_copy(g.node[k]) for k in sorted(tail)]
    inputs = {vi.name for vi in g.input}
    boundary: list[str] = []
    passed: list[onnx.NodeProto] = []
    for node in nodes:
        for i, name in enumerate(node.input):
            if not name or name in made or name in inits:
                continue
            if not _on_device(types.get(name)):
                return None
            if name in inputs:   # a graph input: through the IPU under a name of its own
                src, name = name, f"{name}__to_host"
                node.input[i] = name
                if name not in types:
                    passed.append(helper.make_node("Identity", [src], [name], name=name))
                    types[name] = types[src]
            if name not in boundary:
                boundary.append(name)
    host = helper.make_graph(
        nodes, f"{g.name or 'model'}_host_tail",
        [helper.make_tensor_value_info(n, types[n].tensor_type.elem_type, None)
         for n in boundary],
        [_copy(vi) for vi in g.output if vi.name in made],
        [_copy(inits[n]) for node in nodes for n in node.input if n in inits])
    tail_model = helper.make_model(host, opset_imports=list(model.opset_import))
    tail_model.ir_version = model.ir_version
    keep = [node for k, node in enumerate(g.node) if k not in tail] + passed
    del g.node[:]
    g.node.extend(keep)
    outs = [vi for vi in g.output if vi.name not in made]
    have = {vi.name for vi in outs}
    outs += [helper.make_tensor_value_info(n, types[n].tensor_type.elem_type, None)
             for n in boundary if n not in have]
    del g.output[:]
    g.output.extend(outs)
    _log.info("model %s: the non-tensor tail (%s) runs on the host after the IPU; its "
              "inputs %s are outputs of the compiled model", label,
              ", ".join(n.op_type for n in nodes), boundary)
    return tail_model


def _copy(msg: _M) -> _M:
    out = type(msg)()
    out.CopyFrom(msg)
    return out


def finish_tail(tail: onnx.ModelProto, stream_types: dict[str, str]) -> onnx.ModelProto:
    """The tail reads the compiled model's outputs as the IPU streams them: an input whose
    stream type differs (fp16 after ``--precision fp16``) is cast back to the type the tail
    was built for."""
    g = tail.graph
    casts = []
    for vi in g.input:
        dtype = stream_types.get(vi.name)
        want = vi.type.tensor_type.elem_type
        if dtype is None or DTYPE_TO_ONNX[dtype] == want:
            continue
        inner = f"{vi.name}__host"
        for node in g.node:
            node.input[:] = [inner if i == vi.name else i for i in node.input]
        casts.append(helper.make_node("Cast", [vi.name], [inner], to=want,
                                      name=f"{vi.name}__to_tail_type"))
        vi.type.tensor_type.elem_type = DTYPE_TO_ONNX[dtype]
    if casts:
        nodes = casts + list(g.node)
        del g.node[:]
        g.node.extend(nodes)
        if not any(o.domain in ("", "ai.onnx") for o in tail.opset_import):
            tail.opset_import.append(helper.make_opsetid("", 13))
    return tail


def tail_attributes(tail: onnx.ModelProto | None) -> dict[str, str]:
    """The executable attributes that carry ``tail`` (none without one)."""
    if tail is None:
        return {}
    try:
        return host_tail.encode(tail.SerializeToString())
    except ValueError as exc:
        raise CompileError(str(exc)) from None
