"""The low-level API under ModelRunner: ``Session.createQueueManager`` and its queues, fed
by the user and drained through the session's callbacks (seed 002 10.2.2-10.2.3, seed 003
2.5-2.7), on both kinds of IPU (tests/devices/conftest.py).

The seeds' example model with a batch of 4 samples of 3 floats:
``tensor_C = tensor_A * weights + tensor_B``.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

import host_runtime as model_runtime
from host_runtime.errors import BadRequestError, InvalidStateError
from host_runtime.session._session import Session

SHAPE = (4, 3)
SAMPLE = (1, 3)


class Runs:
    """``runs`` Main runs on a thread of their own (the queues are fed from this one)."""

    def __init__(self, s: Session, runs: int) -> None:
        self.errors: list[BaseException] = []

        def go() -> None:
            try:
                for _ in range(runs):
                    s.runMainPrograms()
            except BaseException as exc:
                self.errors.append(exc)
        self.thread = threading.Thread(target=go, name="main-runs")
        self.thread.start()

    def join(self) -> list[BaseException]:
        self.thread.join(60)
        assert not self.thread.is_alive(), "the runs did not end"
        return self.errors


def test_whole_transfers_round_trip_while_main_runs(model, weights, device):
    with Session(model) as s:
        s.bindToDevice(device)
        qm = s.createQueueManager()
        assert sorted(qm.inputs) == ["tensor_A", "tensor_B"]
        assert sorted(qm.outputs) == ["tensor_C", "weights_saved"]
        n = 6
        a = [np.full(SHAPE, i, np.float32) for i in range(n)]
        b = [np.full(SHAPE, 10 * i, np.float32) for i in range(n)]
        c = [np.zeros(SHAPE, np.float32) for _ in range(n)]
        written: list[int] = []
        runs = Runs(s, n)
        for i in range(n):
            qm.inputs["tensor_A"].enqueue(a[i], a[i].nbytes)
            qm.inputs["tensor_B"].enqueue(b[i], b[i].nbytes)
            qm.outputs["tensor_C"].enqueue(c[i], c[i].nbytes,
                                           write_complete_callback=lambda i=i: written.append(i))
        assert runs.join() == []
        for i in range(n):
            np.testing.assert_allclose(c[i], a[i] * weights + b[i], rtol=1e-6)
        assert written == list(range(n))
        saved = np.zeros(SHAPE, np.float32)
        qm.outputs["weights_saved"].enqueue(saved)
        s.runSavePrograms()
        np.testing.assert_array_equal(saved, weights)


def test_single_samples_are_packed_into_transfers(model, weights, device):
    rng = np.random.default_rng(0)
    with Session(model) as s:
        s.bindToDevice(device)
        mult = model_runtime.ring_size_multiplier_factory.ringSizeMultForMainProgs(model, 2)
        qm = s.createQueueManager(mult)
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
        np.testing.assert_allclose(got, a * np.tile(weights, (2, 1)) + b, rtol=1e-6)
        assert written == list(range(8))


def test_flush_pads_a_partial_transfer_with_zeros(model, weights, device):
    with Session(model) as s:
        s.bindToDevice(device)
        qm = s.createQueueManager()
        a = np.ones((3, 3), np.float32)
        b = np.full((3, 3), 2, np.float32)
        out = np.zeros((3, 3), np.float32)
        qm.inputQueue("tensor_A").enqueue(a)
        qm.inputQueue("tensor_B").enqueue(b)
        qm.outputQueue("tensor_C").enqueue(out)
        qm.flushAll()      # pads the 4th sample; the output queue drops its result
        s.runMainPrograms()
        np.testing.assert_allclose(out, a * weights[:3] + b, rtol=1e-6)


def test_bad_enqueues_are_refused_by_type_and_message(model, device):
    with Session(model) as s:
        s.bindToDevice(device)
        qm = s.createQueueManager()
        with pytest.raises(BadRequestError, match="no input queue for tensor 'nope'; expected "
                                                  "one of tensor_A, tensor_B"):
            qm.inputQueue("nope")
        with pytest.raises(BadRequestError, match=r"queue 'tensor_A': data_size must be a "
                                                  r"positive multiple of one sample \(12 bytes"):
            qm.inputs["tensor_A"].enqueue(np.zeros(4, np.float32), 16)


def test_stop_disconnects_the_queues_of_a_waiting_run(model, weights, device):
    """A run blocked in a callback-less input (a queue nobody fills) ends with stop()."""
    with Session(model) as s:
        s.bindToDevice(device)
        qm = s.createQueueManager()
        runs = Runs(s, 1)   # waits for queued data that never comes (or is refused at once)
        s.stop()
        errors = runs.join()
        assert len(errors) == 1 and isinstance(errors[0], InvalidStateError), errors
        assert s.isStopped()
        assert not qm.inputQueue("tensor_A").ringBuffer().isValid()
        with pytest.raises(InvalidStateError, match=r"stopped; call reload\(\)"):
            s.runMainPrograms()
        qm.resetAll()
        assert qm.inputQueue("tensor_A").ringBuffer().isValid()


def test_a_run_whose_input_queue_is_disconnected_fails_rather_than_compute_from_zeros(
        model, weights, device):
    """The device asks for an input whose queue is then disconnected (as stop() and
    close() do, just before their STOP): the transfer is not made of the zeros the queue
    left, so the run does not compute from them and report success with its outputs
    dropped; it fails with InvalidStateError, as a stopped run does, and the output queue
    receives nothing."""
    waiting = threading.Event()
    with Session(model) as s:
        s.bindToDevice(device)
        qm = s.createQueueManager(timeout_ns=1_000_000,   # called while the device waits
                                  timeout_callback=lambda q, rb: waiting.set())
        out = np.full(SHAPE, -1.0, np.float32)
        qm.outputQueue("tensor_C").enqueue(out)
        qm.inputQueue("tensor_B").enqueue(np.ones(SHAPE, np.float32))
        runs = Runs(s, 1)   # tensor_A never comes
        assert waiting.wait(60)
        qm.inputQueue("tensor_A").disconnect()
        errors = runs.join()
        assert len(errors) == 1 and isinstance(errors[0], InvalidStateError), errors
        assert "input queue 'tensor_A' was disconnected" in str(errors[0])
        np.testing.assert_array_equal(out, -1.0)   # nothing computed from zeros
        # the session goes on: the queues reset, the next run is right
        qm.resetAll()
        a, b = np.full(SHAPE, 2.0, np.float32), np.full(SHAPE, 0.5, np.float32)
        out2 = np.zeros(SHAPE, np.float32)
        qm.inputQueue("tensor_A").enqueue(a)
        qm.inputQueue("tensor_B").enqueue(b)
        qm.outputQueue("tensor_C").enqueue(out2)
        s.runMainPrograms()
        np.testing.assert_allclose(out2, a * weights + b, rtol=1e-6)


def test_a_run_whose_output_queue_is_disconnected_fails_rather_than_drop_its_output(
        model, weights, device):
    """An output queue disconnected before it took the run's transfer (as stop() and close()
    do) drops it; the run does not return as done with an output that reached nobody: it
    fails with InvalidStateError, as a stopped run does."""
    with Session(model) as s:
        s.bindToDevice(device)
        qm = s.createQueueManager()
        qm.inputQueue("tensor_A").enqueue(np.ones(SHAPE, np.float32))
        qm.inputQueue("tensor_B").enqueue(np.ones(SHAPE, np.float32))
        out = np.full(SHAPE, -1.0, np.float32)
        qm.outputQueue("tensor_C").disconnect()
        with pytest.raises(InvalidStateError, match="output queue 'tensor_C' was disconnected"):
            s.runMainPrograms()
        np.testing.assert_array_equal(out, -1.0)
        qm.resetAll()   # connected again: the next run delivers
        a, b = np.full(SHAPE, 3.0, np.float32), np.full(SHAPE, 0.25, np.float32)
        qm.inputQueue("tensor_A").enqueue(a)
        qm.inputQueue("tensor_B").enqueue(b)
        qm.outputQueue("tensor_C").enqueue(out)
        s.runMainPrograms()
        np.testing.assert_allclose(out, a * weights + b, rtol=1e-6)
