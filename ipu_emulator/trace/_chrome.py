"""Merge a host's events and its IPU processes' records into Chrome Trace Event Format.

The result is a JSON object ``{"traceEvents": [...], "displayTimeUnit": "ns",
"otherData": {...}}`` that Perfetto's UI and chrome://tracing open:

- ``M`` metadata: ``process_name`` (``host <pid>``, ``daemon <pid>``, ``ipu <index> · pid
  <pid> · host <pid> runner <n> · model <m> · replica <r>``), ``thread_name``, sort
  indices; each process's dropped events in its args;
- ``X`` complete slices, ``ts``/``dur`` in microseconds of CLOCK_MONOTONIC, nested per
  track as Perfetto nests them (half-open intervals; slices of one instant in file
  order, parents first). An IPU's track has slices only where it worked: program runs
  (``Main``, ``Load``, ``Save``) holding iterations (``iteration``: ``copies in``,
  ``compute``, ``copies out`` or, on the Python path, each ``copy in``/``link in``,
  ``compute``, ``copy out``/``link out``), and the control messages that do work
  (``load``, ``reset``...); a host thread's, a replica's life and waits;
- ``b``/``e`` async slices, one id per request (``id2.local``: the host's own): a
  request, named by its runner, model and replica (``runner 1 · m · replica 0``, which
  Perfetto makes the title of the track it shows that replica's requests on, those in
  flight together one above the other), with its phases as children that add up to it:
  ``preparation``, ``queue`` (holding ``transfer in``), ``waiting for device``,
  ``transfer out``, ``callbacks``;
- ``i`` instants (``main loop``, faults and other named marks);
- arrows bound to their slices by id (``bind_id`` with ``flow_out`` / ``flow_in``): from
  each request's ``transfer in`` to the first IPU iteration that served each of its
  transfers (one that served more requests than it has slices takes the others' on
  1-ns ``batched request`` marks in its ``copies in``), and from an iteration's last
  transfer out on to the next pipeline stage's iteration, once (paired by the
  transfer's sequence number, which every slot tag carries).
  Each source ends before its destination starts, so Perfetto draws them forward.
"""

from __future__ import annotations

import bisect
from typing import Any, Iterable, NamedTuple

from ipu_emulator.ipu_protocol import Op
from ipu_emulator.trace import recorder as rec

__all__ = ["IpuRecords", "merge", "combine", "PHASES", "REQUEST_CAT", "request_track"]

PHASES = ("preparation", "queue", "waiting for device", "transfer out", "callbacks")
"""The phases of a request (its children, in order; ``transfer in`` is inside ``queue``)."""

REQUEST_CAT = "request"
"""The category of a request's async slices (the request, its phases, its transfers)."""


def request_track(runner: str, model: str, replica: int) -> str:
    """The title of a replica's request track, and the name of each request on it
    (Perfetto titles an async track by its first slice's name, and shows the tracks of
    one name in a process as one): ``runner 1 · simple_model · replica 0``. Runner
    first and replica last: a title too long for the UI's column is cut in the middle."""
    return f"{runner} · {model or '?'} · replica {replica}"

_IPU_CODES = frozenset((rec.I_OP, rec.I_PROGRAM, rec.I_IN, rec.I_OUT, rec.I_COMPUTE,
                        rec.I_STEP, rec.I_WAIT))
_OP_NAMES = {Op.LOAD: "load", Op.RUN: "run", Op.LOOP: "main loop", Op.UNLOAD: "unload",
             Op.RESET: "reset", Op.HOST: "handover", Op.MODES: "modes", Op.STOP: "stop",
             Op.PING: "ping"}


class IpuRecords(NamedTuple):
    """What one IPU process's trace buffer held."""

    pid: int
    ipu: int                # the IPU's index (the machine's IPU number)
    records: list[tuple[int, int, int, int, int, int, int]]
    dropped: int


def _us(ns: int) -> float:
    return round(ns / 1000.0, 3)


