"""The rules a model must keep before it runs: metadata, anchors and programs agree.

One place for the rules, used by both sides:

- the host (``host_runtime.popef``) checks a model when it is built from its
  files (``check_model``: the executable against the metadata's anchors and
  program flow) and turns a ``RuleError`` into a ``PopefError``;
- the IPU process checks what it can see without the metadata when a host
  loads an executable and asks it to loop programs (``check_loaded_streams``:
  every stream the host connected is transferred by some program;
  ``check_loop``: every iteration of the loop streams an output, no stream
  twice and none unconnected), so that a host that skipped the first check gets an error instead of
  a device that waits forever. Both run once per LOAD / LOOP, never per
  iteration: the C steps of a Main iteration pay nothing for them.

Rules (the ``rule`` of a ``RuleError``)::

    program-index   every index of programFlow (load, main, save) and of an
                    anchor's programs names a program of the executable
    main-missing    programFlow.main names at least one program
    main-empty      every Main program has instructions and Main streams out
                    at least one output per iteration; so has every IPU's part of
                    a multi-IPU executable, except a part the compiler marked idle
                    (an IPU that holds no node: ``Executable.idle``, which the
                    executable's own checks keep empty)
    repeat-count    every Repeat of a program the flow runs counts >= 1
    anchor-stream   every INPUT/OUTPUT anchor is a stream of the executable of the
                    same direction, dtype, shape and size
    stream-anchor   every stream a program of the flow uses is an anchor
    anchor-programs an anchor lists exactly the programs that stream it (at least one)
    role-load       a Load program only streams in
    role-save       a Save program does not stream in
    stream-count    per Main iteration, every Main input is streamed in exactly
                    once and every Main output streamed out exactly once (a
                    fused model's Switch branch: once in the branches of its
                    sub-graph, never in the others)
    stream-order    per Main iteration, a Main output is streamed out only after
                    the iteration has written its device tensor (on the device:
                    only tensors an Execute or Copy of the iteration writes), and
                    an Execute or Copy reads a streamed-in tensor only after the
                    iteration has streamed it in

An *iteration* is the body of the Repeat that is the whole of a single Main
program (what the compiler emits), else one run of the Main programs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Iterable, Mapping, Sequence

from ipu_emulator.errors import ExecutableError
from ipu_emulator.executable import (Copy, Execute, Executable, Instruction, Program, Repeat,
                                     StreamIn, StreamOut, Switch, is_link, is_sync)

__all__ = [
    "AnchorSpec",
    "FlowSpec",
    "RuleError",
    "check_model",
    "check_loaded_streams",
    "check_loop",
    "programs_streaming",
    "stream_counts",
    "unnumbered_outputs",
]

_MAX_COUNTS = 8
"""Distinct per-iteration counts kept per stream (more: the stream is 'many')."""


class RuleError(ExecutableError):
    """A model breaks one of the rules above; ``rule`` names it."""

    def __init__(self, rule: str, message: str) -> None:
        super().__init__(f"rule {rule}: {message}")
        self.rule = rule


@dataclass(frozen=True)
class AnchorSpec:
    """What the metadata says of one anchor (plain values, no host types)."""

    name: str
    handle: str
    direction: str | None          # "in" (INPUT), "out" (OUTPUT), None (UNKNOWN)
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    programs: tuple[int, ...]


@dataclass(frozen=True)
class FlowSpec:
    """The metadata's program flow."""

    load: tuple[int, ...] = ()
    main: tuple[int, ...] = ()
    save: tuple[int, ...] = ()


# -- counting streams through Repeat / Switch ----------------------------------------

Counts = dict[tuple[str, str], frozenset[int]]
"""(direction, handle) -> the numbers of transfers one run can make (one per path)."""

_ZERO = frozenset({0})


def _add(a: frozenset[int], b: frozenset[int]) -> frozenset[int]:
    out = frozenset(x + y for x in a for y in b)
    return out if len(out) <= _MAX_COUNTS else frozenset(sorted(out)[:_MAX_COUNTS])


