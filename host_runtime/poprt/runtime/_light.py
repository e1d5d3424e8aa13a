"""PopRT's ``LightRunner`` and ``HostConcatRunner``.

``LightRunner(executable, LightRunnerConfig)`` is a ``Runner`` that can be stopped and
reloaded and whose weights can be replaced in place:

- ``config.replica_to_device``: replica id -> ``Device`` (PopRT's or model_runtime's);
  the runner loads onto those devices instead of attaching its own, and leaves them
  attached when it stops (the caller owns them);
- ``set_input_anchor(name, array)`` stages a new value for a weight (an input the PopEF
  file carries, ``get_model_inputs()`` marks it ``popef_contains_tensor_data``);
  ``update_weights()`` loads the staged values on the emulated IPUs in place: Main's
  loop stops, the Load programs run again on the same IPU processes with the new tensor
  data (held in shared memory like frozen inputs), and Main loops again; no reload, no
  new process. Requests in flight finish first;
- ``stop()`` unloads the model (its devices stay the caller's); ``reload()`` loads it
  again, with the weights last updated.

``HostConcatRunner(executable, HostConcatRunnerConfig)`` runs a model whose inputs were
merged by PopRT's ``apply_host_concat_split`` pass: requests carry the original inputs,
and the host writes each merged input with their bytes one after the other
(``host_concat_config``: merged name -> ``HostConcatConfig``; empty, the PopEF file's
opaque blob ``HostConcatRunnerConfig`` gives it, JSON of that shape).
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Optional

import numpy as np

from host_runtime.errors import BadRequestError
from host_runtime.memory import as_readable_array
from host_runtime.runner import OutputFuture
from host_runtime.runner.config import ModelRunnerConfig

from host_runtime.poprt._names import sHostConcatRunnerConfig
from host_runtime.poprt.runtime._config import (HostConcatConfig, HostConcatRunnerConfig,
                                                LightRunnerConfig, RuntimeConfig)
from host_runtime.poprt.runtime._runner import Runner

__all__ = ["LightRunner", "HostConcatRunner", "HOST_CONCAT_BLOB"]

HOST_CONCAT_BLOB = sHostConcatRunnerConfig


class LightRunner(Runner):
    """A ``Runner`` with ``update_weights``, ``stop`` and ``reload`` (module docstring)."""

    _DEFAULT: type[RuntimeConfig] = LightRunnerConfig

    def __init__(self, executable: Any, config: Optional[ModelRunnerConfig] = None) -> None:
        super().__init__(executable, config)
        self._staged: dict[str, np.ndarray] = {}
        self._weights = {d.name: d for d in self.model_runner.getModelInputs()}

    def set_input_anchor(self, name: str, value: Any) -> None:
        """Stage ``value`` for weight ``name``; ``update_weights()`` loads it."""
        desc = self._weights.get(name)
        if desc is None or not desc.popef_contains_tensor_data:
            names = sorted(n for n, d in self._weights.items() if d.popef_contains_tensor_data)
            raise BadRequestError(
                f"set_input_anchor: {name!r} is not a weight of the model (an input its PopEF "
                f"file carries); expected one of {', '.join(names) or '(none)'}")
        arr = as_readable_array(value, name)
        if list(arr.shape) != desc.shape or arr.dtype != desc.numpy_data_type():
            raise BadRequestError(
                f"set_input_anchor({name!r}): expected {desc.numpy_data_type()} of shape "
                f"{desc.shape}, got {arr.dtype} of shape {list(arr.shape)}")
        self._staged[name] = np.array(arr, copy=True)

    def update_weights(self) -> None:
        """Load the staged weights on the emulated IPUs in place (module docstring)."""
        if not self._staged:
            raise BadRequestError("update_weights: no weight was staged; call "
                                  "set_input_anchor(name, array) first")
        self.update_load_inputs(self._staged)
        self._staged = {}

    def stop(self) -> None:
        """Unload the model; the devices of ``replica_to_device`` stay attached."""
        self.close()


class HostConcatRunner(Runner):
    """Concatenates inputs on the host into a merged model's inputs (module docstring)."""

    _DEFAULT: type[RuntimeConfig] = HostConcatRunnerConfig

    def __init__(self, executable: Any, config: Optional[ModelRunnerConfig] = None) -> None:
        super().__init__(executable, config)
        given = getattr(config, "host_concat_config", None) or {}
        concat = dict(given) if given else self._from_popef()
        descs = {d.name: d for d in self.model_runner.getExecuteInputs()}
        for name, hcc in concat.items():
            desc = descs.get(name)
            if desc is None:
                raise BadRequestError(
                    f"host_concat_config: {name!r} is not an input of the model; expected one "
                    f"of {', '.join(sorted(descs))}")
            if hcc.data_size_bytes and hcc.data_size_bytes != desc.size_in_bytes:
                raise BadRequestError(
                    f"host_concat_config[{name!r}].data_size_bytes: the model's input holds "
                    f"{desc.size_in_bytes} bytes, got {hcc.data_size_bytes}")
        self._concat = concat
        self._descs = descs

    def _from_popef(self) -> dict[str, HostConcatConfig]:
        blob = self.model_runner.model.opaque(HOST_CONCAT_BLOB)
        if blob is None:
            return {}
        try:
            doc = json.loads(bytes(blob.data).decode("utf-8"))
            out = {}
            for item in doc:
                hcc = HostConcatConfig()
                hcc.tensor_name = str(item["tensor_name"])
                hcc.input_tensor_names = [str(n) for n in item["input_tensor_names"]]
                hcc.shape = [int(d) for d in item.get("shape", [])]
                hcc.data_size_bytes = int(item.get("data_size_bytes", 0))
                out[hcc.tensor_name] = hcc
            return out
        except (ValueError, KeyError, TypeError) as exc:
            raise BadRequestError(
                f"the PopEF opaque blob {HOST_CONCAT_BLOB!r} is not a JSON list of "
                f"{{tensor_name, input_tensor_names, shape, data_size_bytes}}: {exc}") from exc

    def _merged(self, input: Mapping[str, Any]) -> dict[str, Any]:
        ins = dict(input)
        for name, hcc in self._concat.items():
            if name in ins:
                continue
            desc = self._descs[name]
            missing = [n for n in hcc.input_tensor_names if n not in ins]
            if missing:
                raise BadRequestError(
                    f"merged input {name!r} is made of {hcc.input_tensor_names}; missing "
                    f"{missing}")
            parts = [np.ascontiguousarray(as_readable_array(ins.pop(n), n)).reshape(-1)
                     .view(np.uint8) for n in hcc.input_tensor_names]
            flat = np.concatenate(parts)
            if flat.nbytes != desc.size_in_bytes:
                raise BadRequestError(
                    f"merged input {name!r}: the inputs {hcc.input_tensor_names} hold "
                    f"{flat.nbytes} bytes, the model's input {desc.size_in_bytes}")
            ins[name] = flat.view(desc.numpy_data_type()).reshape(desc.shape)
        return ins

    def execute(self, input: Mapping[str, Any], output: Mapping[str, Any]) -> None:
        super().execute(self._merged(input), output)

    def execute_async(self, input: Mapping[str, Any],
                      output: Optional[Mapping[str, Any]] = None) -> OutputFuture:
        return super().execute_async(self._merged(input), output)

    executeAsync = execute_async