class _Out:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.flow = 0
        self.depth: dict[int, int] = {}
        self.marks: dict[int, int] = {}   # request marks made inside a slice (flow_in)

    def slice(self, name: str, pid: int, tid: int, ts: int, dur: int, cat: str,
              args: dict[str, Any] | None = None, depth: int = 0) -> dict[str, Any]:
        """An X slice; ``depth`` orders slices that start at one instant (parents first,
        then siblings in time order) in the file. Perfetto takes the longer first at one
        instant whatever the order, which is why no slice is zero-length (_visible)."""
        start = _us(ts)   # dur from the rounded ends: a child never ends after its parent
        ev: dict[str, Any] = {"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tid,
                              "ts": start, "dur": round(_us(ts + max(0, dur)) - start, 3)}
        if args:
            ev["args"] = args
        self.events.append(ev)
        self.depth[id(ev)] = depth
        return ev

    def async_slice(self, name: str, pid: int, ident: str, ts: int, dur: int,
                    args: dict[str, Any] | None = None, depth: int = 0) -> dict[str, Any]:
        """An async slice (``b`` and ``e`` events of id ``ident``, local to the process:
        Perfetto puts each id on a track of its own, titled by its first slice's name);
        returns its ``b`` event (which holds its arrows' ``bind_id``). ``depth`` orders
        the events of one instant: ends before begins, inner ends first, outer begins
        first, as Perfetto reads them in file order."""
        scope = {"cat": REQUEST_CAT, "pid": pid, "tid": pid, "id2": {"local": ident}}
        begin: dict[str, Any] = {"ph": "b", "name": name, **scope, "ts": _us(ts)}
        if args:
            begin["args"] = args
        end = {"ph": "e", "name": name, **scope, "ts": _us(ts + max(0, dur))}
        self.events += [begin, end]
        self.depth[id(begin)] = depth
        self.depth[id(end)] = -depth
        return begin

    def meta(self, what: str, pid: int, tid: int | None, args: dict[str, Any]) -> None:
        ev: dict[str, Any] = {"ph": "M", "name": what, "pid": pid, "args": args}
        if tid is not None:
            ev["tid"] = tid
        self.events.append(ev)

    def instant(self, name: str, pid: int, tid: int, ts: int, args: dict[str, Any]) -> None:
        self.events.append({"ph": "i", "s": "t", "name": name, "cat": "instant", "pid": pid,
                            "tid": tid, "ts": _us(ts), "args": args})

    def flow_out(self, src: dict[str, Any]) -> int:
        """The flow id leaving slice ``src`` (its ``bind_id``; a new one if it has none)."""
        if "bind_id" not in src:
            self.flow += 1
            src["bind_id"] = self.flow
            src["flow_out"] = True
        return int(src["bind_id"])

    def flow_in(self, flow: int, dst: list[dict[str, Any]],
                args: dict[str, Any] | None = None) -> bool:
        """Bind flow ``flow`` into the first slice of ``dst`` not bound yet (a slice holds
        one ``bind_id``). None free (an iteration serving more requests than it has
        slices: dynamic batching): into a new 1-ns ``batched request`` mark (``args``)
        inside the first of them with room, after the marks before it; False if none has."""
        for ev in dst:
            if "bind_id" not in ev:
                ev["bind_id"] = flow
                ev["flow_in"] = True
                return True
        for host in dst[1:] + dst[:1]:
            start, dur = round(host["ts"] * 1000), round(host["dur"] * 1000)
            n = self.marks.get(id(host), 0)
            if n + 1 <= dur:
                self.marks[id(host)] = n + 1
                ev = self.slice("batched request", host["pid"], host["tid"], start + n, 1,
                                "transfer", args, depth=self.depth[id(host)] + 1)
                ev["bind_id"] = flow
                ev["flow_in"] = True
                return True
        return False


