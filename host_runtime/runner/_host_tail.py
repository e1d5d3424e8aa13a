"""A model's host-side tail: the non-tensor end of a classifier (``ZipMap``), run with
onnxruntime on each result.

The compiler cuts such a tail off the model (``ipu_emulator.compiler``): the IPU
computes the tensors it reads, which are outputs of the compiled model, and the
executable carries the tail's ONNX bytes (``ipu_emulator.host_tail``). The runner adds
the tail's outputs (a list of dicts for ``ZipMap``, as onnxruntime gives them) to every
result: the dict ``execute`` returns, the caller's own output dict, and the future's
results.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping

import numpy as np

from host_runtime import popef
from host_runtime.errors import BadRequestError, PopefError
from ipu_emulator import host_tail
from host_runtime.popef import decoded_programs
from ipu_emulator.errors import IpuEmulatorError

__all__ = ["HostTail"]

_log = logging.getLogger(__name__)


class HostTail:
    """The tail's onnxruntime session, and the names it reads and gives."""

    __slots__ = ("_session", "inputs", "outputs")

    def __init__(self, model_bytes: bytes, label: str) -> None:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.log_severity_level = 4
        so.intra_op_num_threads = 1
        so.inter_op_num_threads = 1
        try:
            self._session = ort.InferenceSession(model_bytes, so,
                                                 providers=["CPUExecutionProvider"])
        except Exception as exc:
            raise PopefError(f"executable {label!r}: its host-side tail does not load in "
                             f"onnxruntime: {str(exc)[:300]}") from None
        self.inputs = [i.name for i in self._session.get_inputs()]
        self.outputs = [o.name for o in self._session.get_outputs()]

    @classmethod
    def of(cls, model: popef.Model) -> "HostTail | None":
        """The model's tail (None: it has none, or its executable does not decode, which
        the session reports)."""
        try:
            exe = decoded_programs(model.executable)
        except (IpuEmulatorError, PopefError):
            return None
        data = host_tail.decode(exe.attributes)
        if data is None:
            return None
        tail = cls(data, exe.name)
        _log.info("executable %r: outputs %s are computed on the host from %s", exe.name,
                  tail.outputs, tail.inputs)
        return tail

    def run(self, results: Mapping[str, Any]) -> dict[str, Any]:
        """The tail's outputs for one result (name -> array of the compiled outputs)."""
        feeds = {}
        for name in self.inputs:
            if name not in results:
                raise BadRequestError(
                    f"output {name!r} is missing from the request's outputs; the model's "
                    f"host-side outputs {self.outputs} are computed from it")
            feeds[name] = np.asarray(results[name])
        values = self._session.run(self.outputs, feeds)
        return dict(zip(self.outputs, values))

    def complete(self, results: Any, output_data: Any) -> Any:
        """Add the tail's outputs to ``results`` (or, when the caller gave the output
        memory, to the caller's output dict); returns ``results``."""
        target = results if results is not None else output_data
        if isinstance(target, dict):
            for name, value in self.run(target).items():
                dict.__setitem__(target, name, value)
        return results
