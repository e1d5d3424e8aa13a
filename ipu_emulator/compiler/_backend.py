"""The compiler back end: prepared ONNX graphs -> an ``Executable`` and its anchors.

Program layout (PopEF program flow load=[0], main=[1], save=[2])::

    0 load   StreamIn(w, w) for every weight exported as tensor data
    1 main   Repeat(device_iterations,
                 [StreamIn inputs..., Execute(graph), StreamOut outputs...])      one model
             Repeat(device_iterations,
                 [StreamIn(index), Switch(index, [branch graph0, branch graph1, ...])])  fused
    2 save   StreamOut(w, w + "_saved") for every weight when ``save_weights``

A fused executable names its tensors and anchors ``graph<i>/<onnx name>`` and
selects a sub-graph by the ``index`` input: S32, shape [1], one value per
device iteration. Only the chosen branch's streams are read and written.
"""

from __future__ import annotations

import logging
import os
from typing import Sequence

import onnx

import ipu_emulator
from ipu_emulator.compiler._onnx import DTYPE_TO_ONNX, dtype_of, load_model, release_stash
from ipu_emulator.compiler._prepare import Prepared, prepare
from ipu_emulator.compiler._tail import tail_attributes
from ipu_emulator.compiler._parts import compile_sharded
from ipu_emulator.compiler._sharding import annotate_one_ipu
from ipu_emulator.compiler._weights import externalize, refuse_stashed
from ipu_emulator.compiler._types import (
    INDEX_DTYPE, INDEX_NAME, INDEX_SHAPE, LOAD_PROGRAM, MAIN_PROGRAM, SAVE_PROGRAM, TARGETS,
    AnchorDesc, CompileOptions, CompileResult, ModelSpec, Target, check_fit, count, ipu_memory)
from ipu_emulator.errors import CompileError
from ipu_emulator.executable import (
    Execute, Executable, Graph, Instruction, Program, Repeat, StreamIn, StreamOut, StreamSpec,
    Switch, TensorSig, numpy_dtype, plan_memory)
from shm.errors import echo

__all__ = [
    "Target",
    "TARGETS",
    "ModelSpec",
    "CompileOptions",
    "AnchorDesc",
    "CompileResult",
    "compile_onnx",
    "LOAD_PROGRAM",
    "MAIN_PROGRAM",
    "SAVE_PROGRAM",
    "INDEX_NAME",
]

_log = logging.getLogger(__name__)

def compile_onnx(models: "ModelSpec | Sequence[ModelSpec]",
                 options: CompileOptions | None = None) -> CompileResult:
    """Compile one model (or fuse several) into an executable for the emulated IPU."""
    opts = options or CompileOptions()
    specs = [models] if isinstance(models, ModelSpec) else list(models)
    if not specs:
        raise CompileError("no model to compile")
    target = TARGETS.get(opts.ipu_version)
    if target is None:
        raise CompileError(f"ipu_version {echo(opts.ipu_version)} is not supported; expected one of "
                           f"{', '.join(TARGETS)}")
    if not 1 <= int(opts.device_iterations) <= (1 << 31) - 1:
        raise CompileError(f"batches_per_step must be a positive integer, got "
                           f"{opts.device_iterations}")
    if not 1 <= int(opts.num_ipus) <= 64:
        raise CompileError(f"num_ipus must be in [1, 64], got {opts.num_ipus}")
    if not opts.name or len(opts.name.encode()) > 128:
        raise CompileError(f"executable name must be 1..128 bytes, got {echo(opts.name)}")
    fused = opts.fuse if opts.fuse is not None else len(specs) > 1
    if not fused and len(specs) > 1:
        raise CompileError(f"{len(specs)} models given without fusion; compile one model or fuse")

    sharded = bool(opts.sharding_info or opts.pipelining_info or opts.enable_pipelining)
    if sharded and len(specs) > 1:
        raise CompileError(f"manual sharding applies to one model; {len(specs)} models were "
                           "given (fused models are not sharded)")
    try:
        return _compile(specs, opts, target, fused, sharded)
    finally:
        release_stash()   # large external data read in place (compiler._onnx)


