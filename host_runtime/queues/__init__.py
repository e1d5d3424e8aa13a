"""Queues: the low-level API's QueueManager, input/output queues and their SPSC ring buffers."""

from __future__ import annotations

from host_runtime.queues._queues import IMemoryPool, IQueue, InputData, InputQueue, InputRingBuffer, OutputData, OutputQueue, OutputRingBuffer, QueueManager, ReadCompleteCallback, ReadStartCallback, RingMemoryPool, RingSizeMultiplierProdType, SpscRingBuffer, WriteCompleteCallback, allocateQueueStorage, ring_size_multiplier_factory

__all__ = ["IMemoryPool", "IQueue", "InputData", "InputQueue", "InputRingBuffer", "OutputData", "OutputQueue", "OutputRingBuffer", "QueueManager", "ReadCompleteCallback", "ReadStartCallback", "RingMemoryPool", "RingSizeMultiplierProdType", "SpscRingBuffer", "WriteCompleteCallback", "allocateQueueStorage", "ring_size_multiplier_factory"]
