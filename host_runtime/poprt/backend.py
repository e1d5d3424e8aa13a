"""An ONNX backend over the emulated IPU (``onnx.backend.base.Backend``).

PopRT ships ``poprt.backend``; this is its counterpart, so that ONNX's own
conformance harness runs against the emulator the way it runs against
onnxruntime::

    import onnx.backend.test
    from host_runtime.poprt import backend

    globals().update(onnx.backend.test.BackendTest(backend, __name__).test_cases)

``prepare(model)`` compiles the model with the project's compiler
(``ipu_emulator.compiler``) into a PopEF model, held in memory, and loads it
on an emulated IPU through ``ModelRunner``; ``BackendRep.run(inputs)``
executes it and returns the outputs in graph-output order.

Start-up cost: every ``BackendRep`` of a process loads onto the same attached
IPU (one IPU process, kept between models: ``ModelRunnerConfig.
replica_to_device``). One model's runner holds the IPU at a time: running
another rep unloads it (its compiled PopEF stays in memory and reloads in a
few ms), and runs of the process are serialised. A rep's executable is
unloaded when the rep is closed or collected; ``release_device()`` detaches
the IPU (also done at exit).

Options of ``prepare`` (keyword arguments):

- ``input_shapes``: ``{"X": [1, 3, 224, 224]}`` fixes dynamic input dims. An
  input whose shape is still dynamic is compiled at its first ``run`` for the
  shapes given then (and once more for every new shape).
- ``precision``: ``"fp32"`` (default) or ``"fp16"``; an fp16 rep takes and
  returns the model's own dtypes (it casts at its boundary).
- ``ipu_version``: ``"ipu2"`` or ``"ipu21"`` (default: the machine's).

A model the IPU cannot run is refused by ``prepare`` (or the first ``run`` of
a dynamic model) with ``ipu_emulator.errors.CompileError`` naming why. An
output shape the compiler took from the model's declaration (shape inference
could not see it) is a contract: a run that computes another shape fails
with ``DeviceExecutionError``, and the next run loads the model afresh.
"""

from __future__ import annotations

import atexit
import io
import logging
import os
import threading
from collections import namedtuple
from typing import Any, Optional, Sequence

import numpy as np
import onnx
from onnx.backend.base import Backend, BackendRep, Device, DeviceType

__all__ = ["IpuBackend", "IpuBackendRep", "prepare", "run_model", "run_node", "supports_device",
           "holds_device", "release_device"]

_log = logging.getLogger(__name__)

_ONNX_NUMPY = {
    onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.FLOAT16: np.float16,
    onnx.TensorProto.DOUBLE: np.float64, onnx.TensorProto.INT8: np.int8,
    onnx.TensorProto.UINT8: np.uint8, onnx.TensorProto.INT16: np.int16,
    onnx.TensorProto.UINT16: np.uint16, onnx.TensorProto.INT32: np.int32,
    onnx.TensorProto.UINT32: np.uint32, onnx.TensorProto.INT64: np.int64,
    onnx.TensorProto.UINT64: np.uint64, onnx.TensorProto.BOOL: np.bool_,
}


class _SharedDevice:
    """One attached emulated IPU that every rep of this process loads onto.

    A ModelRunner keeps its session's main loop running on the IPU, so one runner
    holds the IPU at a time: ``run`` of another compiled model closes the holder's
    runner (its compiled PopEF model stays in memory, and is loaded again, in a few
    ms, when it runs next). Runs are serialised by the lock."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._device: Any = None
        self._holder: Optional["_Compiled"] = None
        self._registered = False

    def get(self) -> Any:
        from host_runtime.devices import DeviceManager

        with self.lock:
            dev = self._device
            if dev is not None and (not dev.isAttached() or dev.link.lost is not None):
                _log.warning("the backend's IPU %s was lost; attaching another", dev.describe())
                self._close_locked()
                dev = None
            if dev is None:
                dev = DeviceManager().getDevice(1)
                self._device = dev
                if not self._registered:
                    atexit.register(self.release)
                    self._registered = True
            return dev

    def runner_of(self, compiled: "_Compiled") -> Any:
        """``compiled``'s ModelRunner, loaded on the IPU (the caller holds ``lock``)."""
        device = self.get()
        holder = self._holder
        if holder is not None and holder is not compiled:
            self._holder = None
            holder.unload()
        if compiled.runner is None:
            compiled.load(device)
        self._holder = compiled
        return compiled.runner

    def forget(self, compiled: "_Compiled") -> None:
        with self.lock:
            if self._holder is compiled:
                self._holder = None
            compiled.unload()

    def held(self) -> bool:
        return self._device is not None

    def release(self) -> None:
        with self.lock:
            self._close_locked()

    def _close_locked(self) -> None:
        holder, self._holder = self._holder, None
        if holder is not None:
            holder.unload()
        dev, self._device = self._device, None
        if dev is not None:
            try:
                dev.close()
            except Exception as exc:  # noqa: BLE001 - best effort at release
                _log.warning("closing the backend's IPU failed: %s", exc)


