"""The onnxruntime sessions of an executable's graphs: their options, the weights
section handed to them as views (``prepack`` decides whether onnxruntime copies and
prepacks them or computes with them where they lie; see ``Interpreter``), and the check
that each ONNX model has the interface the executable declares.

A warm IPU process a daemon lends (``--pool``) keeps the sessions of small graphs
(:func:`keep_sessions`): the next host that loads the same executable gets them
again instead of onnxruntime building them anew (most of a LOAD). The key is the
graph's content (a BLAKE2b digest of its ONNX model, of the weights handed to it and
of the session's options), so a changed graph or weight is a new session; a session
that computes with weights in place (the host's memory) is never kept."""

from __future__ import annotations

import collections
import hashlib
from typing import Any

import numpy as np

from ipu_emulator.errors import DeviceProgramError, ExecutableError
from ipu_emulator.executable import ORT_TYPES, Executable, Graph, numpy_dtype

__all__ = ["GraphSessions", "make_sessions", "keep_sessions"]

KEPT_SESSIONS = 8            # sessions kept per process (the least recently used go)
KEPT_GRAPH_BYTES = 4 << 20   # a graph larger (ONNX model + its weights) is not kept

_kept: "collections.OrderedDict[bytes, object] | None" = None


def keep_sessions(on: bool = True) -> None:
    """Keep the sessions of small graphs in this process from now (``on``), or drop
    every kept one and keep none (the default)."""
    global _kept
    _kept = collections.OrderedDict() if on else None


def _session_key(graph: Graph, weights: bytes | memoryview, options: tuple[Any, ...]
                 ) -> bytes | None:
    """The content key of ``graph``'s session made with ``options``; None: not kept."""
    if len(graph.model) + sum(w.nbytes for w in graph.external) > KEPT_GRAPH_BYTES:
        return None
    h = hashlib.blake2b(repr((options, len(graph.model), [
        (w.name, w.dtype, tuple(w.shape), w.nbytes) for w in graph.external])).encode(),
        digest_size=32)
    h.update(graph.model)
    raw = memoryview(weights).cast("B") if graph.external else memoryview(b"")
    for w in graph.external:
        h.update(raw[w.offset:w.offset + w.nbytes])
    return h.digest()


class GraphSessions:
    """One onnxruntime session per graph of an executable, and what they compute with.

    ``keep``: the weights (numpy views of ``exe.weights`` and their OrtValues) the
    sessions may read, kept for as long as the sessions live. ``in_place``: the sessions
    compute with ``exe.weights`` where it lies (else they copied it while being made).
    """

    def __init__(self, sessions: list[object], keep: list[object], in_place: bool) -> None:
        self.sessions = sessions
        self.keep = keep
        self.in_place = in_place


def make_sessions(exe: Executable, num_threads: int, prepack: bool,
                  weights_kept: bool) -> GraphSessions:
    """An onnxruntime session for each graph of ``exe`` (see ``Interpreter`` for
    ``prepack`` and ``weights_kept``). Raises ``DeviceProgramError`` if onnxruntime
    cannot load one, ``ExecutableError`` if one's interface differs from its declaration."""
    import onnxruntime as ort  # deferred: importing it costs ~0.2 s

    def options() -> Any:
        so = ort.SessionOptions()
        so.intra_op_num_threads = max(1, int(num_threads))
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.log_severity_level = 4   # failures surface as exceptions, not log lines
        # A spinning ORT worker steals the core another device process needs.
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        so.add_session_config_entry("session.inter_op.allow_spinning", "0")
        if not prepack:
            so.add_session_config_entry("session.disable_prepacking", "1")
        return so
    sessions: list[object] = []
    keep: list[object] = []   # OrtValues over exe.weights, kept for the sessions
    # prepacked from where they lie (no copy first): only where the caller keeps them
    # and every weight is aligned (else onnxruntime would compute with a copy anyway)
    in_place = not prepack or (weights_kept and _aligned(exe))
    kept = _kept
    for k, g in enumerate(exe.graphs):
        # in place: the session reads the host's memory, which goes with the host
        key = (_session_key(g, exe.weights, (num_threads, bool(prepack)))
               if kept is not None and not (in_place and g.external) else None)
        sess = kept.pop(key, None) if kept is not None and key is not None else None
        if sess is None:
            try:
                opts = options()
                if g.external:
                    _add_weights(ort, opts, g, exe.weights, keep, in_place=in_place)
                sess = ort.InferenceSession(g.model, opts, providers=["CPUExecutionProvider"])
            except Exception as exc:
                raise DeviceProgramError(
                    f"executable {exe.name!r}: graph {k} cannot be loaded by onnxruntime: "
                    f"{exc}") from exc
        _check_interface(exe.name, k, g, sess)
        if kept is not None and key is not None:
            kept[key] = sess   # the most recently used last
            while len(kept) > KEPT_SESSIONS:
                kept.popitem(last=False)
        sessions.append(sess)
    return GraphSessions(sessions, keep, in_place)


def _add_weights(ort: Any, so: Any, graph: Graph, weights: bytes | memoryview,
                 keep: list[object], in_place: bool) -> None:
    """Give onnxruntime ``graph``'s external initializers as views of ``weights`` (``keep``
    keeps them for as long as the session may read them). ``in_place``: onnxruntime
    computes with them as they are; else it copies them while the session is made."""
    if in_place:   # without it onnxruntime copies initializers given as external data
        so.add_session_config_entry("session.use_external_initializer_file_buffers_directly",
                                    "1")
    raw = np.frombuffer(weights, dtype=np.uint8)
    names, values = [], []
    for w in graph.external:
        arr = raw[w.offset:w.offset + w.nbytes].view(numpy_dtype(w.dtype)).reshape(w.shape)
        if in_place and arr.ctypes.data % 64:   # a section inside a bytes object or a file
            # at an odd offset: computed with, so aligned (else onnxruntime copies it anyway)
            arr = arr.copy()
        names.append(w.name)
        values.append(ort.OrtValue.ortvalue_from_numpy(arr))
        keep.append(arr)
    keep.extend(values)
    so.add_external_initializers(names, values)


def _aligned(exe: Executable) -> bool:
    """Every external weight of ``exe`` lies 64-aligned in ``exe.weights``."""
    if not len(exe.weights):
        return False
    base = np.frombuffer(exe.weights, dtype=np.uint8).ctypes.data
    return all((base + w.offset) % 64 == 0 for g in exe.graphs for w in g.external)


def _check_interface(exe_name: str, k: int, graph: Graph, sess: object) -> None:
    """The ONNX model must have exactly the interface the executable declares."""
    for kind, declared, actual in (("input", graph.inputs, sess.get_inputs()),  # type: ignore[attr-defined]
                                   ("output", graph.outputs, sess.get_outputs())):  # type: ignore[attr-defined]
        want = {s.name: s for s in declared}
        have = {a.name: a for a in actual}
        if set(want) != set(have):
            raise ExecutableError(
                f"executable {exe_name!r}: graph {k} declares {kind}s {sorted(want)} but its "
                f"ONNX model has {sorted(have)}")
        for name, sig in want.items():
            a = have[name]
            dims_ok = len(a.shape) == len(sig.shape) and all(
                not isinstance(d, int) or d == e for d, e in zip(a.shape, sig.shape))
            if ORT_TYPES.get(a.type) != sig.dtype or not dims_ok:
                raise ExecutableError(
                    f"executable {exe_name!r}: graph {k} {kind} {name!r} is declared "
                    f"{sig.dtype}{list(sig.shape)} but the ONNX model has {a.type}{a.shape}")
