"""ModelRunner's statistics scraped over real HTTP as Prometheus metrics (host_runtime.runner.runner_metrics).

Each test serves a private ``CollectorRegistry`` with ``prometheus_client``'s
HTTP server on 127.0.0.1 (a free port), scrapes it with urllib and parses the
text with ``prometheus_client.parser``.
"""

from __future__ import annotations

import gc
import urllib.request
from typing import Iterator

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from tests._helpers import kill_and_wait
from tests.scrape import scrape, value

import host_runtime as model_runtime
from host_runtime.errors import DeviceLostError
from host_runtime.runner.runner_metrics import _runner_number as runner_number

SHAPE = (1, 4)

pytestmark = pytest.mark.usefixtures("private_machine")


@pytest.fixture
def served() -> Iterator[tuple[CollectorRegistry, str]]:
    registry = CollectorRegistry()
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        yield registry, f"http://127.0.0.1:{server.server_port}/metrics"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def rand(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"tensor_A": rng.standard_normal(SHAPE).astype(np.float32),
            "tensor_B": rng.standard_normal(SHAPE).astype(np.float32)}


def test_five_executes_are_five_requests_with_their_durations(model_path, weights, served):
    registry, url = served
    with model_runtime.ModelRunner(model_path) as r:
        registry.register(r.metrics_collector())
        fams = scrape(url)
        model = r.model.metadata.executable()
        assert value(fams, "ipu_model_runner_requests_total", model=model, replica="0") == 0
        for i in range(5):
            x = rand(i)
            np.testing.assert_allclose(r.execute(x)["tensor_C"],
                                       x["tensor_A"] * weights + x["tensor_B"], rtol=1e-6)
        fams = scrape(url)
        assert value(fams, "ipu_model_runner_requests_total", model=model, replica="0") == 5
        mean = r.getMonitoringStatisticsMean({})
        for phase in ("request", "read_preparation", "read_queue", "computation"):
            name = f"ipu_model_runner_{phase}_seconds"
            assert value(fams, name + "_count", model=model, replica="0") == 5
            total = value(fams, name + "_sum", model=model, replica="0")
            # the same requests as getMonitoringStatisticsMean (us), in seconds
            assert total == pytest.approx(5 * mean[f"{phase}_monitoring_statistics_mean_us"]
                                          / 1e6, rel=1e-6, abs=1e-9)
            q50 = value(fams, name, model=model, replica="0", quantile="0.5")
            q99 = value(fams, name, model=model, replica="0", quantile="0.99")
            assert 0 <= q50 <= q99
        assert value(fams, "ipu_model_runner_request_seconds", model=model, replica="0",
                     quantile="0.9") == pytest.approx(
            r.getMonitoringStatisticsPercentile({}, 0.9)[
                "request_monitoring_statistics_percentile_us"] / 1e6)
        assert not fams.get("ipu_model_runner_request_errors")


def test_replicas_are_labelled_and_the_collector_drops_a_dropped_runner(model_path, served):
    registry, url = served
    cfg = model_runtime.ModelRunnerConfig(replication_factor=2)
    r = model_runtime.ModelRunner(model_path, config=cfg)
    registry.register(r.metrics_collector())
    model = r.model.metadata.executable()
    for i in range(3):
        r.execute(rand(i), replica_id=0)
    r.execute(rand(9), replica_id=1)
    fams = scrape(url)
    assert value(fams, "ipu_model_runner_requests_total", model=model, replica="0") == 3
    assert value(fams, "ipu_model_runner_requests_total", model=model, replica="1") == 1
    r.close()
    del r
    gc.collect()
    fams = scrape(url)     # the collector held the runner weakly: it is gone
    assert fams["ipu_model_runner_requests"] == []


def test_device_lost_is_counted_by_its_class(model_path, served):
    registry, url = served
    with model_runtime.ModelRunner(model_path) as r:
        registry.register(r.metrics_collector())
        model = r.model.metadata.executable()
        r.execute(rand(0))
        pid = r._replicas[0].session.device().pids()[0]
        kill_and_wait(pid)
        with pytest.raises(DeviceLostError):
            r.execute(rand(1))
        fams = scrape(url)
        assert value(fams, "ipu_model_runner_request_errors_total", model=model, replica="0",
                     error="DeviceLostError") == 1
        assert value(fams, "ipu_model_runner_requests_total", model=model, replica="0") == 1


def test_default_registry_on_request(model_path):
    from prometheus_client import REGISTRY, generate_latest

    with model_runtime.ModelRunner(model_path) as r:
        collector = r.metrics_collector(register_default=True)
        assert r.metrics_collector(register_default=True) is collector   # registered once
        r.execute(rand(0))
        fams = {f.name: f.samples for f in
                text_string_to_metric_families(generate_latest(REGISTRY).decode())}
        model = r.model.metadata.executable()
        assert value(fams, "ipu_model_runner_requests_total", model=model, replica="0",
                     runner=runner_number(r)) == 1
        collector.discard(r)


def test_two_runners_of_one_model_in_one_collector_are_told_apart(model_path, served):
    registry, url = served
    with model_runtime.ModelRunner(model_path) as r1, model_runtime.ModelRunner(model_path) as r2:
        collector = r1.metrics_collector()
        registry.register(collector.add(r2))
        r1.execute(rand(0))
        for i in range(2):
            r2.execute(rand(i))
        fams = scrape(url)
        model = r1.model.metadata.executable()
        assert value(fams, "ipu_model_runner_requests_total", model=model, replica="0",
                     runner=runner_number(r1)) == 1
        assert value(fams, "ipu_model_runner_requests_total", model=model, replica="0",
                     runner=runner_number(r2)) == 2
        with pytest.raises(ValueError, match="Duplicated"):   # one collector per registry
            registry.register(r2.metrics_collector())
