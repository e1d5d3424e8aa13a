"""A warm IPU process keeps the onnxruntime sessions of small graphs (``keep_sessions``):
the same graph and weights get the same session back; any other content, a session
computing with the host's memory in place, or one past the bound gets a new one."""

from __future__ import annotations

from typing import Iterator

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from ipu_emulator.compiler import CompileOptions, ModelSpec, compile_onnx
from ipu_emulator.executable import Executable
from ipu_emulator.ipu import _sessions
from ipu_emulator.ipu._sessions import keep_sessions, make_sessions


def _exe(w: np.ndarray) -> Executable:
    """``y = x @ w`` with ``w`` an initializer large enough to be external weights."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "mm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, w.shape[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, w.shape[1]])],
        [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    result = compile_onnx(ModelSpec(model), CompileOptions())
    return Executable.from_bytes(result.executable.to_bytes())


def _y(sess: object, w: np.ndarray) -> np.ndarray:
    x = np.arange(w.shape[0], dtype=np.float32)[None, :] / 7
    got = sess.run(None, {"x": x})[0]   # type: ignore[attr-defined]
    np.testing.assert_allclose(got, x @ w, rtol=1e-5)
    return got


@pytest.fixture
def kept() -> Iterator[None]:
    keep_sessions()
    try:
        yield
    finally:
        keep_sessions(False)


W = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)


def test_the_same_graph_and_weights_get_the_kept_session_back(kept) -> None:
    assert [w.name for w in _exe(W).graphs[0].external] == ["w"]   # weights outside the graph
    first = make_sessions(_exe(W), 1, prepack=True, weights_kept=False)
    assert first.sessions[0] is not None and not first.in_place
    again = make_sessions(_exe(W), 1, prepack=True, weights_kept=False)
    assert again.sessions[0] is first.sessions[0]
    _y(again.sessions[0], W)
    # other options (threads) are another session
    assert make_sessions(_exe(W), 2, prepack=True, weights_kept=False).sessions[0] \
        is not first.sessions[0]


def test_a_changed_weight_is_a_new_session_that_computes_with_it(kept) -> None:
    first = make_sessions(_exe(W), 1, prepack=True, weights_kept=False)
    w2 = W.copy()
    w2[5, 7] += 1.0
    second = make_sessions(_exe(w2), 1, prepack=True, weights_kept=False)
    assert second.sessions[0] is not first.sessions[0]
    _y(second.sessions[0], w2)
    _y(first.sessions[0], W)


def test_sessions_computing_in_place_or_when_not_kept_are_never_shared(kept) -> None:
    exe = _exe(W)
    in_place = [make_sessions(exe, 1, prepack=False, weights_kept=False) for _ in range(2)]
    assert in_place[0].in_place and in_place[0].sessions[0] is not in_place[1].sessions[0]
    keep_sessions(False)
    off = [make_sessions(exe, 1, prepack=True, weights_kept=False) for _ in range(2)]
    assert off[0].sessions[0] is not off[1].sessions[0]


def test_the_least_recently_used_go_past_the_bound(kept, monkeypatch) -> None:
    monkeypatch.setattr(_sessions, "KEPT_SESSIONS", 1)
    w2 = W + 1
    a = make_sessions(_exe(W), 1, prepack=True, weights_kept=False).sessions[0]
    make_sessions(_exe(w2), 1, prepack=True, weights_kept=False)
    again = make_sessions(_exe(W), 1, prepack=True, weights_kept=False).sessions[0]
    assert again is not a
    _y(again, W)
    monkeypatch.setattr(_sessions, "KEPT_GRAPH_BYTES", 16)   # too large to keep: never kept
    big = [make_sessions(_exe(W * 2), 1, prepack=True, weights_kept=False).sessions[0]
           for _ in range(2)]
    assert big[0] is not big[1]
