"""PopRT's Python runtime (``poprt.runtime``) over emulated IPUs.

``from host_runtime.poprt import runtime`` (or, under ``ipu-emulator run``, ``from poprt
import runtime``) gives PopRT's names: ``Runner`` and its configurations, ``PackRunner``,
``LightRunner``, ``HostConcatRunner``, ``DeviceManager``/``Device``, the descriptors and
memory views. Every runner runs on ``host_runtime.ModelRunner`` (one request path).
"""

from __future__ import annotations

from host_runtime.memory import (ConstTensorMemoryView, InputMemoryView, OutputMemoryView,
                                 TensorMemory, TensorMemoryView)
from host_runtime.runner import OutputFuture
from host_runtime.runner.config import DataDesc, InputDesc, OutputDesc

from host_runtime.poprt.runtime._config import (DeviceWaitConfig, HostConcatConfig,
                                                HostConcatRunnerConfig, LightRunnerConfig,
                                                PackAlgorithm, PackRunnerConfig, RunnerType,
                                                RuntimeConfig)
from host_runtime.poprt.runtime._devices import Device, DeviceManager, ReplicaIdToDevice
from host_runtime.poprt.runtime._light import HostConcatRunner, LightRunner
from host_runtime.poprt.runtime._pack import PackFuture, PackRunner
from host_runtime.poprt.runtime._runner import ModelRunner, Runner

OutputFutureMemoryView = OutputFuture
"""``execute_async`` without outputs returns it: ``future[name]`` waits for that output."""

__all__ = [
    "ConstTensorMemoryView", "DataDesc", "Device", "DeviceManager", "DeviceWaitConfig",
    "HostConcatConfig", "HostConcatRunner", "HostConcatRunnerConfig", "InputDesc",
    "InputMemoryView", "LightRunner", "LightRunnerConfig", "ModelRunner", "OutputDesc",
    "OutputFutureMemoryView", "OutputMemoryView", "PackAlgorithm", "PackFuture",
    "PackRunner", "PackRunnerConfig", "ReplicaIdToDevice", "Runner", "RunnerType",
    "RuntimeConfig", "TensorMemory", "TensorMemoryView",
]
