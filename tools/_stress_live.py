"""Live counters of ``ipu-emulator stress``: a progress line per scenario and ``/metrics``.

Each host process prints ``PROGRESS <ok> <expected> <wrong> <hung> <errors>
<cycles> <latency seconds>`` (its running totals) a few times a second; the
rig's reader thread keeps the last one per host (``HostProc.progress``).
:class:`LiveStats` sums them per scenario, adds what the orchestrator counts
itself (hosts started and killed, IPUs killed), and is read by:

- :class:`Progress`: on a terminal, one line per scenario rewritten in place
  (``\\r``) with requests, rate and failures so far; otherwise one plain line
  per scenario when it ends;
- :class:`StressCollector` (``--metrics-port``): the same counters for
  Prometheus, at scrape time::

    ipu_emulator_stress_requests_total{scenario,outcome}  ok, expected_failure, wrong,
                                                          hung, error
    ipu_emulator_stress_request_seconds{scenario}         summary (_count, _sum) of the
                                                          checked requests
    ipu_emulator_stress_hosts_started_total{scenario}
    ipu_emulator_stress_hosts_killed_total{scenario}
    ipu_emulator_stress_ipus_killed_total{scenario}
    ipu_emulator_stress_attach_cycles_total{scenario}
    ipu_emulator_stress_scenario_running{scenario}        1 while it runs
    ipu_emulator_stress_scenario_seconds{scenario}        time so far / it took
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol, TextIO

from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


from tools._stress_rig import _PROGRESS_FIELDS, HostProc


class Scenario(Protocol):
    """What the live statistics read of a running scenario (``tools.stress._Scenario``)."""

    name: str
    hosts: list[HostProc]
    result: "ScenarioResult"


@dataclass
class ScenarioResult:
    """What one scenario found."""
    name: str
    hosts: int = 0
    hosts_killed: int = 0
    ipus_killed: int = 0
    orphans_checked: int = 0     # IPU processes of killed hosts seen to exit (embedded mode)
    ok: int = 0
    expected: int = 0
    wrong: int = 0
    hung: int = 0
    errors: int = 0
    cycles: int = 0
    leaks: int = 0
    p50_ms: float | None = None
    p99_ms: float | None = None
    seconds: float = 0.0
    faults: int = 0              # runs an injected fault affected (the faults scenario)
    resets: int = 0              # replicas auto_reset (the faults scenario)
    recovery_ms: list[float] = field(default_factory=list)   # fault to next right answer
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not (self.wrong or self.hung or self.errors or self.leaks or self.problems) \
            and self.ok > 0

__all__ = ["LiveStats", "Progress", "ScenarioResult", "StressCollector", "FIELDS"]

FIELDS = _PROGRESS_FIELDS
_OUTCOMES = (("ok", "ok"), ("expected", "expected_failure"), ("wrong", "wrong"),
             ("hung", "hung"), ("errors", "error"))
PREFIX = "ipu_emulator_stress"


class _Entry:
    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.started = time.monotonic()
        self.ended: float | None = None
        self.final: "ScenarioResult | None" = None

    def totals(self) -> dict[str, float]:
        sums = dict.fromkeys(FIELDS, 0.0)
        for host in list(self.scenario.hosts):
            for k, v in host.progress.items():
                sums[k] = sums.get(k, 0.0) + v
        final = self.final
        if final is not None:   # the hosts' result files are the last word
            for k in ("ok", "expected", "wrong", "hung", "errors", "cycles"):
                sums[k] = float(getattr(final, k))
        return sums

    def seconds(self) -> float:
        return (self.ended if self.ended is not None else time.monotonic()) - self.started


class LiveStats:
    """The scenarios of a run, as they go (thread-safe reads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: list[_Entry] = []

    def begin(self, scenario: Scenario) -> None:
        with self._lock:
            self._entries.append(_Entry(scenario))

    def end(self, result: "ScenarioResult") -> None:
        with self._lock:
            entry = self._entries[-1]
            entry.ended = time.monotonic()
            entry.final = result

    def entries(self) -> list[_Entry]:
        with self._lock:
            return list(self._entries)

    def current(self) -> _Entry | None:
        with self._lock:
            return self._entries[-1] if self._entries else None


def describe(entry: _Entry) -> str:
    t = entry.totals()
    requests = int(t["ok"] + t["expected"] + t["wrong"] + t["errors"])
    secs = entry.seconds()
    failures = int(t["wrong"] + t["hung"] + t["errors"])
    r = entry.scenario.result
    extra = (f", {r.hosts_killed} hosts killed" if r.hosts_killed else "") + \
        (f", {r.ipus_killed} ipus killed" if r.ipus_killed else "") + \
        (f", {int(t['expected'])} failed as expected" if t["expected"] else "")
    return (f"scenario {entry.scenario.name}: {requests} requests, "
            f"{requests / secs if secs > 0 else 0.0:.0f}/s, {failures} failures{extra}, "
            f"{secs:.1f} s")


class Progress:
    """Shows each scenario's progress on ``stream``: rewritten in place on a terminal (a
    thread redraws it), one plain line per scenario otherwise."""

    def __init__(self, live: LiveStats, stream: TextIO | None = None,
                 interval: float = 0.5) -> None:
        self.live = live
        self.stream = stream if stream is not None else sys.stdout
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.interval = interval
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._width = 0
        self._thread: threading.Thread | None = None
        if self.tty:
            self._thread = threading.Thread(target=self._redraw, name="stress-progress",
                                            daemon=True)
            self._thread.start()

    def _write(self, text: str, final: bool) -> None:
        with self._lock:
            if self.tty:
                pad = max(0, self._width - len(text))
                self.stream.write("\r" + text + " " * pad + ("\n" if final else ""))
                self._width = 0 if final else len(text)
            elif final:
                self.stream.write(text + "\n")
            self.stream.flush()

    def _redraw(self) -> None:
        while not self._stop.wait(self.interval):
            entry = self.live.current()
            if entry is not None and entry.final is None:
                self._write(describe(entry), final=False)

    def scenario_done(self) -> None:
        entry = self.live.current()
        if entry is not None:
            self._write(describe(entry), final=True)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)