def _compile(specs: list[ModelSpec], opts: CompileOptions, target: Target, fused: bool,
             sharded: bool) -> CompileResult:
    prepared: list[Prepared] = []
    for spec in specs:
        model, _folder, label = load_model(spec.source, spec.base_dir)
        refuse_stashed(model, label, spec.precision, opts, fused or sharded)
        shapes = {k: [int(d) for d in v] for k, v in (spec.input_shapes or {}).items()}
        prepared.append(prepare(model, label, shapes, spec.precision,
                                opts.weights_as_tensor_data))
    tails = [p.label for p in prepared if p.host_tail is not None]
    if tails and (fused or sharded):
        raise CompileError(
            f"model {echo(tails[0], 200)} ends in a non-tensor tail (computed on the host); "
            f"that is supported for one model on its own, not {'fused' if fused else 'sharded'} "
            "(unsupported: non-tensor outputs of fused or sharded models)")
    if sharded and opts.num_ipus > 1:
        result = compile_sharded(prepared[0], opts, target, ipu_memory(opts, target))
    else:
        result = _assemble(prepared, opts, target, fused)
        if sharded:   # one IPU: one program set; the placement is still checked and recorded
            annotate_one_ipu(result, prepared[0], opts)
    for p in prepared:
        result.fp16_error.update(p.fp16_error)
    return result


class _Anchors:
    """The executable's streams, the anchors the host sees and the device tensors they
    need, as the models are added."""

    def __init__(self) -> None:
        self.tensor_specs: list[tuple[str, str, tuple[int, ...]]] = []
        self.streams: dict[str, StreamSpec] = {}
        self.anchors: list[AnchorDesc] = []

    def add(self, name: str, direction: str, dtype: str, shape: tuple[int, ...],
            program: int, kind: str, sub: str | None, data: bytes | None = None,
            tensor: bool = True) -> None:
        """Anchor ``name`` of stream ``name`` (and, with ``tensor``, its device tensor)."""
        if tensor:
            self.tensor_specs.append((name, dtype, shape))
        if name in self.streams:
            raise CompileError(f"anchor name {echo(name)} is used twice; rename the tensor")
        self.streams[name] = StreamSpec(direction, dtype, list(shape),
                                        numpy_dtype(dtype).itemsize * count(shape))
        self.anchors.append(AnchorDesc(name, name, direction, dtype, shape, (program,), kind,
                                       sub, data))


def _branch(a: _Anchors, gi: int, p: Prepared, fused: bool, save_weights: bool,
            load: list[Instruction], save: list[Instruction]
            ) -> tuple[tuple[Instruction, ...], list[str]]:
    """Model ``gi``'s Main body (its inputs streamed in, its graph run, its outputs
    streamed out; its weights added to ``load`` and ``save``) and the anchors it owns."""
    prefix = f"graph{gi}/" if fused else ""
    sub = f"graph{gi}" if fused else None
    members: list[str] = []
    in_pairs: list[tuple[str, str]] = []
    out_pairs: list[tuple[str, str]] = []
    body: list[Instruction] = []
    for w, data in p.weights:
        name = prefix + w.name
        a.add(name, "in", w.dtype, w.shape, LOAD_PROGRAM, "weight", sub, data)
        load.append(StreamIn(name, name))
        in_pairs.append((w.name, name))
        members.append(name)
        if save_weights:
            handle = name + "_saved"
            a.add(handle, "out", w.dtype, w.shape, SAVE_PROGRAM, "saved", sub, tensor=False)
            save.append(StreamOut(name, handle))
            members.append(handle)
    for v in p.inputs:
        name = prefix + v.name
        a.add(name, "in", v.dtype, v.shape, MAIN_PROGRAM, "input", sub)
        body.append(StreamIn(name, name))
        in_pairs.append((v.name, name))
        members.append(name)
    outs: list[Instruction] = []
    for v in p.outputs:
        name = prefix + v.name
        a.add(name, "out", v.dtype, v.shape, MAIN_PROGRAM, "output", sub)
        outs.append(StreamOut(name, name))
        out_pairs.append((v.name, name))
        members.append(name)
    body.append(Execute(gi, tuple(in_pairs), tuple(out_pairs)))
    body.extend(outs)
    return tuple(body), members


