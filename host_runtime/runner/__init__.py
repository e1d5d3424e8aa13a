"""ModelRunner: the high-level API (replicas, requests, dynamic batching, timeouts, monitoring)."""

from __future__ import annotations

from host_runtime.runner._model_runner import ModelRunner, OutputFuture
from host_runtime.runner.config import DataDesc, InputDesc, ModelRunnerConfig, OutputDesc

__all__ = ["ModelRunner", "OutputFuture", "DataDesc", "InputDesc", "ModelRunnerConfig", "OutputDesc"]
