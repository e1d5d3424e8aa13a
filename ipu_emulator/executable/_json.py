"""The program section's JSON, part by part: each part's encoder (``sig_json``,
``instr_json``) and its strict decoder, which checks every key, type and bound as it
reads (``Doc``) and raises ``ExecutableError`` naming the JSON path and the section's
byte offset. ``_executable`` puts the parts together."""

from __future__ import annotations

from typing import Any

from ipu_emulator.errors import ExecutableError
from ipu_emulator.executable._limits import (
    ALIGNMENT, _MAX_BYTES, _MAX_DEPTH, _MAX_DIM, _MAX_ITEMS, _MAX_NAME, _MAX_RANK,
    _MAX_REPEAT)
from ipu_emulator.executable._model import (
    DTYPES, Copy, DeviceTensor, Execute, ExternalWeight, Graph, Instruction, Program, Repeat,
    StreamIn, StreamOut, StreamSpec, Switch, TensorSig, _nbytes)

__all__ = ["Doc", "decode_graphs", "decode_programs", "decode_streams", "decode_tensors",
           "instr_json", "no_duplicate_keys", "sig_json"]


def no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r:.40}")
        out[k] = v
    return out


# -- JSON encoding of instructions ------------------------------------------------

def sig_json(s: TensorSig) -> dict[str, Any]:
    return {"name": s.name, "dtype": s.dtype, "shape": list(s.shape)}


def instr_json(i: Instruction) -> dict[str, Any]:
    if isinstance(i, StreamIn):
        return {"op": "stream_in", "handle": i.handle, "tensor": i.tensor}
    if isinstance(i, StreamOut):
        return {"op": "stream_out", "tensor": i.tensor, "handle": i.handle}
    if isinstance(i, Execute):
        return {"op": "execute", "graph": i.graph, "inputs": [list(p) for p in i.inputs],
                "outputs": [list(p) for p in i.outputs]}
    if isinstance(i, Repeat):
        return {"op": "repeat", "count": i.count, "body": [instr_json(b) for b in i.body]}
    if isinstance(i, Switch):
        return {"op": "switch", "index": i.index,
                "branches": [[instr_json(b) for b in br] for br in i.branches]}
    if isinstance(i, Copy):
        return {"op": "copy", "src": i.src, "dst": i.dst}
    raise ExecutableError(f"not an instruction: {i!r}")


class Doc:
    """Typed accessors over decoded JSON that raise ``ExecutableError`` with a path."""

    def __init__(self, offset: int) -> None:
        self.offset = offset

    def fail(self, path: str, msg: str) -> ExecutableError:
        return ExecutableError(f"program section: {path}: {msg}", offset=self.offset)

    def obj(self, v: Any, path: str, keys: tuple[str, ...]) -> dict[str, Any]:
        if not isinstance(v, dict):
            raise self.fail(path, f"expected an object, got {type(v).__name__}")
        if set(v) != set(keys):
            missing = sorted(set(keys) - set(v))
            extra = sorted(set(v) - set(keys))
            raise self.fail(path, f"expected keys {sorted(keys)}; missing {missing}, "
                                  f"unexpected {extra}")
        return v

    def lst(self, v: Any, path: str, limit: int = _MAX_ITEMS) -> list[Any]:
        if not isinstance(v, list):
            raise self.fail(path, f"expected a list, got {type(v).__name__}")
        if len(v) > limit:
            raise self.fail(path, f"{len(v)} items exceed the limit of {limit}")
        return v

    def int_(self, v: Any, path: str, lo: int, hi: int) -> int:
        if type(v) is not int or not lo <= v <= hi:
            raise self.fail(path, f"expected an integer in [{lo}, {hi}], got {v!r}")
        return v

    def str_(self, v: Any, path: str) -> str:
        if not isinstance(v, str) or not 0 < len(v) <= _MAX_NAME:
            raise self.fail(path, f"expected a non-empty string of at most {_MAX_NAME} "
                                  f"characters, got {v!r:.80}")
        return v

    def dtype(self, v: Any, path: str) -> str:
        if not isinstance(v, str) or v not in DTYPES:
            raise self.fail(path, f"expected a data type in {list(DTYPES)}, got {v!r:.40}")
        return v

    def shape(self, v: Any, path: str) -> tuple[int, ...]:
        dims = self.lst(v, path, _MAX_RANK)
        return tuple(self.int_(d, f"{path}[{k}]", 0, _MAX_DIM) for k, d in enumerate(dims))