# ----------------------------------------------------------------------------- IPU side
class _Iteration:
    __slots__ = ("start", "end", "seq", "children", "out_seen", "lead")

    def __init__(self, start: int) -> None:
        self.start = start
        self.end = start
        self.seq = 0
        self.children: list[tuple[str, int, int, dict[str, Any]]] = []
        self.out_seen = False
        # unnumbered links taken before the iteration's first numbered transfer (a sharded
        # model's token from the last IPU): the IPU's, not the request's (Main's children)
        self.lead: list[tuple[str, int, int, dict[str, Any]]] = []


class Served(NamedTuple):
    """An IPU iteration that served a transfer: its slices, for binding arrows."""

    start: int
    end: int
    pid: int
    into: list[dict[str, Any]]          # the iteration, then its children (arrows in)
    out: dict[str, Any] | None          # its last transfer out (the arrow on)


_IDLE_OPS = (Op.LOOP, Op.RUN)   # containers that hold idle time: not slices (see below)


def _ipu_events(out: _Out, ipu: IpuRecords, window: tuple[int, int], tid: int | None = None
                ) -> dict[int, list[Served]]:
    """Write one IPU's slices (on thread ``tid``, default its pid); returns seq ->
    the iterations that served it.

    Only work is a slice, so the track is busy where it has one: program runs (with
    their iterations and transfers) and the control messages that do work (``load``,
    ``reset``...). ``main loop`` and ``run`` (which hold idle time while the IPU waits
    for input) are instants at their start, and ``wait for input`` is a slice only
    inside a program run (outside one, the gap is the idle time)."""
    pid, tid = ipu.pid, ipu.pid if tid is None else tid
    lo, hi = window
    recs = sorted((r for r in ipu.records if r[0] + r[1] >= lo and r[0] <= hi),
                  key=lambda r: (r[0], -r[1]))
    iterations: dict[int, list[Served]] = {}
    programs = [r for r in recs if r[2] == rec.I_PROGRAM]
    starts = [p[0] for p in programs]
    # the iterations of each Main run, from its C steps or its Python path's transfers
    per_program: dict[int, list[tuple[int, int, int, int, int, int, int]]] = {}
    loose = []
    for r in recs:
        code = r[2]
        if code in (rec.I_PROGRAM, rec.I_OP, rec.I_INSTANT):
            continue
        k = bisect.bisect_right(starts, r[0]) - 1
        if k >= 0 and r[0] + r[1] <= programs[k][0] + programs[k][1]:
            per_program.setdefault(k, []).append(r)
        elif code != rec.I_WAIT:
            loose.append(r)
    for k, p in enumerate(programs):
        _program(out, pid, tid, p, per_program.get(k, []), iterations, loose)
    for r in loose:
        _transfer_slice(out, pid, tid, r)
    for r in recs:
        code = r[2]
        if code == rec.I_OP:
            try:
                op = Op(r[4])
                name = _OP_NAMES.get(op, op.name.lower())
            except ValueError:
                op, name = None, f"op {r[4]}"
            if op in _IDLE_OPS:
                out.instant(name, pid, tid, r[0], {"op": r[4], "dur_us": _us(r[1])})
            else:
                out.slice(name, pid, tid, r[0], r[1], "control", {"op": r[4]})
        elif code == rec.I_INSTANT:
            out.instant(rec.unpack_name(r[4], r[5], r[6]), pid, tid, r[0], {})
    return iterations


