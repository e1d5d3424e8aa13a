"""QueueManager (and the session's main loop) on a loopback device: no IPU process.

The seeds' example model with a batch of 2 samples of 3 floats:
``tensor_C = tensor_A * weights + tensor_B``.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from host_runtime.errors import BadRequestError, InvalidStateError
from host_runtime.session._session import Session
from tests.unit._loopback import model, model_path, offline, weights  # noqa: F401  (fixtures)

SHAPE = (2, 3)
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
        self.thread.join(30)
        assert not self.thread.is_alive(), "the runs did not end"
        return self.errors


def samples(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(SAMPLE).astype(np.float32) for _ in range(n)]


def test_whole_transfers_round_trip_and_match_numpy(loopback_device, model, weights):
    with offline(), Session(model) as s:
        s.bindToDevice(loopback_device)
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


def test_single_samples_are_packed_into_transfers(loopback_device, model, weights):
    with Session(model) as s:
        s.bindToDevice(loopback_device)
        qm = s.createQueueManager()
        a, b = samples(4, 1), samples(4, 2)
        c = [np.zeros(SAMPLE, np.float32) for _ in range(4)]
        runs = Runs(s, 2)   # 4 samples = 2 transfers of a batch of 2
        for i in range(4):
            qm.inputQueue("tensor_A").enqueue(a[i])
            qm.inputQueue("tensor_B").enqueue(b[i])
            qm.outputQueue("tensor_C").enqueue(c[i])
        assert runs.join() == []
        got = np.concatenate(c)
        np.testing.assert_allclose(got, np.concatenate(a) * np.tile(weights, (2, 1))
                                   + np.concatenate(b), rtol=1e-6)


def test_flush_pads_a_partial_transfer_with_zeros(loopback_device, model, weights):
    with Session(model) as s:
        s.bindToDevice(loopback_device)
        qm = s.createQueueManager()
        (a,), (b,) = samples(1, 3), samples(1, 4)
        c = np.zeros(SAMPLE, np.float32)
        runs = Runs(s, 1)
        qm.inputs["tensor_A"].enqueue(a)
        qm.inputs["tensor_B"].enqueue(b)
        qm.outputs["tensor_C"].enqueue(c)
        qm.flushAll()   # the second sample of the batch: zeros in, dropped out
        assert runs.join() == []
        np.testing.assert_allclose(c, a * weights[:1] + b, rtol=1e-6)


def test_bad_enqueues_are_refused_by_type_and_message(loopback_device, model):
    with Session(model) as s:
        s.bindToDevice(loopback_device)
        qm = s.createQueueManager()
        with pytest.raises(BadRequestError, match="no input queue for tensor 'nope'; expected "
                                                  "one of tensor_A, tensor_B"):
            qm.inputQueue("nope")
        with pytest.raises(BadRequestError, match=r"queue 'tensor_A': data_size must be a "
                                                  r"positive multiple of one sample \(12 bytes"):
            qm.inputs["tensor_A"].enqueue(np.zeros(4, np.float32), 16)


def test_stop_disconnects_the_queues_of_a_waiting_run(loopback_device, model):
    with Session(model) as s:
        s.bindToDevice(loopback_device)
        s.createQueueManager()
        runs = Runs(s, 1)   # waits for queued data that never comes (or is refused at once)
        s.stop()
        errors = runs.join()
        assert len(errors) == 1 and isinstance(errors[0], InvalidStateError), errors
        assert s.isStopped()


def test_the_main_loop_over_direct_rings_until_stop(loopback_device, model, weights):
    """The session's fast path (docs/design.md section 8): the caller's thread alone."""
    with Session(model) as s:
        s.bindToDevice(loopback_device)
        for h in ("tensor_A", "tensor_B", "tensor_C"):
            s.direct.claim(h)
        direct = s.direct
        ra, rb, rc = (direct.input_ring("tensor_A"), direct.input_ring("tensor_B"),
                      direct.output_ring("tensor_C"))
        loop = s.direct.start_main_loop()
        with pytest.raises(InvalidStateError, match="main loop is running"):
            s.runMainPrograms()
        rng = np.random.default_rng(0)
        for _ in range(20):
            a = rng.standard_normal(SHAPE).astype(np.float32)
            b = rng.standard_normal(SHAPE).astype(np.float32)
            ra.write(a.tobytes())
            rb.write(b.tobytes())
            data, _ = rc.read(timeout=30)
            np.testing.assert_allclose(np.frombuffer(data, np.float32).reshape(SHAPE),
                                       a * weights + b, rtol=1e-6)
        s.stop()
        assert loop.result(timeout=30) is None and s.isStopped()
