"""``ipu-emulator trace FILE``: where the time went, from a timeline trace.

Reads a Chrome trace written by ``ipu_emulator.trace`` (``IPU_EMULATOR_TRACE=FILE``)
and prints, per model and replica, the latency percentiles of each request
phase (preparation, queue, transfer in, waiting for device, transfer out,
callbacks), and per IPU process the fraction of the traced time it was busy
(running programs) and computing (of the time its events cover, when its oldest
events were dropped). ``--json`` prints the same as JSON;
``--check`` also checks the file's structure (:func:`validate`: named processes,
slices nested per track, each request on a track titled by its runner, model and
replica, flows paired, IPU iterations inside the requests they served, phases adding
up to their request) and exits 1 naming what is wrong.

A request and its phases are async slices (``b``/``e`` events of one ``id2.local``,
which Perfetto puts on a track of their own in the host's process, titled by the first
slice's name); everything else is an ``X`` slice on its thread's track. Both are read
here as slices: dicts with ``ts`` and ``dur`` (us) and the track they are on.
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
from collections import defaultdict
from typing import Any

import numpy as np

__all__ = ["main", "load", "summarise", "validate", "requests", "arrows", "slices", "role",
           "PHASES", "PARENTS"]

PHASES = ("preparation", "queue", "transfer in", "waiting for device", "transfer out",
          "callbacks")
_TOP_PHASES = ("preparation", "queue", "waiting for device", "transfer out", "callbacks")
_QUANTILES = (0.5, 0.9, 0.99)
_EPS = 0.0015   # us: the rounding of ts and dur to ns
PARENTS = {"preparation": ("request",), "queue": ("request",),
            "waiting for device": ("request",), "transfer out": ("request",),
            "callbacks": ("request",), "transfer in": ("queue",), "iteration": ("Main",),
            "copies in": ("iteration",), "copies out": ("iteration",)}
"""Where each slice nests (docs/tracing.md); ``request`` is a request, whatever its name
(:func:`role`)."""
_PARTS = frozenset(PHASES)     # a request's children (and ``transfer in (seq N)``)
FAILED = "failed: "
"""The one part of a request that failed (``failed: <error class>``; the request's args
name it as ``error``): it has no phases, and is counted apart from the latencies."""


def role(e: dict[str, Any]) -> str:
    """What a slice is: ``request`` for a request (an ``X`` slice named so, or the async
    slice named by its runner, model and replica, which holds the request's parts:
    category ``request`` and not one of them), else its name."""
    name = str(e.get("name", ""))
    if (e.get("cat", e.get("category")) == "request" and name not in _PARTS
            and not name.startswith(("transfer in (seq", FAILED))):
        return "request"
    return name


def load(path: str) -> dict[str, Any]:
    """The trace object in ``path`` (ValueError if it is not a Chrome trace object)."""
    with open(path, encoding="utf-8") as f:
        trace = json.load(f)
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ValueError(f"{path}: not a Chrome trace object (a JSON object with a "
                         "traceEvents list)")
    return trace


def _names(trace: dict[str, Any]) -> tuple[dict[int, str], dict[tuple[int, int], str]]:
    procs: dict[int, str] = {}
    threads: dict[tuple[int, int], str] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            procs[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            threads[(e["pid"], e["tid"])] = e["args"]["name"]
    return procs, threads


Track = tuple[int, Any]
"""Where a slice is: (pid, tid) of a thread's track, (pid, (category, id)) of an async
one."""


def _async_track(e: dict[str, Any]) -> Track:
    """The track of an async event as Perfetto's JSON reader makes it: its category and
    id, in its process (``id2.local``) or across processes (``id``, ``id2.global``)."""
    id2: dict[str, Any] = e["id2"] if isinstance(e.get("id2"), dict) else {}
    if "local" in id2:
        return (e["pid"], (e.get("cat", ""), "local", str(id2["local"])))
    return (e["pid"], (e.get("cat", ""), "global", str(id2.get("global", e.get("id", "")))))


class _Slices:
    """A trace's slices, each with its track, its parent on the track (async ones by
    the order of their events, as Perfetto's reader nests them), and what is wrong
    with the async events' pairing."""

    def __init__(self, trace: dict[str, Any]) -> None:
        self.all: list[dict[str, Any]] = []
        self.track: dict[int, Track] = {}
        self.parent: dict[int, dict[str, Any] | None] = {}
        self.problems: list[str] = []
        open_: dict[Track, list[dict[str, Any]]] = defaultdict(list)
        # in order of time, file order among equals (Perfetto's sort)
        for e in sorted((e for e in trace["traceEvents"] if e.get("ph") in ("X", "b", "e")),
                        key=lambda e: e["ts"]):
            if e["ph"] == "X":
                self._add(dict(e), (e["pid"], e["tid"]))
                continue
            where = _async_track(e)
            stack = open_[where]
            if e["ph"] == "b":
                s = dict(e, dur=0.0)
                self._add(s, where, stack[-1] if stack else None)
                stack.append(s)
            elif not stack or stack[-1]["name"] != e.get("name", stack[-1]["name"]):
                self.problems.append(
                    f"async end {e.get('name')!r} at {e['ts']} (id {where[1][2]}) closes "
                    + (f"nothing: {stack[-1]['name']!r} is open" if stack else "nothing"))
            else:
                s = stack.pop()
                s["dur"] = round(e["ts"] - s["ts"], 3)
        for where, stack in open_.items():
            self.problems += [f"async slice {s['name']!r} at {s['ts']} (id {where[1][2]}) "
                              "never ends" for s in stack]

    def _add(self, s: dict[str, Any], where: Track,
             parent: dict[str, Any] | None = None) -> None:
        self.all.append(s)
        self.track[id(s)] = where
        if isinstance(where[1], tuple):
            self.parent[id(s)] = parent

    def tracks(self) -> dict[Track, list[dict[str, Any]]]:
        """Each track's slices, in order of start (the longer first at one instant)."""
        tracks: dict[Track, list[dict[str, Any]]] = defaultdict(list)
        for s in self.all:
            tracks[self.track[id(s)]].append(s)
        for evs in tracks.values():
            evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        return tracks


