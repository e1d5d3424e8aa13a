"""ModelRunner's monitoring statistics as Prometheus metrics (``prometheus-client``).

``runner.metrics_collector()`` returns a collector the application registers
in its registry (``registry.register(collector)``); ``metrics_collector(
register_default=True)`` adds the runner to one process-wide collector
registered in ``prometheus_client.REGISTRY`` (served by
``prometheus_client.start_http_server``). A registry takes one collector of
these metrics: for several runners add them to one
(``registry.register(r1.metrics_collector().add(r2))``) or use the default one. Nothing is computed on the request
path: a scrape reads the runner's :class:`~host_runtime.runner.monitoring.RequestMonitor`
statistics (the ones ``getMonitoringStatistics*`` report). Runners are held
weakly: a runner the application dropped disappears from the scrape.

Metrics (labels ``model`` = the PopEF executable's name, ``replica``,
``runner`` = this process's runner number, unique among the collector's runners)::

    ipu_model_runner_requests_total                 requests completed
    ipu_model_runner_request_errors_total{error}    failed calls and requests by error
                                                    class (BadRequestError, DeviceLostError,
                                                    DeviceTimeoutError, ...)
    ipu_model_runner_resets_total{error}            auto_resets of a replica, by the class of
                                                    the error before it
    ipu_model_runner_faults_injected_total{kind}    Main runs an injected fault affected
                                                    (ipu_emulator.faults), by kind (label
                                                    replica "all": the schedule is the runner's)
    ipu_model_runner_request_seconds                summary per phase: _count and _sum
    ipu_model_runner_read_preparation_seconds       over every request, quantiles 0.5,
    ipu_model_runner_read_queue_seconds             0.9 and 0.99 over the last
    ipu_model_runner_computation_seconds            request_tracepoints_buffer_size ones

Summaries rather than histograms: the runner keeps exact per-request traces,
so quantiles come from those at scrape time at no cost per request, where
histogram buckets would be counted on the request path. An error is counted
once: when ``execute``/``executeAsync`` raises it, or when a queued request
fails with it (its future then raises the same, uncounted again).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from typing import Iterable, Iterator, Protocol

from prometheus_client import REGISTRY
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from host_runtime.popef.model import Model
from host_runtime.runner.monitoring import PHASES, RequestMonitor

__all__ = ["ModelRunnerCollector", "collector_for", "default_collector", "QUANTILES", "PREFIX",
           "MonitoredRunner"]


class MonitoredRunner(Protocol):
    """What a collector reads of a ``ModelRunner``: its model and one monitor per replica.
    (A protocol, so that this module, imported lazily, does not import the runner's.)"""

    def request_monitors(self) -> list[RequestMonitor]: ...
    def faults_injected(self) -> dict[str, int]: ...

    @property
    def model(self) -> Model: ...


PREFIX = "ipu_model_runner"
QUANTILES = (0.5, 0.9, 0.99)
_LABELS = ["model", "replica", "runner"]
_HELP = {
    "request": "time from the request's arrival to its outputs being back on the host",
    "read_preparation": "time validating the request and writing its inputs to the device",
    "read_queue": "time waiting behind earlier requests of the replica",
    "computation": "time from the device taking the request to its outputs being back",
}
_numbers = itertools.count()
_number_of: "weakref.WeakKeyDictionary[MonitoredRunner, str]" = weakref.WeakKeyDictionary()
_number_lock = threading.Lock()


def _runner_number(runner: MonitoredRunner) -> str:
    with _number_lock:
        num = _number_of.get(runner)
        if num is None:
            num = _number_of[runner] = str(next(_numbers))
        return num


def _model_name(runner: MonitoredRunner) -> str:
    try:
        return str(runner.model.metadata.executable())
    except Exception:   # pragma: no cover - a model without metadata
        return ""


class ModelRunnerCollector(Collector):
    """Collects the statistics of the runners added to it (held weakly)."""

    def __init__(self, runners: Iterable[MonitoredRunner] = ()) -> None:
        self._runners: "weakref.WeakSet[MonitoredRunner]" = weakref.WeakSet()
        self._lock = threading.Lock()
        for r in runners:
            self.add(r)

    def add(self, runner: MonitoredRunner) -> "ModelRunnerCollector":
        _runner_number(runner)
        with self._lock:
            self._runners.add(runner)
        return self

    def discard(self, runner: MonitoredRunner) -> None:
        with self._lock:
            self._runners.discard(runner)

    def runners(self) -> list[MonitoredRunner]:
        with self._lock:
            return sorted(self._runners, key=lambda r: int(_runner_number(r)))

    def describe(self) -> list[Metric]:
        return list(self._families())

    def collect(self) -> Iterator[Metric]:
        rows: list[tuple[list[str], RequestMonitor]] = []
        faults: list[tuple[list[str], dict[str, int]]] = []
        for runner in self.runners():
            model, num = _model_name(runner), _runner_number(runner)
            monitors = runner.request_monitors()
            rows += [([model, str(rid), num], mon) for rid, mon in enumerate(monitors)]
            faults.append(([model, "all", num], runner.faults_injected()))
        return iter(self._families(rows, faults))

    def _families(self, rows: list[tuple[list[str], RequestMonitor]] | None = None,
                  faults: list[tuple[list[str], dict[str, int]]] | None = None
                  ) -> list[Metric]:
        requests = CounterMetricFamily(f"{PREFIX}_requests", "requests completed", labels=_LABELS)
        errors = CounterMetricFamily(f"{PREFIX}_request_errors",
                                     "requests failed, by the class of their error",
                                     labels=_LABELS + ["error"])
        resets = CounterMetricFamily(f"{PREFIX}_resets",
                                     "auto_resets of a replica, by the class of the error "
                                     "before it", labels=_LABELS + ["error"])
        injected = CounterMetricFamily(f"{PREFIX}_faults_injected",
                                       "Main runs an injected fault affected, by kind",
                                       labels=_LABELS + ["kind"])
        for labels, counts in faults or ():
            for kind, n in sorted(counts.items()):
                injected.add_metric(labels + [kind], n)
        phases = {p: Metric(f"{PREFIX}_{p}_seconds", _HELP[p], "summary") for p in PHASES}
        for labels, mon in rows or ():
            snap = mon.snapshot(QUANTILES)
            requests.add_metric(labels, snap.requests)
            for name, n in sorted(snap.errors.items()):
                errors.add_metric(labels + [name], n)
            for name, n in sorted(snap.resets.items()):
                resets.add_metric(labels + [name], n)
            values = dict(zip(_LABELS, labels))
            for p, fam in phases.items():
                for q, v in snap.quantiles_us[p]:
                    fam.add_sample(fam.name, dict(values, quantile=repr(q)), v / 1e6)
                fam.add_sample(fam.name + "_count", values, float(snap.requests))
                fam.add_sample(fam.name + "_sum", values, snap.sums_us[p] / 1e6)
        return [requests, errors, resets, injected, *phases.values()]


_default: ModelRunnerCollector | None = None
_default_lock = threading.Lock()


def default_collector() -> ModelRunnerCollector:
    """The process-wide collector, registered in ``prometheus_client.REGISTRY`` once."""
    global _default
    with _default_lock:
        if _default is None:
            _default = ModelRunnerCollector()
            REGISTRY.register(_default)
        return _default


def collector_for(runner: MonitoredRunner, register_default: bool = False) -> ModelRunnerCollector:
    """A collector of ``runner`` alone, or (``register_default``) the default one with
    ``runner`` added."""
    if register_default:
        return default_collector().add(runner)
    return ModelRunnerCollector([runner])
