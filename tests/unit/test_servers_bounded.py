"""The servers are bounded: ``/metrics`` serves from a fixed pool of threads and drops silent
clients; the daemon caps its connections and drops a connection that never speaks."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
import urllib.request
from typing import Callable

import pytest
from prometheus_client import CollectorRegistry, Counter

from ipu_emulator.daemon import daemon_metrics, server as daemon_server
from ipu_emulator.daemon import socket_protocol as wire
from ipu_emulator.daemon.daemon_metrics import MetricsServer

HALF_OPEN = 400


@pytest.fixture
def metrics(monkeypatch):
    monkeypatch.setattr(daemon_metrics._Quiet, "timeout", 0.2)
    registry = CollectorRegistry()
    Counter("probe_total", "a probe", registry=registry).inc(3)
    server = MetricsServer(registry, 0)
    yield server
    server.close()


def _half_open(port: int, n: int) -> list[socket.socket]:
    socks = []
    for _ in range(n):   # connect, say nothing
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        socks.append(s)
    return socks


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=20) as r:
        return str(r.read().decode())


def _new_threads(before: set[threading.Thread]) -> set[threading.Thread]:
    """Threads started since ``before`` was taken (a set, not a count: a thread an earlier
    test of this worker left winding down may end meanwhile), but the peer-exit watcher
    (shm.liveness: it comes and goes with the processes earlier tests watched)."""
    return {t for t in set(threading.enumerate()) - before if t.name != "shm-peer-exits"}


def test_metrics_threads_stay_fixed_under_half_open_clients(metrics) -> None:
    before = set(threading.enumerate())
    socks = _half_open(metrics.port, HALF_OPEN)
    try:
        for _ in range(50):   # the pool was started with the server: no thread a client
            assert _new_threads(before) == set()
        # served while they stay connected: silent ones are dropped after the timeout
        assert "probe_total 3.0" in _scrape(metrics.url)
    finally:
        for s in socks:
            s.close()
    assert _new_threads(before) == set()


def test_a_slow_client_is_dropped_after_the_timeout(metrics) -> None:
    s = socket.create_connection(("127.0.0.1", metrics.port), timeout=10)
    try:
        s.sendall(b"GET /metr")   # never finishes its request line
        t0 = time.monotonic()
        assert s.recv(100) == b""   # closed by the server
        assert time.monotonic() - t0 < 5
    finally:
        s.close()
    assert "probe_total 3.0" in _scrape(metrics.url)


def test_close_stops_the_pool(monkeypatch) -> None:
    before = set(threading.enumerate())
    server = MetricsServer(CollectorRegistry(), 0)
    assert len(_new_threads(before)) == 2 + daemon_metrics._PooledServer.WORKERS
    server.close()
    assert {t for t in _new_threads(before) if t.is_alive()} == set()


# -- the daemon ---------------------------------------------------------------------------

class _Bare(daemon_server.Daemon):
    """Only the daemon's connection handling (no IPUs, no socket path of a home)."""

    def __init__(self) -> None:   # noqa: D107 - the fields _serve_client uses
        self._conns = set()
        self.released: list[int] = []

    async def _release(self, conn, why) -> None:
        self.released.append(conn.pid)

    async def _handle(self, conn, req):
        return {"ok": True, "op": req.get("op")}


def _serve_while(daemon: _Bare, path: str, clients: Callable[[], None]) -> None:
    """Serve ``daemon``'s connections at ``path`` while ``clients()`` runs on a thread."""
    async def main() -> None:
        srv = await asyncio.start_unix_server(daemon._serve_client, path=path)
        await asyncio.get_running_loop().run_in_executor(None, clients)
        srv.close()
        await srv.wait_closed()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_the_daemon_caps_connections_and_drops_silent_ones(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(daemon_server, "MAX_CONNECTIONS", 20)
    monkeypatch.setattr(daemon_server, "FIRST_MESSAGE_TIMEOUT", 0.3)
    path = str(tmp_path / "d.sock")
    daemon = _Bare()
    result: dict[str, object] = {}

    def clients() -> None:
        result["threads"] = set(threading.enumerate())
        silent = []
        for _ in range(20):
            c = socket.socket(socket.AF_UNIX)
            c.connect(path)
            silent.append(c)
        extra = socket.socket(socket.AF_UNIX)
        extra.connect(path)
        extra.settimeout(10)
        result["refused"] = wire.decode(extra.makefile("rb").readline())
        extra.close()
        result["threads_after"] = _new_threads(result["threads"])  # type: ignore[arg-type]
        t0 = time.monotonic()
        for c in silent:   # each dropped by the daemon after its silence
            c.settimeout(10)
            assert c.recv(10) == b""
        result["dropped_after"] = time.monotonic() - t0
        talker = socket.socket(socket.AF_UNIX)
        talker.connect(path)
        talker.sendall(wire.encode({"op": "hello"}))
        talker.settimeout(10)
        result["answer"] = wire.decode(talker.makefile("rb").readline())
        talker.close()
        for c in silent:
            c.close()
    _serve_while(daemon, path, clients)
    refused = result["refused"]
    assert isinstance(refused, dict) and refused["error"] == "overloaded"
    assert "20 connections at most" in str(refused["message"])
    assert float(str(result["dropped_after"])) < 5
    assert result["answer"] == {"ok": True, "op": "hello", "v": wire.VERSION}
    assert daemon.released.count(os.getpid()) == 21   # the 20 silent ones and the talker
    assert result["threads_after"] == set()   # no thread a connection


def test_at_the_cap_the_daemon_closes_an_idle_connection_for_a_new_one(tmp_path,
                                                                        monkeypatch) -> None:
    """Hosts keep the connection of their last release for their next attach: at the cap,
    one that holds nothing and waits for no answer is closed to let a new host in (a host
    that finds its kept connection closed connects anew); silent ones are not taken."""
    monkeypatch.setattr(daemon_server, "MAX_CONNECTIONS", 3)
    path = str(tmp_path / "d.sock")
    daemon = _Bare()
    result: dict[str, object] = {}

    def clients() -> None:
        idle = []
        for _ in range(2):   # hosts that spoke and now wait
            c = socket.socket(socket.AF_UNIX)
            c.connect(path)
            c.settimeout(10)
            c.sendall(wire.encode({"op": "hello"}))
            assert wire.decode(c.makefile("rb").readline())["ok"]
            idle.append(c)
        silent = socket.socket(socket.AF_UNIX)
        silent.connect(path)
        new = socket.socket(socket.AF_UNIX)
        new.connect(path)
        new.settimeout(10)
        new.sendall(wire.encode({"op": "hello"}))
        result["answer"] = wire.decode(new.makefile("rb").readline())
        closed = 0
        for c in idle:
            c.setblocking(False)
            try:
                closed += c.recv(10) == b""
            except BlockingIOError:
                pass
        result["closed"] = closed
        silent.setblocking(False)
        try:
            result["silent_closed"] = silent.recv(10) == b""
        except BlockingIOError:
            result["silent_closed"] = False
        for c in [*idle, silent, new]:
            c.close()
    _serve_while(daemon, path, clients)
    assert result["answer"] == {"ok": True, "op": "hello", "v": wire.VERSION}
    assert result["closed"] == 1 and result["silent_closed"] is False