def stream_counts(body: Sequence[Instruction]) -> Counts:
    """How many transfers of each stream one run of ``body`` makes, per path."""
    counts: Counts = {}

    def seq(key: tuple[str, str], more: frozenset[int]) -> None:
        counts[key] = _add(counts.get(key, _ZERO), more)

    for i in body:
        if isinstance(i, StreamIn):
            seq(("in", i.handle), frozenset({1}))
        elif isinstance(i, StreamOut):
            seq(("out", i.handle), frozenset({1}))
        elif isinstance(i, Repeat):
            for key, c in stream_counts(i.body).items():
                seq(key, frozenset(x * i.count for x in c))
        elif isinstance(i, Switch):
            per_branch = [stream_counts(b) for b in i.branches]
            keys = {k for p in per_branch for k in p}
            for key in keys:
                union: frozenset[int] = frozenset()
                for p in per_branch:
                    union |= p.get(key, _ZERO)
                seq(key, union)
    return counts


def programs_streaming(exe: Executable) -> dict[tuple[str, str], set[int]]:
    """(direction, handle) -> the indices of ``exe``'s programs that stream it."""
    used: dict[tuple[str, str], set[int]] = {}
    for k, p in enumerate(exe.programs):
        for key in stream_counts(p.body):
            used.setdefault(key, set()).add(k)
    return used


def unnumbered_outputs(parts: Sequence[Sequence[Program]], numbered: Collection[str]
                       ) -> set[str]:
    """The host output streams whose transfers carry no request's number: those written
    by an IPU (``parts``: each IPU's programs) that reads none of the ``numbered`` input
    streams, directly or through the IPU-Links of an IPU that does. An iteration takes its
    number from its inputs (the sharding token carries none), so such an IPU's outputs
    are tagged 0: e.g. one that computes a model output from weights alone."""
    reads, writes = [], []
    for programs in parts:
        keys = {key for p in programs for key in stream_counts(p.body)}
        reads.append({h for d, h in keys if d == "in"})
        writes.append({h for d, h in keys if d == "out"})
    on = {k for k, r in enumerate(reads) if not r.isdisjoint(numbered)}
    grew = True
    while grew:   # a link from an IPU whose iterations are numbered numbers the reader's
        grew = False
        for k, r in enumerate(reads):
            if k not in on and any(h in writes[j] for j in on for h in r
                                   if is_link(h) and not is_sync(h)):
                on.add(k)
                grew = True
    return {h for k, w in enumerate(writes) if k not in on for h in w if not is_link(h)}


def _repeats(body: Sequence[Instruction]) -> Iterable[Repeat]:
    for i in body:
        if isinstance(i, Repeat):
            yield i
            yield from _repeats(i.body)
        elif isinstance(i, Switch):
            for b in i.branches:
                yield from _repeats(b)


def _iteration(exe: Executable, main: Sequence[int]) -> tuple[tuple[Instruction, ...], int, str]:
    """(the body of one Main iteration, iterations per run, how to name it)."""
    if len(main) == 1:
        body = exe.programs[main[0]].body
        if len(body) == 1 and isinstance(body[0], Repeat):
            return body[0].body, body[0].count, f"Main program {main[0]}"
        return body, 1, f"Main program {main[0]}"
    body = tuple(i for p in main for i in exe.programs[p].body)
    return body, 1, f"Main programs {list(main)}"


def _say(n: int) -> str:
    return "once" if n == 1 else f"{n} times"


def _describe_counts(c: frozenset[int]) -> str:
    if len(c) == 1:
        return _say(next(iter(c)))
    return "on different paths " + " or ".join(_say(x) for x in sorted(c))


# -- the host's check: the whole model --------------------------------------------------

