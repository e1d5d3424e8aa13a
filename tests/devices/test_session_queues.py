"""The low-level API under ModelRunner: ``Session.createQueueManager`` and its queues,
over a real IPU process (seed 002 10.2.2-10.2.3, seed 003 2.5-2.7)."""

from __future__ import annotations

import numpy as np

import host_runtime as model_runtime
from tests._helpers import weights_of

SHAPE = (4, 3)


def test_queue_manager_feeds_main_programs(model):
    w = weights_of(model, SHAPE)
    rng = np.random.default_rng(0)
    with model_runtime.Session(model) as s:
        mult = model_runtime.ring_size_multiplier_factory.ringSizeMultForMainProgs(model, 2)
        qm = s.createQueueManager(mult)
        assert set(qm.inputs) == {"tensor_A", "tensor_B"}
        assert "tensor_C" in qm.outputs
        assert qm.inputQueue("tensor_A").tensorInfo().shape() == list(SHAPE)
        pool = model_runtime.allocateQueueStorage(qm.outputQueue("tensor_C"))
        # one sample at a time: the queues pack 4 samples into each transfer
        a = rng.standard_normal((8, 3)).astype(np.float32)
        b = rng.standard_normal((8, 3)).astype(np.float32)
        outs = []
        written = []
        for i in range(8):
            qm.inputQueue("tensor_A").enqueue(a[i:i + 1])
            qm.inputQueue("tensor_B").enqueue(b[i:i + 1])
            blob = pool.getMemoryBlob()[:12]
            outs.append(blob)
            qm.outputQueue("tensor_C").enqueue(blob, 12, lambda i=i: written.append(i))
        s.runMainPrograms()
        s.runMainPrograms()
        got = np.stack([np.frombuffer(o, np.float32) for o in outs])
        np.testing.assert_allclose(got, a * np.tile(w, (2, 1)) + b, rtol=1e-6)
        assert written == list(range(8))


def test_flush_pads_a_partial_batch(model):
    w = weights_of(model, SHAPE)
    with model_runtime.Session(model) as s:
        qm = s.createQueueManager()
        a = np.ones((3, 3), np.float32)
        b = np.full((3, 3), 2, np.float32)
        out = np.zeros((3, 3), np.float32)
        qm.inputQueue("tensor_A").enqueue(a)
        qm.inputQueue("tensor_B").enqueue(b)
        qm.outputQueue("tensor_C").enqueue(out)
        qm.flushAll()      # pads the 4th sample; the output queue drops its result
        s.runMainPrograms()
        np.testing.assert_allclose(out, a * w[:3] + b, rtol=1e-6)


def test_stop_disconnects_the_queues(model):
    with model_runtime.Session(model) as s:
        qm = s.createQueueManager()
        s.stop()
        assert not qm.inputQueue("tensor_A").ringBuffer().isValid()
        qm.resetAll()
        assert qm.inputQueue("tensor_A").ringBuffer().isValid()
