"""The daemon's ``/metrics`` (``ipu-emulator daemon --metrics-port PORT``).

Served by ``MetricsServer`` (a fixed set of threads, silent clients dropped), from a
registry of the daemon's own (never the default one). The pool's state is
read at scrape time from the daemon's objects (plain attribute reads; the
event loop owns every change); events are counted by small hooks in the
daemon's event loop (:class:`DaemonMetrics` methods) and in
:class:`~ipu_emulator.daemon._pool.PooledIpu` (starts, resets, held time)::

    ipu_emulator_daemon_ipus                        IPUs in the pool
    ipu_emulator_daemon_ipus_by_state{state}        free, attaching, held, resetting, ...
    ipu_emulator_daemon_ipus_attached               held or being attached
    ipu_emulator_daemon_ipus_held{holder}           IPUs each host pid holds
    ipu_emulator_daemon_attach_requests_total{result}   ok, busy, failed, refused
    ipu_emulator_daemon_attach_seconds              histogram: attach requests that
                                                    succeeded, request to reply
    ipu_emulator_daemon_attach_waits_total          attaches that succeeded after being
                                                    answered busy (the host waited)
    ipu_emulator_daemon_attach_wait_seconds         histogram: first busy reply to a host
                                                    -> its successful attach
    ipu_emulator_daemon_ipu_hosts_served_total{ipu} attaches of each IPU
    ipu_emulator_daemon_ipu_held_seconds_total{ipu} time each IPU was held by a host
    ipu_emulator_daemon_ipu_resets_total{ipu}       IPUs taken back from a host and reset
    ipu_emulator_daemon_ipu_program_runs_total{ipu} programs the IPU ran (its requests: each
                                                    IPU process publishes the count in its
                                                    control ring's user word)
    ipu_emulator_daemon_ipu_restarts_total{ipu}     IPU processes started after the first
    ipu_emulator_daemon_ipu_process_deaths_total{ipu}   IPU processes that died
    ipu_emulator_daemon_ipu_process_cpu_seconds_total{ipu}  CPU time of its current process
    ipu_emulator_daemon_faults_injected_total{kind} Main runs a fault of the daemon's schedule
                                                    affected (ipu_emulator.faults), by kind

Hosts talk to an IPU process over shared-memory rings the daemon never sees;
each IPU process counts the programs it runs in its control ring's user word
(one store per run), which the daemon reads at scrape time, with the hosts
it served, how long they held it (busy time = held time) and the CPU time its
process used (read from /proc).
"""

from __future__ import annotations

import collections
import contextlib
import queue
import selectors
import socket
import threading
import time
from typing import Any, Callable, Iterator, Protocol, Sequence

from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import psutil
from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ipu_emulator.errors import MetricsServeError

from ipu_emulator.daemon._pool import PooledIpu


class Pool(Protocol):
    """What the metrics read of the daemon: its pool of IPUs (at scrape time)."""

    @property
    def ipus(self) -> Sequence[PooledIpu]: ...
    def faults_injected(self) -> dict[str, int]: ...

__all__ = ["DaemonMetrics", "PREFIX", "MetricsServer", "MetricsServeError"]

PREFIX = "ipu_emulator_daemon"
_STATES = ("starting", "free", "attaching", "held", "resetting", "dead", "failed")
_WAITERS_KEPT = 4096   # hosts answered busy and not attached since (oldest dropped)


