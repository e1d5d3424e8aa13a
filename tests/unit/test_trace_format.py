"""The pieces of a timeline (ipu_emulator.trace) without IPU processes: the shared-memory
ring of records, the recorder's switch, the merge into Chrome trace events, and the
checks ``ipu-emulator trace --check`` makes (each shown failing)."""

from __future__ import annotations

import os

import pytest

from ipu_emulator import trace
from ipu_emulator.trace import _chrome, recorder
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


_ARGS = {"runner": "runner 1", "model": "m", "replica": 0}
_TITLE = "runner 1 · m · replica 0"


def _async(*slices, ident="1"):
    """The b/e events of one request's slices ``(name, ts, dur, depth[, args])``, in the
    writer's order: by time; at one instant ends first (the inner first), then begins
    (the outer first)."""
    scope = {"cat": "request", "pid": 1, "tid": 1, "id2": {"local": ident}}
    events = []
    for name, ts, dur, depth, *args in slices:
        events.append(((ts, 1, depth), {"ph": "b", "name": name, "ts": ts, **scope,
                                        **({"args": args[0]} if args else {})}))
        events.append(((ts + dur, 0, -depth), {"ph": "e", "name": name, "ts": ts + dur,
                                               **scope}))
    return [e for _, e in sorted(events, key=lambda k: k[0])]


def test_the_checks_find_what_is_wrong():
    good = _timeline(*_async((_TITLE, 0, 10, 0, _ARGS), ("preparation", 0, 2, 1),
                             ("queue", 2, 3, 1), ("waiting for device", 5, 5, 1)))
    assert trace_summary.validate(good) == []
    bad_nesting = _timeline(_x("a", 0, 10), _x("b", 5, 10))
    assert "overlaps 'a' without nesting" in trace_summary.validate(bad_nesting)[0]
    unpaired = _timeline({"ph": "s", "id": 7, "pid": 1, "tid": 1, "ts": 1})
    assert trace_summary.validate(unpaired) == ["flow 7 is not paired: ['s']"]
    short = _timeline(*_async((_TITLE, 0, 10, 0, dict(_ARGS, request_id=3)),
                              ("preparation", 0, 2, 1)))
    assert trace_summary.validate(short) == ["request 3: phases add up to 2.000 us of "
                                             "10.000 us"]
    nameless = {"traceEvents": [_x("a", 0, 1)]}
    assert trace_summary.validate(nameless) == ["process 1 has events but no process_name"]


def test_the_checks_find_a_request_perfetto_would_title_or_nest_wrongly():
    # on a thread's track ("lane"): Perfetto titles it with the thread's id
    on_thread = _timeline(_x("request", 0, 1, tid=1 << 30, cat="request",
                             args={"request_id": 3}))
    assert trace_summary.validate(on_thread) == [
        f"request 3 at 0 is on thread {1 << 30}'s track, which Perfetto titles with the "
        "thread's id: a request is an async slice"]
    # its name titles its track: it must say which runner, model and replica
    misnamed = _timeline(*_async(("request", 0, 10, 0, _ARGS), ("preparation", 0, 10, 1)))
    assert trace_summary.validate(misnamed) == [
        f"request None at 0 is named 'request', not by its runner, model and replica "
        f"({_TITLE!r}): the name titles its track"]
    # events of one instant out of order: the next phase begins before the last ends,
    # so Perfetto nests it in that one, and the end closes the wrong slice
    swapped = _async((_TITLE, 0, 10, 0, _ARGS), ("preparation", 0, 2, 1),
                     ("waiting for device", 2, 8, 1))
    k = next(i for i, e in enumerate(swapped) if e["ph"] == "e" and e["name"] == "preparation")
    swapped[k], swapped[k + 1] = swapped[k + 1], swapped[k]
    problems = trace_summary.validate(_timeline(*swapped))
    assert problems[0] == ("async end 'preparation' at 2 (id 1) closes nothing: "
                           "'waiting for device' is open")
    assert "'waiting for device' at 2 is not inside 'request' (inside 'preparation')" in problems
    # an end without its begin, a begin without its end
    assert trace_summary.validate(_timeline(*_async((_TITLE, 0, 10, 0, _ARGS))[1:])) == [
        "async end 'runner 1 · m · replica 0' at 10 (id 1) closes nothing"]
    assert trace_summary.validate(_timeline(*_async((_TITLE, 0, 10, 0, _ARGS))[:1])) == [
        "async slice 'runner 1 · m · replica 0' at 0 (id 1) never ends"]


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


