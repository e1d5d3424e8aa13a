"""The ``interrupt`` scenario's parts, inside a host of ``ipu-emulator stress``
(``tools._stress_host``).

- :class:`Interrupter`: every few milliseconds a KeyboardInterrupt lands in a random
  worker thread while that thread is inside a call of the runtime (``execute``,
  ``executeAsync``, waiting on a future, ``runMainPrograms``): in the main thread through
  a real SIGINT whose handler raises, in the other threads as an asynchronous exception
  (``PyThreadState_SetAsyncExc``: what a signal handler's exception is to the thread it
  lands in; Python runs signal handlers in the main thread only). The request it hits is
  abandoned (counted as failed as expected); every other answer must be right.
- :class:`CallbackSession`: a Session with a QueueManager on a device of its own, run by
  a thread of its own: each request enqueues its inputs and its output buffer, then runs
  Main; some of the queues' user callbacks raise (once each), and the interrupter hits
  ``runMainPrograms`` too. A run a callback made fail raises the callback's error
  (counted as failed as expected); every output buffer must end up holding its own
  request's result.
"""

from __future__ import annotations

import ctypes
import os
import random
import signal
import threading
import time
from typing import Any, Callable

import numpy as np

from tools._stress_spec import HostSpec

__all__ = ["Interrupter", "CallbackSession"]

_MAIN = 0   # the worker id of the main thread


def _async_raise(ident: int, exc: type[BaseException] | None) -> bool:
    """Raise ``exc`` in thread ``ident`` at its next check (None: withdraw a pending one);
    whether it was sent.

    Never while a thread is being started: CPython (3.11) gives a new thread's state its
    starter's ident until the thread runs, and PyThreadState_SetAsyncExc sets the first
    state of that ident, the new one's. The runtime's own threads (a watchdog a worker
    starts) must not get the worker's interrupt: while ``threading.enumerate()`` lists
    a thread that is not alive (being started, or ending), nothing is sent."""
    if exc is not None and not all(t.is_alive() for t in threading.enumerate()):
        return False
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(ident), ctypes.py_object(exc) if exc is not None else None)
    return True


class Interrupter:
    """KeyboardInterrupts into the workers that are inside a runtime call (``call``).

    Worker ``0`` must be the main thread (it gets real SIGINTs). ``delivered`` counts
    the interrupts sent. A worker's "armed" mark is a plain store set before its ``try``
    and cleared first thing in its ``finally`` (no call in between, so no exception can
    skip either): a thread that is not inside a runtime call is never a target."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._armed: dict[int, int] = {}      # worker id -> thread ident (0: not armed)
        self.delivered = 0
        signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self._armed.get(_MAIN):
            raise KeyboardInterrupt

    def call(self, tid: int, action: Callable[[], Any]) -> Any:
        """``action()``, open to interrupts while it runs (worker ``tid``, this thread)."""
        armed = self._armed
        ident = threading.get_ident()
        armed[tid] = ident
        try:
            return action()
        finally:
            armed[tid] = 0
            if tid != _MAIN:
                with self._lock:    # one sent as the call ended must not land later
                    _async_raise(ident, None)

    def run(self, over: Callable[[], bool]) -> None:
        """Until ``over()`` (the host's deadline or request budget): an interrupt every
        5-40 ms."""
        me = os.getpid()
        while not over():
            time.sleep(self._rng.uniform(0.005, 0.04))
            with self._lock:
                targets = [(tid, ident) for tid, ident in list(self._armed.items()) if ident]
                if not targets:
                    continue
                tid, ident = self._rng.choice(targets)
                if tid == _MAIN:
                    os.kill(me, signal.SIGINT)
                elif not _async_raise(ident, KeyboardInterrupt):
                    continue
                self.delivered += 1

    def close(self) -> None:
        signal.signal(signal.SIGINT, signal.default_int_handler)


class CallbackSession:
    """A Session and QueueManager whose user callbacks raise now and then (see above)."""

    def __init__(self, spec: HostSpec) -> None:
        import host_runtime as mr
        from host_runtime import popef

        self.mr = mr
        model = popef.load_model([spec.models.model])
        anchor, data = model.metadata.anchor("tensor_A"), model.tensorData("weights")
        if anchor is None or data is None:
            raise ValueError(f"{spec.models.model}: not the example model (tensor_A, weights)")
        shape = tuple(anchor.tensorInfo().shape())
        self.w: np.ndarray = np.frombuffer(data.data, np.float32).reshape(shape)
        self.device = mr.DeviceManager().getDevice(1)
        try:
            self.session = mr.Session(spec.models.model)
            self.session.bindToDevice(self.device)
            self.qm = self.session.createQueueManager()
        except BaseException:
            self.device.close()
            raise
        self.buffers: list[tuple[int, np.ndarray, np.ndarray]] = []   # (request, out, want)

    def run(self, tally: Any, interrupter: Interrupter, tid: int, over: Callable[[], bool],
            seed: int) -> None:
        """Requests until ``over()`` (the host's deadline or request budget); then the
        runs the failed ones left over, and the check of every output buffer."""
        rng, r = np.random.default_rng(seed), random.Random(seed)
        shape = self.w.shape
        rb = self.qm.inputs["tensor_A"].ringBuffer()
        i = 0
        while not over():
            i += 1
            a = rng.standard_normal(shape).astype(np.float32)
            b = rng.standard_normal(shape).astype(np.float32)
            out = np.full(shape, np.nan, np.float32)
            fail_in = r.random() < 0.1
            fail_out = r.random() < 0.1
            self.qm.inputs["tensor_A"].enqueue(
                a, a.nbytes, read_complete_callback=_Once(f"input of request {i}")
                if fail_in else None)
            self.qm.inputs["tensor_B"].enqueue(b, b.nbytes)
            self.qm.outputs["tensor_C"].enqueue(
                out, out.nbytes, write_complete_callback=_Once(f"output of request {i}")
                if fail_out else None)
            self.buffers.append((i, out, a * self.w + b))
            self._run_main(tally, interrupter, tid)
            # a run a callback made fail left its inputs queued (an interrupted one goes on
            # on the device): serve what is left before queueing more
            for _ in range(8):
                if not rb.readAvailable():
                    break
                self._run_main(tally, interrupter, tid)
        for _ in range(8):
            if not rb.readAvailable():
                break
            self._run_main(tally, None, tid)
        self.session.stop()   # every run has ended: the buffers are final
        for k, out, want in self.buffers:
            if np.allclose(out, want, rtol=1e-5, atol=1e-5):
                with tally.lock:
                    tally.ok += 1
            else:
                tally.problem("wrong", f"queue request {k}: its output buffer holds "
                              f"{out.ravel()[:3].tolist()}, want {want.ravel()[:3].tolist()}")

    def _run_main(self, tally: Any, interrupter: Interrupter | None, tid: int) -> None:
        try:
            if interrupter is None:
                self.session.runMainPrograms()
            else:
                interrupter.call(tid, self.session.runMainPrograms)
        except KeyboardInterrupt:
            with tally.lock:
                tally.expected += 1
        except self.mr.DeviceExecutionError as exc:
            if "raised ValueError: injected failure of the callback of" in str(exc):
                with tally.lock:
                    tally.expected += 1
            else:
                tally.problem("errors", f"queue run: {type(exc).__name__}: {exc}")

    def close(self) -> None:
        try:
            self.session.close()
        finally:
            self.device.close()


class _Once:
    """A queue callback that raises the first time it is called."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.raised = False

    def __call__(self) -> None:
        if not self.raised:
            self.raised = True
            raise ValueError(f"injected failure of the callback of the {self.what}")
