"""A user callback that raises never shifts later results (QueueManager, Session callbacks).

Loopback device, the seeds' example model with a batch of 2 samples of 3 floats:
``tensor_C = tensor_A * weights + tensor_B``. Request k is its inputs A_k, B_k and its
output buffer C_k, enqueued together; a callback of request 2 raises once. The run that
served it fails with the callback's error (by type and message); no input is taken by a
failed transfer, so every later run still pairs A_k with B_k and C_k, and every buffer
ends up holding its own request's result.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from host_runtime.errors import DeviceExecutionError
from host_runtime.session._session import Session
from tests.unit._loopback import model, model_path, weights  # noqa: F401  (fixtures)

SHAPE = (2, 3)
N = 5
BAD = 2


class Once:
    """A callback that raises the first time it is called, then records its calls."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1
        if self.calls == 1:
            raise ValueError(f"{self.what} of request {BAD} failed")


class Runs:
    """``runs`` Main runs on a thread of their own (the queues are fed from this one);
    the DeviceExecutionErrors they raise."""

    def __init__(self, s: Session, runs: int) -> None:
        self.errors: list[BaseException] = []

        def go() -> None:
            for _ in range(runs):
                try:
                    s.runMainPrograms()
                except DeviceExecutionError as exc:
                    self.errors.append(exc)
        self.thread = threading.Thread(target=go, name="main-runs")
        self.thread.start()

    def join(self) -> list[BaseException]:
        self.thread.join(30)
        assert not self.thread.is_alive(), "the runs did not end"
        return self.errors


@pytest.mark.parametrize("where", ["read_start", "read_complete", "write_complete"])
def test_a_queue_callback_that_raises_fails_its_run_and_shifts_nothing(
        loopback_device, model, weights, where):
    with Session(model) as s:
        s.bindToDevice(loopback_device)
        qm = s.createQueueManager()
        a = [np.full(SHAPE, i + 1, np.float32) for i in range(N)]
        b = [np.full(SHAPE, 10 * (i + 1), np.float32) for i in range(N)]
        c = [np.zeros(SHAPE, np.float32) for _ in range(N)]
        bad = Once({"read_start": "read start callback", "read_complete":
                    "read complete callback", "write_complete": "write complete callback"}[where])
        # an input callback's failure leaves request 2's inputs queued: one more run serves it
        runs = Runs(s, N + 1 if where != "write_complete" else N)
        for i in range(N):
            cb = bad if i == BAD else None
            qm.inputs["tensor_A"].enqueue(
                a[i], a[i].nbytes, read_start_callback=cb if where == "read_start" else None,
                read_complete_callback=cb if where == "read_complete" else None)
            qm.inputs["tensor_B"].enqueue(b[i], b[i].nbytes)
            qm.outputs["tensor_C"].enqueue(
                c[i], c[i].nbytes, write_complete_callback=cb if where == "write_complete"
                else None)
        errors = runs.join()
        anchor = "tensor_C" if where == "write_complete" else "tensor_A"
        assert [(type(e), str(e)) for e in errors] == [(
            DeviceExecutionError,
            f"main programs: the callback of anchor {anchor!r} raised ValueError: "
            f"{bad.what} of request {BAD} failed")]
        for i in range(N):
            np.testing.assert_allclose(c[i], a[i] * weights + b[i], rtol=1e-6,
                                       err_msg=f"request {i}")
        for q in [*qm.inputs.values(), qm.outputs["tensor_C"]]:   # every item used, freed
            state = q.ringBuffer().getState()
            assert "read_locked=0 readable=0" in state and "write_locked=False" in state, state
        # an input item taken back is read again: its callback too
        assert bad.calls == (1 if where == "write_complete" else 2)