# -- the merge, read by Perfetto's rules (what ipu-emulator trace --check models) --------
def _merged(host: int = 100, ipu: int = 200):
    """A host's two requests on one IPU: the second's first transfer taken by the IPU
    before the host had laid its second; a main loop and an idle wait around them."""
    R = recorder
    life = (R.H_LIFE, 1, 1000, 500, ("attach and load", 0, (ipu,), "m", 7))
    req1 = (R.H_REQUEST, 1, 9000, 4200,
            (7, 0, 1, 1, (5,), (9000, 9500, 9600, 10500, 10600, 13100, 13200, 13200)))
    req2 = (R.H_REQUEST, 1, 20000, 4100,
            (7, 0, 2, 2, (6, 7), (20000, 20100, 20200, 21000, 21100, 24000, 24100, 24100)))
    records = [(2000, 100_000, R.I_OP, 0, int(_chrome.Op.LOOP), 1, 0),
               (3000, 6000, R.I_WAIT, 0, 0, 0, 0),                  # idle: no slice
               (10000, 5000, R.I_PROGRAM, 0, 1, 2, 1),
               (11000, 2000, R.I_STEP, 0, 5, 500, 2000),            # copies out: 0 ns
               (20400, 3000, R.I_PROGRAM, 0, 1, 2, 2),
               (20500, 800, R.I_STEP, 0, 6, 100, 700),
               (21500, 900, R.I_STEP, 0, 7, 100, 800)]
    return _chrome.merge(host, "host", [life, req1, req2], 0, {1: (host, "MainThread")},
                         [_chrome.IpuRecords(ipu, 0, records, 0)], (0, 200_000))


def test_each_arrow_leaves_its_request_before_the_iteration_it_ends_in():
    timeline = _merged()
    assert trace_summary.validate(timeline) == []
    drawn = [(a["name"], b["name"], b["args"]["seq"], a["ts"] + a["dur"] <= b["ts"])
             for a, b in trace_summary.arrows(timeline)]
    assert drawn == [("transfer in", "iteration", 5, True),
                     ("transfer in (seq 6)", "iteration", 6, True),
                     ("transfer in", "iteration", 7, True)]
    # no zero-length slice: callbacks (0 ns) and copies out (0 ns) are drawn 1 ns long
    assert min(e["dur"] for e in trace_summary.slices(timeline)) == 0.001
    request = trace_summary.requests(timeline)[0][0]
    assert (request["ts"], request["dur"]) == (9.0, 4.201)
    assert request["name"] == "runner 1 · m · replica 0"
    # every flow is bound by id to both its slices: no v1 's'/'f' events
    assert not [e for e in timeline["traceEvents"] if e["ph"] in ("s", "f")]


def test_every_request_of_a_batched_iteration_gets_its_arrow():
    """Six requests batched into one transfer (dynamic batching), one iteration serving
    them all: it has four slices to bind arrows into; the other two end on 1-ns
    ``batched request`` marks inside its ``copies in``, side by side, each naming its request."""
    R = recorder
    life = (R.H_LIFE, 1, 1000, 500, ("attach and load", 0, (200,), "m", 7))
    reqs = [(R.H_REQUEST, 1, 9000 + 10 * k, 4200,
             (7, 0, k + 1, 1, (5,), tuple(t + 10 * k for t in
                                          (9000, 9500, 9600, 10500, 10600, 13100, 13200,
                                           13200))))
            for k in range(6)]
    records = [(2000, 100_000, R.I_OP, 0, int(_chrome.Op.LOOP), 1, 0),
               (10900, 5000, R.I_PROGRAM, 0, 1, 2, 1),
               (11000, 2000, R.I_STEP, 0, 5, 500, 1500)]
    timeline = _chrome.merge(100, "host", [life, *reqs], 0, {1: (100, "MainThread")},
                             [_chrome.IpuRecords(200, 0, records, 0)], (0, 200_000))
    assert trace_summary.validate(timeline) == []
    drawn = trace_summary.arrows(timeline)
    assert len(drawn) == 6 and all(a["name"] == "transfer in" for a, _ in drawn)
    assert sorted(b["name"] for _, b in drawn) == \
        ["batched request", "batched request", "compute", "copies in", "copies out", "iteration"]
    marks = sorted((b for _, b in drawn if b["name"] == "batched request"), key=lambda b: b["ts"])
    assert [(m["ts"], m["dur"], m["args"]["request_id"]) for m in marks] == \
        [(11.0, 0.001, 5), (11.001, 0.001, 6)]
    (copies_in,) = [e for e in trace_summary.slices(timeline) if e["name"] == "copies in"]
    assert all(copies_in["ts"] <= m["ts"] and m["ts"] + m["dur"] <= copies_in["ts"]
               + copies_in["dur"] for m in marks)   # (and validate() checked the nesting)