def decode_tensors(d: Doc, v: Any) -> dict[str, DeviceTensor]:
    tensors: dict[str, DeviceTensor] = {}
    for k, t in enumerate(d.lst(v, "$.tensors")):
        p = f"$.tensors[{k}]"
        t = d.obj(t, p, ("name", "dtype", "shape", "offset"))
        name = d.str_(t["name"], p + ".name")
        if name in tensors:
            raise d.fail(p + ".name", f"duplicate device tensor {name!r}")
        tensors[name] = DeviceTensor(name, d.dtype(t["dtype"], p + ".dtype"),
                                     d.shape(t["shape"], p + ".shape"),
                                     d.int_(t["offset"], p + ".offset", 0, _MAX_BYTES))
    return tensors


def decode_streams(d: Doc, v: Any) -> dict[str, StreamSpec]:
    streams: dict[str, StreamSpec] = {}
    for k, s in enumerate(d.lst(v, "$.streams")):
        p = f"$.streams[{k}]"
        s = d.obj(s, p, ("handle", "direction", "dtype", "shape"))
        handle = d.str_(s["handle"], p + ".handle")
        if handle in streams:
            raise d.fail(p + ".handle", f"duplicate stream {handle!r}")
        if s["direction"] not in ("in", "out"):
            raise d.fail(p + ".direction", f"expected 'in' or 'out', got {s['direction']!r:.20}")
        dtype = d.dtype(s["dtype"], p + ".dtype")
        shape = d.shape(s["shape"], p + ".shape")
        streams[handle] = StreamSpec(s["direction"], dtype, list(shape), _nbytes(dtype, shape))
    return streams


def decode_graphs(d: Doc, v: Any, graphs: memoryview, wsec: memoryview | bytes,
                   with_graphs: bool) -> list[Graph]:
    graph_list: list[Graph] = []
    for k, g in enumerate(d.lst(v, "$.graphs")):
        p = f"$.graphs[{k}]"
        g = d.obj(g, p, ("inputs", "outputs", "offset", "length")
                  + (("external",) if isinstance(g, dict) and "external" in g else ()))
        off = d.int_(g["offset"], p + ".offset", 0, len(graphs))
        length = d.int_(g["length"], p + ".length", 0, len(graphs) - off)
        sigs = []
        for key in ("inputs", "outputs"):
            items = []
            for j, s in enumerate(d.lst(g[key], f"{p}.{key}")):
                q = f"{p}.{key}[{j}]"
                s = d.obj(s, q, ("name", "dtype", "shape"))
                items.append(TensorSig(d.str_(s["name"], q + ".name"),
                                       d.dtype(s["dtype"], q + ".dtype"),
                                       d.shape(s["shape"], q + ".shape")))
            sigs.append(tuple(items))
        ext = [_decode_external(d, e, f"{p}.external[{j}]", len(wsec))
               for j, e in enumerate(d.lst(g.get("external", []), p + ".external"))]
        graph_list.append(Graph(sigs[0], sigs[1],
                                bytes(graphs[off:off + length]) if with_graphs else b"",
                                tuple(ext)))
    return graph_list


