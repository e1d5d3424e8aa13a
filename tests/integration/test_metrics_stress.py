"""``ipu-emulator stress``: its live counters scraped over real HTTP (``--metrics-port``) and
parsed with ``prometheus_client.parser``; its progress line per scenario."""

from __future__ import annotations

import re
import select
import subprocess
import sys

from prometheus_client import CollectorRegistry
from tests.scrape import scrape, value

from ipu_emulator.daemon.daemon_metrics import MetricsServer
from tools import stress
from tools._stress_live import LiveStats, StressCollector
from tools._stress_rig import REPO

P = "ipu_emulator_stress_"


def test_counters_after_a_known_run_match_its_results():
    opts = stress._parser().parse_args(["--requests", "6", "--hosts", "2", "--threads", "1",
                                        "--replicas", "1", "--seed", "5"])
    live = LiveStats()
    registry = CollectorRegistry()
    registry.register(StressCollector(live))
    server = MetricsServer(registry, 0)
    try:
        [result], problems = stress.run(opts, live)
        assert result.passed and not problems, (result, problems)
        fams = scrape(server.url)
    finally:
        server.close()
    assert result.ok == 2 * 6            # 6 requests per host, every one checked
    assert value(fams, P + "requests_total", scenario="mixed", outcome="ok") == 12
    for outcome in ("wrong", "hung", "error", "expected_failure"):
        assert value(fams, P + "requests_total", scenario="mixed", outcome=outcome) == 0
    assert value(fams, P + "request_seconds_count", scenario="mixed") == 12
    assert value(fams, P + "request_seconds_sum", scenario="mixed") > 0
    assert value(fams, P + "hosts_started_total", scenario="mixed") == 2
    assert value(fams, P + "scenario_running", scenario="mixed") == 0


def test_cli_serves_live_counters_and_prints_a_plain_progress_line():
    proc = subprocess.Popen(
        [sys.executable, "-m", "tools.cli", "stress", "--duration", "2", "--hosts", "1",
         "--threads", "1", "--replicas", "1", "--seed", "7", "--metrics-port", "0"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        url = None
        for _ in range(100):   # bounded: the line comes before any host starts
            if not select.select([proc.stderr], [], [], 30)[0]:
                break
            m = re.search(r"serving /metrics at (http://127\.0\.0\.1:\d+/metrics)",
                          proc.stderr.readline())
            if m:
                url = m.group(1)
                break
        assert url, "stress did not print where /metrics is"
        running = ok = 0.0
        for _ in range(1200):   # bounded: until requests were counted while it runs
            fams = scrape(url)
            running = value(fams, P + "scenario_running", scenario="mixed") \
                if fams.get(P + "scenario_running") else 0.0
            ok = value(fams, P + "requests_total", scenario="mixed", outcome="ok") \
                if fams.get(P + "requests") else 0.0
            if running == 1 and ok > 0:
                break
            select.select([], [], [], 0.05)
        assert running == 1 and ok > 0
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out + err
    # not a terminal: one plain line for the scenario, no carriage returns
    lines = [ln for ln in out.splitlines() if ln.startswith("scenario mixed: ")]
    assert len(lines) == 1 and "\r" not in out, out
    assert re.match(r"scenario mixed: (\d+) requests, \d+/s, 0 failures, [\d.]+ s$", lines[0])
    assert int(re.findall(r"(\d+) requests", lines[0])[0]) >= ok