def test_an_iteration_begun_before_its_transfer_was_laid_gets_no_arrow_back_in_time():
    """The IPU's iteration began (waiting for its inputs) before the host began laying
    the transfer it served: the arrow leaves the request's last phase that ended by then
    (none: no arrow), never the laying, which would point back in time."""
    R = recorder

    def timeline(step_at: int) -> dict:
        req = (R.H_REQUEST, 1, 9000, 4200,
               (7, 0, 1, 1, (5,), (9000, 9500, 9600, 10500, 10600, 13100, 13200, 13200)))
        life = (R.H_LIFE, 1, 1000, 500, ("attach and load", 0, (200,), "m", 7))
        records = [(2000, 100_000, R.I_OP, 0, int(_chrome.Op.LOOP), 1, 0),
                   (step_at - 50, 3000, R.I_PROGRAM, 0, 1, 2, 1),
                   (step_at, 2000, R.I_STEP, 0, 5, 500, 2000)]
        return _chrome.merge(100, "host", [life, req], 0, {1: (100, "MainThread")},
                             [_chrome.IpuRecords(200, 0, records, 0)], (0, 200_000))

    after_first = timeline(9550)      # after the first phase (9000-9500), before laying
    assert trace_summary.validate(after_first) == []
    [(src, dst)] = trace_summary.arrows(after_first)
    assert dst["name"] == "iteration" and src["ts"] + src["dur"] <= dst["ts"]
    assert src["name"] != "transfer in" and not src["name"].startswith("transfer in (")
    within_first = timeline(9300)     # no phase ended yet: no arrow at all
    assert trace_summary.validate(within_first) == []
    assert trace_summary.arrows(within_first) == []


def test_an_ipu_track_holds_work_only_and_names_say_whom_it_served():
    timeline = _merged()
    xs = {e["name"] for e in timeline["traceEvents"] if e["ph"] == "X" and e["pid"] == 200}
    assert xs == {"Main", "iteration", "copies in", "compute", "copies out"}
    marks = [e["name"] for e in timeline["traceEvents"] if e["ph"] == "i"]
    assert marks == ["main loop"]
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in timeline["traceEvents"]
             if e["ph"] == "M" and e["name"] in ("process_name", "thread_name")}
    assert names[(200, None)] == "ipu 0 · pid 200 · host 100 runner 1 · model m · replica 0"
    assert names[(200, 200)] == "ipu 0"
    assert names[(100, 100)] == "MainThread"      # and no other thread: no request lanes
    assert len(names) == 4
    summary = trace_summary.summarise(timeline)
    (ipu,) = summary["ipus"]
    # busy: the Main runs (11000..13001 ns: its copies out drawn 1 ns; 20500..22400) of 200 us
    assert ipu["busy_fraction"] == pytest.approx((2.001 + 1.9) / 200, abs=1e-6)
    assert ipu["program_runs"] == {"Load": 0, "Main": 2, "Save": 0}
    assert [(m["host"], m["runner"], m["model"], m["requests"])
            for m in summary["models"]] == [("host 100", "runner 1", "m", 2)]


def test_the_perfetto_rules_each_shown_failing():
    timeline = _merged()
    events = timeline["traceEvents"]
    # the first request ending 1 ns sooner, where its callbacks (0 ns, drawn 1 ns) begin:
    # they are then outside it
    end = next(e for e in events if e["ph"] == "e" and e["name"] == "runner 1 · m · replica 0")
    events.remove(end)
    end["ts"] = round(end["ts"] - 0.001, 3)
    events.insert(next(k for k, e in enumerate(events) if e["ph"] == "b"
                       and e["name"] == "callbacks"), end)
    assert trace_summary.validate(timeline) == [
        f"'callbacks' at {end['ts']} is not inside 'request' (inside nothing)"]
    # Perfetto nests a zero-length slice in the slice that starts at its instant
    zero = _timeline(_x("Main", 0, 10, cat="program"),
                     _x("iteration", 0, 10, cat="iteration"), _x("compute", 0, 5),
                     _x("copies in", 5, 0, cat="transfer"),
                     _x("copies out", 5, 5, cat="transfer"))
    assert trace_summary.validate(zero) == [
        "'copies in' at 5 is not inside 'iteration' (inside 'copies out')"]
    timeline = _merged()
    it = next(e for e in timeline["traceEvents"] if e["name"] == "iteration")
    it["ts"] -= 1.0              # taken before the host finished laying it: drawn backwards
    assert any("is drawn backwards: from 'transfer in' at 10.5 to 'iteration' at 10.0" in p
               for p in trace_summary.validate(timeline))
    timeline = _merged()
    for e in timeline["traceEvents"]:
        e.pop("flow_out", None)
    assert "flow 1 ends in 'iteration' but leaves no slice" in trace_summary.validate(timeline)