def _decode_external(d: Doc, e: Any, q: str, wsec_len: int) -> ExternalWeight:
    if not isinstance(e, list) or len(e) != 4:
        raise d.fail(q, "expected [name, data type, shape, offset]")
    ref = ExternalWeight(d.str_(e[0], q), d.dtype(e[1], q), d.shape(e[2], q),
                         d.int_(e[3], q, 0, _MAX_BYTES))
    if ref.offset % ALIGNMENT or ref.offset + ref.nbytes > wsec_len:
        raise d.fail(q, f"initializer {ref.name!r} at [{ref.offset}, "
                        f"+{ref.nbytes}) is not an aligned span of the "
                        f"{wsec_len}-byte weights section")
    return ref


def decode_programs(d: Doc, v: Any) -> list[Program]:
    programs = []
    counter = [0]
    for k, pr in enumerate(d.lst(v, "$.programs")):
        p = f"$.programs[{k}]"
        pr = d.obj(pr, p, ("name", "body"))
        programs.append(Program(d.str_(pr["name"], p + ".name"),
                                _decode_body(d, pr["body"], p + ".body", 0, counter)))
    return programs


def _decode_body(d: Doc, v: Any, path: str, depth: int, counter: list[int]
                 ) -> tuple[Instruction, ...]:
    if depth > _MAX_DEPTH:
        raise d.fail(path, f"instructions nested deeper than {_MAX_DEPTH}")
    out: list[Instruction] = []
    for k, i in enumerate(d.lst(v, path)):
        counter[0] += 1
        if counter[0] > _MAX_ITEMS:
            raise d.fail(path, f"more than {_MAX_ITEMS} instructions")
        p = f"{path}[{k}]"
        if not isinstance(i, dict) or "op" not in i:
            raise d.fail(p, "expected an instruction object with an 'op' key")
        op = i["op"]
        if op == "stream_in":
            i = d.obj(i, p, ("op", "handle", "tensor"))
            out.append(StreamIn(d.str_(i["handle"], p + ".handle"), d.str_(i["tensor"], p + ".tensor")))
        elif op == "stream_out":
            i = d.obj(i, p, ("op", "tensor", "handle"))
            out.append(StreamOut(d.str_(i["tensor"], p + ".tensor"), d.str_(i["handle"], p + ".handle")))
        elif op == "execute":
            i = d.obj(i, p, ("op", "graph", "inputs", "outputs"))
            pairs = []
            for key in ("inputs", "outputs"):
                items = []
                for j, pair in enumerate(d.lst(i[key], f"{p}.{key}")):
                    q = f"{p}.{key}[{j}]"
                    if not isinstance(pair, list) or len(pair) != 2:
                        raise d.fail(q, "expected [onnx name, device tensor]")
                    items.append((d.str_(pair[0], q), d.str_(pair[1], q)))
                pairs.append(tuple(items))
            out.append(Execute(d.int_(i["graph"], p + ".graph", 0, _MAX_ITEMS), pairs[0], pairs[1]))
        elif op == "repeat":
            i = d.obj(i, p, ("op", "count", "body"))
            out.append(Repeat(d.int_(i["count"], p + ".count", 0, _MAX_REPEAT),
                              _decode_body(d, i["body"], p + ".body", depth + 1, counter)))
        elif op == "switch":
            i = d.obj(i, p, ("op", "index", "branches"))
            branches = tuple(
                _decode_body(d, b, f"{p}.branches[{j}]", depth + 1, counter)
                for j, b in enumerate(d.lst(i["branches"], p + ".branches", 1 << 16)))
            out.append(Switch(d.str_(i["index"], p + ".index"), branches))
        elif op == "copy":
            i = d.obj(i, p, ("op", "src", "dst"))
            out.append(Copy(d.str_(i["src"], p + ".src"), d.str_(i["dst"], p + ".dst")))
        else:
            raise d.fail(p + ".op", f"unknown instruction {op!r:.40}; expected one of "
                                    "stream_in, stream_out, execute, repeat, switch, copy")
    return tuple(out)
