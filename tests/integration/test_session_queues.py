"""Session.createQueueManager: queues fed by the user, drained through the session's callbacks."""

from __future__ import annotations

import threading

import numpy as np

from host_runtime.devices._manager import DeviceManager
from host_runtime.errors import InvalidStateError
from host_runtime.session._session import Session
from tests._helpers import PATIENT

SHAPE = (1, 4)


def test_queue_manager_round_trip_and_stop_disconnects(model):
    w = np.frombuffer(model.tensorData("weights").data, np.float32).reshape(SHAPE)
    with DeviceManager().getDevice(1, wait_config=PATIENT) as dev, Session(model) as s:
        s.bindToDevice(dev)
        qm = s.createQueueManager()
        n = 5
        errors: list[BaseException] = []

        def device_loop(runs: int) -> None:
            try:
                for _ in range(runs):
                    s.runMainPrograms()
            except BaseException as exc:
                errors.append(exc)
        t = threading.Thread(target=device_loop, args=(n,))
        t.start()
        inputs = [(np.full(SHAPE, i, np.float32), np.full(SHAPE, 10 * i, np.float32))
                  for i in range(n)]
        outputs = [np.zeros(SHAPE, np.float32) for _ in range(n)]
        for (a, b), c in zip(inputs, outputs):
            qm.inputs["tensor_A"].enqueue(a, a.nbytes)
            qm.inputs["tensor_B"].enqueue(b, b.nbytes)
            qm.outputs["tensor_C"].enqueue(c, c.nbytes)
        t.join(120)
        assert not t.is_alive() and not errors, errors
        for (a, b), c in zip(inputs, outputs):
            np.testing.assert_allclose(c, a * w + b, rtol=1e-6)
        # a run waiting for queued data is released by stop(): the queues are disconnected
        t = threading.Thread(target=device_loop, args=(1,))
        t.start()
        s.stop()
        t.join(120)
        assert not t.is_alive()
        assert s.isStopped()
        assert all(isinstance(e, InvalidStateError) for e in errors), errors
