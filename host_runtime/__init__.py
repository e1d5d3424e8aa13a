"""Model Runtime over emulated IPUs: the public API, spelt as in the seeds.

Use it the way the seeds' listings use ``model_runtime``::

    import host_runtime as model_runtime
    from host_runtime import popef

    runner = model_runtime.ModelRunner(model_runtime.PopefPaths(paths), config=config)

Importing this package is cheap: the errors are imported eagerly, every
other name is imported on first use (PEP 562), so ``import host_runtime``
pulls in neither numpy-heavy modules nor the device driver until needed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from host_runtime.errors import (
    BadRequestError,
    DeviceExecutionError,
    DeviceLostError,
    DeviceTimeoutError,
    DeviceUnavailableError,
    ForkedProcessError,
    InvalidStateError,
    ModelRuntimeError,
    PackageHashMismatchError,
    PopefError,
    RemoteTraceback,
    RecoveryAction,
    DeviceRuntimeError,
    ApplicationRuntimeError,
    RecoverableRuntimeError,
    UnrecoverableRuntimeError,
)

__all__ = [
    # ModelRunner (high-level API)
    "ModelRunner",
    "ModelRunnerConfig",
    "DataDesc",
    "InputDesc",
    "OutputDesc",
    "OutputFuture",
    "OutputFutureMemory",
    "OutputFutureMemoryView",
    "ReplicaIdToOutputMemoryView",
    "ReplicaIdToDevice",
    # tensor memory
    "PopefPaths",
    "InputMemoryView",
    "OutputMemoryView",
    "OutputMemory",
    "TensorMemory",
    "TensorMemoryView",
    "ConstTensorMemoryView",
    "empty_shared",
    "is_shared",
    # devices and sessions
    "DeviceManager",
    "Device",
    "DeviceWaitConfig",
    "DeviceWaitStrategy",
    "DeviceConstraints",
    "Session",
    "SessionConfig",
    "LaunchPolicy",
    "CallbackInfo",
    "CallbackHandle",
    "CallbackFactory",
    "predicate_factory",
    "PopefDataUsagePolicy",
    "AnchorCallbackPolicy",
    "AnchorWithPolicy",
    "ProgramsWithPolicy",
    "null_anchor_callback_predicate",
    "null_popef_data_usage_predicate",
    "PopefDataUsagePredicate",
    "AnchorCallbackPredicate",
    # queues (low-level API)
    "QueueManager",
    "InputQueue",
    "OutputQueue",
    "IQueue",
    "InputData",
    "OutputData",
    "SpscRingBuffer",
    "InputRingBuffer",
    "OutputRingBuffer",
    "IMemoryPool",
    "RingMemoryPool",
    "allocateQueueStorage",
    "ring_size_multiplier_factory",
    "RingSizeMultiplierProdType",
    "ReadStartCallback",
    "ReadCompleteCallback",
    "WriteCompleteCallback",
    # errors
    "ModelRuntimeError",
    "BadRequestError",
    "PopefError",
    "InvalidStateError",
    "ForkedProcessError",
    "DeviceUnavailableError",
    "DeviceLostError",
    "DeviceTimeoutError",
    "DeviceExecutionError",
    "PackageHashMismatchError",
    "RemoteTraceback",
    "RecoveryAction",
    "DeviceRuntimeError",
    "ApplicationRuntimeError",
    "RecoverableRuntimeError",
    "UnrecoverableRuntimeError",
]

# name -> module that defines it (imported on first access)
_LAZY: dict[str, str] = {
    "ModelRunner": "host_runtime.runner",
    "OutputFuture": "host_runtime.runner",
    "OutputFutureMemory": "host_runtime._seed_types",
    "OutputFutureMemoryView": "host_runtime._seed_types",
    "ReplicaIdToOutputMemoryView": "host_runtime._seed_types",
    "ReplicaIdToDevice": "host_runtime._seed_types",
    "ModelRunnerConfig": "host_runtime.runner",
    "DataDesc": "host_runtime.runner",
    "InputDesc": "host_runtime.runner",
    "OutputDesc": "host_runtime.runner",
    "PopefPaths": "host_runtime.memory",
    "InputMemoryView": "host_runtime.memory",
    "OutputMemoryView": "host_runtime.memory",
    "OutputMemory": "host_runtime.memory",
    "TensorMemory": "host_runtime.memory",
    "TensorMemoryView": "host_runtime.memory",
    "ConstTensorMemoryView": "host_runtime.memory",
    "empty_shared": "host_runtime.memory",
    "is_shared": "host_runtime.memory",
    "DeviceManager": "host_runtime.devices",
    "Device": "host_runtime.devices",
    "DeviceWaitConfig": "host_runtime.devices",
    "DeviceWaitStrategy": "host_runtime.devices",
    "DeviceConstraints": "host_runtime.devices",
    "Session": "host_runtime.session",
    "SessionConfig": "host_runtime.session",
    "LaunchPolicy": "host_runtime.session",
    "CallbackInfo": "host_runtime.session",
    "CallbackHandle": "host_runtime.session",
    "CallbackFactory": "host_runtime.session",
    "predicate_factory": "host_runtime.session",
    "AnchorWithPolicy": "host_runtime.session",
    "ProgramsWithPolicy": "host_runtime.session",
    "null_anchor_callback_predicate": "host_runtime.session",
    "null_popef_data_usage_predicate": "host_runtime.session",
    "PopefDataUsagePolicy": "host_runtime.session",
    "AnchorCallbackPolicy": "host_runtime.session",
    "PopefDataUsagePredicate": "host_runtime.session",
    "AnchorCallbackPredicate": "host_runtime.session",
    "QueueManager": "host_runtime.queues",
    "InputQueue": "host_runtime.queues",
    "OutputQueue": "host_runtime.queues",
    "IQueue": "host_runtime.queues",
    "InputData": "host_runtime.queues",
    "OutputData": "host_runtime.queues",
    "SpscRingBuffer": "host_runtime.queues",
    "InputRingBuffer": "host_runtime.queues",
    "OutputRingBuffer": "host_runtime.queues",
    "IMemoryPool": "host_runtime.queues",
    "RingMemoryPool": "host_runtime.queues",
    "allocateQueueStorage": "host_runtime.queues",
    "ring_size_multiplier_factory": "host_runtime.queues",
    "RingSizeMultiplierProdType": "host_runtime.queues",
    "ReadStartCallback": "host_runtime.queues",
    "ReadCompleteCallback": "host_runtime.queues",
    "WriteCompleteCallback": "host_runtime.queues",
}

_SUBMODULES = ("popef", "poprt", "errors", "memory", "queues", "runner", "devices", "session",
               "settings")


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))



if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from host_runtime.runner.config import DataDesc, InputDesc, ModelRunnerConfig, OutputDesc
    from host_runtime.devices import (Device, DeviceConstraints, DeviceManager,
                                      DeviceWaitConfig, DeviceWaitStrategy)
    from host_runtime.memory import (ConstTensorMemoryView, InputMemoryView, OutputMemory,
                                     OutputMemoryView, PopefPaths, TensorMemory,
                                     TensorMemoryView)
    from host_runtime.runner import ModelRunner, OutputFuture
    from host_runtime.memory import empty_shared, is_shared
    from host_runtime._seed_types import (OutputFutureMemory, OutputFutureMemoryView,
                                          ReplicaIdToDevice, ReplicaIdToOutputMemoryView)
    from host_runtime.session import (AnchorCallbackPolicy, AnchorCallbackPredicate,
                                         AnchorWithPolicy, PopefDataUsagePolicy,
                                         PopefDataUsagePredicate, ProgramsWithPolicy,
                                         null_anchor_callback_predicate,
                                         null_popef_data_usage_predicate, predicate_factory)
    from host_runtime.queues import (IMemoryPool, InputData, InputQueue, InputRingBuffer,
                                     IQueue, OutputData, OutputQueue, OutputRingBuffer,
                                     QueueManager, ReadCompleteCallback, ReadStartCallback,
                                     RingMemoryPool, RingSizeMultiplierProdType,
                                     SpscRingBuffer, WriteCompleteCallback,
                                     allocateQueueStorage, ring_size_multiplier_factory)
    from host_runtime.session import (CallbackFactory, CallbackHandle, CallbackInfo,
                                      LaunchPolicy, Session, SessionConfig)
