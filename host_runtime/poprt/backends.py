"""PopRT's backends: ``Backend`` (compile on first use, run on an emulated IPU) and
``ORTBackend`` (the same with onnxruntime's ``InferenceSession`` calls).

``Backend(model).run(output_names, inputs)`` compiles the model with
``Compiler.compile`` the first time it is used (``run``, ``get_io_info``), loads it
on an emulated IPU through ``ModelRunner`` and returns the outputs named, in that
order. The IPU is held until the backend is closed or dropped.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Mapping, Sequence

import numpy as np
import onnx

from host_runtime.errors import BadRequestError, InvalidStateError
from host_runtime.poprt._compile_api import Compiler, Executable, load_onnx
from host_runtime.poprt._options import CompilerOptions

__all__ = ["Backend", "ORTBackend", "runtime_config"]

_log = logging.getLogger("poprt.backends")


def _model_of(path_or_bytes: Any) -> onnx.ModelProto:
    if hasattr(path_or_bytes, "read"):
        return load_onnx(path_or_bytes.read())
    return load_onnx(path_or_bytes)


def _snake(key: str) -> str:
    """``"timeoutNS"`` -> ``"timeout_ns"``, ``"batchSizeTimeoutNS"`` ->
    ``"batch_size_timeout_ns"``."""
    key = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", key)
    return re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", key).lower()


def runtime_config(options: Any) -> Any:
    """A ``RuntimeConfig`` from None, a config, or a dict of its fields (PopRT's
    ``runtime_options``: snake_case or camelCase names, as ``{"timeoutNS": 0}``)."""
    from host_runtime.poprt.runtime import RuntimeConfig
    from host_runtime.runner.config import ModelRunnerConfig

    if options is None:
        return RuntimeConfig()
    if isinstance(options, ModelRunnerConfig):
        return options
    if not isinstance(options, Mapping):
        raise BadRequestError(f"runtime_options must be a RuntimeConfig or a dict, got "
                              f"{type(options).__name__}")
    cfg = RuntimeConfig()
    for key, value in options.items():
        name = _snake(str(key))
        if name.startswith("_") or "." in name or not hasattr(cfg, name):
            raise BadRequestError(f"runtime_options: {key!r} is not a RuntimeConfig field")
        setattr(cfg, name, value)
    return cfg


class Backend:
    """Compile an ONNX model for the emulated IPU on first use and run it."""

    def __init__(self, path_or_bytes: Any, *, export_popef: str | None = None,
                 compiler_options: CompilerOptions | None = None,
                 runtime_options: Any = None, align_output_dtype: bool = False,
                 logger: logging.Logger | None = None) -> None:
        self.model = _model_of(path_or_bytes)
        self.export_popef = export_popef
        self.compiler_options = compiler_options if compiler_options is not None \
            else CompilerOptions()
        if not isinstance(self.compiler_options, CompilerOptions):
            self.compiler_options = CompilerOptions.from_dict(dict(self.compiler_options))
        self.runtime_options = runtime_options
        self.align_output_dtype = bool(align_output_dtype)
        self.logger = logger or _log
        self.executable: Executable | None = None
        self._runner: Any = None
        self._closed = False
        self._declared = {vi.name: vi.type.tensor_type.elem_type for vi in self.model.graph.output
                          if vi.type.WhichOneof("value") == "tensor_type"}

    def _load(self) -> Any:
        if self._closed:
            raise InvalidStateError("the backend is closed")
        if self._runner is None:
            from host_runtime.runner import ModelRunner

            if self.executable is None:
                self.executable = Compiler.compile(self.model, None, self.compiler_options)
                if self.export_popef:
                    self.executable.save(self.export_popef)
            self._runner = ModelRunner(self.executable,
                                       config=runtime_config(self.runtime_options))
        return self._runner

    def get_io_info(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(inputs, outputs)``: name -> ``(shape, numpy dtype)`` of the compiled model."""
        runner = self._load()
        ins = {d.name: (list(d.shape), d.numpy_data_type()) for d in runner.getExecuteInputs()}
        outs = {d.name: (list(d.shape), d.numpy_data_type()) for d in runner.getExecuteOutputs()}
        return ins, outs

    def run(self, output_names: Sequence[str] | None, inputs: Mapping[str, Any],
            align_output_dtype: bool = False) -> list[np.ndarray]:
        """Run once; returns the outputs named (None: every output), in that order."""
        runner = self._load()
        if not isinstance(inputs, Mapping):
            raise BadRequestError(f"inputs must be a dict of name -> array, got "
                                  f"{type(inputs).__name__}")
        wanted = {d.name: d.numpy_data_type() for d in runner.getExecuteInputs()}
        feeds = {}
        for name, value in inputs.items():
            arr = np.asarray(value)
            want = wanted.get(name)
            if want is not None and arr.dtype != want and arr.dtype.kind == np.dtype(want).kind:
                arr = arr.astype(want)
            feeds[name] = np.ascontiguousarray(arr)
        result = runner.execute(feeds)
        names = list(output_names) if output_names else [d.name for d in
                                                         runner.getExecuteOutputs()]
        unknown = [n for n in names if n not in result]
        if unknown:
            raise BadRequestError(f"outputs {unknown} are not outputs of the model; its outputs "
                                  f"are {sorted(result)}")
        out = [np.asarray(result[n]) for n in names]
        if align_output_dtype or self.align_output_dtype:
            out = [self._aligned(n, a) for n, a in zip(names, out)]
        return out

    def _aligned(self, name: str, arr: np.ndarray) -> np.ndarray:
        elem = self._declared.get(name)
        if not elem:
            return arr
        want = onnx.helper.tensor_dtype_to_np_dtype(elem)
        return arr if arr.dtype == want else arr.astype(want)

    def set_opaque_blobs(self) -> None:
        """Opaque blobs are written from ``compiler_options.opaque_blobs`` when the model is
        compiled; after that they are fixed."""
        if self.executable is not None:
            raise InvalidStateError("the model is compiled already; set "
                                    "compiler_options.opaque_blobs before the first run")

    def close(self) -> None:
        """Unload the model and give the IPU back."""
        self._closed = True
        runner, self._runner = self._runner, None
        if runner is not None:
            runner.close()

    def __enter__(self) -> "Backend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Arg:
    """What ``InferenceSession.get_inputs()`` lists: name, shape, type."""

    def __init__(self, name: str, shape: list[int], dtype: Any) -> None:
        self.name = name
        self.shape = shape
        elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
        kind = onnx.TensorProto.DataType.Name(elem).lower()
        self.type = f"tensor({'float' if kind == 'float' else kind})"

    def __repr__(self) -> str:
        return f"NodeArg(name={self.name!r}, type={self.type!r}, shape={self.shape})"


class ORTBackend(Backend):
    """A ``Backend`` called as ``onnxruntime.InferenceSession`` is: ``sess_options``,
    ``providers`` and ``provider_options`` are accepted and unused; ``lazy_load=False``
    compiles and loads now."""

    def __init__(self, path_or_bytes: Any, sess_options: Any = None, providers: Any = None,
                 provider_options: Any = None, lazy_load: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(path_or_bytes, **kwargs)
        if not lazy_load:
            self._load()

    def run(self, output_names: Sequence[str] | None,  # type: ignore[override]
            input_feed: Mapping[str, Any], run_options: Any = None,
            align_output_dtype: bool = False) -> list[np.ndarray]:
        """``InferenceSession.run(output_names, input_feed, run_options)`` (run_options is
        accepted and unused)."""
        return super().run(output_names, input_feed, align_output_dtype)

    def get_inputs(self) -> list[_Arg]:
        ins, _ = self.get_io_info()
        return [_Arg(n, s, t) for n, (s, t) in ins.items()]

    def get_outputs(self) -> list[_Arg]:
        _, outs = self.get_io_info()
        return [_Arg(n, s, t) for n, (s, t) in outs.items()]
