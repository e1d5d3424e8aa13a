"""How a timeline's tracks are listed: Perfetto lists a process's threads by thread id,
so the id of each request lane sets where its track is."""

from __future__ import annotations

from ipu_emulator.trace import _chrome, recorder as R


def _request(key: int, replica: int, rid: int, t0: int, t7: int) -> tuple:
    step = (t7 - t0) // 8
    instants = tuple(t0 + k * step for k in range(7)) + (t7,)
    return (R.H_REQUEST, 1, t0, t7 - t0, (key, replica, rid, 1, (rid,), instants))


def test_the_lanes_of_each_replica_are_listed_together_in_order():
    # replica 0's second lane is made after replica 1's first (requests in that order)
    events = [(R.H_LIFE, 1, 100, 50, ("attach and load", 0, (200,), "m", 7)),
              (R.H_LIFE, 1, 100, 50, ("attach and load", 1, (201,), "m", 8)),
              (R.H_LIFE, 1, 150, 50, ("attach and load", 0, (202,), "n", 9)),
              _request(9, 0, 1, 500, 9000),       # runner 2 first
              _request(7, 0, 2, 1000, 5000),
              _request(8, 1, 3, 1500, 3000),
              _request(7, 0, 4, 2000, 6000),      # overlaps request 2: a second lane
              _request(8, 1, 5, 4000, 4500)]      # replica 1's first lane again
    timeline = _chrome.merge(100, "host", events, 0, {1: (100, "MainThread")}, [],
                             (0, 10_000))
    lanes = sorted((e["tid"], e["args"]["name"]) for e in timeline["traceEvents"]
                   if e["ph"] == "M" and e["name"] == "thread_name" and e["tid"] != 100)
    assert [name for _, name in lanes] == [
        "runner 1 · model m · replica 0 requests",
        "runner 1 · model m · replica 0 requests (lane 2)",
        "runner 1 · model m · replica 1 requests",
        "runner 2 · model n · replica 0 requests"]
    # each request on its lane's track, and no two tracks share an id
    tid_of = {name: tid for tid, name in lanes}
    assert len(tid_of) == len(set(tid_of.values())) == 4
    on = {e["args"]["request_id"]: e["tid"] for e in timeline["traceEvents"]
          if e["ph"] == "X" and e["name"] == "request"}
    assert on == {1: tid_of["runner 2 · model n · replica 0 requests"],
                  2: tid_of["runner 1 · model m · replica 0 requests"],
                  3: tid_of["runner 1 · model m · replica 1 requests"],
                  4: tid_of["runner 1 · model m · replica 0 requests (lane 2)"],
                  5: tid_of["runner 1 · model m · replica 1 requests"]}
    # a request's phases are on its track too
    phases = {e["tid"] for e in timeline["traceEvents"] if e["ph"] == "X" and
              e["name"] in _chrome.PHASES}
    assert phases == set(on.values())
