"""PopRT's ``Runner`` (and its older name ``ModelRunner``) over ``host_runtime.ModelRunner``.

``Runner(popef, config)`` loads a model (see ``_source`` for what ``popef`` may be)
onto emulated IPUs and runs requests on dicts of numpy arrays: ``execute(inputs,
outputs)`` writes the results into the caller's arrays, ``execute_async`` (also
``executeAsync``) returns a future to ``wait()`` on. The config's type selects the
runner, as in PopRT: a ``PackRunnerConfig`` (``runner_type`` ``PackRunner``) makes a
``PackRunner``; anything else this runner.

Fused models (several ONNX models compiled into one executable whose Main selects a
sub-graph by the ``index`` input; also an MFConverter model compiled as a plain one,
whose tensors are all ``graphK/...``): when the caller does not give ``index`` the runner
fills it from the tensor names (``graphK/...`` selects sub-graph ``K``); when the
caller gives it in another integer type than the model's (PopRT's examples pass
uint32, the reference's program index type) it is converted, range-checked.
"""

from __future__ import annotations

import re
import warnings
from typing import TYPE_CHECKING, Any, Mapping, Optional

import numpy as np

from host_runtime.errors import BadRequestError, InvalidStateError
from host_runtime.runner import ModelRunner as _Engine
from host_runtime.runner import OutputFuture
from host_runtime.runner.config import DataDesc, ModelRunnerConfig

from host_runtime.poprt.runtime._config import (RunnerType, RuntimeConfig, runner_type_of,
                                                to_model_runner_config)
from host_runtime.poprt.runtime._devices import model_runtime_devices
from host_runtime.poprt.runtime._source import model_source

if TYPE_CHECKING:  # pragma: no cover
    from host_runtime import popef

__all__ = ["Runner", "ModelRunner", "FusedIndex", "register_runner"]

_GRAPH = re.compile(r"^graph(\d+)/")
INDEX_NAME = "index"


class FusedIndex:
    """The ``index`` input of a fused model: filled from tensor names, or converted."""

    def __init__(self, model: "popef.Model") -> None:
        md = model.metadata
        index = md.anchor(INDEX_NAME)
        subgraphs = dict(md.subgraphs())
        if not subgraphs and index is not None:
            # an MFConverter model compiled without enable_model_fusion (PopRT's
            # poprt_run_popef example): its tensors are named graphK/...
            for a in md.anchors():
                m = _GRAPH.match(a.name())
                if m is not None:
                    subgraphs.setdefault(f"graph{m.group(1)}", []).append(a.name())
                elif a.name() != INDEX_NAME:
                    subgraphs = {}
                    break
        self.fused = bool(subgraphs) and index is not None
        self.dtype = index.tensorInfo().numpyDType() if index is not None else np.dtype(np.int32)
        self.shape = tuple(index.tensorInfo().shape()) if index is not None else (1,)
        self.count = 0
        self._subgraph_of: dict[str, int] = {}
        for sub, names in subgraphs.items():
            m = re.fullmatch(r"graph(\d+)", sub)
            if m:
                self.count = max(self.count, int(m.group(1)) + 1)
                for n in names:
                    self._subgraph_of[n] = int(m.group(1))

    def fill(self, inputs: Mapping[str, Any], outputs: Mapping[str, Any]) -> dict[str, Any]:
        ins = dict(inputs)
        if not self.fused:
            return ins
        if INDEX_NAME in ins:
            ins[INDEX_NAME] = self._convert(ins[INDEX_NAME])
            return ins
        chosen: dict[int, list[str]] = {}
        for name in [*ins, *outputs]:
            k = self._subgraph_of.get(name)
            if k is None:
                m = _GRAPH.match(name)
                if m is None:
                    continue
                k = int(m.group(1))
            chosen.setdefault(k, []).append(name)
        if len(chosen) != 1:
            detail = "; ".join(f"graph{k}: {', '.join(v)}" for k, v in sorted(chosen.items()))
            raise BadRequestError(
                "cannot fill the 'index' input of the fused model: expected tensors of exactly "
                f"one sub-graph (graphK/...), got {detail or 'no sub-graph tensors'}; "
                "pass 'index' explicitly")
        ins[INDEX_NAME] = np.full(self.shape, next(iter(chosen)), dtype=self.dtype)
        return ins

    def _convert(self, value: Any) -> Any:
        arr = np.asarray(value)
        if arr.dtype == self.dtype:
            return value
        if arr.dtype.kind not in "iu":
            raise BadRequestError(
                f"input 'index' of the fused model: expected an integer array (the model's "
                f"{self.dtype}; uint32 and the other integer types are converted), "
                f"got {arr.dtype}")
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= max(self.count, 1)):
            raise BadRequestError(
                f"input 'index' of the fused model: expected a sub-graph number 0..{self.count - 1}, "
                f"got {arr.reshape(-1).tolist()}")
        return arr.astype(self.dtype)


