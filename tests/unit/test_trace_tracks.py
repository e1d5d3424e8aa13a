"""Where a timeline's requests are: async slices, one id per request, named by runner,
model and replica. Perfetto puts each id on a track of its own in the host's process,
titled by its first slice's name (no id appended, as it does to a thread's track), and
shows a process's tracks of one title as one, requests in flight together one above the
other: no made-up threads ("lanes")."""

from __future__ import annotations

from collections import defaultdict

from ipu_emulator import trace
from ipu_emulator.trace import _chrome, recorder as R
from tests.unit._loopback import model_path  # noqa: F401  (fixture)
from tools import trace_summary

SHAPE = (1, 4)


def _request(key: int, replica: int, rid: int, t0: int, t7: int) -> tuple:
    step = (t7 - t0) // 8
    instants = tuple(t0 + k * step for k in range(7)) + (t7,)
    return (R.H_REQUEST, 1, t0, t7 - t0, (key, replica, rid, 1, (rid,), instants))


def _timeline() -> dict:
    # replica 0 of runner 1 has two requests in flight together (2 and 4)
    events = [(R.H_LIFE, 1, 100, 50, ("attach and load", 0, (200,), "m", 7)),
              (R.H_LIFE, 1, 100, 50, ("attach and load", 1, (201,), "m", 8)),
              (R.H_LIFE, 1, 150, 50, ("attach and load", 0, (202,), "n", 9)),
              _request(9, 0, 1, 500, 9000),       # runner 2 first
              _request(7, 0, 2, 1000, 5000),
              _request(8, 1, 3, 1500, 3000),
              _request(7, 0, 4, 2000, 6000),      # overlaps request 2
              _request(8, 1, 5, 4000, 4500)]
    return _chrome.merge(100, "host", events, 0, {1: (100, "MainThread")}, [], (0, 10_000))


def test_each_request_is_an_async_slice_named_by_its_runner_model_and_replica():
    timeline = _timeline()
    assert trace_summary.validate(timeline) == []
    # no thread but the host's own: no lane of a made-up id
    threads = {e["tid"]: e["args"]["name"] for e in timeline["traceEvents"]
               if e["ph"] == "M" and e["name"] == "thread_name"}
    assert threads == {100: "MainThread"}
    assert not [e for e in timeline["traceEvents"] if e["ph"] == "X"
                and e["cat"] in ("request", "phase")]
    begins = [e for e in timeline["traceEvents"] if e["ph"] == "b"]
    ends = [e for e in timeline["traceEvents"] if e["ph"] == "e"]
    assert len(begins) == len(ends) == 5 * 7    # request, 5 phases, transfer in
    assert all(e["cat"] == "request" and e["pid"] == 100 and set(e["id2"]) == {"local"}
               for e in begins + ends)
    # each request and its parts share one id, which no other request has; the first
    # event of an id (what titles its track) is the request, named by where it ran
    by_id: dict[str, list[dict]] = defaultdict(list)
    for e in timeline["traceEvents"]:
        if e["ph"] in ("b", "e"):
            by_id[e["id2"]["local"]].append(e)
    titles = {evs[0]["args"]["request_id"]: evs[0]["name"] for evs in by_id.values()}
    assert titles == {1: "runner 2 · n · replica 0", 2: "runner 1 · m · replica 0",
                      3: "runner 1 · m · replica 1", 4: "runner 1 · m · replica 0",
                      5: "runner 1 · m · replica 1"}
    assert {e["name"] for evs in by_id.values() for e in evs[1:]} == {
        *_chrome.PHASES, "transfer in", *titles.values()}
    assert trace.request_track("runner 3", "", 2) == "runner 3 · ? · replica 2"


def test_the_events_of_one_instant_are_in_the_order_perfetto_nests_them():
    # Perfetto reads b/e events of one instant in file order: an end before a begin (a
    # phase ends where the next begins), the inner end first, the outer begin first
    timeline = _timeline()
    seen: dict[tuple, list[str]] = defaultdict(list)
    for e in timeline["traceEvents"]:
        if e["ph"] in ("b", "e"):
            seen[(e["id2"]["local"], e["ts"])].append(e["ph"] + " " + e["name"])
    first = next(evs for (_, ts), evs in seen.items() if ts == 1.0)   # request 2 begins
    assert first == ["b runner 1 · m · replica 0", "b preparation"]
    assert ["e preparation", "b queue"] in seen.values()
    assert ["e callbacks", "e runner 1 · m · replica 0"] in seen.values()
    # read back as Perfetto nests them: every phase in its request, on the request's track
    (req, phases), = [r for r in trace_summary.requests(timeline)
                      if r[0]["args"]["request_id"] == 4]
    assert (req["ts"], req["dur"]) == (2.0, 4.0)
    assert set(phases) == set(trace_summary.PHASES)
    assert sum(phases[p] for p in _chrome.PHASES) == 4.0


def test_runners_made_one_after_the_other_are_told_apart(tmp_path, model_path, loopback_device):
    """A runner dropped before the next is made frees its replica's life, whose address
    (its ``id``) the next one's may take: each life has a key of its own on the timeline,
    so the two are two runners, not one."""
    import gc

    import numpy as np

    import host_runtime as model_runtime

    x = {"tensor_A": np.ones((1, 4), np.float32), "tensor_B": np.ones((1, 4), np.float32)}
    path = tmp_path / "t.json"
    keys, addresses = [], []
    gc.disable()   # freed by reference counting alone, at once
    try:
        with trace.tracing(str(path)):
            for _ in range(3):
                runner = model_runtime.ModelRunner(model_path, model_runtime.ModelRunnerConfig(
                    replica_to_device={0: loopback_device}))
                life = runner._replicas[0]._life
                keys.append(life.trace_key)
                addresses.append(id(life))   # (may repeat: the key must not)
                del life
                runner.execute(x)
                runner.close()
                del runner
    finally:
        gc.enable()
    timeline = trace_summary.load(str(path))
    runners = {r["args"]["runner"] for r, _ in trace_summary.requests(timeline)}
    assert runners == {"runner 1", "runner 2", "runner 3"}, (runners, addresses)
    assert len(set(keys)) == 3
