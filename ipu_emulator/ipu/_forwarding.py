"""Which outputs of a graph are one of its inputs, forwarded unchanged.

An ONNX graph output made by an ``Identity`` node straight from a graph input
(``y = Identity(x)``) holds exactly the input's bytes. onnxruntime makes it by
one ``memcpy`` on one thread; the IPU process copies it itself instead, with
:func:`shm.copy.copy_bytes` (a helper thread takes part of a large copy while
the host waits for the output), and onnxruntime computes only the graph's other
outputs, or is not run at all when there are none.

The ONNX model is read here without the ``onnx`` package (the IPU process does
not import it): its top-level ``graph.node`` list is walked in protobuf's wire
format, which only needs to find ``Identity`` nodes. A model that cannot be read
this way forwards nothing, and onnxruntime computes every output as before.
"""

from __future__ import annotations

from typing import Iterator

from ipu_emulator.executable import Graph

__all__ = ["forwarded_outputs"]

_MODEL_GRAPH = 7                       # ModelProto.graph
_GRAPH_NODE = 1                        # GraphProto.node
_NODE_INPUT, _NODE_OUTPUT, _NODE_OP, _NODE_DOMAIN = 1, 2, 4, 7
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


class _Unreadable(Exception):
    pass


def _varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise _Unreadable
        b = buf[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7


def _fields(buf: memoryview, pos: int, end: int) -> Iterator[tuple[int, int, int]]:
    """``(field number, start, stop)`` of each length-delimited field in buf[pos:end];
    other wire types are skipped."""
    while pos < end:
        key, pos = _varint(buf, pos, end)
        number, wire = key >> 3, key & 7
        if wire == _VARINT:
            _, pos = _varint(buf, pos, end)
        elif wire == _I64:
            pos += 8
        elif wire == _I32:
            pos += 4
        elif wire == _LEN:
            n, pos = _varint(buf, pos, end)
            if pos + n > end:
                raise _Unreadable
            yield number, pos, pos + n
            pos += n
        else:                            # groups (never in ONNX) or damage
            raise _Unreadable
        if pos > end:
            raise _Unreadable


def _identities(model: bytes) -> list[tuple[str, str]]:
    """``(input, output)`` of each top-level Identity node of the ONNX ``model``."""
    buf = memoryview(model)
    found = []
    for number, lo, hi in _fields(buf, 0, len(buf)):
        if number != _MODEL_GRAPH:
            continue
        for field, nlo, nhi in _fields(buf, lo, hi):
            if field != _GRAPH_NODE:
                continue
            ins: list[bytes] = []
            outs: list[bytes] = []
            op = domain = b""
            for f, a, b in _fields(buf, nlo, nhi):
                if f == _NODE_INPUT:
                    ins.append(bytes(buf[a:b]))
                elif f == _NODE_OUTPUT:
                    outs.append(bytes(buf[a:b]))
                elif f == _NODE_OP:
                    op = bytes(buf[a:b])
                elif f == _NODE_DOMAIN:
                    domain = bytes(buf[a:b])
            if op == b"Identity" and domain in (b"", b"ai.onnx") and len(ins) == 1 \
                    and len(outs) == 1:
                found.append((ins[0].decode("utf-8", "replace"),
                              outs[0].decode("utf-8", "replace")))
    return found


def forwarded_outputs(graph: Graph) -> dict[str, str]:
    """``{output name: input name}`` of ``graph``'s outputs that are an ``Identity`` of one
    of its inputs with the same declared type and shape (see the module docstring)."""
    model = graph.model if isinstance(graph.model, bytes) else bytes(graph.model)
    if b"Identity" not in model:   # the usual case: nothing to read
        return {}
    try:
        pairs = _identities(model)
    except _Unreadable:
        return {}
    inputs = {s.name: s for s in graph.inputs}
    outputs = {s.name: s for s in graph.outputs}
    forwarded = {}
    for src, dst in pairs:
        a, b = inputs.get(src), outputs.get(dst)
        if a is None or b is None or src == dst or src in outputs:
            continue
        if a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape):
            forwarded[dst] = src
    return forwarded
