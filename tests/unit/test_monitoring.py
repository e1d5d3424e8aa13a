"""RequestMonitor: seed key names, bounded buffer, inferred queue time."""

from __future__ import annotations

import pytest

from host_runtime.errors import BadRequestError
from host_runtime.runner.monitoring import RequestMonitor

US = 1000  # ns


def test_empty_monitor_reports_zeros_with_seed_keys():
    m = RequestMonitor()
    assert m.time_trace({}) == {
        "request_duration_us": 0.0, "read_preparation_duration_us": 0.0,
        "read_queue_duration_us": 0.0, "computation_duration_us": 0.0}
    assert set(m.total_count({})) == {
        "request_monitoring_statistics_count", "read_preparation_monitoring_statistics_count",
        "read_queue_monitoring_statistics_count", "computation_monitoring_statistics_count"}


def test_phases_of_serial_requests():
    m = RequestMonitor()
    # request 1: received 0, prepared 10us, done 100us
    m.record(0, 10 * US, 100 * US)
    # request 2 arrives while 1 runs: received 20, prepared 30, done 150 -> queued until 100
    m.record(20 * US, 30 * US, 150 * US)
    t = m.time_trace({})
    assert t == {"request_duration_us": 130.0, "read_preparation_duration_us": 10.0,
                 "read_queue_duration_us": 70.0, "computation_duration_us": 50.0}
    first = m.time_trace({}, cur=0)
    assert first["read_queue_duration_us"] == 0.0 and first["computation_duration_us"] == 90.0
    mean = m.mean({})
    assert mean["request_monitoring_statistics_mean_us"] == pytest.approx(115.0)
    assert mean["read_queue_monitoring_statistics_mean_us"] == pytest.approx(35.0)
    assert m.total_count({})["request_monitoring_statistics_count"] == 2.0
    p = m.percentile({}, 1.0)
    assert p["request_monitoring_statistics_percentile_us"] == pytest.approx(130.0)
    assert p["read_preparation_monitoring_statistics_percentile_us"] == pytest.approx(10.0)


def test_buffer_bounds_statistics_but_not_count():
    m = RequestMonitor(buffer_size=2)
    for i in range(5):
        start = i * 1000 * US
        m.record(start, start + i * US, start + 100 * US)
    assert len(m) == 2
    assert m.total_count({})["computation_monitoring_statistics_count"] == 5.0
    assert m.mean({})["read_preparation_monitoring_statistics_mean_us"] == pytest.approx(3.5)


def test_unbounded_buffer_when_zero():
    m = RequestMonitor(buffer_size=0)
    for i in range(1500):
        m.record(i, i, i + 1)
    assert len(m) == 1500


def test_fills_and_returns_given_dict():
    m = RequestMonitor()
    d = {"keep": 1.0}
    assert m.mean(d) is d and d["keep"] == 1.0 and len(d) == 5


def test_bad_arguments():
    m = RequestMonitor()
    m.record(0, 1, 2)
    with pytest.raises(BadRequestError, match="quantile must be in \\[0, 1\\], got 99"):
        m.percentile({}, 99)
    with pytest.raises(BadRequestError, match="cur=5 is out of range; the buffer holds 1"):
        m.time_trace({}, cur=5)
    with pytest.raises(BadRequestError, match=">= 0, got -1"):
        RequestMonitor(-1)


@pytest.mark.parametrize("read", ["time_trace", "total_count", "mean", "percentile", "len",
                                  "count", "snapshot", "record", "settle"])
def test_deferred_requests_are_recorded_in_order_before_any_read(read):
    """defer() (execute's fused path) records later; every read, and the next record, sees
    the requests as if recorded at once, in the order they finished."""
    eager, lazy = RequestMonitor(), RequestMonitor()
    requests = [(0, 10 * US, 100 * US, 12 * US), (20 * US, 30 * US, 150 * US, 35 * US),
                (160 * US, 165 * US, 200 * US, 0)]
    for r in requests:
        eager.record(*r)
        lazy.defer(*r)
    if read == "record":
        eager.record(170 * US, 175 * US, 260 * US)
        lazy.record(170 * US, 175 * US, 260 * US)
    elif read == "settle":
        lazy.settle()
    else:
        reader = {"len": len, "count": lambda m: m.count,
                  "snapshot": lambda m: m.snapshot((0.5,))}.get(
            read, lambda m: getattr(m, read)({}))
        assert reader(lazy) == reader(eager)
    for k in range(len(eager)):
        assert lazy.time_trace({}, cur=k) == eager.time_trace({}, cur=k)
    assert lazy.snapshot((0.1, 0.9)) == eager.snapshot((0.1, 0.9))
    assert lazy.count == len(requests) + (read == "record")


def test_reset_chain_records_deferred_requests_with_the_old_chain():
    eager, lazy = RequestMonitor(), RequestMonitor()
    eager.record(0, 10 * US, 100 * US)
    lazy.defer(0, 10 * US, 100 * US)
    eager.reset_chain()
    lazy.reset_chain()
    eager.record(20 * US, 30 * US, 150 * US)   # after a restart: not queued behind request 1
    lazy.record(20 * US, 30 * US, 150 * US)
    assert lazy.time_trace({}) == eager.time_trace({})
    assert lazy.time_trace({})["read_queue_duration_us"] == 0.0
