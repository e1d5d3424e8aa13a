"""``ipu-emulator trace FILE``: where the time went, from a timeline trace.

Reads a Chrome trace written by ``ipu_emulator.trace`` (``IPU_EMULATOR_TRACE=FILE``)
and prints, per model and replica, the latency percentiles of each request
phase (preparation, queue, transfer in, waiting for device, transfer out,
callbacks), and per IPU process the fraction of the traced time it was busy
(running programs) and computing (of the time its events cover, when its oldest
events were dropped). ``--json`` prints the same as JSON;
``--check`` also checks the file's structure (:func:`validate`: named processes,
slices nested per thread, flows paired, IPU iterations inside the requests they
served, phases adding up to their request) and exits 1 naming what is wrong.
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
from collections import defaultdict
from typing import Any

import numpy as np

__all__ = ["main", "load", "summarise", "validate", "requests", "PHASES"]

PHASES = ("preparation", "queue", "transfer in", "waiting for device", "transfer out",
          "callbacks")
_TOP_PHASES = ("preparation", "queue", "waiting for device", "transfer out", "callbacks")
_QUANTILES = (0.5, 0.9, 0.99)
_EPS = 0.0015   # us: the rounding of ts and dur to ns


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


def _tracks(trace: dict[str, Any]) -> dict[tuple[int, int], list[dict[str, Any]]]:
    tracks: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for e in trace["traceEvents"]:
        if e.get("ph") == "X":
            tracks[(e["pid"], e["tid"])].append(e)
    for evs in tracks.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
    return tracks


def requests(trace: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, float]]]:
    """Each request slice and its phases' durations (us)."""
    out = []
    for evs in _tracks(trace).values():
        current: tuple[dict[str, Any], dict[str, float]] | None = None
        for e in evs:
            if e["name"] == "request" and e.get("cat") == "request":
                current = (e, {})
                out.append(current)
            elif e.get("cat") == "phase" and current is not None:
                req = current[0]
                if e["ts"] >= req["ts"] - _EPS and e["ts"] + e["dur"] <= req["ts"] + req["dur"] + _EPS:
                    current[1][e["name"]] = current[1].get(e["name"], 0.0) + e["dur"]
    return out


def summarise(trace: dict[str, Any]) -> dict[str, Any]:
    """Per model and replica: request count and phase percentiles (us); per IPU process:
    busy and compute fractions of the traced window."""
    procs, _ = _names(trace)
    groups: dict[tuple[str, int], list[dict[str, float]]] = defaultdict(list)
    for req, phases in requests(trace):
        args = req.get("args", {})
        row = {"request": req["dur"], **{p: phases.get(p, 0.0) for p in PHASES}}
        groups[(str(args.get("model", "")), int(args.get("replica", 0)))].append(row)
    models = []
    for (model, replica), rows in sorted(groups.items()):
        entry: dict[str, Any] = {"model": model, "replica": replica, "requests": len(rows),
                                 "latency_us": {}}
        for phase in ("request", *PHASES):
            values = np.array([r[phase] for r in rows])
            entry["latency_us"][phase] = {f"p{round(q * 100):d}": float(np.quantile(values, q))
                                          for q in _QUANTILES}
            entry["latency_us"][phase]["mean"] = float(values.mean())
        models.append(entry)
    window = trace.get("otherData", {}).get("window_us") or [0.0, 0.0]
    span = max(float(window[1]) - float(window[0]), 1e-9)
    busy: dict[int, float] = defaultdict(float)
    compute: dict[int, float] = defaultdict(float)
    covered: dict[int, float] = {}
    for (pid, _), evs in _tracks(trace).items():
        if not procs.get(pid, "").startswith("ipu ") or not evs:
            continue
        for e in evs:
            if e.get("cat") == "program":
                busy[pid] += e["dur"]
            elif e["name"] == "compute":
                compute[pid] += e["dur"]
        # the time its events cover: the whole window, unless its oldest were dropped
        first = (min(e["ts"] for e in evs if e.get("cat") != "control")
                 if _dropped(trace, pid) else float(window[0]))
        covered[pid] = max(float(window[1]) - first, 1e-9) if first < window[1] else span
    ipus = [{"ipu": name, "pid": pid, "busy_fraction": busy[pid] / covered.get(pid, span),
             "compute_fraction": compute[pid] / covered.get(pid, span),
             "covered_us": covered.get(pid, span)}
            for pid, name in sorted(procs.items(), key=lambda kv: kv[1])
            if name.startswith("ipu ")]
    return {"window_us": span, "models": models, "ipus": ipus,
            "dropped_events": trace.get("otherData", {}).get("dropped_events", {})}