def check_model(exe: Executable, anchors: Sequence[AnchorSpec], flow: FlowSpec,
                subgraphs: Mapping[str, Sequence[str]] | None = None) -> None:
    """Check ``exe`` against the metadata's anchors and flow; raises ``RuleError``."""
    n = len(exe.programs)
    have = f"the executable has {n} programs (0..{n - 1})" if n else \
        "the executable has no programs"
    for phase, progs in (("load", flow.load), ("main", flow.main), ("save", flow.save)):
        for p in progs:
            if not 0 <= p < n:
                raise RuleError("program-index", f"programFlow.{phase} names program {p}; "
                                f"{have}")
    for a in anchors:
        for p in a.programs:
            if not 0 <= p < n:
                raise RuleError("program-index", f"anchor {a.name!r} lists program {p}; "
                                f"{have}")
    if not flow.main:
        raise RuleError("main-missing", "programFlow.main names no program; a model needs "
                        "a Main program")
    for p in flow.main:
        if not exe.programs[p].body:
            raise RuleError("main-empty", f"Main program {p} has no instructions")
    _check_parts(exe, flow)
    for phase, progs in (("Load", flow.load), ("Main", flow.main), ("Save", flow.save)):
        for p in progs:
            for r in _repeats(exe.programs[p].body):
                if r.count < 1:
                    raise RuleError("repeat-count", f"{phase} program {p} has a Repeat of "
                                    f"count {r.count}; expected >= 1 (its body would never "
                                    "run)")

    _check_roles(exe, flow)
    _check_anchor_streams(exe, anchors, flow)
    by_handle = {a.handle: a for a in anchors if a.direction is not None}
    main = set(flow.main)
    main_anchors = [a for a in by_handle.values() if main.intersection(a.programs)]
    _check_main_iteration(exe, flow.main, main_anchors, subgraphs or {})


def _check_parts(exe: Executable, flow: FlowSpec) -> None:
    """Each IPU's part runs the flow's Main programs: a part not marked idle has them, with
    instructions, and every iteration streams something out (its links or anchors)."""
    for k, part in enumerate(exe.parts):
        if part.idle:
            continue
        for p in flow.main:
            if p >= len(part.programs) or not part.programs[p].body:
                raise RuleError("main-empty", f"IPU {k}'s part has no instructions in Main "
                                f"program {p}, and is not marked idle (only an IPU that holds "
                                "no node of the model may run nothing)")
        body, _count, what = _iteration(part, flow.main)
        if not _every_path_streams_out(body):
            raise RuleError("main-empty", f"IPU {k}'s part: {what} has an iteration that "
                            "streams nothing out")


def _check_anchor_streams(exe: Executable, anchors: Sequence[AnchorSpec], flow: FlowSpec) -> None:
    used = programs_streaming(exe)
    seen: set[str] = set()
    for a in anchors:
        if a.direction is None:
            continue
        if a.handle in seen:
            raise RuleError("anchor-stream", f"two anchors have handle {a.handle!r}")
        seen.add(a.handle)
        kind = "INPUT" if a.direction == "in" else "OUTPUT"
        s = exe.streams.get(a.handle)
        if s is None:
            raise RuleError("anchor-stream", f"{kind} anchor {a.name!r} has handle "
                            f"{a.handle!r}, which is not a stream of the executable; its "
                            f"streams are {sorted(exe.streams)}")
        if s.direction != a.direction:
            raise RuleError("anchor-stream", f"{kind} anchor {a.name!r} is stream "
                            f"{a.handle!r}, which the executable streams '{s.direction}'")
        if s.dtype != a.dtype or tuple(s.shape) != tuple(a.shape) or s.nbytes != a.nbytes:
            raise RuleError("anchor-stream", f"anchor {a.name!r} is {a.dtype}{list(a.shape)} "
                            f"({a.nbytes} bytes) but stream {a.handle!r} of the executable is "
                            f"{s.dtype}{list(s.shape)} ({s.nbytes} bytes)")
        streaming = used.get((a.direction, a.handle), set())
        if not streaming:
            raise RuleError("anchor-programs", f"{kind} anchor {a.name!r}: no program of "
                            f"the executable streams {a.handle!r} {a.direction}")
        if set(a.programs) != streaming:
            raise RuleError("anchor-programs", f"anchor {a.name!r} lists programs "
                            f"{sorted(a.programs)} but the programs that stream "
                            f"{a.handle!r} {a.direction} are {sorted(streaming)}")
    for phase, progs in (("Load", flow.load), ("Main", flow.main), ("Save", flow.save)):
        for p in progs:
            for direction, handle in stream_counts(exe.programs[p].body):
                if handle not in seen:
                    raise RuleError("stream-anchor", f"{phase} program {p} streams "
                                    f"{handle!r} {direction}, but the metadata has no "
                                    "INPUT/OUTPUT anchor of that handle")