def _program(out: _Out, pid: int, tid: int, p: tuple[int, int, int, int, int, int, int],
             inner: list[tuple[int, int, int, int, int, int, int]],
             iterations: dict[int, list[Served]],
             loose: list[tuple[int, int, int, int, int, int, int]]) -> None:
    """One program run (``Load``, ``Main``, ``Save``) and what ran inside it."""
    ts, dur, _, _, index, kind, runs = p
    kind_name = rec.PROGRAM_KINDS[kind] if 0 <= kind < len(rec.PROGRAM_KINDS) else "program"
    waits = [r for r in inner if r[2] == rec.I_WAIT]
    inner = [r for r in inner if r[2] != rec.I_WAIT]
    start, end = ts, ts + dur
    its = _iterations(inner) if kind_name == "Main" else []
    if kind_name == "Main" and inner:
        # a Main run: from its first transfer taken to its last one published (what
        # follows, releasing slots, is after the host may have its answer)
        start = max(ts, inner[0][0])
        end = min(end, max(r[0] + r[1] for r in inner))
        end = max([end] + [it.end for it in its])
    out.slice(kind_name, pid, tid, start, end - start, "program",
              {"program": index, "runs": runs}, depth=1)
    for it in its:
        for name, cts, cdur, args in it.lead:
            out.slice(name, pid, tid, cts, cdur, "transfer", args, depth=2)
        into = [out.slice("iteration", pid, tid, it.start, it.end - it.start, "iteration",
                          {"seq": it.seq}, depth=2)]
        last_out = None
        for name, cts, cdur, args in it.children:
            ev = out.slice(name, pid, tid, cts, cdur, "transfer", args, depth=3)
            into.append(ev)
            if "out" in name:
                last_out = ev
        iterations.setdefault(it.seq, []).append(Served(it.start, it.end, pid, into, last_out))
    for w in waits:
        if start <= w[0] and w[0] + w[1] <= end and not any(
                it.start < w[0] + w[1] and w[0] < it.end for it in its):
            out.slice("wait for input", pid, tid, w[0], w[1], "wait",
                      {"stream": w[4], "polled": bool(w[5])}, depth=2)
    if kind_name != "Main":
        loose.extend(inner)


def _transfer_slice(out: _Out, pid: int, tid: int,
                    r: tuple[int, int, int, int, int, int, int]) -> None:
    ts, dur, code, _, a, b, c = r
    if code == rec.I_IN:
        out.slice("link in" if c else "copy in", pid, tid, ts, dur, "transfer",
                  {"seq": a, "stream": b})
    elif code == rec.I_OUT:
        out.slice("link out" if c else "copy out", pid, tid, ts, dur, "transfer",
                  {"seq": a, "stream": b})
    elif code == rec.I_COMPUTE:
        out.slice("compute", pid, tid, ts, dur, "compute", {"graph": a})
    elif code == rec.I_STEP:
        out.slice("iteration", pid, tid, ts, dur, "iteration", {"seq": a})


def _iterations(inner: list[tuple[int, int, int, int, int, int, int]]) -> list[_Iteration]:
    """The iterations of one Main run: each C step, or a run of Python transfers from an
    input after an output to the last output."""
    its: list[_Iteration] = []
    cur: _Iteration | None = None
    for ts, dur, code, _, a, b, c in inner:
        if code == rec.I_STEP:
            it = _Iteration(ts)
            it.end, it.seq = ts + dur, a
            taken, computed = ts + b, ts + c
            it.children = [("copies in", ts, b, {"seq": a}),
                           ("compute", taken, computed - taken, {}),
                           ("copies out", computed, ts + dur - computed, {"seq": a})]
            its.append(it)
            cur = None
            continue
        if cur is None or (code == rec.I_IN and cur.out_seen):
            cur = _Iteration(ts)
            its.append(cur)
        if code == rec.I_IN:
            name, args = ("link in" if c else "copy in"), {"seq": a, "stream": b}
        elif code == rec.I_OUT:
            name, args = ("link out" if c else "copy out"), {"seq": a, "stream": b}
            cur.out_seen = True
        else:
            name, args = "compute", {"graph": a}
        if code in (rec.I_IN, rec.I_OUT) and a:
            cur.seq = max(cur.seq, a)
        cur.end = max(cur.end, ts + dur)
        cur.children.append((name, ts, dur, args))
    for it in its:
        k = 0
        if it.seq:   # (an iteration of numbered transfers starts at the first of them)
            while k < len(it.children) and it.children[k][0] == "link in" \
                    and not it.children[k][3]["seq"]:
                k += 1
        if k < len(it.children):
            it.lead, it.children = _visible(it.children[:k]), it.children[k:]
            it.start = it.children[0][1]
        it.children = _visible(it.children)
        it.end = max([it.end] + [cts + cdur for _, cts, cdur, _ in it.children])
    return its