def _dropped(trace: dict[str, Any], pid: int) -> int:
    for e in trace["traceEvents"]:
        if e.get("ph") == "M" and e.get("name") == "process_name" and e["pid"] == pid:
            return int(e["args"].get("dropped_events", 0))
    return 0


def validate(trace: dict[str, Any]) -> list[str]:
    """What is wrong with the trace's structure (empty: nothing)."""
    problems: list[str] = []
    procs, _ = _names(trace)
    events = trace["traceEvents"]
    for pid in sorted({e["pid"] for e in events if e.get("ph") != "M"}):
        if pid not in procs:
            problems.append(f"process {pid} has events but no process_name")
    tracks = _tracks(trace)
    for (pid, tid), evs in tracks.items():
        stack: list[dict[str, Any]] = []
        for e in evs:
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"] + _EPS:
                stack.pop()
            if stack and e["ts"] + e["dur"] > stack[-1]["ts"] + stack[-1]["dur"] + _EPS:
                problems.append(f"{procs.get(pid, pid)} thread {tid}: {e['name']!r} at "
                                f"{e['ts']} overlaps {stack[-1]['name']!r} without nesting")
            stack.append(e)
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
    # each request's phases add up to it
    for req, phases in requests(trace):
        total = sum(phases.get(p, 0.0) for p in _TOP_PHASES)
        if req["dur"] > 1.0 and abs(total - req["dur"]) > 0.05 * req["dur"]:
            problems.append(f"request {req.get('args', {}).get('request_id')}: phases add up "
                            f"to {total:.3f} us of {req['dur']:.3f} us")
    # each request's flows land in IPU iterations inside the request
    reqs: dict[tuple[int, int], tuple[list[float], list[dict[str, Any]]]] = {}
    its: dict[tuple[int, int], dict[float, dict[str, Any]]] = defaultdict(dict)
    for key, evs in tracks.items():
        mine = [e for e in evs if e["name"] == "request" and e.get("cat") == "request"]
        if mine:
            reqs[key] = ([e["ts"] for e in mine], mine)
        for e in evs:
            if e["name"] == "iteration":
                its[key][e["ts"]] = e
    for fid, ends in flows.items():
        s, f = ends.get("s"), ends.get("f")
        if s is None or f is None or (s["pid"], s["tid"]) not in reqs:
            continue
        starts, mine = reqs[(s["pid"], s["tid"])]
        k = bisect.bisect_right(starts, s["ts"] + _EPS) - 1
        it = its.get((f["pid"], f["tid"]), {}).get(f["ts"])
        if k < 0 or it is None or s["ts"] > mine[k]["ts"] + mine[k]["dur"] + _EPS:
            problems.append(f"flow {fid}: no request or no IPU iteration at its ends")
            continue
        r = mine[k]
        if it["ts"] < r["ts"] - _EPS or it["ts"] + it["dur"] > r["ts"] + r["dur"] + _EPS:
            problems.append(f"flow {fid}: IPU iteration [{it['ts']}, +{it['dur']}] is not "
                            f"inside request [{r['ts']}, +{r['dur']}]")
    return problems


def _print(summary: dict[str, Any]) -> None:
    print(f"traced {summary['window_us'] / 1e6:.3f} s")
    for m in summary["models"]:
        print(f"\nmodel {m['model'] or '?'}  replica {m['replica']}  {m['requests']} requests"
              "  (us)")
        print(f"  {'phase':20s} {'p50':>10s} {'p90':>10s} {'p99':>10s} {'mean':>10s}")
        for phase, q in m["latency_us"].items():
            print(f"  {phase:20s} {q['p50']:10.1f} {q['p90']:10.1f} {q['p99']:10.1f} "
                  f"{q['mean']:10.1f}")
    if summary["ipus"]:
        print(f"\n  {'IPU':10s} {'pid':>8s} {'busy':>8s} {'compute':>8s}")
        for i in summary["ipus"]:
            print(f"  {i['ipu']:10s} {i['pid']:8d} {i['busy_fraction']:8.1%} "
                  f"{i['compute_fraction']:8.1%}")
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