class _Quiet(WSGIRequestHandler):
    timeout = 5.0   # seconds a client may stay silent (half-open, slow): then it is dropped

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _PooledServer(WSGIServer):
    """A WSGI server with a fixed set of threads however many clients connect.

    The accepting thread (``serve_forever``) hands each new connection to one sorting
    thread, which waits (``selectors``) until the client has sent something: a
    connection silent for ``_Quiet.timeout`` seconds is closed there, and past
    ``MAX_PENDING`` waiting connections the oldest is closed. A connection with data
    goes to one of ``WORKERS`` threads, which serve it with the handler's timeout
    (a slow client is dropped after it); past ``BACKLOG`` connections waiting for a
    worker, the new one is closed. Threads: 1 + 1 + ``WORKERS``, started once."""

    WORKERS = 4
    BACKLOG = 64
    MAX_PENDING = 256
    request_queue_size = 64

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._waiting: queue.Queue[tuple[Any, Any] | None] = queue.Queue(self.BACKLOG)
        self._workers: list[threading.Thread] = []
        self._arrived: collections.deque[tuple[Any, Any]] = collections.deque()
        self._wake_r, self._wake_w = socket.socketpair()
        self._closing = False
        super().__init__(*args, **kwargs)   # a bind that fails calls server_close()
        self._workers = [threading.Thread(target=self._work, name=f"metrics-http-{i}",
                                          daemon=True) for i in range(self.WORKERS)]
        self._workers.append(threading.Thread(target=self._sort, name="metrics-http-wait",
                                              daemon=True))
        for t in self._workers:
            t.start()

    def process_request(self, request: Any, client_address: Any) -> None:
        self._arrived.append((request, client_address))
        try:
            self._wake_w.send(b"\0")
        except OSError:   # the wake-up buffer full: the sorter is awake anyway
            pass

    def _sort(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._wake_r, selectors.EVENT_READ)
        pending: dict[Any, tuple[Any, float]] = {}   # insertion order: oldest first
        try:
            while not self._closing:
                for key, _ in sel.select(0.05):
                    if key.fileobj is self._wake_r:
                        with contextlib.suppress(OSError):
                            self._wake_r.recv(4096)
                        continue
                    request: Any = key.fileobj
                    sel.unregister(request)
                    address, _t = pending.pop(request)
                    try:
                        self._waiting.put_nowait((request, address))
                    except queue.Full:   # every worker busy, the backlog full: refused
                        self.shutdown_request(request)
                while self._arrived:
                    request, address = self._arrived.popleft()
                    if len(pending) >= self.MAX_PENDING:
                        oldest = next(iter(pending))
                        sel.unregister(oldest)
                        del pending[oldest]
                        self.shutdown_request(oldest)
                    sel.register(request, selectors.EVENT_READ)
                    pending[request] = (address, time.monotonic())
                expired = time.monotonic() - _Quiet.timeout
                for request in [r for r, (_a, t) in pending.items() if t < expired]:
                    sel.unregister(request)
                    del pending[request]
                    self.shutdown_request(request)
        finally:
            for request in pending:
                self.shutdown_request(request)
            sel.close()

    def _work(self) -> None:
        while True:
            item = self._waiting.get()
            if item is None:
                return
            request, client_address = item
            try:
                self.finish_request(request, client_address)
            except Exception:
                self.handle_error(request, client_address)
            finally:
                self.shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass   # a client that vanished or timed out: nothing to report

    def server_close(self) -> None:
        super().server_close()
        self._closing = True
        while True:   # connections still waiting are closed, the workers told to stop
            try:
                item = self._waiting.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                self.shutdown_request(item[0])
        workers = [t for t in self._workers if t.name != "metrics-http-wait"]
        for _ in workers:
            self._waiting.put(None)
        for t in self._workers:
            t.join(_Quiet.timeout + 1)
        while self._arrived:
            self.shutdown_request(self._arrived.popleft()[0])
        self._wake_r.close()
        self._wake_w.close()


class MetricsServer:
    """``/metrics`` of ``registry`` over HTTP at ``address:port`` (0: a free port), served
    until ``close()`` by a fixed set of threads (``_PooledServer``); a client silent for
    ``_Quiet.timeout`` seconds is dropped, and connections beyond the bounds are closed
    (``prometheus_client.start_http_server`` starts a thread per connection, without a
    cap)."""

    def __init__(self, registry: CollectorRegistry, port: int, address: str = "127.0.0.1"
                 ) -> None:
        self._httpd = make_server(address, port, make_wsgi_app(registry), _PooledServer,
                                  handler_class=_Quiet)
        self.address = address
        self.port = int(self._httpd.server_port)
        self._thread = threading.Thread(target=self._httpd.serve_forever,
                                        name="metrics-http", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.port}/metrics"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)