def _visible(children: list[tuple[str, int, int, dict[str, Any]]]
             ) -> list[tuple[str, int, int, dict[str, Any]]]:
    """Siblings in time order, each at least 1 ns long and starting where the one before
    ends: Perfetto nests a zero-length slice in whatever slice starts at its instant
    (also another zero-length one), so a zero-length phase would land in its next
    sibling, or outside its parent at the parent's end. The few ns this moves a
    boundary is the price of each slice showing where it belongs."""
    out = []
    cursor = None
    for name, ts, dur, args in children:
        start = ts if cursor is None else max(ts, cursor)
        end = max(ts + dur, start + 1)
        out.append((name, start, end - start, args))
        cursor = end
    return out


# ----------------------------------------------------------------------------- host side
def _monotonic(t: int) -> int:
    return t + rec.PERF_OFFSET


def _phases(instants: tuple[int, ...]) -> list[tuple[str, int, int]]:
    """(name, start, end) of a request's phases (module docstring), clamped in order."""
    t0, t1, t2, t3, t4, t5, t6, t7 = (_monotonic(t) for t in instants)
    t7 = max(t0, t7)

    def clamp(t: int, lo: int) -> int:
        return min(max(t, lo), t7)
    t1 = clamp(t1, t0)
    t4 = clamp(t4, t1)
    t5 = clamp(t5 or t4, t4)
    t6 = clamp(t6 or t5, t5)
    t2 = min(max(t2 or t1, t1), t4)
    t3 = min(max(t3 or t2, t2), t4)
    return [("preparation", t0, t1), ("queue", t1, t4), ("transfer in", t2, t3),
            ("waiting for device", t4, t5), ("transfer out", t5, t6), ("callbacks", t6, t7)]


def _runners(events: list[tuple[Any, ...]]) -> tuple[
        dict[int, tuple[str, str]], dict[int, list[tuple[int, str, int, list[int]]]]]:
    """Each replica life's runner (``runner N``, its model) and devices over time.

    A runner is not in the events: its replicas are. A life of replica 0 starts a new
    runner; a life of replica r > 0 joins the newest runner of its model."""
    runners: dict[int, tuple[str, str]] = {}
    devices: dict[int, list[tuple[int, str, int, list[int]]]] = {}
    newest: dict[str, str] = {}
    count = 0
    for code, _, ts, _, payload in sorted((e for e in events if e[0] == rec.H_LIFE),
                                          key=lambda e: e[2]):
        what, replica, pids, model, key = payload
        if what in ("attach and load", "reset", "running"):
            devices.setdefault(key, []).append((ts, model, replica, list(pids)))
        if key not in runners:
            if replica == 0 or model not in newest:
                count += 1
                newest[model] = f"runner {count}"
            runners[key] = (newest[model], model)
    return runners, devices