def _check_roles(exe: Executable, flow: FlowSpec) -> None:
    main = set(flow.main)
    for p in flow.load:
        if p in main:
            raise RuleError("role-load", f"program {p} is in both programFlow.load and .main")
        outs = sorted(h for d, h in stream_counts(exe.programs[p].body) if d == "out")
        if outs:
            raise RuleError("role-load", f"Load program {p} streams out {outs}; a Load "
                            "program only streams in")
    for p in flow.save:
        if p in main:
            raise RuleError("role-save", f"program {p} is in both programFlow.save and .main")
        ins = sorted(h for d, h in stream_counts(exe.programs[p].body) if d == "in")
        if ins:
            raise RuleError("role-save", f"Save program {p} streams in {ins}; a Save "
                            "program only streams out")


def _check_main_iteration(exe: Executable, main: Sequence[int],
                          main_anchors: Sequence[AnchorSpec],
                          subgraphs: Mapping[str, Sequence[str]]) -> None:
    body, _count, what = _iteration(exe, main)
    counts = stream_counts(body)
    if not any(d == "out" and c != _ZERO for (d, _h), c in counts.items()):
        raise RuleError("main-empty", f"{what} streams out nothing; a Main iteration "
                        "must produce at least one output")
    for a in main_anchors:
        assert a.direction is not None
        c = counts.get((a.direction, a.handle), _ZERO)
        verb = "streamed in" if a.direction == "in" else "streamed out"
        kind = "input" if a.direction == "in" else "output"
        if not c <= {0, 1} or 1 not in c:
            raise RuleError("stream-count", f"{what}: {kind} {a.handle!r} is {verb} "
                            f"{_describe_counts(c)} per iteration; expected exactly once")
    # every path of an iteration, in order: branches of the sub-graphs, outputs after writes
    members = {k: set(v) for k, v in subgraphs.items()}
    main_handles = {(a.direction, a.handle) for a in main_anchors}
    # A multi-IPU executable's own programs are the host's view of its parts (never run:
    # no Execute writes its outputs): their order is checked on each IPU (check_loop).
    strict = not getattr(exe, "parts", None)
    _walk_iteration(body, set(), what, main_handles, members,
                    _computed(body) if strict else set(), strict)


def _computed(body: Sequence[Instruction], fed: bool = False) -> set[str]:
    """Device tensors an Execute or Copy (``fed``: a StreamIn) of ``body`` writes."""
    out: set[str] = set()
    for i in body:
        if isinstance(i, StreamIn) and fed:
            out.add(i.tensor)
        elif isinstance(i, Execute) and not fed:
            out.update(t for _, t in i.outputs)
        elif isinstance(i, Copy) and not fed:
            out.add(i.dst)
        elif isinstance(i, Repeat):
            out |= _computed(i.body, fed)
        elif isinstance(i, Switch):
            for b in i.branches:
                out |= _computed(b, fed)
    return out