def slices(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """Every slice of the trace: each ``X`` event, and each async slice (its ``b`` event
    with the ``dur`` its ``e`` gives), as copies."""
    return _Slices(trace).all


def requests(trace: dict[str, Any], _found: _Slices | None = None
             ) -> list[tuple[dict[str, Any], dict[str, float]]]:
    """Each request slice that completed and its phases' durations (us)."""
    out = []
    for evs in (_found or _Slices(trace)).tracks().values():
        current: tuple[dict[str, Any], dict[str, float]] | None = None
        for e in evs:
            if role(e) == "request":
                current = None if "error" in e.get("args", {}) else (e, {})
                if current is not None:
                    out.append(current)
            elif e["name"] in _PARTS and current is not None:
                req = current[0]
                if e["ts"] >= req["ts"] - _EPS and e["ts"] + e["dur"] <= req["ts"] + req["dur"] + _EPS:
                    current[1][e["name"]] = current[1].get(e["name"], 0.0) + e["dur"]
    return out


def _union(intervals: list[tuple[float, float]]) -> float:
    """The time ``intervals`` cover together."""
    total, reach = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def summarise(trace: dict[str, Any]) -> dict[str, Any]:
    """Per host, runner, model and replica: request count and phase percentiles (us); per IPU
    process: busy and compute fractions of the traced window (busy: the time its
    track has a slice, as Perfetto's collapsed track shows it) and its Load, Main and
    Save program runs."""
    procs, _ = _names(trace)
    groups: dict[tuple[str, str, str, int], list[dict[str, float]]] = defaultdict(list)
    found = _Slices(trace)
    tracks = found.tracks()
    def group(req: dict[str, Any]) -> tuple[str, str, str, int]:
        args = req.get("args", {})
        return (procs.get(req["pid"], str(req["pid"])), str(args.get("runner", "")),
                str(args.get("model", "")), int(args.get("replica", 0)))
    for req, phases in requests(trace, found):
        groups[group(req)].append(
            {"request": req["dur"], **{p: phases.get(p, 0.0) for p in PHASES}})
    failed: dict[tuple[str, str, str, int], int] = defaultdict(int)
    for e in found.all:
        if role(e) == "request" and "error" in e.get("args", {}):
            failed[group(e)] += 1
    models = []
    for key in sorted(set(groups) | set(failed)):
        host, runner, model, replica = key
        rows = groups.get(key, [])
        entry: dict[str, Any] = {"host": host, "runner": runner, "model": model,
                                 "replica": replica, "requests": len(rows),
                                 "failed": failed.get(key, 0), "latency_us": {}}
        if not rows:
            models.append(entry)
            continue
        for phase in ("request", *PHASES):
            values = np.array([r[phase] for r in rows])
            entry["latency_us"][phase] = {f"p{round(q * 100):d}": float(np.quantile(values, q))
                                          for q in _QUANTILES}
            entry["latency_us"][phase]["mean"] = float(values.mean())
        models.append(entry)
    window = trace.get("otherData", {}).get("window_us") or [0.0, 0.0]
    span = max(float(window[1]) - float(window[0]), 1e-9)
    busy: dict[int, list[tuple[float, float]]] = defaultdict(list)
    compute: dict[int, float] = defaultdict(float)
    runs: dict[int, dict[str, int]] = defaultdict(lambda: {"Load": 0, "Main": 0, "Save": 0})
    covered: dict[int, float] = {}
    for (pid, _), evs in tracks.items():
        if not procs.get(pid, "").startswith("ipu ") or not evs:
            continue
        for e in evs:
            busy[pid].append((e["ts"], e["ts"] + e["dur"]))
            if e.get("cat") == "program" and e["name"] in runs[pid]:
                runs[pid][e["name"]] += 1
            elif e["name"] == "compute":
                compute[pid] += e["dur"]
        # the time its events cover: the whole window, unless its oldest were dropped
        first = (min(e["ts"] for e in evs if e.get("cat") != "control")
                 if _dropped(trace, pid) else float(window[0]))
        covered[pid] = max(float(window[1]) - first, 1e-9) if first < window[1] else span
    ipus = [{"ipu": name, "pid": pid,
             "busy_fraction": _union(busy[pid]) / covered.get(pid, span),
             "compute_fraction": compute[pid] / covered.get(pid, span),
             "program_runs": dict(runs[pid]), "covered_us": covered.get(pid, span)}
            for pid, name in sorted(procs.items(), key=lambda kv: kv[1])
            if name.startswith("ipu ")]
    return {"window_us": span, "models": models, "ipus": ipus,
            "dropped_events": trace.get("otherData", {}).get("dropped_events", {})}


def _dropped(trace: dict[str, Any], pid: int) -> int:
    for e in trace["traceEvents"]:
        if e.get("ph") == "M" and e.get("name") == "process_name" and e["pid"] == pid:
            return int(e["args"].get("dropped_events", 0))
    return 0


def _nest(evs: list[dict[str, Any]]) -> tuple[dict[int, dict[str, Any] | None], list[str]]:
    """Perfetto's nesting of one track's X slices (as its trace processor does it): in
    order of start, the longer first at one instant (file order among equals); a slice's
    parent is the innermost open one, and a slice is closed once it ended before the next
    one starts, or ended at that start and was not zero-length. So a slice starting at
    its parent's end is not inside it, and a zero-length slice holds whatever starts at
    its instant. Returns each slice's parent and the slices that overlap without nesting."""
    parent: dict[int, dict[str, Any] | None] = {}
    bad: list[str] = []
    stack: list[tuple[int, int, dict[str, Any]]] = []   # (end ns, dur ns, slice)

    def ns(us: float) -> int:   # as Perfetto reads JSON times: whole nanoseconds
        return round(us * 1000)
    for e in sorted(evs, key=lambda e: (ns(e["ts"]), -ns(e["dur"]))):
        start, dur = ns(e["ts"]), ns(e["dur"])
        while stack and (stack[-1][0] < start or (stack[-1][0] == start and stack[-1][1] > 0)):
            stack.pop()
        if stack and start + dur > stack[-1][0]:
            bad.append(f"{e['name']!r} at {e['ts']} overlaps {stack[-1][2]['name']!r} "
                       "without nesting")
        parent[id(e)] = stack[-1][2] if stack else None
        stack.append((start + dur, dur, e))
    return parent, bad


def validate(trace: dict[str, Any]) -> list[str]:
    """What is wrong with the trace's structure (empty: nothing), by the rules Perfetto
    reads it with: every process named; on each thread's track, slices nest
    (:func:`_nest`); each async slice ends, in the slice it began in; each slice where the
    docs put it (each request phase in its request, each iteration's transfers in it);
    each request on a track of its own titled by its runner, model and replica, not on a
    thread's (Perfetto titles those with the thread's id); every arrow bound
    (``bind_id``: ``flow_out`` on one slice, ``flow_in`` on others) and drawn forward
    (Perfetto draws it from the source's end, or its start when that is not before the
    destination's); each request's arrows land on IPU iterations inside the request;
    each request's phases add up to it."""
    problems: list[str] = []
    procs, _ = _names(trace)
    events = trace["traceEvents"]
    for pid in sorted({e["pid"] for e in events if e.get("ph") != "M"}):
        if pid not in procs:
            problems.append(f"process {pid} has events but no process_name")
    found = _Slices(trace)
    problems += found.problems
    parent = dict(found.parent)
    for (pid, tid), evs in found.tracks().items():
        if isinstance(tid, tuple):
            continue            # async: nested by its events' order (_Slices)
        p, bad = _nest(evs)
        parent.update(p)
        problems.extend(f"{procs.get(pid, pid)} thread {tid}: {b}" for b in bad)
    by_id = {id(s): s for s in found.all}
    for e in found.all:
        up = parent.get(id(e))
        want = PARENTS.get(e["name"])
        if e["name"].startswith("transfer in (seq"):
            want = ("transfer in",)
        if want and e.get("cat") in ("phase", "transfer", "iteration", "request") and (
                up is None or role(up) not in want):
            inside = repr(up["name"]) if up else "nothing"
            problems.append(f"{e['name']!r} at {e['ts']} is not inside {want[0]!r} "
                            f"(inside {inside})")
        if role(e) == "request":
            problems += _request_track(e, found.track[id(e)], up)
    _check_v1_flows(events, problems)
    _check_bound_flows(by_id, parent, problems)
    for req, phases in requests(trace, found):
        total = sum(phases.get(p, 0.0) for p in _TOP_PHASES)
        if req["dur"] > 1.0 and abs(total - req["dur"]) > 0.05 * req["dur"]:
            problems.append(f"request {req.get('args', {}).get('request_id')}: phases add up "
                            f"to {total:.3f} us of {req['dur']:.3f} us")
    return problems


def _request_track(req: dict[str, Any], where: Track, up: dict[str, Any] | None) -> list[str]:
    """What is wrong with where a request is: it must be the first slice of an async
    track (which Perfetto titles by its name, with no id) named by its runner, model
    and replica."""
    from ipu_emulator.trace import request_track

    args = req.get("args", {})
    at = f"request {args.get('request_id')} at {req['ts']}"
    if not isinstance(where[1], tuple):
        return [f"{at} is on thread {where[1]}'s track, which Perfetto titles with the "
                "thread's id: a request is an async slice"]
    if up is not None:
        return [f"{at} is inside {up['name']!r}, not the first slice of its track"]
    want = request_track(str(args.get("runner", "")), str(args.get("model", "")),
                         int(args.get("replica", 0)))
    if req["name"] != want:
        return [f"{at} is named {req['name']!r}, not by its runner, model and replica "
                f"({want!r}): the name titles its track"]
    return []


def _check_v1_flows(events: list[dict[str, Any]], problems: list[str]) -> None:
    flows: dict[Any, dict[str, dict[str, Any]]] = defaultdict(dict)
    for e in events:
        if e.get("ph") in ("s", "f"):
            if e["ph"] in flows[e["id"]]:
                problems.append(f"flow {e['id']} has two {e['ph']!r} events")
            flows[e["id"]][e["ph"]] = e
    for fid, ends in flows.items():
        if set(ends) != {"s", "f"}:
            problems.append(f"flow {fid} is not paired: {sorted(ends)}")
        elif ends["f"]["ts"] < ends["s"]["ts"] - _EPS:
            problems.append(f"flow {fid} goes back in time")


def _ancestor(e: dict[str, Any] | None, parent: dict[int, dict[str, Any] | None],
              name: str) -> dict[str, Any] | None:
    while e is not None and role(e) != name:
        e = parent.get(id(e))
    return e


def arrows(trace: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Each arrow (source slice, destination slice) as Perfetto binds it (``bind_id``):
    slices as :func:`slices` gives them."""
    every = slices(trace)
    outs = {e["bind_id"]: e for e in every if e.get("flow_out") and not e.get("flow_in")}
    return [(outs[e["bind_id"]], e) for e in every
            if e.get("flow_in") and e["bind_id"] in outs]


def _check_bound_flows(by_id: dict[int, dict[str, Any]],
                       parent: dict[int, dict[str, Any] | None], problems: list[str]) -> None:
    outs: dict[Any, dict[str, Any]] = {}
    for e in by_id.values():
        if e.get("flow_out"):
            if e["bind_id"] in outs:
                problems.append(f"flow {e['bind_id']} leaves two slices")
            outs[e["bind_id"]] = e
    for dst in by_id.values():
        if not dst.get("flow_in"):
            continue
        fid = dst["bind_id"]
        src = outs.get(fid)
        if src is None:
            problems.append(f"flow {fid} ends in {dst['name']!r} but leaves no slice")
            continue
        begin = src["ts"] if src["ts"] >= dst["ts"] else src["ts"] + src["dur"]
        if begin > dst["ts"] + _EPS:
            problems.append(f"flow {fid} is drawn backwards: from {src['name']!r} at {begin} "
                            f"to {dst['name']!r} at {dst['ts']}")
        req = _ancestor(src, parent, "request")
        if req is None:
            continue
        it = _ancestor(dst, parent, "iteration")
        if it is None:
            problems.append(f"flow {fid}: from a request to {dst['name']!r}, not an iteration")
        elif it["ts"] < req["ts"] - _EPS or it["ts"] + it["dur"] > req["ts"] + req["dur"] + _EPS:
            problems.append(f"flow {fid}: IPU iteration [{it['ts']}, +{it['dur']}] is not "
                            f"inside request [{req['ts']}, +{req['dur']}]")


def _print(summary: dict[str, Any]) -> None:
    print(f"traced {summary['window_us'] / 1e6:.3f} s")
    for m in summary["models"]:
        print(f"\n{m['host']}  {m['runner'] or 'runner ?'}  model {m['model'] or '?'}  "
              f"replica {m['replica']}  {m['requests']} requests"
              + (f", {m['failed']} failed" if m.get("failed") else "") + "  (us)")
        print(f"  {'phase':20s} {'p50':>10s} {'p90':>10s} {'p99':>10s} {'mean':>10s}")
        for phase, q in m["latency_us"].items():
            print(f"  {phase:20s} {q['p50']:10.1f} {q['p90']:10.1f} {q['p99']:10.1f} "
                  f"{q['mean']:10.1f}")
    if summary["ipus"]:
        print(f"\n  {'busy':>7s} {'compute':>8s} {'Load':>5s} {'Main':>6s} {'Save':>5s}  IPU")
        for i in summary["ipus"]:
            r = i["program_runs"]
            print(f"  {i['busy_fraction']:7.1%} {i['compute_fraction']:8.1%} {r['Load']:5d} "
                  f"{r['Main']:6d} {r['Save']:5d}  {i['ipu']}")
    dropped = {k: v for k, v in summary["dropped_events"].items() if v}
    if dropped:
        print("\ndropped events (oldest, past each process's buffer): "
              + ", ".join(f"{k}: {v}" for k, v in dropped.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ipu-emulator trace", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("file", nargs="+",
                        help="a trace written with IPU_EMULATOR_TRACE=FILE or --trace; several "
                             "(processes of one machine: one clock) are read as one")
    parser.add_argument("--combine", metavar="OUT",
                        help="write the files given as one trace to OUT (e.g. a daemon's and "
                             "its hosts')")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--check", action="store_true",
                        help="also check the trace's structure; exit 1 if it is wrong")
    a = parser.parse_args(argv)
    try:
        traces = [load(f) for f in a.file]
    except (OSError, ValueError) as exc:
        print(f"ipu-emulator trace: {exc}", file=sys.stderr)
        return 2
    from ipu_emulator import trace as tracing

    trace = traces[0] if len(traces) == 1 else tracing.combine(traces)
    if a.combine:
        tracing.write(trace, a.combine)
    summary = summarise(trace)
    problems = validate(trace) if a.check else []
    if a.json:
        if a.check:
            summary["problems"] = problems
        print(json.dumps(summary, indent=2))
    else:
        _print(summary)
        for p in problems:
            print(f"problem: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