def merge(pid: int, role: str, events: list[tuple[Any, ...]], dropped: int,
          threads: dict[int, tuple[int, str]], ipus: Iterable[IpuRecords],
          window: tuple[int, int]) -> dict[str, Any]:
    """The Chrome trace of a host (or daemon) process ``pid`` and its IPU processes."""
    out = _Out()
    label = f"{role} {pid}"
    out.meta("process_name", pid, None, {"name": label, "dropped_events": dropped})
    out.meta("process_sort_index", pid, None, {"sort_index": 0})
    tid_of = {ident: native for ident, (native, _) in threads.items()}
    for ident, (native, name) in threads.items():
        out.meta("thread_name", pid, native, {"name": name})
    runners, devices = _runners(events)
    served: dict[int, list[str]] = {}     # IPU pid -> what it served
    for key, lives in devices.items():
        for _, model, replica, pids in lives:
            for stage, ipu_pid in enumerate(pids):
                what = (f"{label} {runners[key][0]} · model {model or '?'} · replica {replica}"
                        + (f" · stage {stage}" if len(pids) > 1 else ""))
                if what not in served.setdefault(ipu_pid, []):
                    served[ipu_pid].append(what)
    ipu_list = list(ipus)
    iterations: dict[int, dict[int, list[Served]]] = {}
    for ipu in sorted(ipu_list, key=lambda i: (i.ipu, i.pid)):
        name = f"ipu {ipu.ipu} · pid {ipu.pid}"
        if served.get(ipu.pid):
            name += " · " + "; ".join(served[ipu.pid])
        out.meta("process_name", ipu.pid, None, {"name": name, "ipu": ipu.ipu,
                                                  "pid": ipu.pid, "dropped_events": ipu.dropped})
        out.meta("process_sort_index", ipu.pid, None, {"sort_index": 10 + ipu.ipu})
        out.meta("thread_name", ipu.pid, ipu.pid, {"name": f"ipu {ipu.ipu}"})
        iterations[ipu.pid] = _ipu_events(out, ipu, window)
    lo, hi = window
    count = [0]     # requests written (their async ids)
    for code, ident, ts, dur, payload in events:
        tid = tid_of.get(ident, 0)
        if code == rec.H_REQUEST:
            _request(out, pid, payload, threads.get(ident, (0, ""))[1], devices, iterations,
                     runners, count)
        elif code == rec.H_FAILED:
            _failed(out, pid, ts, dur, payload, devices, runners, count)
        elif code == rec.H_LIFE and payload[0] != "running":   # (running: a name only)
            what, replica, pids, model, key = payload
            out.slice(f"{what} (replica {replica})", pid, tid, ts, dur, "device",
                      {"runner": runners.get(key, ("", ""))[0], "replica": replica,
                       "model": model, "ipu_pids": list(pids)})
        elif code == rec.H_WAIT:
            out.slice(payload[0], pid, tid, ts, dur, "wait", {}, depth=1)
        elif code == rec.H_INSTANT:
            name, args = payload
            out.instant(name, pid, tid, ts, {k: _jsonable(v) for k, v in args.items()})
        elif code == rec.I_INSTANT:
            out.instant(rec.unpack_name(*payload), pid, tid, ts, {})
    # IPU hooks that ran in this process (a loopback device's thread): as an IPU's
    loopback: dict[int, list[tuple[int, int, int, int, int, int, int]]] = {}
    for code, ident, ts, dur, payload in events:
        if code in _IPU_CODES:
            loopback.setdefault(ident, []).append((ts, dur, code, 0, *payload))
    for ident, records in loopback.items():
        _ipu_events(out, IpuRecords(pid, -1, records, 0), window, tid_of.get(ident, 0))
    depth = out.depth
    # parents before children at one instant, then siblings in time order (a reader
    # that keeps file order nests them right; Perfetto, longer first, does too); async
    # ends before begins (Perfetto reads those of one instant in file order)
    out.events.sort(key=lambda e: (e["ph"] != "M", e["pid"], e.get("tid", 0), e.get("ts", 0),
                                   e["ph"] != "e", depth.get(id(e), 0), e.get("dur", 0)))
    return {"traceEvents": out.events, "displayTimeUnit": "ns",
            "otherData": {"clock": "CLOCK_MONOTONIC", "host_pid": pid, "role": role,
                          "window_us": [_us(lo), _us(hi)],
                          "dropped_events": {label: dropped,
                                             **{f"ipu {i.ipu} ({i.pid})": i.dropped
                                                for i in ipu_list}}}}


def _jsonable(v: Any) -> Any:
    return v if isinstance(v, (int, float, str, bool)) or v is None else repr(v)


def _served_by(key: int, ts: int, devices: dict[int, list[tuple[int, str, int, list[int]]]],
               runners: dict[int, tuple[str, str]]) -> tuple[str, str, list[int]]:
    """The runner, model and IPU processes of the replica life ``key`` at ``ts``."""
    model, pids = "", []
    for since, m, _replica, p in devices.get(key, []):
        if since <= ts:
            model, pids = m, p
    return runners.get(key, ("runner ?", ""))[0], model, pids