_shared = _SharedDevice()


def _after_fork_in_child() -> None:
    """A forked child attaches an IPU of its own when it runs a model: the parent's IPU and
    the runner loaded on it stay the parent's (dropped here, they only forget this
    process's copy; see host_runtime._fork), and a lock a thread of the parent held at
    the fork is not held here."""
    _shared.lock = threading.RLock()
    holder, _shared._holder = _shared._holder, None
    if holder is not None:
        holder.runner = None
    _shared._device = None


os.register_at_fork(after_in_child=_after_fork_in_child)


def holds_device() -> bool:
    """Whether the backend keeps an IPU attached now."""
    return _shared.held()


def release_device() -> None:
    """Detach the IPU the backend keeps between models (reps still open stop working)."""
    _shared.release()


def _graph_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    inits = {t.name for t in model.graph.initializer}
    return [vi for vi in model.graph.input if vi.name not in inits]


def _static_dims(vi: onnx.ValueInfoProto) -> Optional[list[int]]:
    tt = vi.type.tensor_type
    if vi.type.WhichOneof("value") != "tensor_type" or not tt.HasField("shape"):
        return None
    dims = []
    for d in tt.shape.dim:
        if not d.HasField("dim_value"):
            return None
        dims.append(int(d.dim_value))
    return dims


class _Compiled:
    """One compiled shape signature of a rep: its PopEF model, and its ModelRunner while
    it holds the IPU."""

    def __init__(self, model: onnx.ModelProto, shapes: dict[str, list[int]], precision: str,
                 ipu_version: Optional[str], label: str) -> None:
        from host_runtime.popef import ModelBuilder, Reader
        from host_runtime.poprt.compiler import write_popef
        from ipu_emulator.compiler import CompileOptions, ModelSpec, compile_onnx
        from ipu_emulator.executable import numpy_dtype

        version = ipu_version or f"ipu{_shared.get().ipuVersion()}"
        result = compile_onnx(ModelSpec(model, shapes, precision),
                              CompileOptions(name=label[:128] or "model", ipu_version=version))
        buf = io.BytesIO()
        write_popef(result, buf)
        reader = Reader()
        reader.parseStream(buf.getvalue(), name=f"<{label}>")
        self.popef_model = ModelBuilder(reader).createModel()
        self.runner: Any = None
        self.inputs = {a.name: (np.dtype(numpy_dtype(a.dtype)), tuple(a.shape))
                       for a in result.anchors if a.kind == "input"}

    def load(self, device: Any) -> None:
        from host_runtime.runner.config import ModelRunnerConfig
        from host_runtime.runner import ModelRunner

        cfg = ModelRunnerConfig()
        cfg.replica_to_device = {0: device}     # the runner binds to it and leaves it attached
        self.runner = ModelRunner(self.popef_model, cfg)

    def unload(self) -> None:
        runner, self.runner = self.runner, None
        if runner is not None:
            runner.close()

    def close(self) -> None:
        _shared.forget(self)