class StressCollector(Collector):
    """The run's live counters for Prometheus, read at scrape time."""

    def __init__(self, live: LiveStats) -> None:
        self.live = live

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(f"{PREFIX}_requests", "requests checked, by outcome",
                                       labels=["scenario", "outcome"])
        latency = Metric(f"{PREFIX}_request_seconds", "latency of the requests checked ok",
                         "summary")
        counters: dict[str, tuple[str, Any]] = {
            "hosts_started": ("host processes started", lambda e, t: e.scenario.result.hosts),
            "hosts_killed": ("host processes killed", lambda e, t: e.scenario.result.hosts_killed),
            "ipus_killed": ("IPU processes killed", lambda e, t: e.scenario.result.ipus_killed),
            "attach_cycles": ("attach-run-detach cycles (daemon scenario)",
                              lambda e, t: t["cycles"]),
        }
        fams = {k: CounterMetricFamily(f"{PREFIX}_{k}", text, labels=["scenario"])
                for k, (text, _) in counters.items()}
        running = GaugeMetricFamily(f"{PREFIX}_scenario_running", "1 while the scenario runs",
                                    labels=["scenario"])
        seconds = GaugeMetricFamily(f"{PREFIX}_scenario_seconds", "seconds the scenario has "
                                    "run (or took)", labels=["scenario"])
        seen: set[str] = set()
        for e in reversed(self.live.entries()):   # a scenario run twice: its last run
            name = e.scenario.name
            if name in seen:
                continue
            seen.add(name)
            t = e.totals()
            for key, outcome in _OUTCOMES:
                requests.add_metric([name, outcome], t[key])
            latency.add_sample(latency.name + "_count", {"scenario": name}, t["ok"])
            latency.add_sample(latency.name + "_sum", {"scenario": name}, t["latency_s"])
            for k, (_, get) in counters.items():
                fams[k].add_metric([name], float(get(e, t)))
            running.add_metric([name], 0.0 if e.final is not None else 1.0)
            seconds.add_metric([name], e.seconds())
        yield requests
        yield latency
        yield from fams.values()
        yield running
        yield seconds
