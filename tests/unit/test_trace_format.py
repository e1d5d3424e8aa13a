"""The pieces of a timeline (ipu_emulator.trace) without IPU processes: the shared-memory
ring of records, the recorder's switch, the merge into Chrome trace events, and the
checks ``ipu-emulator trace --check`` makes (each shown failing)."""

from __future__ import annotations

import os

import pytest

from ipu_emulator import trace
from ipu_emulator.trace import recorder
from shm.tracebuf import TraceBuffer
from tools import trace_summary


def test_the_ring_keeps_the_newest_records_and_counts_the_dropped():
    buf = TraceBuffer.create(4)
    try:
        other = TraceBuffer.attach(buf.name)   # the reader's mapping, as the host's
        buf.unlink()                           # the name goes; both mappings stay
        assert not os.path.exists("/dev/shm" + buf.name)
        other.set_writer(1234, 3)
        for k in range(6):
            other.write(recorder.I_COMPUTE, 1000 + k, 10, k, -k, 7)
        records, dropped = buf.records()
        assert dropped == 2 and buf.writer() == (1234, 3)
        assert [r[0] for r in records] == [1002, 1003, 1004, 1005]
        assert records[-1] == (1005, 10, recorder.I_COMPUTE, 0, 5, -5, 7)
        other.close()
    finally:
        buf.close()


def test_a_buffer_that_is_not_one_is_refused():
    buf = TraceBuffer.create(2)
    try:
        buf.buf[0:4] = b"XXXX"
        with pytest.raises(ValueError, match="not a version-1 trace buffer"):
            TraceBuffer.attach(buf.name)
    finally:
        buf.close()
        buf.unlink()
    with pytest.raises(ValueError, match="holds 1..16777216 records, got 0"):
        TraceBuffer.create(0)


def test_off_records_nothing_and_a_session_names_its_process(tmp_path):
    assert not recorder.ON and not trace.enabled()
    trace.instant("ignored")                      # no session: nothing, no error
    with pytest.raises(RuntimeError, match="tracing is not on"):
        trace.stop()
    with trace.tracing(str(tmp_path / "t.json")):
        assert recorder.ON and trace.active()
        trace.instant("fault: link lost", ipu=1)
        with pytest.raises(RuntimeError, match="already on"):
            trace.start()
    assert not recorder.ON
    timeline = trace_summary.load(str(tmp_path / "t.json"))
    assert trace_summary.validate(timeline) == []
    names = {e["args"]["name"] for e in timeline["traceEvents"] if e["name"] == "process_name"}
    assert names == {f"host {os.getpid()}"}
    (mark,) = [e for e in timeline["traceEvents"] if e["ph"] == "i"]
    assert mark["name"] == "fault: link lost" and mark["args"] == {"ipu": 1}


def test_an_ipu_instant_keeps_24_bytes_of_its_name():
    assert recorder.unpack_name(*recorder.pack_name("fault injected: link 0->1 lost")) == \
        "fault injected: link 0->"


def _x(name, ts, dur, tid=1, **extra):
    return {"ph": "X", "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, **extra}


def _timeline(*events):
    return {"traceEvents": [{"ph": "M", "name": "process_name", "pid": 1,
                             "args": {"name": "host 1"}}, *events]}


def test_the_checks_find_what_is_wrong():
    good = _timeline(_x("request", 0, 10, cat="request", args={"replica": 0}),
                     _x("preparation", 0, 2, cat="phase"), _x("queue", 2, 3, cat="phase"),
                     _x("waiting for device", 5, 5, cat="phase"))
    assert trace_summary.validate(good) == []
    bad_nesting = _timeline(_x("a", 0, 10), _x("b", 5, 10))
    assert "overlaps 'a' without nesting" in trace_summary.validate(bad_nesting)[0]
    unpaired = _timeline({"ph": "s", "id": 7, "pid": 1, "tid": 1, "ts": 1})
    assert trace_summary.validate(unpaired) == ["flow 7 is not paired: ['s']"]
    short = _timeline(_x("request", 0, 10, cat="request", args={"request_id": 3}),
                      _x("preparation", 0, 2, cat="phase"))
    assert trace_summary.validate(short) == ["request 3: phases add up to 2.000 us of "
                                             "10.000 us"]
    nameless = {"traceEvents": [_x("a", 0, 1)]}
    assert trace_summary.validate(nameless) == ["process 1 has events but no process_name"]


def test_host_and_ipu_times_share_one_clock_however_busy_the_machine(monkeypatch):
    # perf_counter and monotonic are one clock on Linux: the offset is 0 by what the
    # clocks say of themselves, not by two reads that a preemption can set apart
    assert recorder.PERF_OFFSET == 0
    reads = iter([0, 5_000_000] * 8)
    monkeypatch.setattr(recorder.time, "monotonic_ns", lambda: next(reads))
    assert recorder._perf_offset() == 0
    # where they are two clocks, the tightest of the paired reads sets the offset
    monkeypatch.setattr(recorder.time, "get_clock_info",
                        lambda name: type("info", (), {"implementation": name})())
    pairs = iter([100, 9_000_000, 100, 150] + [0, 10**9] * 14)
    monkeypatch.setattr(recorder.time, "monotonic_ns", lambda: next(pairs))
    monkeypatch.setattr(recorder.time, "perf_counter_ns", lambda: 25)
    assert recorder._perf_offset() == 100
