"""Run by tests/integration/test_interrupt.py in a fresh interpreter: a Session (and its
QueueManager) under SIGINT every 50 ms and user callbacks that raise.

    python -m tests.integration.interrupt_session_program MODEL SECONDS \
        {callbacks,queues,queues_late}

``callbacks``: the anchors are bound with ``setCallbackForAnchor``; every 7th request's
input callback raises, every 11th request's output callback raises; the main thread
calls ``runMainPrograms`` in a loop while SIGINT arrives every 50 ms. A run that
returns must have delivered its own result to the output callback; a run that raised
(KeyboardInterrupt, or the named error of the callback that raised) delivers nothing
that a later run takes for its own.

``queues``: the QueueManager's queues; each request enqueues its inputs and its output
buffer, then runs Main; a KeyboardInterrupt may come inside an enqueue or a run (one
that lands as the run is entered means no run: after each run that returns, the program
runs Main for what is still queued). Every output buffer must end up holding the result
of the inputs enqueued with it.

``queues_late``: as ``queues``, and every 13th enqueue also raises KeyboardInterrupt just
after its item was published (the moment a SIGINT lands only now and then: an enqueue
that took effect though the caller saw it interrupted).

Prints ``RESULT {json}``: right and wrong answers, interrupts, errors by type and message,
wrong answers of 10 calls after the signals stop, and what was left in /dev/shm.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import sys
import threading
import time
from collections import Counter
from typing import Any

import numpy as np


def main(path: str, seconds: float, how: str) -> None:
    import host_runtime as model_runtime
    from host_runtime import popef
    from shm.cleanup import list_objects

    model = popef.load_model([path])
    shape = tuple(model.metadata.anchor("tensor_A").tensorInfo().shape())
    weights = np.frombuffer(model.tensorData("weights").data, np.float32).reshape(shape)
    counts: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    detail: list[str] = []        # each wrong output buffer: what it holds
    me = os.getpid()
    armed = [False]      # SIGINT raises only while the runtime is called
    stop = threading.Event()

    def on_sigint(sig: int, frame: Any) -> None:
        if armed[0]:
            raise KeyboardInterrupt

    def sigint() -> None:
        while not stop.wait(0.05):
            os.kill(me, signal.SIGINT)

    def value(i: int) -> tuple[np.ndarray, np.ndarray]:
        return (np.full(shape, float(i % 1000), np.float32), np.full(shape, 0.5, np.float32))

    def want(i: int) -> np.ndarray:
        a, b = value(i)
        return a * weights + b

    def note(i: int, exc: BaseException, prefix: str = "") -> None:
        """Count an error by type and message, request numbers as N; one that names another
        request than the one that raised it is counted as "misattributed"."""
        text = f"{type(exc).__name__}: {exc}"
        named = [int(n) for n in re.findall(r"request (\d+)", text)]
        if any(n != i for n in named):
            counts["misattributed"] += 1
        errors[prefix + re.sub(r"request \d+", "request N", text)] += 1

    signal.signal(signal.SIGINT, on_sigint)
    dev = model_runtime.DeviceManager().getDevice(1)
    session = model_runtime.Session(model)
    session.bindToDevice(dev)
    sender = threading.Thread(target=sigint, daemon=True)
    if how == "callbacks":
        current = [0]
        got: dict[int, np.ndarray] = {}

        def feed(name: str, k: int) -> Any:
            def cb(view: memoryview) -> None:
                i = current[0]
                if name == "tensor_A" and i % 7 == 0:
                    raise ValueError(f"input callback of request {i} failed")
                np.frombuffer(view, np.float32)[:] = value(i)[k].ravel()
            return cb

        def sink(view: memoryview) -> None:
            i = current[0]
            if i % 11 == 0:
                raise ValueError(f"output callback of request {i} failed")
            got[i] = np.frombuffer(view, np.float32).reshape(shape).copy()

        session.setCallbackForAnchor("tensor_A", feed("tensor_A", 0))
        session.setCallbackForAnchor("tensor_B", feed("tensor_B", 1))
        session.setCallbackForAnchor("tensor_C", sink)

        def one(i: int) -> None:
            current[0] = i
            got.pop(i, None)
            armed[0] = True
            try:
                session.runMainPrograms()
            finally:
                armed[0] = False
            out = got.get(i)
            if out is None:
                errors["no output for a run that returned"] += 1
            else:
                counts["right" if np.allclose(out, want(i), rtol=1e-6) else "wrong"] += 1
    else:
        qm = session.createQueueManager()
        rb = qm.inputs["tensor_A"].ringBuffer()
        outputs: list[tuple[int, np.ndarray]] = []
        if how == "queues_late":
            published_count = itertools.count(1)
            for queue in (*qm.inputs.values(), *qm.outputs.values()):
                ring = queue.ringBuffer()

                def late(item: Any, write: Any = ring.write) -> None:
                    write(item)
                    if armed[0] and not stop.is_set() and next(published_count) % 13 == 0:
                        raise KeyboardInterrupt
                ring.write = late   # type: ignore[method-assign]

        def published(queue: Any) -> int:
            """How many items the queue's ring has published (its public state line)."""
            state = queue.ringBuffer().getState()
            found = re.search(r"written=(\d+)", state)
            assert found is not None, state
            return int(found.group(1))

        def one(i: int) -> None:
            a, b = value(i)
            out = np.full(shape, -1.0, np.float32)
            request = [(qm.inputs["tensor_A"], a), (qm.inputs["tensor_B"], b),
                       (qm.outputs["tensor_C"], out)]
            before = [published(q) for q, _ in request]
            armed[0] = True
            try:
                # a request is its three enqueues and its run: the user keeps them together
                # (an interrupt inside does not undo the enqueues made)
                try:
                    for q, buf in request:
                        q.enqueue(buf, buf.nbytes)
                finally:
                    armed[0] = False
                    # finish the request's enqueues (no interrupt here: disarmed). Whether
                    # an interrupted enqueue took effect is read from its ring: the
                    # interrupt may land after the item was published (inside enqueue, or
                    # as it returns), and enqueuing it again would shift every later
                    # request by one item
                    for (q, buf), n in zip(request, before):
                        if published(q) == n:
                            q.enqueue(buf, buf.nbytes)
                    outputs.append((i, out))
                armed[0] = True
                session.runMainPrograms()
            finally:
                armed[0] = False
            # An interrupt that lands as runMainPrograms is entered (Python runs the handler
            # at the call's first instruction) means no run, as with a C++ binding: the
            # user cannot tell, and that request's transfer waits in the queues. A run that
            # returns has waited for every earlier one, so what is still queued is exact:
            # run Main for it (disarmed), so that the backlog never fills the queues.
            while rb.readAvailable():
                session.runMainPrograms()

    end = time.monotonic() + seconds
    i = 0
    sender.start()
    while time.monotonic() < end:
        i += 1
        try:
            one(i)
        except KeyboardInterrupt:
            counts["interrupted"] += 1
        except model_runtime.ModelRuntimeError as exc:
            note(i, exc)
    stop.set()
    sender.join()
    after = 0
    wrong_before = counts["wrong"]
    for k in range(10):
        i += 1
        try:
            one(i)
        except model_runtime.ModelRuntimeError as exc:
            note(i, exc, "after: ")
    if how != "callbacks":
        session.stop()      # every run has finished: each output buffer is final
        for j, out in outputs:
            ok = np.allclose(out, want(j), rtol=1e-6)
            counts["right" if ok else "wrong"] += 1
            if not ok:
                # what the buffer holds: never written (-1), or whose result
                whose = [k for k in range(max(1, j - 50), i + 1)
                         if np.allclose(out, want(k), rtol=1e-6)]
                detail.append(f"request {j} of {i}: " + (
                    "never written" if np.all(out == -1.0) else f"holds request {whose}'s"))
            if not ok and j > i - 10:
                after += 1
    else:
        after = counts["wrong"] - wrong_before
    session.close()
    dev.close()
    left = sorted(o.entry for o in list_objects() if o.pid == me)
    print("RESULT " + json.dumps({"right": counts["right"], "wrong": counts["wrong"],
                                  "interrupted": counts["interrupted"],
                                  "misattributed": counts["misattributed"],
                                  "errors": dict(errors), "wrong_after": after, "left": left,
                                  "wrong_detail": detail[:10]}),
          flush=True)


if __name__ == "__main__":
    main(sys.argv[1], float(sys.argv[2]), sys.argv[3])
