"""SpscRingBuffer, InputQueue/OutputQueue packing and splitting, pools, factories.

Pure host code: no processes. Threads are synchronised with events and joins,
never with sleeps.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from host_runtime.errors import BadRequestError, DeviceTimeoutError, InvalidStateError
from host_runtime.popef.model import (Anchor, DataType, ExecutableBlob, Metadata, Model,
                                      ProgramFlow, TensorInfo, TensorType)
from host_runtime.queues._queues import (InputData, InputQueue, InputRingBuffer, OutputQueue,
                                 OutputRingBuffer, QueueManager, RingMemoryPool,
                                 SpscRingBuffer, allocateQueueStorage,
                                 ring_size_multiplier_factory)


# ----------------------------------------------------------------- SpscRingBuffer
def test_a_writer_waits_for_a_free_slot_at_most_the_host_sync_timeout(monkeypatch):
    monkeypatch.setenv("IPU_EMULATOR_HOST_SYNC_TIMEOUT", "0.2")   # read when the ring is made
    rb: SpscRingBuffer[int] = SpscRingBuffer(1, "r", peer=lambda: "the device is asleep")
    rb.write(1)
    start = time.monotonic()
    with pytest.raises(DeviceTimeoutError) as info:
        rb.write(2)                      # the consumer takes nothing
    assert 0.2 <= time.monotonic() - start < 10.0   # the bound, not the default 60 s
    assert str(info.value) == (
        "SpscRingBuffer 'r': all 1 buffers stayed full for 0.2 s: the consumer took nothing "
        "(the host sync timeout, IPU_EMULATOR_HOST_SYNC_TIMEOUT); the device is asleep")
    assert "write_locked=False" in rb.getState()   # still usable: the consumer frees a slot
    got: list[int] = []
    reader = threading.Thread(target=lambda: [got.append(rb.readLock()), rb.readComplete()])
    reader.start()
    rb.write(3)                          # waits for the reader's free slot, not the bound
    reader.join()
    assert got == [1] and rb.readLock() == 3


def test_ring_fifo_write_read():
    rb: SpscRingBuffer[int] = SpscRingBuffer(3, "r")
    for i in range(3):
        rb.write(i)
    assert rb.readAvailable()
    got = []
    for _ in range(3):
        got.append(rb.readLock())
        rb.readComplete()
    assert got == [0, 1, 2] and not rb.readAvailable()
    assert rb.numBuffers() == 3 and rb.label() == "r"


def test_write_lock_returns_same_slot_until_complete():
    rb = InputRingBuffer(2, "in")
    a = rb.writeLock()
    assert rb.writeLock() is a
    a.data_size = 7
    rb.writeComplete()
    b = rb.writeLock()
    assert b is not a
    rb.writeComplete()
    assert rb.readLock().data_size == 7


def test_several_read_locks_and_read_reset():
    rb: SpscRingBuffer[str] = SpscRingBuffer(4, "r")
    for s in "abc":
        rb.write(s)
    assert [rb.readLock(), rb.readLock()] == ["a", "b"]
    rb.readReset()
    assert rb.readLock() == "a"
    rb.readComplete()
    assert rb.readLock() == "b"


def test_complete_without_lock_is_invalid_state():
    rb: SpscRingBuffer[int] = SpscRingBuffer(1, "r")
    with pytest.raises(InvalidStateError, match="readComplete\\(\\) without readLock"):
        rb.readComplete()
    with pytest.raises(InvalidStateError, match="writeComplete\\(\\) without writeLock"):
        rb.writeComplete()


def test_full_ring_blocks_writer_until_read_complete():
    rb: SpscRingBuffer[int] = SpscRingBuffer(1, "r")
    rb.write(1)
    started = threading.Event()
    done = threading.Event()

    def writer():
        started.set()
        rb.write(2)
        done.set()

    t = threading.Thread(target=writer)
    t.start()
    started.wait()
    assert not done.wait(0.05)
    assert rb.readLock() == 1
    rb.readComplete()
    t.join(10)
    assert done.is_set() and rb.readLock() == 2


def test_invalidate_wakes_blocked_reader():
    rb: SpscRingBuffer[int] = SpscRingBuffer(2, "r")
    result = []

    def reader():
        rb.readLock()
        result.append(rb.isValid())

    t = threading.Thread(target=reader)
    t.start()
    rb.invalidate()
    t.join(10)
    assert result == [False]
    rb.reset()
    assert rb.isValid() and not rb.readAvailable()
    rb.write(5)
    assert rb.readLock() == 5


def test_read_timeout_callback_called_until_data_arrives():
    calls = []

    def on_timeout(ring):
        calls.append(ring.label())
        if len(calls) == 3:
            ring.write(42)

    rb: SpscRingBuffer[int] = SpscRingBuffer(2, "slow", on_timeout, timeout_ns=1_000_000)
    assert rb.readLock() == 42
    assert calls == ["slow"] * 3


def test_get_state_describes_counts():
    rb: SpscRingBuffer[int] = SpscRingBuffer(3, "lbl")
    rb.write(1)
    text = rb.getState("> ")
    assert text.startswith("> lbl:") and "readable=1" in text and "free=2" in text


def test_bad_ring_size():
    with pytest.raises(BadRequestError, match="num_buffers must be >= 1, got 0"):
        SpscRingBuffer(0, "x")


# ----------------------------------------------------------------- queues
INFO = TensorInfo(DataType.F32, [4, 2])   # batch of 4 samples of 2 floats; 32 bytes


def make_in(n=16):
    return InputQueue(InputRingBuffer(n, "x"), INFO, "x")


def make_out(n=16):
    return OutputQueue(OutputRingBuffer(n, "y"), INFO, "y")


def test_input_queue_packs_small_items_into_one_transfer():
    q = make_in()
    a = np.arange(2, dtype=np.float32).reshape(1, 2)
    b = np.arange(2, 8, dtype=np.float32).reshape(3, 2)
    events = []
    q.enqueue(a, read_start_callback=lambda: events.append("start a"),
              read_complete_callback=lambda: events.append("done a"))
    q.enqueue(b, read_complete_callback=lambda: events.append("done b"))
    slot = np.full(8, -1, dtype=np.float32)
    assert q.fill(slot)
    np.testing.assert_array_equal(slot, np.arange(8, dtype=np.float32))
    assert events == ["start a", "done a", "done b"]


def test_input_queue_splits_large_item_across_transfers():
    q = make_in()
    big = np.arange(16, dtype=np.float32)   # two transfers
    q.enqueue(big)
    s1, s2 = np.zeros(8, np.float32), np.zeros(8, np.float32)
    q.fill(s1)
    q.fill(s2)
    np.testing.assert_array_equal(np.concatenate([s1, s2]), big)


def test_input_flush_pads_partial_then_dummy_batch():
    q = make_in()
    q.enqueue(np.ones((3, 2), np.float32))
    q.flush()
    q.flush()
    s = np.full(8, 9, np.float32)
    q.fill(s)
    np.testing.assert_array_equal(s, [1, 1, 1, 1, 1, 1, 0, 0])
    s[:] = 9
    q.fill(s)
    np.testing.assert_array_equal(s, np.zeros(8))


def test_input_queue_rejects_partial_samples_naming_queue():
    q = make_in()
    with pytest.raises(BadRequestError, match="queue 'x'.*multiple of one sample \\(8 bytes.*got 12"):
        q.enqueue(np.zeros(3, np.float32))


def test_enqueue_lock_complete_path_and_disconnect():
    q = make_in()
    item = q.enqueueLock()
    item.data = np.full(8, 3, np.float32)
    item.data_size = 32
    q.enqueueComplete()
    s = np.zeros(8, np.float32)
    q.fill(s)
    assert (s == 3).all()
    done = []
    t = threading.Thread(target=lambda: done.append(q.fill(np.zeros(8, np.float32))))
    t.start()
    q.disconnect()
    t.join(10)
    assert done == [False]
    q.reset()
    q.enqueue(np.full(8, 4, np.float32))
    q.fill(s)
    assert (s == 4).all()


def test_output_queue_splits_transfer_and_flush_discards():
    q = make_out()
    first = np.zeros((1, 2), np.float32)
    second = np.zeros((2, 2), np.float32)
    done = []
    q.enqueue(first, write_complete_callback=lambda: done.append("first"))
    q.enqueue(second, write_complete_callback=lambda: done.append("second"))
    q.flush()   # the fourth sample is padding produced by a flushed input
    q.flush()   # a whole dummy transfer
    transfer = np.arange(8, dtype=np.float32)
    q.drain(transfer)
    np.testing.assert_array_equal(first, [[0, 1]])
    np.testing.assert_array_equal(second, [[2, 3], [4, 5]])
    assert done == ["first", "second"]
    later = np.zeros((4, 2), np.float32)
    q.enqueue(later)
    q.drain(np.full(8, 7, np.float32))        # consumed by the second flush marker
    q.drain(np.full(8, 8, np.float32))
    assert (later == 8).all()


def test_output_queue_item_spanning_transfers():
    q = make_out()
    big = np.zeros(16, np.float32)
    q.enqueue(big)
    q.drain(np.arange(8, dtype=np.float32))
    q.drain(np.arange(8, 16, dtype=np.float32))
    np.testing.assert_array_equal(big, np.arange(16))


def test_producer_consumer_threads_round_trip():
    qi, qo = make_in(4), make_out(4)
    n = 50
    data = np.random.default_rng(0).standard_normal((n, 2)).astype(np.float32)
    out = np.zeros_like(data)

    def device():   # what the session's stream servicing does: in -> compute -> out
        slot = np.zeros(8, np.float32)
        for _ in range((n + 3) // 4):
            qi.fill(slot)
            qo.drain(slot * 2)

    t = threading.Thread(target=device)
    t.start()
    for i in range(n):
        qo.enqueue(out[i:i + 1])
        qi.enqueue(data[i:i + 1])
    qi.flush()
    qo.flush()
    t.join(20)
    assert not t.is_alive()
    np.testing.assert_array_equal(out, data * 2)


# ----------------------------------------------------------------- pools
def test_ring_memory_pool_cycles():
    pool = RingMemoryPool(8, 3)
    blobs = [pool.getMemoryBlob() for _ in range(4)]
    assert pool.numBlobs() == 3 and pool.blobSize() == 8
    assert all(b.nbytes == 8 for b in blobs)
    assert np.shares_memory(blobs[0], blobs[3]) and not np.shares_memory(blobs[0], blobs[1])


def test_allocate_queue_storage_matches_queue():
    q = make_in(5)
    pool = allocateQueueStorage(q, extra_buffers=2)
    assert pool.numBlobs() == 7 and pool.blobSize() == 32


# ----------------------------------------------------------------- factories and manager
def _model():
    f32 = TensorInfo(DataType.F32, [4, 2])
    anchors = [
        Anchor("w", "w", f32, False, TensorType.INPUT, [0]),
        Anchor("x", "x_h", f32, False, TensorType.INPUT, [1]),
        Anchor("y", "y_h", f32, False, TensorType.OUTPUT, [1]),
        Anchor("s", "s", f32, False, TensorType.OUTPUT, [2]),
    ]
    md = Metadata(anchors, ProgramFlow([0], [1], [2]))
    return Model(md, ExecutableBlob("e", b""), tensors=[])


def test_ring_size_multiplier_factories():
    m = _model()
    anchors = {a.name(): a for a in m.metadata.anchors()}
    f = ring_size_multiplier_factory.ringSizeMultForMainProgs(m, 5, 1)
    assert f(anchors["x"]) == 5 and f(anchors["w"]) == 1 and f(anchors["s"]) == 1
    g = ring_size_multiplier_factory.ringSizeMultForProgs([0, 2], 3)
    assert g(anchors["w"]) == 3 and g(anchors["s"]) == 3 and g(anchors["x"]) == 1


class _FakeSession:
    def __init__(self):
        self._model = _model()
        self.callbacks = {}

    def _user(self, kind):
        # as Session: anchors without PopEF data (here: those of the Main programs)
        main = set(self._model.metadata.programFlow().main())
        return [a for a in self._model.metadata.anchors()
                if a.type() == kind and main.intersection(a.programs())]

    def getUserInputAnchors(self):
        return self._user(TensorType.INPUT)

    def getUserOutputAnchors(self):
        return self._user(TensorType.OUTPUT)

    def setCallbackForAnchor(self, handle, cb):
        self.callbacks[handle] = cb


def test_queue_manager_binds_main_user_anchors():
    s = _FakeSession()
    qm = QueueManager(s, ring_size_multiplier=3)
    assert set(qm.inputs) == {"x"} and set(qm.outputs) == {"y"}
    assert set(s.callbacks) == {"x_h", "y_h"}
    assert qm.inputQueue("x") is qm.inputQueue("x_h")
    assert qm.inputQueue("x").numBuffers() == 12
    with pytest.raises(BadRequestError, match="no output queue for tensor 'nope'; expected one of y"):
        qm.outputQueue("nope")
    out = np.zeros(8, np.float32)
    qm.outputQueue("y").enqueue(out)
    qm.inputQueue("x").enqueue(np.ones(8, np.float32))
    slot = np.zeros(8, np.float32)
    s.callbacks["x_h"](slot)
    s.callbacks["y_h"](slot + 1)
    assert (out == 2).all()
    qm.disconnectAll()
    assert not qm.inputQueue("x").ringBuffer().isValid()
    qm.resetAll()
    assert qm.inputQueue("x").ringBuffer().isValid()


def test_queue_manager_timeout_callback_flushes():
    s = _FakeSession()
    seen = []

    def on_timeout(queue, ring):
        seen.append(queue.name())
        queue.flush()

    qm = QueueManager(s, 1, timeout_ns=1_000_000, timeout_callback=on_timeout)
    slot = np.full(8, 5, np.float32)
    assert s.callbacks["x_h"](slot)
    assert seen == ["x"] and not slot.any()