def test_combined_traces_keep_every_arrow_and_a_shared_ipu_once():
    a, b = _merged(100, 200), _merged(101, 201)
    both = trace.combine([a, b])
    assert trace_summary.validate(both) == []
    # two hosts' "runner 1" told apart
    assert [(m["host"], m["runner"]) for m in trace_summary.summarise(both)["models"]] == \
        [("host 100", "runner 1"), ("host 101", "runner 1")]
    assert len(trace_summary.arrows(both)) == 6
    assert len({x["bind_id"] for x, _ in trace_summary.arrows(both)}) == 6
    # the same IPU process in two files (a daemon's, a host's): once, arrows kept
    twice = trace.combine([_merged(100, 200), a])
    assert trace_summary.validate(twice) == []
    assert len([e for e in twice["traceEvents"] if e["name"] == "iteration"]) == 3
    assert len(trace_summary.arrows(twice)) == 3


def test_a_sharded_models_token_is_the_main_runs_not_the_iterations():
    # (ts, dur, code, 0, a, b, c): the last IPU's token (unnumbered link in), then the
    # request's transfer seq 5, its compute and output
    inner = [(1000, 10, recorder.I_IN, 0, 0, 3, 1),
             (5000, 10, recorder.I_IN, 0, 5, 0, 0),
             (5010, 100, recorder.I_COMPUTE, 0, 0, 0, 0),
             (5110, 10, recorder.I_OUT, 0, 5, 1, 0)]
    (it,) = _chrome._iterations(inner)
    assert (it.seq, it.start) == (5, 5000)
    assert [c[0] for c in it.lead] == ["link in"]
    assert [c[0] for c in it.children] == ["copy in", "compute", "copy out"]
    # an iteration of unnumbered transfers only keeps them
    (alone,) = _chrome._iterations(inner[:1])
    assert (alone.seq, alone.start, alone.lead) == (0, 1000, [])


def test_a_pipelines_last_stage_ending_after_its_request_still_gets_the_link_arrow():
    """Two IPUs, one request: the first stage's iteration inside the request, the last
    stage's ending 20 us after it (its step records its end once it let go of its
    input slots, after publishing the output the host read): the link arrow is drawn."""
    R = recorder
    life = (R.H_LIFE, 1, 1000, 500, ("attach and load", 0, (200, 300), "m", 7))
    req = (R.H_REQUEST, 1, 9000, 30_000,
           (7, 0, 1, 1, (5,), (9000, 9500, 9600, 10500, 10600, 38900, 39000, 39000)))
    first = [(2000, 100_000, R.I_OP, 0, int(_chrome.Op.LOOP), 1, 0),
             (10900, 9000, R.I_PROGRAM, 0, 1, 2, 1),
             (11000, 8000, R.I_STEP, 0, 5, 500, 7000)]
    last = [(2000, 100_000, R.I_OP, 0, int(_chrome.Op.LOOP), 1, 0),
            (19900, 40_000, R.I_PROGRAM, 0, 1, 2, 1),
            (20000, 39_000, R.I_STEP, 0, 5, 500, 18_000)]   # ends at 59000, after 39000
    timeline = _chrome.merge(100, "host", [life, req], 0, {1: (100, "MainThread")},
                             [_chrome.IpuRecords(200, 0, first, 0),
                              _chrome.IpuRecords(300, 1, last, 0)], (0, 200_000))
    assert trace_summary.validate(timeline) == []
    drawn = [(a["name"], a["pid"], b["name"], b["pid"]) for a, b in trace_summary.arrows(timeline)]
    assert drawn == [("transfer in", 100, "iteration", 200),
                     ("copies out", 200, "iteration", 300)]