def _walk_iteration(body: Sequence[Instruction], written: set[str], what: str,
                    main_handles: set[tuple[str | None, str]],
                    members: Mapping[str, set[str]], computed: set[str],
                    strict: bool = False) -> set[str]:
    """Check the order of one path; returns the tensors written after ``body``.

    ``strict`` (the host, for Main output anchors): every output streamed out must have
    been written earlier in the iteration. Else (the device, which cannot tell an anchor
    from an IPU-Link token) only tensors the iteration computes (``computed``:
    Execute/Copy outputs); others (a token, a forwarded input) keep their value."""
    written = set(written)
    fed = _computed(body, fed=True)
    for i in body:
        if isinstance(i, (Execute, Copy)):
            reads = [t for _, t in i.inputs] if isinstance(i, Execute) else [i.src]
            stale = [t for t in reads if t in fed and t not in written]
            if stale:
                op = f"graph {i.graph}" if isinstance(i, Execute) else f"copy to {i.dst!r}"
                raise RuleError("stream-order", f"{what}: {op} reads {stale} before the "
                                "iteration streams them in: it would compute with the "
                                "previous iteration's values")
        if isinstance(i, StreamIn):
            written.add(i.tensor)
        elif isinstance(i, StreamOut):
            if (("out", i.handle) in main_handles and (strict or i.tensor in computed)
                    and i.tensor not in written):
                raise RuleError("stream-order", f"{what} streams out {i.handle!r} (device "
                                f"tensor {i.tensor!r}) before the iteration has written "
                                "that tensor: the host would receive the previous "
                                "iteration's value")
        elif isinstance(i, Execute):
            written.update(t for _, t in i.outputs)
        elif isinstance(i, Copy):
            written.add(i.dst)
        elif isinstance(i, Repeat):
            if i.count >= 1:
                written = _walk_iteration(i.body, written, what, main_handles, members,
                                          computed, strict)
        elif isinstance(i, Switch):
            after: set[str] | None = None
            for k, b in enumerate(i.branches):
                sub = members.get(f"graph{k}")
                if sub is not None:
                    streamed = {h for (d, h) in stream_counts(b) if (d, h) in main_handles}
                    expected = {h for (d, h) in main_handles if h in sub}
                    if streamed != expected:
                        raise RuleError(
                            "stream-count", f"{what}: branch {k} of the switch on "
                            f"{i.index!r} streams {sorted(streamed)}, but sub-graph graph{k} "
                            f"of the metadata has the Main anchors {sorted(expected)}")
                w = _walk_iteration(b, written, what, main_handles, members, computed,
                                    strict)
                after = w if after is None else after & w
            written = after if after is not None else written
    return written


# -- the device's checks: what it sees without the metadata -------------------------------

def check_loaded_streams(exe: Executable, streams: Iterable[tuple[str, str]],
                         used: dict[tuple[str, str], set[int]] | None = None) -> None:
    """Each ``(handle, direction)`` the host connected that ``exe`` declares is a stream
    some program of ``exe`` transfers in that direction (else the host would wait on it
    forever). Streams ``exe`` does not declare are left alone: one IPU of a multi-IPU
    device is offered every host stream and uses its own. ``used``:
    ``programs_streaming(exe)`` if the caller keeps it."""
    if used is None:
        used = programs_streaming(exe)
    for handle, direction in streams:
        s = exe.streams.get(handle)
        if s is not None and (direction, handle) not in used:
            raise RuleError("anchor-stream", f"the host connected {direction} stream "
                            f"{handle!r}, which is never streamed {direction} by any of the "
                            f"executable's {len(exe.programs)} programs")


def check_loop(exe: Executable, programs: Sequence[int],
               connected: Iterable[str] | None = None) -> None:
    """``programs`` run as a main loop: every path of one iteration streams an output,
    no stream more than once and none out before the iteration wrote it, and (given the
    handles the host ``connected``) every stream it uses is connected. Else the loop would
    spin, wait for what the host will not send, or send stale values."""
    for p in programs:
        for r in _repeats(exe.programs[p].body):
            if r.count < 1:
                raise RuleError("repeat-count", f"program {p} has a Repeat of count "
                                f"{r.count}; a main loop of it would never transfer")
    body, _count, what = _iteration(exe, programs)
    counts = stream_counts(body)
    if connected is not None:
        have = set(connected)
        missing = sorted({h for (_d, h) in counts} - have)
        if missing:
            raise RuleError("stream-anchor", f"{what} streams {missing}, which the host did "
                            "not connect (no anchor of that handle)")
    for (direction, handle), c in counts.items():
        if max(c) > 1:
            raise RuleError("stream-count", f"{what} streams {handle!r} {direction} "
                            f"{_describe_counts(c)} per iteration; expected at most once")
    if not _every_path_streams_out(body):
        raise RuleError("main-empty", f"{what} has an iteration that streams nothing out; a "
                        "main loop of it would spin, or the host wait, without end")
    _walk_iteration(body, set(), what, {k for k in counts if k[0] == "out"}, {},
                    _computed(body))


def _every_path_streams_out(body: Sequence[Instruction]) -> bool:
    for i in body:
        if isinstance(i, StreamOut):
            return True
        if isinstance(i, Repeat) and i.count >= 1 and _every_path_streams_out(i.body):
            return True
        if isinstance(i, Switch) and i.branches and all(
                _every_path_streams_out(b) for b in i.branches):
            return True
    return False
