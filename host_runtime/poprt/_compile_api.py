"""PopRT's ``Compiler`` and ``Executable``: ONNX model -> an in-memory PopEF model.

``Compiler.compile(model, outputs, options)`` returns an ``Executable``. It *is* a
``host_runtime.popef.Model`` (a subclass), so every runner takes it as it is:
``poprt.runtime.Runner(exe)``, ``ModelRunner(exe)``, ``Session(exe)``;
``exe.model`` gives the same object typed as a ``popef.Model``, ``exe.to_bytes()``
the PopEF file's bytes, ``exe.save(path)`` writes them. ``compile_and_export``
writes the PopEF file, the bytes the ``poprt`` command writes for the same model
and options.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pathlib
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Sequence

import onnx
from onnx import helper

from host_runtime import popef
from host_runtime.errors import BadRequestError
from host_runtime.poprt._errors import NotSupportedError, PoplarRequiredError
from host_runtime.poprt._onnx_util import prune
from host_runtime.poprt._options import CompilerOptions
from host_runtime.poprt._sharding_props import read_sharding
from host_runtime.poprt._writing import write_file, write_popef

if TYPE_CHECKING:  # pragma: no cover
    from ipu_emulator.compiler import CompileResult, ModelSpec

__all__ = ["Compiler", "Executable", "load_onnx", "split_fused",
           "compile_result", "popef_bytes", "popef_extras"]

_log = logging.getLogger("poprt.compiler")

class Executable(popef.Model):
    """A compiled model: a ``popef.Model`` that runners accept directly.

    ``Executable(popef_path)`` also loads a PopEF file (a path, a list of paths, the
    file's bytes, or a ``popef.Model``)."""

    def __init__(self, popef_path: "str | os.PathLike[str] | list[str] | bytes | popef.Model",
                 *, compile_result: "CompileResult | None" = None) -> None:
        data: bytes | None = None
        if isinstance(popef_path, (bytes, bytearray, memoryview)):
            data = bytes(popef_path)
            reader = popef.Reader()
            reader.parseStream(data, name="<executable>")
            model = popef.ModelBuilder(reader).createModel()
        elif isinstance(popef_path, popef.Model):
            model = popef_path
        elif isinstance(popef_path, (str, os.PathLike, list, tuple)):
            paths = [popef_path] if isinstance(popef_path, (str, os.PathLike)) else list(popef_path)
            model = popef.load_model([os.fspath(p) for p in paths])
        else:
            raise BadRequestError("Executable expects a PopEF path, a list of paths, PopEF bytes "
                                  f"or a popef.Model, got {type(popef_path).__name__}")
        super().__init__(metadata=model.metadata, executable=model.executable,
                         tensors=list(model.tensors), feeds=list(model.feeds),
                         opaques=list(model.opaques))
        self._bytes = data
        self.compile_result = compile_result

    @property
    def model(self) -> popef.Model:
        """This executable as a ``popef.Model`` (itself)."""
        return self

    def to_bytes(self) -> bytes:
        """The PopEF file's bytes."""
        if self._bytes is None:
            buf = io.BytesIO()
            with popef.Writer(buf) as w:
                w.writeModel(self)
            self._bytes = buf.getvalue()
        return self._bytes

    def save(self, path: "str | os.PathLike[str]") -> None:
        """Write the PopEF file to ``path`` (replaced whole)."""
        data = self.to_bytes()
        write_file(pathlib.Path(path), lambda f: _put(f, data))

    def __repr__(self) -> str:
        md = self.metadata
        return (f"Executable({md.executable()!r}, {md.numIpus()} x {md.ipuVersion()}, "
                f"{len(md.anchors())} anchors)")


def _put(f: Any, data: bytes) -> None:
    f.write(data)


def load_onnx(model: Any) -> onnx.ModelProto:
    """A ModelProto from a ModelProto, serialized bytes or a path."""
    if isinstance(model, onnx.ModelProto):
        out = onnx.ModelProto()
        out.CopyFrom(model)
        return out
    if isinstance(model, (bytes, bytearray, memoryview)):
        try:
            return onnx.load_model_from_string(bytes(model))
        except Exception as exc:
            raise BadRequestError(f"the model bytes are not a serialized ONNX model: {exc}"
                                  ) from None
    if isinstance(model, (str, os.PathLike)):
        if not os.path.isfile(model):
            raise BadRequestError(f"model {os.fspath(model)!r} is not an ONNX file (give a "
                                  "ModelProto, its serialized bytes or a path)")
        try:   # (onnx refuses external data outside the model's folder, among others)
            return onnx.load(os.fspath(model))
        except Exception as exc:
            raise BadRequestError(f"model {os.fspath(model)!r} cannot be loaded as ONNX: "
                                  f"{exc}") from None
    raise BadRequestError(f"expected an onnx.ModelProto, its serialized bytes or a path, got "
                          f"{type(model).__name__}")


def _select_outputs(model: onnx.ModelProto, outputs: Sequence[str] | None) -> onnx.ModelProto:
    if outputs is None:
        return model
    if isinstance(outputs, str) or not all(isinstance(o, str) for o in outputs):
        raise BadRequestError(f"outputs must be a list of tensor names, got {outputs!r}")
    names = list(dict.fromkeys(outputs))
    if not names or names == [o.name for o in model.graph.output]:
        return model
    g = model.graph
    have = {o.name: o for o in g.output}
    known = {o for n in g.node for o in n.output} | {vi.name for vi in g.input}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise BadRequestError(f"outputs {unknown} are not tensors of the model; its outputs "
                              f"are {list(have)}")
    infos = {vi.name: vi for vi in g.value_info}
    new = [have.get(n) or infos.get(n) or onnx.ValueInfoProto(name=n) for n in names]
    del g.output[:]
    g.output.extend(new)
    return prune(model)


def compile_result(model: Any, outputs: Sequence[str] | None,
                   options: CompilerOptions | None, *, save_weights: bool = False,
                   base_dir: "str | os.PathLike[str] | None" = None) -> "CompileResult":
    """Compile with the emulator's compiler as ``options`` say (the keywords: what only the
    ``poprt`` command sets: ``--save_weights``, the model's folder)."""
    from ipu_emulator.compiler import TARGETS, CompileOptions, ModelSpec, compile_onnx
    from ipu_emulator.system import load_system_config

    opts = options if options is not None else CompilerOptions()
    if not isinstance(opts, CompilerOptions):
        raise BadRequestError(f"options must be a CompilerOptions, got {type(opts).__name__}")
    proto = _select_outputs(load_onnx(model), outputs)
    mode = opts.virtual_graph_mode
    if mode in ("auto", "execution_phase"):
        raise NotSupportedError(f"virtual_graph_mode {mode!r} is not supported by the IPU "
                                "emulator (it needs PopART's automatic placement); shard with "
                                "poprt.converter.Sharder and virtual_graph_mode 'manual'")
    shard, stages = read_sharding(proto)
    if (shard or stages) and mode != "manual":
        _log.warning("the model carries sharding maps but virtual_graph_mode is %r: compiled "
                     "without sharding (set virtual_graph_mode = 'manual')", mode)
        shard, stages = {}, {}
    machine = load_system_config()
    version = opts.ipu_version or machine.ipu_version
    target = TARGETS[version]
    if version == machine.ipu_version:   # the emulated IPUs this machine has (their knobs)
        target = replace(target, tiles=machine.tiles_per_ipu,
                         bytes_per_tile=machine.memory_per_tile)
    if not 0 <= opts.num_io_tiles < target.tiles:
        raise BadRequestError(f"num_io_tiles must be in [0, {target.tiles}), got "
                              f"{opts.num_io_tiles}")
    memory = (target.tiles - opts.num_io_tiles) * target.bytes_per_tile
    specs: list[ModelSpec]
    if opts.enable_model_fusion:
        specs = [ModelSpec(m, base_dir=base_dir) for m in split_fused(proto)]
    else:
        specs = [ModelSpec(proto, base_dir=base_dir)]
    sharded = bool(shard or stages or opts.enable_pipelining)
    copts = CompileOptions(ipu_version=version, device_iterations=opts.batches_per_step,
                           weights_as_tensor_data=not opts.constant_weights,
                           num_ipus=opts.num_ipus, fuse=opts.enable_model_fusion,
                           sharding_info=shard or None, pipelining_info=stages or None,
                           enable_pipelining=opts.enable_pipelining, ipu_memory=memory,
                           save_weights=save_weights)
    if sharded and len(specs) == 1:
        copts.fuse = False
    progress = opts.progress
    if progress is not None:
        progress(0, 100)
    result = compile_onnx(specs, copts)
    if progress is not None:
        progress(100, 100)
    if opts.serialize_ir:
        if not opts.serialized_ir_dest:
            raise BadRequestError("serialize_ir is set but serialized_ir_dest is empty")
        model_out = result.output_model   # replaced whole, never written through a link
        write_file(pathlib.Path(opts.serialized_ir_dest), lambda f: onnx.save(model_out, f))
    return result


def popef_extras(options: CompilerOptions | None) -> tuple[dict[str, str], dict[str, bytes]]:
    """What the options put in the PopEF file besides the program: engine options (the
    user's and the performance options set) and opaque blobs."""
    opts = options if options is not None else CompilerOptions()
    engine = {str(k): str(v) for k, v in opts.engine_options.items()}
    engine.update(opts.tuning())
    blobs = {str(k): (v if isinstance(v, bytes) else str(v).encode())
             for k, v in opts.opaque_blobs.items()}
    return engine, blobs


def popef_bytes(result: "CompileResult", options: CompilerOptions | None) -> bytes:
    """The PopEF file of a compile result, with the options' engine options and opaque
    blobs."""
    engine, blobs = popef_extras(options)
    buf = io.BytesIO()
    write_popef(result, buf, engine_options=engine, opaques=blobs)
    return buf.getvalue()


class Compiler:
    """Compile ONNX models for the emulated IPU (PopRT's ``poprt.compiler.Compiler``)."""

    @staticmethod
    def compile(model: Any, outputs: Sequence[str] | None = None,
                options: CompilerOptions | None = None) -> Executable:
        """Compile ``model`` (a ModelProto, its serialized bytes or a path) with the tensors
        ``outputs`` as outputs (None: the graph's outputs). Raises
        ``ipu_emulator.errors.CompileError`` when the model is refused."""
        result = compile_result(model, outputs, options)
        return Executable(popef_bytes(result, options), compile_result=result)

    @staticmethod
    def compile_and_export(model: Any, outputs: Sequence[str] | None, filename: str,
                           options: CompilerOptions | None = None) -> None:
        """Compile and write the PopEF file ``filename``."""
        if not isinstance(filename, (str, os.PathLike)) or not os.fspath(filename):
            raise BadRequestError(f"filename must be a PopEF file path, got {filename!r}")
        Compiler.compile(model, outputs, options).save(filename)

    @staticmethod
    def compile_and_get_summary_report(model: Any, outputs: Sequence[str] | None,
                                       options: CompilerOptions | None = None,
                                       reset_profile: bool = True) -> str:
        """Poplar's compilation summary report: refused, it needs Poplar's profiler."""
        raise PoplarRequiredError("compile_and_get_summary_report needs Poplar's profiler, "
                                  "which the IPU emulator does not have; Compiler.compile "
                                  "gives the executable (its memory: "
                                  "executable.compile_result.executable.required_bytes)")


def _strip(prefix: str, name: str) -> str:
    return name[len(prefix):] if name.startswith(prefix) else name


def split_fused(model: onnx.ModelProto) -> list[onnx.ModelProto]:
    """The models of a fused model (MFConverter), each with its own names."""
    g = model.graph
    models = []
    k = 0
    while True:
        prefix = f"graph{k}/"
        nodes = [n for n in g.node if n.output and n.output[0].startswith(prefix)]
        ins = [vi for vi in g.input if vi.name.startswith(prefix)]
        if not nodes and not ins:
            break
        sub = helper.make_graph([], f"graph{k}", [], [])
        for n in nodes:
            node = sub.node.add()
            node.CopyFrom(n)
            node.name = _strip(prefix, node.name)
            node.input[:] = [_strip(prefix, i) for i in node.input]
            node.output[:] = [_strip(prefix, o) for o in node.output]
        for src, dst in ((g.input, sub.input), (g.output, sub.output),
                         (g.value_info, sub.value_info)):
            for vi in src:
                if vi.name.startswith(prefix):
                    v = dst.add()
                    v.CopyFrom(vi)
                    v.name = _strip(prefix, v.name)
        for t in g.initializer:
            if t.name.startswith(prefix):
                c = sub.initializer.add()
                c.CopyFrom(t)
                c.name = _strip(prefix, c.name)
        sub_model = helper.make_model(sub, opset_imports=list(model.opset_import))
        sub_model.ir_version = model.ir_version
        models.append(sub_model)
        k += 1
    if len(models) < 2:
        raise BadRequestError("enable_model_fusion is set but the model is not a fused model "
                              "(poprt.converter.MFConverter makes one)")
    return models
