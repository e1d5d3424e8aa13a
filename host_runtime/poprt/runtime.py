"""The PopRT runtime of seed 004: ``Runner`` and ``RuntimeConfig`` over ``ModelRunner``.

``Runner(popef_path, config).execute(inputs, outputs)`` runs one request with
dicts of numpy arrays and writes the results into the caller's arrays. On a
fused model (several ONNX models compiled into one executable whose Main
selects a sub-graph by the ``index`` input) the runner fills ``index`` from
the tensor names when the caller does not give it: names ``graphK/...``
select sub-graph ``K``. Together with ``validate_io_params = False`` this
runs the seed's ``run.py`` unchanged apart from its import.
"""

from __future__ import annotations

import os
import re
from typing import Any, Mapping, Optional

import numpy as np

from host_runtime.runner.config import DataDesc, ModelRunnerConfig
from host_runtime.errors import BadRequestError
from host_runtime.memory import PopefPaths
from host_runtime.runner import ModelRunner, OutputFuture

__all__ = ["Runner", "RuntimeConfig"]

_GRAPH = re.compile(r"^graph(\d+)/")
INDEX_NAME = "index"


class RuntimeConfig(ModelRunnerConfig):
    """PopRT runtime options: the same fields and defaults as ``ModelRunnerConfig``."""

    def __repr__(self) -> str:
        return "Runtime" + super().__repr__()[len("ModelRunner"):]

    __str__ = __repr__


class Runner:
    """Loads a PopEF model onto an emulated IPU and runs requests on dicts of numpy arrays."""

    def __init__(self, popef_path: str | os.PathLike[str] | list[str] | Any,
                 config: Optional[ModelRunnerConfig] = None) -> None:
        cfg = config if config is not None else RuntimeConfig()
        if isinstance(popef_path, (str, os.PathLike)):
            popef_path = PopefPaths([os.fspath(popef_path)])
        self._runner = ModelRunner(popef_path, config=cfg)
        md = self._runner.model.metadata
        index = md.anchor(INDEX_NAME)
        self._fused = bool(md.subgraphs()) and index is not None
        self._index_dtype = index.tensorInfo().numpyDType() if index is not None else np.int32
        self._index_shape = tuple(index.tensorInfo().shape()) if index is not None else (1,)
        self._subgraph_of: dict[str, int] = {}
        for sub, names in md.subgraphs().items():
            m = re.fullmatch(r"graph(\d+)", sub)
            if m:
                for n in names:
                    self._subgraph_of[n] = int(m.group(1))

    # -- the seed's API ---------------------------------------------------------------
    def execute(self, inputs: Mapping[str, Any], outputs: Mapping[str, Any]) -> None:
        """Run one request; the results are written into the arrays of ``outputs``."""
        self._runner.execute(self._with_index(inputs, outputs), dict(outputs))

    def execute_async(self, inputs: Mapping[str, Any],
                      outputs: Optional[Mapping[str, Any]] = None) -> OutputFuture:
        """Queue one request; ``future.wait()`` then read the output arrays."""
        ins = self._with_index(inputs, outputs or {})
        if outputs is None:
            return self._runner.executeAsync(ins)
        return self._runner.executeAsync(ins, dict(outputs))

    def get_execute_inputs(self) -> list[DataDesc]:
        return self._runner.getExecuteInputs()

    def get_execute_outputs(self) -> list[DataDesc]:
        return self._runner.getExecuteOutputs()

    # -- Python conveniences -------------------------------------------------------------
    @property
    def model_runner(self) -> ModelRunner:
        return self._runner

    def close(self) -> None:
        self._runner.close()

    def __enter__(self) -> "Runner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the index of fused models ---------------------------------------------------------
    def _with_index(self, inputs: Mapping[str, Any], outputs: Mapping[str, Any]) -> dict[str, Any]:
        ins = dict(inputs)
        if not self._fused or INDEX_NAME in ins:
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
        ins[INDEX_NAME] = np.full(self._index_shape, next(iter(chosen)), dtype=self._index_dtype)
        return ins