class _PoolCollector(Collector):
    """The pool's state and per-IPU counters, read at scrape time."""

    def __init__(self, daemon: Pool) -> None:
        self._daemon = daemon

    def collect(self) -> Iterator[Metric]:
        ipus: list[PooledIpu] = list(self._daemon.ipus)
        yield GaugeMetricFamily(f"{PREFIX}_ipus", "IPUs in the pool", value=len(ipus))
        states = GaugeMetricFamily(f"{PREFIX}_ipus_by_state", "IPUs in each state",
                                   labels=["state"])
        counts = {s: 0 for s in _STATES}
        holders: dict[str, int] = {}
        for ipu in ipus:
            counts[ipu.state] = counts.get(ipu.state, 0) + 1
            holder = ipu.holder
            if holder and ipu.state in ("attaching", "held"):
                holders[str(holder)] = holders.get(str(holder), 0) + 1
        for state, n in counts.items():
            states.add_metric([state], n)
        yield states
        yield GaugeMetricFamily(f"{PREFIX}_ipus_attached", "IPUs held by a host or being "
                                "attached", value=counts["held"] + counts["attaching"])
        held = GaugeMetricFamily(f"{PREFIX}_ipus_held", "IPUs held (or being attached) by "
                                 "each host, by its pid", labels=["holder"])
        for pid_text, n in sorted(holders.items()):
            held.add_metric([pid_text], n)
        yield held
        now = time.monotonic()
        per_ipu: dict[str, tuple[str, Callable[[PooledIpu], float]]] = {
            "hosts_served": ("attaches of this IPU by hosts", lambda i: i.hosts_served),
            "held_seconds": ("seconds this IPU was held by hosts (its busy time)",
                             lambda i: i.held_seconds_at(now)),
            "resets": ("times this IPU was taken back from a host and reset", lambda i: i.resets),
            "program_runs": ("programs this IPU ran for hosts (a Main run serves one request of "
                             "the model's batch per device iteration)",
                             lambda i: i.program_runs()),
            "restarts": ("IPU processes of this IPU started after the first",
                         lambda i: max(0, i.starts - 1)),
        }
        for name, (text, get) in per_ipu.items():
            fam = CounterMetricFamily(f"{PREFIX}_ipu_{name}", text, labels=["ipu"])
            for ipu in ipus:
                fam.add_metric([str(ipu.index)], get(ipu))
            yield fam
        cpu = CounterMetricFamily(f"{PREFIX}_ipu_process_cpu_seconds", "CPU time of the IPU's "
                                  "current process (user + system; starts again at a restart)",
                                  labels=["ipu"])
        for ipu in ipus:
            seconds = _cpu_seconds(ipu.pid)
            if seconds is not None:
                cpu.add_metric([str(ipu.index)], seconds)
        yield cpu
        injected = CounterMetricFamily(f"{PREFIX}_faults_injected", "Main runs a fault of the "
                                       "daemon's schedule affected, by kind", labels=["kind"])
        for kind, n in sorted(self._daemon.faults_injected().items()):
            injected.add_metric([kind], n)
        yield injected


def _cpu_seconds(pid: int | None) -> float | None:
    if pid is None:
        return None
    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return None
    return float(t.user + t.system)


class DaemonMetrics:
    """The daemon's instruments, and its ``/metrics`` server once ``serve()`` ran."""

    def __init__(self, daemon: Pool, port: int | None = None,
                 address: str = "127.0.0.1") -> None:
        self.port = port
        self.address = address
        self.registry = CollectorRegistry()
        self.registry.register(_PoolCollector(daemon))
        r = self.registry
        self.attach_requests = Counter(f"{PREFIX}_attach_requests", "attach requests by "
                                       "result", ["result"], registry=r)
        for result in ("ok", "busy", "failed", "refused"):
            self.attach_requests.labels(result)
        self.attach_seconds = Histogram(
            f"{PREFIX}_attach_seconds", "successful attach requests, request to reply",
            buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10), registry=r)
        self.attach_waits = Counter(f"{PREFIX}_attach_waits", "attaches that succeeded after "
                                    "the host was answered busy", registry=r)
        self.attach_wait_seconds = Histogram(
            f"{PREFIX}_attach_wait_seconds", "first busy reply to a host until its attach",
            buckets=(.01, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300), registry=r)
        self.deaths = Counter(f"{PREFIX}_ipu_process_deaths", "IPU processes that died",
                              ["ipu"], registry=r)
        for ipu in daemon.ipus:
            self.deaths.labels(str(ipu.index))
        self._waiting: dict[int, float] = {}   # host pid -> its first busy reply
        self._server: MetricsServer | None = None

    # -- hooks (the daemon's event loop) --------------------------------------------------

    def attach_busy(self, host: int) -> None:
        self.attach_requests.labels("busy").inc()
        self._waiting.setdefault(host, time.monotonic())
        while len(self._waiting) > _WAITERS_KEPT:
            self._waiting.pop(next(iter(self._waiting)))

    def attach_done(self, host: int, started: float, ok: bool, refused: bool = False) -> None:
        """An attach request ended: ``ok``, failed on the IPUs, or ``refused`` (bad request,
        stopping)."""
        now = time.monotonic()
        if refused:
            self.attach_requests.labels("refused").inc()
            return
        if not ok:
            self.attach_requests.labels("failed").inc()
            return
        self.attach_requests.labels("ok").inc()
        self.attach_seconds.observe(now - started)
        first_busy = self._waiting.pop(host, None)
        if first_busy is not None:
            self.attach_waits.inc()
            self.attach_wait_seconds.observe(now - first_busy)

    def died(self, ipu: "PooledIpu") -> None:
        self.deaths.labels(str(ipu.index)).inc()

    # -- server ---------------------------------------------------------------------------

    def serve(self) -> int | None:
        """Start serving ``/metrics`` if a port was given; the port it listens on."""
        if self.port is None:
            return None
        try:
            self._server = MetricsServer(self.registry, self.port, self.address)
        except OSError as exc:
            raise MetricsServeError(f"cannot serve /metrics at {self.address}:{self.port}: "
                                    f"{exc}") from exc
        return self._server.port

    @property
    def bound_port(self) -> int | None:
        return None if self._server is None else self._server.port

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
