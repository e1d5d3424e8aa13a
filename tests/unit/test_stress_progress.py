"""``ipu-emulator stress`` progress lines: rewritten in place on a terminal, plain otherwise;
live totals summed from the hosts' PROGRESS lines (tools._stress_live)."""

from __future__ import annotations

import io
from types import SimpleNamespace

from tools._stress_live import LiveStats, Progress, describe
from tools.stress import ScenarioResult


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def _scenario(name: str, *progress: dict[str, float]) -> SimpleNamespace:
    return SimpleNamespace(name=name, result=ScenarioResult(name),
                           hosts=[SimpleNamespace(progress=p) for p in progress])


def test_live_totals_sum_the_hosts_and_the_final_result_wins() -> None:
    live = LiveStats()
    sc = _scenario("mixed", {"ok": 5, "errors": 1, "latency_s": 0.5}, {"ok": 7, "wrong": 2})
    live.begin(sc)  # type: ignore[arg-type]
    entry = live.current()
    assert entry is not None
    t = entry.totals()
    assert (t["ok"], t["errors"], t["wrong"], t["latency_s"]) == (12, 1, 2, 0.5)
    text = describe(entry)
    assert text.startswith("scenario mixed: 15 requests, ") and ", 3 failures, " in text
    final = ScenarioResult("mixed", ok=13, errors=1, wrong=2)
    live.end(final)
    assert entry.totals()["ok"] == 13


def test_terminal_lines_are_rewritten_in_place_and_end_with_a_newline() -> None:
    live = LiveStats()
    live.begin(_scenario("batching", {"ok": 3}))  # type: ignore[arg-type]
    out = _Tty()
    progress = Progress(live, out, interval=3600)   # the redraw thread never fires here
    try:
        progress._write("scenario batching: a long line so far", final=False)
        progress._write("short", final=False)
        progress.scenario_done()
    finally:
        progress.close()
    text = out.getvalue()
    first, second, last = text.split("\r")[1:]
    assert first == "scenario batching: a long line so far"
    assert second.startswith("short") and len(second) == len(first)   # padded over the old
    assert last.startswith("scenario batching: 3 requests, ") and last.endswith("\n")


def test_not_a_terminal_one_plain_line_per_scenario() -> None:
    live = LiveStats()
    out = io.StringIO()
    progress = Progress(live, out)
    try:
        for name in ("mixed", "fused"):
            live.begin(_scenario(name, {"ok": 2}))  # type: ignore[arg-type]
            progress._write("ignored live line", final=False)
            live.end(ScenarioResult(name, ok=2))
            progress.scenario_done()
    finally:
        progress.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and len(lines) == 2
    assert lines[0].startswith("scenario mixed: 2 requests, ")
    assert lines[1].startswith("scenario fused: 2 requests, ")
