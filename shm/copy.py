"""Copies of large transfers, shared with a helper thread.

While one side of the wire copies a large transfer (the host an input into its
ring slot or an output out of one, an IPU process an input it forwards to an
output) the other side waits for it, so a core is often idle: a helper thread
copies part of the bytes meanwhile (numpy releases the GIL while it copies).
Each process makes its own helper at its first large copy (a forked child too).

The bytes are cut into chunks of ``CHUNK_BYTES`` that both threads take in turn
from one counter, so neither waits for the other's share: when the machine is
busy and the helper is not scheduled, the caller copies every chunk itself and
waits at most for the one chunk the helper has started (a fixed split in halves
would wait for the helper's whole half). Below ``PARALLEL_MIN_BYTES`` a single
copy is faster than the hand-over.

A copy this large is written with non-temporal stores (``stream_copy`` of the C
core, numpy's copy without it): its bytes are read next by the other process on
the other core, or by the caller after more than its core's cache holds, so a
store that first reads the line it overwrites (what a cached store does) only
doubles the traffic. Measured on a 16 MiB round trip between two processes: 3.0-
4.0 ms against 3.3-5.4 with cached stores.
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Any, Optional

import numpy as np

__all__ = ["copy_bytes", "PARALLEL_MIN_BYTES", "CHUNK_BYTES"]

PARALLEL_MIN_BYTES = 4 << 20
CHUNK_BYTES = 1 << 20
_U8 = np.dtype(np.uint8)
_ONE = (os.cpu_count() or 1) < 2

_PENDING, _STARTED, _CLOSED = 0, 1, 2

try:   # the C core's copy with non-temporal stores (see the module docstring)
    from shm._ringcore import stream_copy as _stream
except ImportError:   # built without the C extension: numpy's copies
    _stream = None


class _Job:
    """One copy in chunks, whose numbers both threads take from ``chunks``."""

    __slots__ = ("dst", "src", "chunks", "lock", "state", "done", "error")

    def __init__(self, dst: np.ndarray, src: np.ndarray) -> None:
        self.dst, self.src = dst, src
        # one iterator for both threads: each next() is one step of C under the GIL
        self.chunks = iter(range(-(-len(dst) // CHUNK_BYTES)))
        self.lock = threading.Lock()
        self.state = _PENDING
        self.done = threading.Lock()
        self.done.acquire()            # released by the helper when it has finished
        self.error: BaseException | None = None

    def work(self) -> None:
        dst, src = self.dst, self.src
        n = len(dst)
        for k in self.chunks:
            lo = k * CHUNK_BYTES
            hi = lo + CHUNK_BYTES
            if _stream is not None:
                _stream(dst, src, lo, hi if hi < n else n)
            else:
                np.copyto(dst[lo:hi], src[lo:hi])


def _serve(jobs: "queue.SimpleQueue[_Job]") -> None:
    while True:
        job = jobs.get()
        with job.lock:
            if job.state == _CLOSED:     # the caller copied it all before we started
                continue
            job.state = _STARTED
        try:
            job.work()
        except BaseException as exc:     # handed to the caller, which raises it
            job.error = exc
        finally:
            job.done.release()


_lock = threading.Lock()
_jobs: Optional["queue.SimpleQueue[_Job]"] = None
_jobs_pid = 0


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()   # a thread of the parent may have held it at the fork


os.register_at_fork(after_in_child=_after_fork_in_child)


def _helper() -> "queue.SimpleQueue[_Job]":
    global _jobs, _jobs_pid
    jobs = _jobs
    if jobs is not None and _jobs_pid == os.getpid():
        return jobs
    with _lock:
        # a forked child inherits the queue but not the thread: make its own
        if _jobs is None or _jobs_pid != os.getpid():
            _jobs = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(_jobs,), name="ipu-emulator-copy",
                             daemon=True).start()
            _jobs_pid = os.getpid()
        return _jobs


def copy_bytes(dst: Any, src: Any) -> None:
    """``dst[:] = src`` for two byte buffers of the same length (memoryviews or arrays)."""
    n = len(dst)
    if n < PARALLEL_MIN_BYTES:
        dst[:] = src
        return
    if _ONE:
        if _stream is not None:
            _stream(dst, src, 0, n)
        else:
            dst[:] = src
        return
    job = _Job(np.frombuffer(dst, _U8), np.frombuffer(src, _U8))
    _helper().put(job)
    job.work()
    with job.lock:
        started = job.state == _STARTED
        job.state = _CLOSED
    if started:
        job.done.acquire()
        error, job.error = job.error, None
        if error is not None:
            try:
                raise error
            finally:   # (this frame holding the error it raised: a reference cycle)
                del error
