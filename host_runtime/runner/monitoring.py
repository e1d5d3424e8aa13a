"""Per-replica request tracepoints and the statistics ModelRunner reports.

Every request records four instants (``time.perf_counter_ns``)::

    received --read preparation--> prepared --read queue--> started --computation--> completed
    |<------------------------------- request ------------------------------------->|

- *read preparation*: checking the request and building it (before it is queued);
- *read queue*: waiting for the replica (another thread's request), for free input
  slots, laying the inputs into them, and waiting behind earlier requests until
  the device takes it (``started`` = the later of ``laid``, when its inputs are in
  the rings, and the completion of the request before it on the same replica: the
  device runs one request at a time);
- *computation*: from then until its outputs are back on the host.

The timeline (``ipu_emulator.trace``) shows the same instants, and splits these
phases further (docs/tracing.md).

The last ``request_tracepoints_buffer_size`` traces are kept (0 = all);
means and percentiles are over those, counts are over every request. Key
names are the seeds' (seed 001 section 3.8, seed 002 10.1.3).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import NamedTuple, Optional

import numpy as np

from host_runtime.errors import BadRequestError

__all__ = ["RequestMonitor", "MonitorSnapshot", "PHASES"]

PHASES = ("request", "read_preparation", "read_queue", "computation")


class MonitorSnapshot(NamedTuple):
    """What :meth:`RequestMonitor.snapshot` returns (durations in microseconds)."""

    requests: int                                    # every request recorded
    sums_us: dict[str, float]                        # phase -> sum over every request
    quantiles_us: dict[str, list[tuple[float, float]]]   # phase -> [(q, value)], buffer
    errors: dict[str, int]                           # error class name -> failed requests
    buffered: int                                    # traces the quantiles are over
    resets: dict[str, int] = {}                      # error class name -> auto_resets after it


class RequestMonitor:
    """Tracepoints of one replica's requests, bounded by ``buffer_size`` (0 = unbounded)."""

    def __init__(self, buffer_size: int = 1000) -> None:
        if int(buffer_size) < 0:
            raise BadRequestError(
                f"request_tracepoints_buffer_size must be >= 0, got {buffer_size}")
        maxlen: Optional[int] = int(buffer_size) or None
        # (received, prepared, started, completed) in ns: phases are worked out when read
        self._traces: deque[tuple[int, int, int, int]] = deque(maxlen=maxlen)
        self._count = 0
        # sums of each instant over every request (ns): phase sums are their differences
        self._sum_received = self._sum_prepared = self._sum_started = self._sum_completed = 0
        self._errors: dict[str, int] = {}   # failed requests by error class
        self._resets: dict[str, int] = {}   # auto_resets by the class of the error before
        self._last_completed = 0
        self._lock = threading.Lock()
        # (received, prepared, completed, laid) of requests recorded with defer(), in order
        self._deferred: deque[tuple[int, int, int, int]] = deque()

    def record(self, received_ns: int, prepared_ns: int, completed_ns: int,
               laid_ns: int = 0) -> int:
        """Record one finished request; its start is inferred (see module docstring) and
        returned. ``laid_ns``: when its inputs were in the rings (0: ``prepared_ns``).

        ~0.5 us (a lock, four sums): the instants are stored as they are and the phases
        worked out when read. Requests deferred before it are recorded first."""
        with self._lock:
            if self._deferred:
                self._settle_locked()
            return self._add(received_ns, prepared_ns, completed_ns, laid_ns)

    def defer(self, received_ns: int, prepared_ns: int, completed_ns: int,
              laid_ns: int = 0) -> None:
        """``record``, done later: by the next :meth:`settle` (``execute``'s fused path
        calls it while the device computes its next request, off that request's path),
        the next ``record`` or any read. ~0.1 us; the order of requests is kept."""
        self._deferred.append((received_ns, prepared_ns, completed_ns, laid_ns))

    def settle(self) -> None:
        """Record the deferred requests."""
        if self._deferred:
            with self._lock:
                self._settle_locked()

    def _settle_locked(self) -> None:
        d = self._deferred
        while d:
            try:
                received, prepared, completed, laid = d.popleft()
            except IndexError:   # taken by another settle meanwhile
                break
            self._add(received, prepared, completed, laid)

    def _add(self, received_ns: int, prepared_ns: int, completed_ns: int,
             laid_ns: int) -> int:
        """Store one request (the caller holds ``_lock``); returns its inferred start."""
        if not laid_ns:
            laid_ns = prepared_ns
        last = self._last_completed
        # started = max(laid, min(last completion, completed))
        if last <= laid_ns:
            started = laid_ns
        else:
            started = last if last < completed_ns else completed_ns
        if completed_ns > last:
            self._last_completed = completed_ns
        self._traces.append((received_ns, prepared_ns, started, completed_ns))
        self._sum_received += received_ns
        self._sum_prepared += prepared_ns
        self._sum_started += started
        self._sum_completed += completed_ns
        self._count += 1
        return started

    @staticmethod
    def _phases(trace: tuple[int, int, int, int]) -> tuple[float, float, float, float]:
        """(request, read preparation, read queue, computation) in us of a stored trace."""
        received, prepared, started, completed = trace
        return ((completed - received) / 1e3, (prepared - received) / 1e3,
                (started - prepared) / 1e3, (completed - started) / 1e3)

    def record_error(self, error: BaseException) -> None:
        """Count one failed request by the class of its error."""
        name = type(error).__name__
        with self._lock:
            self._errors[name] = self._errors.get(name, 0) + 1
        try:
            error._ipu_monitored = True  # type: ignore[attr-defined]
        except AttributeError:  # pragma: no cover - an exception class with __slots__
            pass

    def record_reset(self, error: BaseException | None) -> None:
        """Count one reset of the replica (``auto_reset``) by the class of the error that
        made it needed."""
        name = type(error).__name__ if error is not None else "DeviceLostError"
        with self._lock:
            self._resets[name] = self._resets.get(name, 0) + 1

    def record_raised(self, error: BaseException) -> None:
        """Count an error a call raised, unless it is a failed request's, counted already."""
        if not getattr(error, "_ipu_monitored", False):
            self.record_error(error)

    def snapshot(self, quantiles: tuple[float, ...] = ()) -> "MonitorSnapshot":
        """Counts and sums over every request, errors by class, and the ``quantiles``
        of each phase over the buffered traces (all durations in microseconds)."""
        self.settle()
        with self._lock:
            count, errors, resets = self._count, dict(self._errors), dict(self._resets)
            sums = self._phases((self._sum_received, self._sum_prepared, self._sum_started,
                                 self._sum_completed))
        m = self._matrix()
        qs = np.quantile(m, quantiles, axis=0) if len(m) and quantiles else None
        per_phase = {phase: [(q, float(qs[k][i]) if qs is not None else 0.0)
                             for k, q in enumerate(quantiles)]
                     for i, phase in enumerate(PHASES)}
        return MonitorSnapshot(count, dict(zip(PHASES, sums)), per_phase, errors, len(m),
                               resets)

    @property
    def count(self) -> int:
        self.settle()
        return self._count

    def __len__(self) -> int:
        self.settle()
        return len(self._traces)

    def time_trace(self, info: dict, cur: int = -1) -> dict:  # type: ignore[type-arg]
        """Durations of one request: the last one by default (``cur`` indexes the buffer)."""
        self.settle()
        with self._lock:
            if not self._traces:
                trace: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0)
            else:
                try:
                    trace = self._phases(self._traces[cur])
                except IndexError:
                    raise BadRequestError(
                        f"getTimeTrace: cur={cur} is out of range; the buffer holds "
                        f"{len(self._traces)} requests (use -1 for the last)") from None
        for phase, value in zip(PHASES, trace):
            info[f"{phase}_duration_us"] = float(value)
        return info

    def _matrix(self) -> np.ndarray:
        self.settle()
        with self._lock:
            if not self._traces:
                return np.zeros((0, 4))
            t = np.array(self._traces, dtype=np.int64)
        # the phases of _phases, column by column
        m = np.empty(t.shape, np.float64)
        m[:, 0] = t[:, 3] - t[:, 0]
        m[:, 1] = t[:, 1] - t[:, 0]
        m[:, 2] = t[:, 2] - t[:, 1]
        m[:, 3] = t[:, 3] - t[:, 2]
        m /= 1e3
        return m

    def percentile(self, info: dict, quantile: float = 0.9) -> dict:  # type: ignore[type-arg]
        q = float(quantile)
        if not 0.0 <= q <= 1.0:
            raise BadRequestError(
                f"getMonitoringStatisticsPercentile: quantile must be in [0, 1], got {quantile}")
        m = self._matrix()
        values = np.quantile(m, q, axis=0) if len(m) else np.zeros(4)
        for phase, value in zip(PHASES, values):
            info[f"{phase}_monitoring_statistics_percentile_us"] = float(value)
        return info

    def mean(self, info: dict) -> dict:  # type: ignore[type-arg]
        m = self._matrix()
        values = m.mean(axis=0) if len(m) else np.zeros(4)
        for phase, value in zip(PHASES, values):
            info[f"{phase}_monitoring_statistics_mean_us"] = float(value)
        return info

    def total_count(self, info: dict) -> dict:  # type: ignore[type-arg]
        self.settle()
        for phase in PHASES:
            info[f"{phase}_monitoring_statistics_count"] = float(self._count)
        return info

    def reset_chain(self) -> None:
        """Forget the last completion instant (after the device was restarted)."""
        with self._lock:
            self._settle_locked()
            self._last_completed = 0
