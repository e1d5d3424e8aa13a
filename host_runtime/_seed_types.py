"""Type names of the seeds' API that are aliases in C++ (seed 002, section 10.1.3).

In C++ these are ``std::unordered_map`` aliases. In Python:

- ``executeAsync`` returns an :class:`~host_runtime.runner._model_runner.OutputFuture`
  (``wait()``, ``future[name]``, iterating yields the output names), whether the
  runner allocates the outputs (C++ ``OutputFutureMemory``) or the caller does
  (C++ ``OutputFutureMemoryView``): both names are that class, so
  ``isinstance(runner.executeAsync(inputs), OutputFutureMemory)`` holds;
- ``ReplicaIdToOutputMemoryView`` and ``ReplicaIdToDevice`` are the dict types
  of ``ModelRunnerConfig.replica_to_save_programs_outputs`` and
  ``ModelRunnerConfig.replica_to_device``; calling one makes an empty dict, as the
  C++ default constructor makes an empty map.
"""

from __future__ import annotations

from host_runtime.runner import OutputFuture
from host_runtime.devices import Device
from host_runtime.memory import OutputMemoryView

__all__ = ["OutputFutureMemory", "OutputFutureMemoryView", "ReplicaIdToOutputMemoryView",
           "ReplicaIdToDevice"]

OutputFutureMemory = OutputFuture
"""What ``executeAsync(inputs)`` returns (outputs allocated by the runner)."""

OutputFutureMemoryView = OutputFuture
"""What ``executeAsync(inputs, outputs)`` returns (outputs in the caller's memory)."""

ReplicaIdToOutputMemoryView = dict[int, OutputMemoryView]
"""Replica id -> where its save programs' outputs go."""

ReplicaIdToDevice = dict[int, Device]
"""Replica id -> the device it runs on."""