def _assemble(prepared: list[Prepared], opts: CompileOptions, target: Target,
              fused: bool) -> CompileResult:
    """One program set on one IPU (or several, replicated): each model a branch of Main
    (fused: the index input chooses the branch), its weights read by Load."""
    a = _Anchors()
    graphs: list[Graph] = []
    load: list[Instruction] = []
    save: list[Instruction] = []
    branches: list[tuple[Instruction, ...]] = []
    subgraphs: dict[str, list[str]] = {}
    weights = bytearray()   # the executable's weights section (compiler._weights)
    if fused:
        a.add(INDEX_NAME, "in", INDEX_DTYPE, INDEX_SHAPE, MAIN_PROGRAM, "index", None)
    for gi, p in enumerate(prepared):
        body, members = _branch(a, gi, p, fused, opts.save_weights, load, save)
        branches.append(body)
        graphs.append(_graph(p, weights))
        if fused:
            subgraphs[f"graph{gi}"] = members
    anchors, streams = a.anchors, a.streams
    tensor_specs = a.tensor_specs

    order = {"index": 0, "input": 1, "output": 2, "weight": 3, "saved": 4}
    anchors.sort(key=lambda a: order[a.kind])
    tensors, memory_bytes = plan_memory(tensor_specs)
    constants = sum(p.constant_bytes for p in prepared)
    activations = max(p.peak_activation_bytes for p in prepared)
    required = memory_bytes + constants + activations
    check_fit(prepared, opts, target, memory_bytes, constants, activations, required)

    if fused:
        main: tuple[Instruction, ...] = (Repeat(opts.device_iterations, (
            StreamIn(INDEX_NAME, INDEX_NAME), Switch(INDEX_NAME, tuple(branches)))),)
    else:
        main = (Repeat(opts.device_iterations, branches[0]),)
    exe = Executable(
        name=opts.name,
        programs=[Program("load", tuple(load)), Program("main", main), Program("save", tuple(save))],
        graphs=graphs, tensors=tensors, streams=streams, memory_bytes=memory_bytes,
        required_bytes=required, ipu_version=target.version, num_ipus=opts.num_ipus,
        device_iterations=opts.device_iterations, package_hash=ipu_emulator.package_hash(),
        weights=memoryview(weights), attributes={"models": ",".join(os.path.basename(p.label) for p in prepared),
                    "fused": "1" if fused else "0",
                    "constant_bytes": str(constants), "activation_bytes": str(activations),
                    **tail_attributes(prepared[0].host_tail if not fused else None)})
    exe.validate()
    from ipu_emulator.compiler._fusion import fuse_models
    output_model = fuse_models([p.model for p in prepared], INDEX_NAME,
                               DTYPE_TO_ONNX[INDEX_DTYPE], list(INDEX_SHAPE)) if fused \
        else prepared[0].model
    return CompileResult(
        executable=exe, anchors=anchors,
        program_flow={"load": [LOAD_PROGRAM], "main": [MAIN_PROGRAM], "save": [SAVE_PROGRAM]},
        output_model=output_model, models=[p.model for p in prepared], subgraphs=subgraphs,
        fused=fused, host_tail=None if fused else prepared[0].host_tail)


def _graph(p: Prepared, weights: bytearray) -> Graph:
    def sig(vi: onnx.ValueInfoProto) -> TensorSig:
        tt = vi.type.tensor_type
        return TensorSig(vi.name, dtype_of(tt.elem_type, f"model {echo(p.label, 200)}: {echo(vi.name)}"),
                         tuple(int(d.dim_value) for d in tt.shape.dim))
    g = p.device_model.graph
    model, external = externalize(p.device_model, weights)
    return Graph(tuple(sig(vi) for vi in g.input), tuple(sig(vi) for vi in g.output),
                 model, external)
