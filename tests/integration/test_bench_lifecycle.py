"""``python -m tools.bench lifecycle`` runs end to end: a private daemon, embedded runners with
and without the template process, every result checked (figures printed, not asserted)."""

from __future__ import annotations

import re

from tools.bench.__main__ import main as bench_main


def test_lifecycle_bench_runs_and_prints_every_row(capsys) -> None:
    assert bench_main(["lifecycle", "--repeats", "1", "--back-to-back", "2"]) == 0
    out = capsys.readouterr().out
    for label in ("onnxruntime InferenceSession + run, in-process",
                  "ModelRunner through a warm daemon", "ModelRunner embedded (template process)",
                  "ModelRunner embedded, template off",
                  "ModelRunner through a warm daemon, 2 lives back to back"):
        assert re.search(rf"^  {re.escape(label)}\s+\d+\.\d\d", out, re.M), out
    assert len(re.findall(r"construct\s+\d+\.\d\d\s+first execute\s+\d+\.\d\d\s+close\(\)\s+"
                          r"\d+\.\d\d", out)) == 4, out
    # each mode is compared with the onnxruntime lives of its own rounds
    assert re.search(r"\(in the daemon's rounds \d+\.\d\d, the embedded ones' \d+\.\d\d\)",
                     out), out
    assert re.search(r"^  ModelRunner embedded, chain sharded over 4 IPUs: construct\s+\d+\.\d\d"
                     r"\s+close\(\)\s+\d+\.\d\d", out, re.M), out