def _failed(out: _Out, pid: int, ts: int, dur: int, payload: tuple[Any, ...],
            devices: dict[int, list[tuple[int, str, int, list[int]]]],
            runners: dict[int, tuple[str, str]], count: list[int]) -> None:
    """A request that failed: a slice from its arrival to its failure on its replica's
    request track, its args naming the error, and one phase inside, ``failed: <error>``."""
    key, replica, request_id, samples, error = payload
    runner, model, _ = _served_by(key, ts, devices, runners)
    count[0] += 1
    ident = f"{ts:x}.{count[0]}"
    dur = max(dur, 1)
    out.async_slice(request_track(runner, model, replica), pid, ident, ts, dur,
                    {"runner": runner, "replica": replica, "request_id": request_id,
                     "batch_size": samples, "seqs": [], "model": model, "error": error})
    out.async_slice(f"failed: {error}", pid, ident, ts, dur, depth=1)


def _request(out: _Out, pid: int, payload: tuple[Any, ...], thread: str,
             devices: dict[int, list[tuple[int, str, int, list[int]]]],
             iterations: dict[int, dict[int, list[Served]]],
             runners: dict[int, tuple[str, str]], count: list[int]) -> None:
    """A request's slices, and its arrows: from its ``transfer in`` (the host laid the
    inputs) to the first IPU iteration that served each of its transfers, and from
    that iteration's last transfer out on to the next pipeline stage's.

    The request and its phases are async slices of one id (the request's own, unique
    in the host's file: its start and number), named by its runner, model and replica
    (:func:`request_track`): Perfetto shows a replica's requests on one track of that
    title, those in flight together one above the other."""
    key, replica, request_id, samples, seqs, instants = payload
    phases = _phases(instants)
    t0, t7 = phases[0][1], phases[-1][2]
    runner, model, pids = _served_by(key, t0, devices, runners)
    # each phase at least 1 ns, in order (see _visible); the request holds them all
    top = _visible([(n, a, b - a, {}) for n, a, b in phases if n != "transfer in"])
    q_start, q_end = top[1][1], top[1][1] + top[1][2]
    t2 = min(max(phases[2][1], q_start), q_end - 1)
    t3 = min(max(phases[2][2], t2 + 1), q_end)
    phases = [(n, a, a + d) for n, a, d, _ in top[:2]] + [("transfer in", t2, t3)] + \
        [(n, a, a + d) for n, a, d, _ in top[2:]]
    end = max(t7, phases[-1][2])
    count[0] += 1
    ident = f"{t0:x}.{count[0]}"
    out.async_slice(request_track(runner, model, replica), pid, ident, t0, end - t0,
                    {"runner": runner, "replica": replica, "request_id": request_id,
                     "batch_size": samples, "seqs": list(seqs), "model": model,
                     "thread": thread})
    laid: dict[str, Any] | None = None
    ended: list[tuple[int, dict[str, Any]]] = []   # (end, slice) of the phases before it
    for name, a, b in phases:
        ev = out.async_slice(name, pid, ident, a, b - a, depth=2 if name == "transfer in"
                             else 1)
        if name == "transfer in":
            laid = ev
        elif laid is None:
            ended.append((b, ev))
    assert laid is not None
    chains: list[tuple[int, list[Served]]] = []
    for seq in seqs:
        chain: list[Served] = []
        for ipu_pid in pids:
            for it in iterations.get(ipu_pid, {}).get(seq, []):
                # inside the request; a later stage's (reached by a link arrow) may end
                # after it: its step records its end once it let go of its input slots,
                # after publishing the output the host then read
                if t0 <= it.start and (it.end <= end or chain and it.start <= end):
                    chain.append(it)
                    break
        if chain:
            chains.append((seq, sorted(chain, key=lambda it: it.start)))
    # an arrow is drawn from its source's end: a transfer the IPU took before the host
    # finished laying them all leaves from a slice of its own inside ``transfer in``,
    # ending when the IPU took it (the host records no per-transfer end)
    t2, t3 = phases[2][1], phases[2][2]
    since = t2
    for seq, chain in sorted(chains, key=lambda c: c[1][0].start):
        src: dict[str, Any] | None = laid
        if chain[0].start < since:
            # the IPU's iteration began (waiting for its inputs) before the host laid
            # this transfer: an arrow from the laying would point back in time; it
            # leaves the last phase that ended by then, or there is none
            src = max(((b, ev) for b, ev in ended if b <= chain[0].start),
                      key=lambda e: e[0], default=(0, None))[1]
        elif chain[0].start < t3 and since < t3:
            # at least 1 ns (see _visible): one starting at its iteration's start is
            # drawn straight down, not backwards
            until = min(max(since + 1, chain[0].start), t3)
            src = out.async_slice(f"transfer in (seq {seq})", pid, ident, since,
                                  until - since, {"seq": seq}, depth=3)
            since = until
        for k, it in enumerate(chain):
            # on from a stage's iteration: drawn once (by the first request it served)
            if src is None or (k and "bind_id" in src) or not out.flow_in(
                    out.flow_out(src), it.into, {"request_id": request_id, "seq": seq}):
                break
            src = it.out


