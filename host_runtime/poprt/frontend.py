"""PopRT's model frontends: ONNX files are loaded; TensorFlow models are refused by name
(tf2onnx is not a dependency of the emulator: convert with tf2onnx, then load the ONNX)."""

from __future__ import annotations

import os
import re
from typing import Any

import onnx

from host_runtime.errors import BadRequestError
from host_runtime.poprt._errors import NotSupportedError

__all__ = ["OnnxFrontend", "TensorflowFrontend", "get_frontend", "Frontend"]


class Frontend:
    """A model source: ``load_model()`` gives an ``onnx.ModelProto``."""

    def __init__(self, path: str, **kwargs: Any) -> None:
        self.path = path
        self.kwargs = kwargs

    def load_model(self) -> onnx.ModelProto:
        raise NotImplementedError


class OnnxFrontend(Frontend):
    """Load an ONNX model from a file, or from the only ``.onnx`` file of a folder."""

    def get_onnx_name(self, dir_or_name: str) -> str | None:
        if os.path.isdir(dir_or_name):
            names = sorted(f for f in os.listdir(dir_or_name) if f.endswith(".onnx"))
            if len(names) != 1:
                raise BadRequestError(f"folder {dir_or_name!r} must hold exactly one .onnx file, "
                                      f"it holds {names}")
            return os.path.join(dir_or_name, names[0])
        if not os.path.isfile(dir_or_name):
            raise BadRequestError(f"{dir_or_name!r} is neither an ONNX file nor a folder")
        return dir_or_name

    def load_model(self) -> onnx.ModelProto:
        name = self.get_onnx_name(self.path)
        assert name is not None
        return onnx.load(name)


class TensorflowFrontend(Frontend):
    """TensorFlow models: refused (``NotSupportedError``): the emulator does not ship
    tf2onnx; convert the model to ONNX with tf2onnx and load that."""

    def __init__(self, path: str, *, saved_model: bool = True, signature_def: str = "",
                 tag: str = "", opset: int = 11, inputs_as_nchw: str | None = None,
                 outputs_as_nchw: str | None = None, inputs: str | None = None,
                 input_shape: dict[str, Any] | None = None, outputs: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self.saved_model, self.signature_def, self.tag, self.opset = (saved_model,
                                                                      signature_def, tag, opset)
        self.inputs, self.outputs, self.input_shape = inputs, outputs, dict(input_shape or {})
        self.inputs_as_nchw, self.outputs_as_nchw = inputs_as_nchw, outputs_as_nchw

    def _refuse(self) -> NotSupportedError:
        return NotSupportedError("the TensorFlow frontend is not supported by the IPU emulator "
                                 "(it needs tf2onnx and TensorFlow); convert the model with "
                                 "tf2onnx and pass the ONNX file")

    def get_inputs_meta(self, graph: Any) -> None:
        raise self._refuse()

    def get_outputs_meta(self, graph: Any) -> None:
        raise self._refuse()

    def load_model(self) -> onnx.ModelProto:
        raise self._refuse()

    def split_nodename_and_shape(self, name: str) -> tuple[str, list[int] | None]:
        """``"x:0[1,224,224,3]"`` -> ``("x:0", [1, 224, 224, 3])``."""
        m = re.fullmatch(r"(.+?)\[([-\d, ]*)\]", name.strip())
        if m is None:
            return name.strip(), None
        dims = [int(d) for d in m.group(2).replace(" ", "").split(",") if d]
        return m.group(1), dims


def get_frontend(path: str, framework: str = "onnx", **kwargs: Any) -> Frontend:
    """The frontend for ``framework`` (``"onnx"`` or ``"tensorflow"``)."""
    if framework == "onnx":
        return OnnxFrontend(path, **kwargs)
    if framework == "tensorflow":
        return TensorflowFrontend(path, **kwargs)
    raise BadRequestError(f"framework must be 'onnx' or 'tensorflow', got {framework!r}")