def engine_config(config: Optional[ModelRunnerConfig], default: type[RuntimeConfig]
                  ) -> ModelRunnerConfig:
    """The engine's configuration for a PopRT runner's ``config`` (None: ``default()``)."""
    cfg = config if config is not None else default()
    if not isinstance(cfg, ModelRunnerConfig):
        raise BadRequestError(f"config must be a {default.__name__}, got {type(cfg).__name__}")
    plain = to_model_runner_config(cfg)
    plain.replica_to_device = model_runtime_devices(dict(cfg.replica_to_device))
    return plain


_KINDS: dict[RunnerType, type["Runner"]] = {}


def register_runner(kind: RunnerType, cls: type["Runner"]) -> None:
    """``Runner(popef, config)`` makes a ``cls`` when ``config.runner_type`` is ``kind``."""
    _KINDS[kind] = cls


class Runner:
    """Loads a PopEF model onto emulated IPUs and runs requests (module docstring)."""

    _DEFAULT: type[RuntimeConfig] = RuntimeConfig

    def __new__(cls, popef: Any = None, config: Optional[ModelRunnerConfig] = None) -> Any:
        kind = _KINDS.get(runner_type_of(config)) if cls is Runner else None
        return object.__new__(kind if kind is not None else cls)

    def __init__(self, popef: Any, config: Optional[ModelRunnerConfig] = None) -> None:
        self._runner: _Engine | None = None
        self._source = model_source(popef)
        self._config = engine_config(config, self._DEFAULT)
        self._runner = _Engine(self._source, config=self._config)
        self._index = FusedIndex(self._runner.model)

    @property
    def _engine(self) -> _Engine:
        r = self._runner
        if r is None:
            raise InvalidStateError(f"the {type(self).__name__} is stopped; reload() it first")
        return r

    # -- PopRT's API ------------------------------------------------------------------
    def execute(self, input: Mapping[str, Any], output: Mapping[str, Any]) -> None:
        """Run one request; the results are written into the arrays of ``output``."""
        # the caller's own dict when it is one: a host tail's outputs (ZipMap's list of
        # dicts, docs/models.md) are added to it
        self._engine.execute(self._index.fill(input, output), _writable(output))

    def execute_async(self, input: Mapping[str, Any],
                      output: Optional[Mapping[str, Any]] = None) -> OutputFuture:
        """Queue one request; ``future.wait()``, then read the output arrays."""
        ins = self._index.fill(input, output or {})
        if output is None:
            return self._engine.executeAsync(ins)
        return self._engine.executeAsync(ins, _writable(output))

    executeAsync = execute_async

    def get_execute_inputs(self) -> list[DataDesc]:
        """The inputs each request carries (weights and frozen inputs excluded)."""
        return self._engine.getExecuteInputs()

    def get_execute_outputs(self) -> list[DataDesc]:
        return self._engine.getExecuteOutputs()

    def get_model_inputs(self) -> list[DataDesc]:
        """Every input of the model; ``popef_contains_tensor_data`` marks weights."""
        return self._engine.getModelInputs()

    def get_model_outputs(self) -> list[DataDesc]:
        return self._engine.getModelOutputs()

    # -- loading (LightRunner's stop/reload/update_weights) ----------------------------
    def reload(self) -> None:
        """Load the model again (after ``close()``/``stop()``), with the Load programs'
        inputs last updated."""
        self.close()
        self._runner = _Engine(self._source, config=self._config)
        self._index = FusedIndex(self._runner.model)

    def update_load_inputs(self, values: Mapping[str, Any]) -> None:
        """New values of inputs only the Load programs read (weights), loaded in place
        (``host_runtime.ModelRunner.update_load_inputs``) and kept for ``reload()``."""
        self._engine.update_load_inputs(dict(values))
        frozen = dict(self._config.frozen_inputs)
        frozen.update(values)
        self._config.frozen_inputs = frozen

    # -- Python conveniences ----------------------------------------------------------
    @property
    def model_runner(self) -> _Engine:
        """The ``host_runtime.ModelRunner`` underneath."""
        return self._engine

    def close(self) -> None:
        """Unload the model and release the IPUs (idempotent; dropping the runner does it)."""
        r, self._runner = self._runner, None
        if r is not None:
            r.close()

    def __enter__(self) -> "Runner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ModelRunner(Runner):
    """PopRT's older name of ``Runner`` (before 1.2.0): deprecated, warns."""

    def __init__(self, popef: Any, config: Optional[ModelRunnerConfig] = None) -> None:
        warnings.warn("poprt.runtime.ModelRunner is deprecated: use poprt.runtime.Runner",
                      DeprecationWarning, stacklevel=2)
        super().__init__(popef, config)


def _writable(output: Mapping[str, Any]) -> dict[str, Any]:
    return output if isinstance(output, dict) else dict(output)
