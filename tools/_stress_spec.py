"""What one stress host is told to do: the spec ``tools.stress`` writes, the host reads.

The orchestrator makes a :class:`HostSpec` per host and :func:`encode` writes it as the
JSON file the host (``python -m tools._stress_host SPEC RESULT``) is started with; the
host reads it back with :func:`decode`, which refuses a field that is missing, unknown
or of the wrong type (naming it). Both ends use the dataclass, so mypy checks both.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ModelPaths", "HostSpec", "SpecError", "encode", "decode"]


class SpecError(ValueError):
    """A host spec that is not what :func:`encode` writes."""


@dataclass(frozen=True)
class ModelPaths:
    """The run's models (``tools._stress_rig.write_models``), compiled once per scenario."""

    model: str = ""            # the simple example model (tensor_A, weights)
    batch_model: str = ""      # a batch-4 model whose samples do not depend on their row
    fused_model: str = ""      # the demo's fused model
    pipeline_model: str = ""   # a chain pipelined over 2 IPUs (kill-pipeline, faults)
    pipeline_onnx: str = ""    # its ONNX model (expected values with onnxruntime)


@dataclass(frozen=True)
class HostSpec:
    """One host of a scenario (defaults: the ``ipu-emulator stress`` command line's)."""

    scenario: str
    seed: int
    models: ModelPaths = field(default_factory=ModelPaths)
    batching: bool = False          # the runner batches dynamically
    replicas: int = 2
    threads: int = 3
    duration: float | None = None   # seconds of load (None: until requests or max_seconds)
    max_seconds: float = 600.0
    requests: int | None = None     # requests per host (None: until the deadline)
    hang_timeout: float = 30.0
    inject_wrong: int = 0           # internal hook: the first N checks expect a wrong value
    shm_fill_mib: int = 256         # shared-machine: the most /dev/shm is filled with
    daemon_socket: str | None = None


def encode(spec: HostSpec) -> str:
    """``spec`` as the JSON text the host reads."""
    return json.dumps(dataclasses.asdict(spec))


def decode(text: str) -> HostSpec:
    """The spec :func:`encode` wrote (SpecError naming what is wrong, else)."""
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise SpecError(f"host spec: not JSON ({exc})") from None
    spec = _build(HostSpec, doc, "host spec")
    assert isinstance(spec, HostSpec)
    return spec


def _build(cls: type, doc: Any, where: str) -> Any:
    """An instance of the dataclass ``cls`` from ``doc``, every field given and typed."""
    if not isinstance(doc, dict):
        raise SpecError(f"{where}: expected a JSON object, got {type(doc).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    missing = [n for n in names if n not in doc]
    unknown = sorted(set(doc) - set(names))
    if missing or unknown:
        raise SpecError(f"{where}: expected the fields {names}; missing {missing}, "
                        f"unknown {unknown}")
    return cls(**{n: _value(hints[n], doc[n], f"{where}.{n}") for n in names})


def _value(hint: Any, value: Any, where: str) -> Any:
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, where)   # type: ignore[arg-type]
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    if value is None and type(None) in options:
        return None
    for kind in options:
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind in (str, bool) and isinstance(value, kind):
            return value
    raise SpecError(f"{where}: expected {hint}, got {value!r}")
