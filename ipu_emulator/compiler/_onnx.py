"""ONNX helpers of the compiler: loading with safe external data, types, onnxruntime probes."""

from __future__ import annotations

import contextvars
import functools
import logging
import os
import pathlib
import re
from typing import Iterator

import numpy as np
import onnx
from onnx import TensorProto

from ipu_emulator.errors import CompileError
from shm.errors import echo

_log = logging.getLogger(__name__)

# -- large external data: kept in its file, not in the model ---------------------------------
# When a model's external data adds up to ``STASH_MIN_BYTES`` or more, its initializers of
# ``STASH_TENSOR_BYTES`` or more are not loaded into the ModelProto (protobuf cannot
# serialize a model over 2 GiB, which shape inference and onnxruntime's checks do): each
# stays external data with location ``STASHED`` and a token
# under which ``_stashed`` holds a read-only memory map of its bytes. ``ort_session`` gives
# onnxruntime those maps; the back end copies them into the executable's weights section
# (``compiler._weights``); ``release_stash`` lets them go after a compilation. The maps are
# the current thread's (a context variable): compilations on other threads keep theirs.
STASH_MIN_BYTES = 1 << 30
STASH_TENSOR_BYTES = 1024
STASHED = "ipu_emulator_stash"
_stash_var: contextvars.ContextVar[dict[str, np.ndarray]] = contextvars.ContextVar("stash")


def _stashed() -> dict[str, np.ndarray]:
    try:
        return _stash_var.get()
    except LookupError:
        maps: dict[str, np.ndarray] = {}
        _stash_var.set(maps)
        return maps


def stashed(tensor: TensorProto) -> np.ndarray | None:
    """The memory map of a stashed initializer (None: its data is in the model)."""
    if tensor.data_location != TensorProto.EXTERNAL:
        return None
    info = {e.key: e.value for e in tensor.external_data}
    if info.get("location") != STASHED:
        return None
    return _stashed().get(info.get("token", ""))


def release_stash() -> None:
    """Let go of every stashed initializer's memory map (of this thread)."""
    _stashed().clear()


