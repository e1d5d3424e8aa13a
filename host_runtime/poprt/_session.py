"""``poprt.backend.get_session`` and ``Session``: the classification demos' entry point.

``get_session(model, 1, "poprt", options={...}).load()`` compiles the model for the
emulated IPU (``options``: a dict of ``CompilerOptions`` fields or a
CompilerOptions); ``backend="onnxruntime"`` runs it with onnxruntime on the host
instead. ``sess.run(output_names, inputs)`` returns the outputs in that order.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import numpy as np

from host_runtime.errors import BadRequestError, InvalidStateError
from host_runtime.poprt._options import CompilerOptions
from ipu_emulator.executable import ORT_TYPES, numpy_dtype

__all__ = ["Session", "get_session"]

_BACKENDS = ("poprt", "onnxruntime")


def _options(options: Any, batches_per_step: int) -> CompilerOptions:
    if options is None:
        opts = CompilerOptions()
    elif isinstance(options, CompilerOptions):
        opts = CompilerOptions.from_dict(options.to_dict())
    elif isinstance(options, Mapping):
        opts = CompilerOptions.from_dict(dict(options))
    else:
        raise BadRequestError(f"options must be a dict or a CompilerOptions, got "
                              f"{type(options).__name__}")
    if batches_per_step != 1:
        opts.batches_per_step = int(batches_per_step)
    return opts


class Session:
    """A model compiled for the emulated IPU (``backend="poprt"``) or run by onnxruntime
    (``backend="onnxruntime"``)."""

    def __init__(self, path_or_bytes: Any, num_devices: int = 1, output_dir: str = "./",
                 options: Any = None, batches_per_step: int = 1, export_popef: bool = False,
                 backend: str = "poprt", align_output_dtype: bool = False) -> None:
        if backend not in _BACKENDS:
            raise BadRequestError(f"backend must be one of {list(_BACKENDS)}, got {backend!r}")
        if int(num_devices) != 1:
            from host_runtime.poprt._errors import NotSupportedError

            raise NotSupportedError(f"num_devices={num_devices}: a session runs on one device "
                                    "(shard with CompilerOptions.num_ipus)")
        self.path_or_bytes = path_or_bytes
        self.backend = backend
        self.output_dir = output_dir
        self.options = _options(options, batches_per_step)
        self.export_popef = bool(export_popef)
        self.align_output_dtype = bool(align_output_dtype)
        self._impl: Any = None

    def set_options(self, options: Any) -> None:
        self.options = _options(options, 1)

    def set_output_dir(self, output_dir: str) -> None:
        self.output_dir = output_dir

    def load(self, **kwargs: Any) -> "Session":
        """Compile and load the model (onnxruntime: create its InferenceSession)."""
        if self.backend == "onnxruntime":
            import onnxruntime

            src = self.path_or_bytes
            if not isinstance(src, (str, bytes, os.PathLike)):
                src = src.SerializeToString()
            self._impl = onnxruntime.InferenceSession(src, providers=["CPUExecutionProvider"])
            return self
        from host_runtime.poprt.backends import Backend

        popef = os.path.join(self.output_dir, "executable.popef") if self.export_popef else None
        self._impl = Backend(self.path_or_bytes, export_popef=popef,
                             compiler_options=self.options,
                             align_output_dtype=self.align_output_dtype)
        self._impl.get_io_info()       # compiles and loads now
        return self

    def _loaded(self) -> Any:
        if self._impl is None:
            raise InvalidStateError("the session is not loaded; call load() first")
        return self._impl

    def get_io_info(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(inputs, outputs)``: name -> ``(shape, dtype)``."""
        impl = self._loaded()
        if self.backend == "onnxruntime":
            return ({i.name: (i.shape, _numpy_dtype(i.type)) for i in impl.get_inputs()},
                    {o.name: (o.shape, _numpy_dtype(o.type)) for o in impl.get_outputs()})
        io: tuple[dict[str, Any], dict[str, Any]] = impl.get_io_info()
        return io

    def get_outputs(self) -> list[str]:
        return list(self.get_io_info()[1])

    def run(self, output_names: Sequence[str] | None, inputs_dict: Mapping[str, Any]
            ) -> list[np.ndarray]:
        impl = self._loaded()
        if self.backend == "onnxruntime":
            out: list[np.ndarray] = impl.run(list(output_names) if output_names else None,
                                             dict(inputs_dict))
            return out
        result: list[np.ndarray] = impl.run(output_names, inputs_dict)
        return result

    def compile_and_export(self, serilization_path: str) -> None:
        """Compile the model and write its PopEF file."""
        from host_runtime.poprt._compile_api import Compiler, load_onnx

        Compiler.compile_and_export(load_onnx(self.path_or_bytes), None, serilization_path,
                                    self.options)

    def close(self) -> None:
        impl, self._impl = self._impl, None
        if impl is not None and hasattr(impl, "close"):
            impl.close()


def get_session(path_or_bytes: Any, num_devices: int = 1, backend: str = "poprt",
                output_dir: str = "./", options: Any = None, batches_per_step: int = 1,
                export_popef: bool = False, align_output_dtype: bool = False) -> Session:
    """A ``Session`` for ``path_or_bytes`` (call ``load()`` before ``run``)."""
    return Session(path_or_bytes, num_devices, output_dir, options, batches_per_step,
                   export_popef, backend, align_output_dtype)


def _numpy_dtype(ort_type: str) -> Any:
    """onnxruntime's type string of a tensor (``'tensor(float)'``) as the numpy dtype the
    ``"poprt"`` backend gives for it (the string itself for what numpy has no type for)."""
    popef_type = ORT_TYPES.get(ort_type)
    if popef_type is not None:
        return numpy_dtype(popef_type)
    return np.dtype(object) if ort_type == "tensor(string)" else ort_type