_BIND = ("bind_id", "flow_in", "flow_out")


def combine(traces: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Traces of several processes of one machine (one clock) as one: their events side
    by side (each keeps its pids), flow ids (``bind_id``) renumbered apart so each
    arrow keeps its two slices, their windows joined.

    An IPU process a daemon lent to several hosts is in each of their files (and the
    daemon's): it is kept once, its slices carrying every host's arrows, and its name
    says whom it served in each."""
    events: list[dict[str, Any]] = []
    seen: dict[tuple[Any, ...], int] = {}      # event -> its index in events
    dropped: dict[str, int] = {}
    lo, hi = float("inf"), float("-inf")
    offset = 0
    for trace in traces:
        top = 0
        for e in trace.get("traceEvents", []):
            if e.get("ph") in ("s", "f"):
                e = dict(e, id=e["id"] + offset)
                top = max(top, e["id"])
            elif "bind_id" in e:
                e = dict(e, bind_id=e["bind_id"] + offset)
                top = max(top, e["bind_id"])
            key = ((e["ph"], e["name"], e["pid"], e.get("tid")) if e.get("ph") == "M" else
                   (e.get("ph"), e.get("name"), e.get("pid"), e.get("tid"), e.get("ts"),
                    e.get("dur"), str(e.get("id2", ""))))
            k = seen.get(key)
            if k is None:
                seen[key] = len(events)
                events.append(e)
            elif e.get("ph") == "M" and e["name"] == "process_name":
                events[k] = _join_names(events[k], e)
            elif "bind_id" in e and "bind_id" not in events[k]:
                events[k] = dict(events[k], **{b: e[b] for b in _BIND if b in e})
        offset = max(offset, top)
        other = trace.get("otherData", {})
        dropped.update(other.get("dropped_events", {}))
        window = other.get("window_us")
        if window:
            lo, hi = min(lo, window[0]), max(hi, window[1])
    if lo > hi:
        lo = hi = 0.0
    return {"traceEvents": events, "displayTimeUnit": "ns",
            "otherData": {"clock": "CLOCK_MONOTONIC", "window_us": [lo, hi],
                          "dropped_events": dropped}}


def _join_names(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """One process's name records from two files: ``ipu N · pid P`` and what each file
    says it served, each once."""
    parts_a = str(a["args"].get("name", "")).split(" · ")
    parts_b = str(b["args"].get("name", "")).split(" · ")
    if parts_a[:2] != parts_b[:2]:
        return a
    served = [x for x in " · ".join(parts_a[2:]).split("; ") if x]
    served += [x for x in " · ".join(parts_b[2:]).split("; ") if x and x not in served]
    name = " · ".join(parts_a[:2]) + ("".join([" · ", "; ".join(served)]) if served else "")
    return dict(a, args=dict(a["args"], name=name))