def _stash(tensor: TensorProto, target: str, offset: int, length: int, label: str) -> bool:
    import secrets

    dtype = ONNX_TO_DTYPE.get(tensor.data_type)
    if dtype is None or length < STASH_TENSOR_BYTES:
        return False
    from ipu_emulator.executable import numpy_dtype

    npdt = numpy_dtype(dtype).newbyteorder("<")
    shape = tuple(int(d) for d in tensor.dims)
    if int(np.prod(shape, dtype=np.int64)) * npdt.itemsize != length:
        raise CompileError(f"model {echo(label, 200)}: initializer {echo(tensor.name)} has "
                           f"{length} bytes of external data for {dtype}{list(shape)}")
    token = secrets.token_hex(8)
    _stashed()[token] = np.memmap(target, dtype=npdt, mode="r", offset=offset, shape=shape)
    del tensor.external_data[:]
    for key, value in (("location", STASHED), ("token", token), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return True

ONNX_TO_DTYPE: dict[int, str] = {
    TensorProto.FLOAT: "F32",
    TensorProto.FLOAT16: "F16",
    TensorProto.DOUBLE: "F64",
    TensorProto.INT8: "S8",
    TensorProto.UINT8: "U8",
    TensorProto.INT16: "S16",
    TensorProto.UINT16: "U16",
    TensorProto.INT32: "S32",
    TensorProto.UINT32: "U32",
    TensorProto.INT64: "S64",
    TensorProto.UINT64: "U64",
    TensorProto.BOOL: "BOOL",
}
DTYPE_TO_ONNX = {v: k for k, v in ONNX_TO_DTYPE.items()}


def dtype_of(elem_type: int, what: str) -> str:
    try:
        return ONNX_TO_DTYPE[elem_type]
    except KeyError:
        name = TensorProto.DataType.Name(elem_type) if elem_type in TensorProto.DataType.values() \
            else str(elem_type)
        raise CompileError(
            f"{what} has element type {name}, which the IPU emulator does not support; "
            f"supported: {', '.join(TensorProto.DataType.Name(t) for t in ONNX_TO_DTYPE)} "
            f"(unsupported: {name} tensors)") from None


def load_model(source: "str | os.PathLike[str] | bytes | onnx.ModelProto",
               base_dir: "str | os.PathLike[str] | None" = None
               ) -> tuple[onnx.ModelProto, pathlib.Path | None, str]:
    """Load a model and its external data (only from inside its own folder).

    Returns ``(model, folder, label)``; ``label`` names the model in messages.
    """
    if isinstance(source, onnx.ModelProto):
        model = onnx.ModelProto()
        model.CopyFrom(source)
        label = model.graph.name or "<model>"
        folder = pathlib.Path(base_dir) if base_dir is not None else None
    elif isinstance(source, (bytes, bytearray, memoryview)):
        try:
            model = onnx.load_model_from_string(bytes(source))
        except Exception as exc:
            raise CompileError(f"model bytes are not a valid ONNX model: {exc}") from None
        label = model.graph.name or "<bytes>"
        folder = pathlib.Path(base_dir) if base_dir is not None else None
    else:
        path = pathlib.Path(source)
        label = str(path)
        if not path.is_file():
            raise CompileError(f"input model {echo(str(path), 200)} does not exist or is not a file")
        try:
            model = onnx.load(str(path), load_external_data=False)
        except Exception as exc:
            raise CompileError(f"input model {echo(str(path), 200)} is not a valid ONNX model: {echo(str(exc), 300, quote=False)}") from None
        folder = path.resolve().parent if base_dir is None else pathlib.Path(base_dir)
    _load_external(model, folder, label)
    return model, folder, label


def iter_tensors(graph: onnx.GraphProto) -> Iterator[TensorProto]:
    """Every TensorProto of a graph: initializers, node attributes, sub-graphs."""
    yield from graph.initializer
    for sp in graph.sparse_initializer:
        yield sp.values
        yield sp.indices
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("g"):
                yield from iter_tensors(attr.g)
            for g in attr.graphs:
                yield from iter_tensors(g)


def _load_external(model: onnx.ModelProto, folder: pathlib.Path | None, label: str) -> None:
    from onnx.external_data_helper import load_external_data_for_tensor

    external = 0
    for t in model.graph.initializer:
        if t.data_location == TensorProto.EXTERNAL:
            info = {e.key: e.value for e in t.external_data}
            try:
                external += int(info.get("length", "0"))
            except ValueError:
                pass   # reported below
    stash = external >= STASH_MIN_BYTES
    main = len(model.graph.initializer)   # iter_tensors yields these first
    for k, tensor in enumerate(iter_tensors(model.graph)):
        if tensor.data_location != TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in tensor.external_data}
        location = info.get("location", "")
        if location == STASHED and info.get("token", "") in _stashed():
            continue   # stashed by an earlier load of this thread (poprt's Converter path)
        if folder is None:
            raise CompileError(
                f"model {echo(label, 200)}: initializer {echo(tensor.name)} refers to external data "
                f"{echo(location, 200)} but the model was not loaded from a folder")
        if not location or os.path.isabs(location) or location.startswith(("/", "\\")):
            raise CompileError(
                f"model {echo(label, 200)}: initializer {echo(tensor.name)} refers to external data "
                f"{echo(location, 200)} outside the model's folder {echo(str(folder), 200)}; refused")
        root = os.path.realpath(folder)
        target = os.path.realpath(os.path.join(root, location))
        if os.path.commonpath([root, target]) != root:
            raise CompileError(
                f"model {echo(label, 200)}: initializer {echo(tensor.name)} refers to external data "
                f"{echo(location, 200)} outside the model's folder {echo(root, 200)}; refused")
        if not os.path.isfile(target):
            raise CompileError(f"model {echo(label, 200)}: external data file {echo(location, 200)} of initializer "
                               f"{echo(tensor.name)} does not exist in {echo(root, 200)}")
        size = os.path.getsize(target)
        try:
            offset = int(info.get("offset", "0"))
            length = int(info["length"]) if "length" in info else size - offset
        except ValueError:
            raise CompileError(f"model {echo(label, 200)}: initializer {echo(tensor.name)} has a non-integer "
                               "external data offset or length") from None
        if offset < 0 or length < 0 or offset + length > size:
            raise CompileError(
                f"model {echo(label, 200)}: initializer {echo(tensor.name)} wants bytes [{offset}, "
                f"{offset + length}) of {echo(location, 200)}, which has {size} bytes")
        if stash and k < main and _stash(tensor, target, offset, length, label):
            continue
        try:
            load_external_data_for_tensor(tensor, root)
        except Exception as exc:
            raise CompileError(f"model {echo(label, 200)}: cannot load external data of initializer "
                               f"{echo(tensor.name)}: {echo(str(exc), 300, quote=False)}") from None
        tensor.data_location = TensorProto.DEFAULT
        del tensor.external_data[:]


@functools.lru_cache(maxsize=1)
def ort_max_ir_version() -> int:
    """The highest ONNX IR version the installed onnxruntime loads."""
    import onnxruntime as ort
    from onnx import helper

    g = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = onnx.IR_VERSION
    so = ort.SessionOptions()
    so.log_severity_level = 4
    try:
        ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
        return onnx.IR_VERSION
    except Exception as exc:
        found = re.search(r"max supported IR version: (\d+)", str(exc))
        return int(found.group(1)) if found else 8


def ort_session(model: onnx.ModelProto, optimize: bool = False) -> object:
    """An onnxruntime session for a model (raises onnxruntime's exception)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 4
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    names, values = [], []
    for t in model.graph.initializer:
        arr = stashed(t)
        if arr is not None:
            names.append(t.name)
            values.append(ort.OrtValue.ortvalue_from_numpy(arr))
    if names:
        so.add_external_initializers(names, values)
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


_MISSING_KERNEL = re.compile(r"Could not find an implementation for (\w+)\((\d+)\) node with name '([^']*)'")
# a contrib op whose schema refuses fp16 (DynamicQuantizeLSTM): onnxruntime's load error
_NO_FP16_TYPE = re.compile(r"Type 'tensor\(float16\)' of (?:input|output) parameter \([^)]*\) "
                           r"of operator \((\w+)\)")


def missing_kernel(exc: BaseException) -> str | None:
    """The op type onnxruntime has no kernel (or no fp16 type) for, if that is what
    ``exc`` says."""
    found = _MISSING_KERNEL.search(str(exc)) or _NO_FP16_TYPE.search(str(exc))
    return found.group(1) if found else None