class IpuBackendRep(BackendRep):
    """A model prepared for the emulated IPU; ``run(inputs)`` executes it."""

    def __init__(self, model: onnx.ModelProto, precision: str = "fp32",
                 input_shapes: Optional[dict[str, Sequence[int]]] = None,
                 ipu_version: Optional[str] = None) -> None:
        self._model = model
        self._precision = precision
        self._ipu_version = ipu_version
        self._label = model.graph.name or "model"
        self._fixed = {k: [int(d) for d in v] for k, v in (input_shapes or {}).items()}
        self._inputs = _graph_inputs(model)
        self._input_names = [vi.name for vi in self._inputs]
        self._outputs = [vi.name for vi in model.graph.output]
        self._out_types = {vi.name: _ONNX_NUMPY.get(vi.type.tensor_type.elem_type)
                           for vi in model.graph.output
                           if vi.type.WhichOneof("value") == "tensor_type"}
        self._compiled: dict[tuple[tuple[int, ...], ...], _Compiled] = {}
        self._closed = False
        shapes = self._static_shapes()
        if shapes is not None:          # compile now: a refusal surfaces in prepare()
            self._compile(shapes)
        else:                           # compiled at the first run; refuse what never can
            from ipu_emulator.compiler import check_interface
            check_interface(model, self._label)

    def _static_shapes(self) -> Optional[dict[str, list[int]]]:
        out: dict[str, list[int]] = {}
        for vi in self._inputs:
            dims = self._fixed.get(vi.name)
            if dims is None:
                if vi.type.WhichOneof("value") != "tensor_type":
                    dims = []      # the compiler names what it cannot take
                else:
                    found = _static_dims(vi)
                    if found is None:
                        return None
                    dims = found
            out[vi.name] = dims
        return out

    def _compile(self, shapes: dict[str, list[int]]) -> _Compiled:
        key = tuple(tuple(shapes.get(n, ())) for n in self._input_names)
        c = self._compiled.get(key)
        if c is None:
            # only the shapes that are not already static, as --input_shape would
            given = {}
            for vi in self._inputs:
                if vi.name in self._fixed or _static_dims(vi) != shapes.get(vi.name):
                    if vi.name in shapes and vi.type.WhichOneof("value") == "tensor_type":
                        given[vi.name] = list(shapes[vi.name])
            c = _Compiled(self._model, given, self._precision, self._ipu_version, self._label)
            self._compiled[key] = c
        return c

    def run(self, inputs: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Execute once. ``inputs``: a list in graph-input order (initializers excluded),
        a dict by name, or one array for a one-input model. Returns a namedtuple-like
        tuple of numpy arrays in graph-output order."""
        from host_runtime.errors import BadRequestError, InvalidStateError

        if self._closed:
            raise InvalidStateError("the backend rep is closed")
        if isinstance(inputs, dict):
            feeds = dict(inputs)
        else:
            if isinstance(inputs, np.ndarray):
                inputs = [inputs]
            values = list(inputs)
            if len(values) > len(self._input_names):
                raise BadRequestError(
                    f"{len(values)} inputs given but the model has {len(self._input_names)}: "
                    f"{self._input_names}")
            feeds = dict(zip(self._input_names, values))
        missing = [n for n in self._input_names if n not in feeds]
        unknown = [n for n in feeds if n not in self._input_names]
        if missing or unknown:
            raise BadRequestError(f"inputs {sorted(feeds)} do not match the model's inputs "
                                  f"{self._input_names} (missing {missing}, unknown {unknown})")
        arrays = {n: np.asarray(v) for n, v in feeds.items()}
        shapes = {n: list(a.shape) for n, a in arrays.items()}
        compiled = self._compile(shapes)
        typed = {}
        for n, a in arrays.items():
            dtype, _shape = compiled.inputs[n]
            if a.dtype != dtype and self._precision == "fp16" and a.dtype == np.float32 \
                    and dtype == np.float16:
                a = a.astype(np.float16)
            typed[n] = a if a.flags.c_contiguous else a.copy(order="C")   # keeps 0-d
        with _shared.lock:
            try:
                result = _shared.runner_of(compiled).execute(typed)
            except Exception:
                # a failed request leaves the runner unusable (ModelRunner without
                # auto_reset): unload it, so that the next run loads the model afresh
                try:
                    _shared.forget(compiled)
                except Exception as exc:  # noqa: BLE001 - the request's error is the news
                    _log.debug("unloading %s after a failure: %s", self._label, exc)
                raise
        outs = []
        for name in self._outputs:
            arr = np.asarray(result[name])
            want = self._out_types.get(name)
            if want is not None and arr.dtype != want:
                arr = arr.astype(want)
            outs.append(arr)
        result_tuple: tuple[Any, ...] = _namedtuple(self._outputs)(*outs)
        return result_tuple

    def close(self) -> None:
        """Unload the model's executables from the IPU (the IPU stays attached)."""
        if self._closed:
            return
        self._closed = True
        compiled, self._compiled = self._compiled, {}
        for c in compiled.values():
            try:
                c.close()
            except Exception as exc:  # noqa: BLE001 - close every runner
                _log.warning("closing a runner of %s failed: %s", self._label, exc)

    def __enter__(self) -> "IpuBackendRep":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - never raise from a finaliser
            pass


def _namedtuple(names: list[str]) -> Any:
    fields = [n if n.isidentifier() and not n.startswith("_") else f"output_{k}"
              for k, n in enumerate(names)]
    try:
        return namedtuple("Outputs", fields, rename=True)
    except ValueError:
        return lambda *a: tuple(a)


class IpuBackend(Backend):
    """``onnx.backend.base.Backend`` over the emulated IPU."""

    @classmethod
    def is_compatible(cls, model: onnx.ModelProto, device: str = "IPU", **kwargs: Any) -> bool:
        return cls.supports_device(device)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        """``"IPU"`` (the emulated IPU); ``"CPU"`` is accepted too, as the harness asks for it."""
        if not isinstance(device, str):
            return False
        return device.split(":")[0].upper() in ("IPU", "CPU")

    @classmethod
    def prepare(cls, model: Any, device: str = "IPU", **kwargs: Any) -> IpuBackendRep:
        """Compile ``model`` (a ModelProto, bytes or a path) and load it on the shared IPU."""
        from host_runtime.errors import BadRequestError

        if not cls.supports_device(device):
            raise BadRequestError(f"device {device!r} is not supported; use 'IPU'")
        if isinstance(model, (bytes, bytearray)):
            model = onnx.load_model_from_string(bytes(model))
        elif isinstance(model, str):
            model = onnx.load(model)
        if not isinstance(model, onnx.ModelProto):
            raise BadRequestError(f"prepare expects an onnx.ModelProto, bytes or a path, got "
                                  f"{type(model).__name__}")
        unknown = set(kwargs) - {"precision", "input_shapes", "ipu_version"}
        if unknown:
            _log.debug("prepare: ignoring options %s", sorted(unknown))
        return IpuBackendRep(model, precision=kwargs.get("precision", "fp32"),
                             input_shapes=kwargs.get("input_shapes"),
                             ipu_version=kwargs.get("ipu_version"))

    @classmethod
    def run_model(cls, model: Any, inputs: Any, device: str = "IPU",
                  **kwargs: Any) -> tuple[Any, ...]:
        with cls.prepare(model, device, **kwargs) as rep:
            return rep.run(inputs)

    @classmethod
    def run_node(cls, node: onnx.NodeProto, inputs: Any, device: str = "IPU",
                 outputs_info: Optional[Sequence[tuple[Any, tuple[int, ...]]]] = None,
                 **kwargs: Any) -> Optional[tuple[Any, ...]]:
        """Run one node: a model is built around it from the inputs' dtypes and shapes."""
        from onnx import helper

        super().run_node(node, inputs, device=device, outputs_info=outputs_info)
        values = list(inputs.values()) if isinstance(inputs, dict) else list(inputs)
        names = [n for n in node.input if n]
        arrays = [np.asarray(v) for v in values]
        graph_inputs = [helper.make_tensor_value_info(
            n, helper.np_dtype_to_tensor_dtype(a.dtype), list(a.shape))
            for n, a in zip(names, arrays)]
        if outputs_info is not None:
            graph_outputs = [helper.make_tensor_value_info(
                n, helper.np_dtype_to_tensor_dtype(np.dtype(t)), list(s))
                for n, (t, s) in zip(node.output, outputs_info)]
        else:
            graph_outputs = [onnx.ValueInfoProto(name=n) for n in node.output if n]
        opset = kwargs.pop("opset_version", None)
        graph = helper.make_graph([node], f"run_node_{node.op_type}", graph_inputs, graph_outputs)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid(
            node.domain or "", opset or onnx.defs.onnx_opset_version())])
        if outputs_info is None:
            inferred = onnx.shape_inference.infer_shapes(model)
            by_name = {vi.name: vi for vi in inferred.graph.value_info}
            by_name.update({vi.name: vi for vi in inferred.graph.output})
            for vi in model.graph.output:
                if vi.name in by_name:
                    vi.CopyFrom(by_name[vi.name])
        return cls.run_model(model, dict(zip(names, arrays)), device, **kwargs)


prepare = IpuBackend.prepare
run_model = IpuBackend.run_model
run_node = IpuBackend.run_node
supports_device = IpuBackend.supports_device
is_compatible = IpuBackend.is_compatible


# PopRT's poprt.backend.get_session / Session (the classification demos' entry point)
from host_runtime.poprt._session import Session, get_session  # noqa: E402

__all__ += ["Session", "get_session"]
