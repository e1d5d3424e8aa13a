"""One inference request in flight, the transfers that carry it to the device, and the
future ``executeAsync`` returns.

A request holds typed views of the user's inputs (borrowed, not copied), the
typed destinations of its outputs (user memory or memory the runner
allocated), how many of its samples are still on the device, and its
tracepoints. It is completed by whichever thread drains the replica's output
rings (see ``_replica``): waiting on a future *drives* the replica instead
of handing work to another thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Optional, Protocol

import numpy as np

from host_runtime._again import again
from host_runtime._fork import current_pid, foreign, forked_error
from host_runtime.errors import DeviceTimeoutError
from host_runtime.runner._batching import TensorSpec

if TYPE_CHECKING:  # pragma: no cover
    from host_runtime.runner._host_tail import HostTail

__all__ = ["Request", "Transfer", "OutputFuture", "Driver"]


class Driver(Protocol):
    """The replica engine a request runs on."""

    def wait_for(self, request: "Request", timeout: float | None) -> bool: ...

    def record_error(self, error: BaseException, request: "Request | None" = None) -> None:
        """``request`` of this engine failed with ``error``: count it (monitoring,
        metrics), and draw it on a timeline being recorded."""


class Request:
    __slots__ = ("driver", "replica", "samples", "inputs", "given", "dests", "results",
                 "remaining", "error", "done", "t_received", "t_prepared", "t_completed",
                 "t_laid", "trace", "outputs_per_transfer", "internal", "description",
                 "__weakref__")

    def __init__(self, driver: Driver, replica: int, samples: int,
                 inputs: dict[str, np.ndarray], dests: dict[str, Optional[np.ndarray]],
                 results: dict[str, Any], outputs_per_transfer: list[tuple[TensorSpec, ...]],
                 t_received: int, internal: bool = False,
                 given: Optional[dict[str, np.ndarray]] = None) -> None:
        self.driver = driver
        self.replica = replica
        self.samples = samples
        self.inputs = inputs          # name -> typed view the device reads, shape_for(samples)
        self.given = given if given is not None else inputs   # every input the caller gave
        self.dests = dests            # output name -> typed destination (absent: discard)
        self.results = results        # output name -> what the user gets back
        # for each transfer, the output TensorSpecs the device writes (fused: per sub-graph)
        self.outputs_per_transfer = outputs_per_transfer
        self.remaining = 0            # segments of this request still on the device
        self.error: BaseException | None = None
        # Done: waiters drive the replica (Driver.wait_for) until it is set; no event. Set
        # first (before anything that can raise, e.g. a KeyboardInterrupt at a call's
        # return), so that a request is never left finished but not done.
        self.done = False
        self.t_received = t_received
        self.t_prepared = t_received   # checked and built, before it is sent
        self.t_laid = t_received       # its inputs are in the rings
        self.t_completed = 0
        self.trace: Optional[list[Any]] = None   # timeline instants (runner._tracing), if on
        self.internal = internal      # a flush or dummy request (no user, no statistics)
        self.description = ""

    # called by the replica engine, with its lock held
    def finish(self) -> None:
        if self.done:
            return
        self.done = True
        self.t_completed = time.perf_counter_ns()

    def fail(self, error: BaseException) -> None:
        if self.done:
            return
        self.error = error
        self.done = True
        self.t_completed = time.perf_counter_ns()
        if not self.internal:
            self.driver.record_error(error, self)   # monitoring (metrics), timeline

    def is_done(self) -> bool:
        return self.done

    def name(self) -> str:
        """What errors call it (``description`` when one was given)."""
        return self.description or f"request to replica {self.replica}"


@dataclass(slots=True, init=False)
class Transfer:
    """One Main iteration on the device: a slot of every input it reads.

    A transfer with no segments is *abandoned*: its inputs reached the device but
    nobody wants its outputs (the request was interrupted); it is drained like any
    other, in its place, and its outputs are dropped, so that the next request reads
    its own."""

    segments: list[tuple[Request, int, int, int]]   # (request, request unit, units, slot unit)
    outputs: tuple[TensorSpec, ...]                  # outputs the device writes for it
    published: bool
    next_output: int
    t_open: float                                    # monotonic time the partial was opened
    samples: int                                     # dynamic batching: samples filled
    slots: dict[str, np.ndarray]                     # open partial's slots
    flush_asked: bool                                # flush_callback called for this partial
    flush_extra: Optional[Request]                   # what it gave, not yet packed
    seq: int                                         # its sequence number on the wire (1, 2, ...)
    t_first: int                                     # tracing: its first output read (ns)
    unsettled: bool                                  # a read of it was interrupted and not
                                                     # yet sorted out (_completion)
    settled: int                                     # segments counted down once read

    def __init__(self, segments: list[tuple[Request, int, int, int]],
                 outputs: tuple[TensorSpec, ...], t_open: float = 0.0) -> None:
        # written out: the generated __init__ with a default_factory took ~0.7 us, this ~0.25
        self.segments = segments
        self.outputs = outputs
        self.published = False
        self.next_output = 0
        self.t_open = t_open
        self.samples = 0
        self.slots = {}
        self.flush_asked = False
        self.flush_extra = None
        self.seq = 0
        self.t_first = 0
        self.unsettled = False
        self.settled = 0


class OutputFuture:
    """The future result of ``executeAsync``: ``wait()``, then ``future[name]``.

    Like the C++ map of shared futures: iterating yields the output names;
    ``future[name]`` waits and returns that output (``TensorMemory`` for
    runner-allocated outputs, ``TensorMemoryView`` over the user's memory
    otherwise) or raises the request's error.
    """

    __slots__ = ("_request", "_owner_pid", "_tail", "_tail_out")

    def __init__(self, request: Request, tail: "HostTail | None" = None) -> None:
        self._request = request
        self._owner_pid = current_pid()
        self._tail = tail                               # the model's host-side tail
        self._tail_out: dict[str, Any] | None = None    # its outputs, once computed

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the result (or an error) is available; False if ``timeout`` passed.

        DeviceTimeoutError when the device made no progress for the host sync timeout
        (``IPU_EMULATOR_HOST_SYNC_TIMEOUT``, counted from the device's last progress, however
        it is polled; the request, and every other in flight on its replica, then fails
        with it);
        ForkedProcessError in a process forked from the one that made the request."""
        if foreign(self._owner_pid):
            raise forked_error("OutputFuture", self._owner_pid)
        r = self._request
        if r.is_done():
            return True
        return r.driver.wait_for(r, timeout)

    def done(self) -> bool:
        if foreign(self._owner_pid):
            raise forked_error("OutputFuture", self._owner_pid)
        r = self._request
        if r.is_done():
            return True
        try:   # a poll drives the replica too: it may find the device silent (all fail)
            return r.driver.wait_for(r, 0.0)
        except DeviceTimeoutError:
            if r.is_done():
                return True
            raise

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._wait_or_raise(timeout)
        return self._request.error

    def result(self, timeout: float | None = None) -> dict[str, Any]:
        """All outputs as a dict; raises the request's error."""
        self._wait_or_raise(timeout)
        r = self._request
        if r.error is not None:
            raise again(r.error)
        out = dict(r.results)
        if self._tail is not None:
            if self._tail_out is None:
                self._tail_out = self._tail.run(out)
            out.update(self._tail_out)
        return out

    def _wait_or_raise(self, timeout: float | None) -> None:
        if not self.wait(timeout):
            raise DeviceTimeoutError(
                f"the result of {self._request.name()} was not "
                f"available within {timeout:g} s")

    def __getitem__(self, name: str) -> Any:
        results = self.result()
        try:
            return results[name]
        except KeyError:
            raise KeyError(f"the request has no output {name!r}; it has "
                           + ", ".join(sorted(results))) from None

    def get(self, name: str, default: Any = None) -> Any:
        return self.result().get(name, default)

    def _names(self) -> list[str]:
        names = list(self._request.results)
        return names + self._tail.outputs if self._tail is not None else names

    def keys(self) -> list[str]:
        return self._names()

    def values(self) -> list[Any]:
        return list(self.result().values())

    def items(self) -> list[tuple[str, Any]]:
        return list(self.result().items())

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    def __contains__(self, name: object) -> bool:
        return name in self._names()

    def __repr__(self) -> str:
        r = self._request
        state = "pending" if not r.is_done() else ("failed" if r.error else "done")
        return f"<OutputFuture {state} outputs={list(r.results)} replica={r.replica}>"
