"""The executable's binary codec: ``encode`` (``Executable.to_bytes``) and ``decode``
(``Executable.from_bytes``) between an ``Executable`` and the layout of the package
docstring (the header, the strict JSON program section, the graph section), and what
reads the body without decoding it (``body_crc32``, ``weights_span``).

Decoding checks every key, type, size and reference as it goes (``_Doc``), so damage
raises ``ExecutableError`` naming the JSON path and the byte offset; the result is then
validated as a whole (``ipu_emulator.executable._validate``).
"""

from __future__ import annotations

import json
import zlib
from typing import Any

from ipu_emulator.errors import ExecutableError
from ipu_emulator.executable._header import (
    FORMAT_VERSION, HEADER_SIZE, ExecutableHeader, read_header)
from ipu_emulator.executable._limits import (
    ALIGNMENT, _MAX_BYTES, _MAX_DEPTH, _MAX_DIM, _MAX_ITEMS, _MAX_JSON, _MAX_NAME, _MAX_RANK,
    _MAX_REPEAT)
from ipu_emulator.executable._model import (
    DTYPES, Copy, DeviceTensor, Execute, Executable, ExternalWeight, Graph, Instruction,
    Program, Repeat, StreamIn, StreamOut, StreamSpec, Switch, TensorSig, _nbytes)
from ipu_emulator.executable._validate import validate

__all__ = ["body_crc32", "decode", "encode", "weights_span"]


def encode(exe: Executable) -> bytes:
    """``exe``'s bytes, validated first."""
    validate(exe)
    blobs = bytearray()
    graphs_json = []
    for g in exe.graphs:
        gj: dict[str, Any] = {
            "inputs": [_sig_json(s) for s in g.inputs],
            "outputs": [_sig_json(s) for s in g.outputs],
            "offset": len(blobs),
            "length": len(g.model),
        }
        if g.external:
            gj["external"] = [[w.name, w.dtype, list(w.shape), w.offset]
                              for w in g.external]
        graphs_json.append(gj)
        blobs += g.model
    doc = {
        "format": FORMAT_VERSION,
        "name": exe.name,
        "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape),
                     "offset": t.offset} for t in exe.tensors.values()],
        "streams": [{"handle": h, "direction": s.direction, "dtype": s.dtype,
                     "shape": list(s.shape)} for h, s in exe.streams.items()],
        "graphs": graphs_json,
        "programs": [{"name": p.name, "body": [_instr_json(i) for i in p.body]}
                     for p in exe.programs],
        "attributes": dict(exe.attributes),
    }
    if exe.parts:   # nested executables, stored after the graphs in the graph section
        parts = []
        for part in exe.parts:
            data = encode(part)
            parts.append({"offset": len(blobs), "length": len(data)})
            blobs += data
        doc["parts"] = parts
    if len(exe.weights):
        blobs += bytes(-len(blobs) % ALIGNMENT)
        doc["weights"] = {"offset": len(blobs), "length": len(exe.weights)}
        blobs += exe.weights
    program = json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()
    # blanks after the JSON: the graph section (and the weights in it) starts 64-aligned
    program += b" " * (-(HEADER_SIZE + len(program)) % ALIGNMENT)
    head = ExecutableHeader(
        name=exe.name, package_hash=exe.package_hash, ipu_version=exe.ipu_version,
        num_ipus=exe.num_ipus, device_iterations=exe.device_iterations,
        memory_bytes=exe.memory_bytes, required_bytes=exe.required_bytes,
        version=FORMAT_VERSION, total_length=HEADER_SIZE + len(program) + len(blobs),
        program_offset=HEADER_SIZE, program_length=len(program),
        graphs_offset=HEADER_SIZE + len(program), graphs_length=len(blobs),
        body_crc32=zlib.crc32(blobs, zlib.crc32(program)))
    # one copy of the (maybe large) graph section, not three
    return b"".join((head.pack(), program, blobs))


def decode(data: bytes | bytearray | memoryview, *, graphs: bool = True,
           weights: bytes | bytearray | memoryview | None = None,
           checksum: bool = True) -> Executable:
    """Decode and validate (``Executable.from_bytes``, which says what the keywords do)."""
    view = memoryview(data).cast("B") if not isinstance(data, bytes) else memoryview(data)
    wview: memoryview | None = None
    if weights is not None:
        wview = memoryview(weights)
        if wview.ndim != 1 or wview.itemsize != 1:
            wview = wview.cast("B")
    hdr = read_header(view)
    if wview is not None:
        if hdr.total_length != len(view) + len(wview):
            raise ExecutableError(
                f"executable of {len(view)} bytes and a weights section of {len(wview)} "
                f"bytes, but its header says {hdr.total_length} bytes in all",
                offset=min(len(view), hdr.total_length))
    elif hdr.total_length != len(view):
        raise ExecutableError(
            f"executable is {len(view)} bytes but its header says {hdr.total_length}"
            + (" (truncated)" if len(view) < hdr.total_length else " (trailing bytes)"),
            offset=min(len(view), hdr.total_length))
    p_off, p_len = hdr.program_offset, hdr.program_length
    g_off, g_len = hdr.graphs_offset, hdr.graphs_length
    if p_off != HEADER_SIZE or p_off + p_len != g_off or g_off + g_len != hdr.total_length:
        raise ExecutableError(
            f"section table is inconsistent: program [{p_off}, +{p_len}), graphs "
            f"[{g_off}, +{g_len}) in {len(view)} bytes", offset=HEADER_SIZE - 4)
    if p_len > _MAX_JSON:
        raise ExecutableError(f"program section of {p_len} bytes exceeds the limit of "
                              f"{_MAX_JSON}", offset=p_off)
    crc = body_crc32(view, wview) if graphs and checksum else hdr.body_crc32
    if crc != hdr.body_crc32:
        raise ExecutableError(
            f"body checksum mismatch: computed {crc:#010x}, header says "
            f"{hdr.body_crc32:#010x} (damaged)", offset=HEADER_SIZE)
    try:
        doc = json.loads(bytes(view[p_off:p_off + p_len]).decode("utf-8"),
                         object_pairs_hook=_no_duplicate_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ExecutableError(f"program section is not valid JSON: {exc}",
                              offset=p_off) from None
    exe = _decode(doc, view[g_off:g_off + g_len], g_off, hdr, graphs, wview)
    validate(exe)
    return exe


def body_crc32(data: bytes | bytearray | memoryview,
               weights: bytes | bytearray | memoryview | None = None) -> int:
    """The CRC-32 of an executable's body (all but its header), its weights section given
    apart or not (compare with ``read_header(data).body_crc32``)."""
    view = memoryview(data)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    crc = zlib.crc32(view[HEADER_SIZE:])
    return zlib.crc32(weights, crc) if weights is not None else crc


def weights_span(data: bytes | bytearray | memoryview) -> tuple[int, int]:
    """``(offset, length)`` of the weights section in the executable ``data`` (its last
    bytes); ``(len, 0)`` when it has none. Reads the header and the program section only
    (raises ``ExecutableError`` if they are damaged)."""
    view = memoryview(data)
    if view.ndim != 1 or view.itemsize != 1:
        view = view.cast("B")
    hdr = read_header(view)
    p_off, p_len, g_off = hdr.program_offset, hdr.program_length, hdr.graphs_offset
    total = hdr.total_length
    if p_len > _MAX_JSON or p_off + p_len > len(view):
        raise ExecutableError(f"program section [{p_off}, +{p_len}) is out of range",
                              offset=p_off)
    try:
        doc = json.loads(bytes(view[p_off:p_off + p_len]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ExecutableError(f"program section is not valid JSON: {exc}",
                              offset=p_off) from None
    w = doc.get("weights") if isinstance(doc, dict) else None
    if not w:
        return total, 0
    off, length = w.get("offset") if isinstance(w, dict) else None, \
        w.get("length") if isinstance(w, dict) else None
    if type(off) is not int or type(length) is not int or off < 0 or length < 0 \
            or g_off + off + length != total:
        raise ExecutableError(f"program section: $.weights: {w!r:.80} is not the last "
                              f"bytes of the executable", offset=p_off)
    return g_off + off, length


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r:.40}")
        out[k] = v
    return out


# -- JSON encoding of instructions ------------------------------------------------

def _sig_json(s: TensorSig) -> dict[str, Any]:
    return {"name": s.name, "dtype": s.dtype, "shape": list(s.shape)}


def _instr_json(i: Instruction) -> dict[str, Any]:
    if isinstance(i, StreamIn):
        return {"op": "stream_in", "handle": i.handle, "tensor": i.tensor}
    if isinstance(i, StreamOut):
        return {"op": "stream_out", "tensor": i.tensor, "handle": i.handle}
    if isinstance(i, Execute):
        return {"op": "execute", "graph": i.graph, "inputs": [list(p) for p in i.inputs],
                "outputs": [list(p) for p in i.outputs]}
    if isinstance(i, Repeat):
        return {"op": "repeat", "count": i.count, "body": [_instr_json(b) for b in i.body]}
    if isinstance(i, Switch):
        return {"op": "switch", "index": i.index,
                "branches": [[_instr_json(b) for b in br] for br in i.branches]}
    if isinstance(i, Copy):
        return {"op": "copy", "src": i.src, "dst": i.dst}
    raise ExecutableError(f"not an instruction: {i!r}")


# -- strict decoding --------------------------------------------------------------

class _Doc:
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



def _decode(doc: Any, graphs: memoryview, g_off: int, hdr: ExecutableHeader,
            with_graphs: bool = True, weights: memoryview | None = None) -> Executable:
    """The ``Executable`` the program section ``doc`` describes over its graph section
    ``graphs`` (at ``g_off`` in the executable); ``weights``: the weights section given
    apart."""
    d = _Doc(hdr.program_offset)
    keys = ("format", "name", "tensors", "streams", "graphs", "programs", "attributes")
    optional = tuple(k for k in ("parts", "weights") if isinstance(doc, dict) and k in doc)
    top = d.obj(doc, "$", keys + optional)
    graphs, wsec = _decode_weights(d, top, graphs, weights)
    if top["format"] != FORMAT_VERSION:
        raise d.fail("$.format", f"expected {FORMAT_VERSION}, got {top['format']!r}")
    if top["name"] != hdr.name:
        raise d.fail("$.name", f"{top['name']!r:.80} differs from the header's {hdr.name!r}")
    tensors = _decode_tensors(d, top["tensors"])
    streams = _decode_streams(d, top["streams"])
    graph_list = _decode_graphs(d, top["graphs"], graphs, wsec, with_graphs)
    programs = []
    counter = [0]
    for k, pr in enumerate(d.lst(top["programs"], "$.programs")):
        p = f"$.programs[{k}]"
        pr = d.obj(pr, p, ("name", "body"))
        programs.append(Program(d.str_(pr["name"], p + ".name"),
                                _decode_body(d, pr["body"], p + ".body", 0, counter)))
    attrs = top["attributes"]
    if not isinstance(attrs, dict) or len(attrs) > 1024 or not all(
            isinstance(a, str) and isinstance(b, str) and len(b) <= 1 << 16
            for a, b in attrs.items()):
        raise d.fail("$.attributes", "expected an object of at most 1024 string values")
    return Executable(
        name=hdr.name, programs=programs, graphs=graph_list, tensors=tensors,
        streams=streams, memory_bytes=hdr.memory_bytes, required_bytes=hdr.required_bytes,
        ipu_version=hdr.ipu_version, num_ipus=hdr.num_ipus,
        device_iterations=hdr.device_iterations, package_hash=hdr.package_hash,
        attributes=dict(attrs), parts=_decode_parts(d, top.get("parts", []), graphs),
        weights=wsec)


def _decode_weights(d: _Doc, top: dict[str, Any], graphs: memoryview,
                    weights: memoryview | None) -> tuple[memoryview, memoryview | bytes]:
    """The graph section without the weights section, and the weights section (the
    one given apart, or the last bytes of ``graphs``; ``b""``: none)."""
    wsec: memoryview | bytes = b""
    if "weights" in top:
        w = d.obj(top["weights"], "$.weights", ("offset", "length"))
        total = len(graphs) + (len(weights) if weights is not None else 0)
        woff = d.int_(w["offset"], "$.weights.offset", 0, total)
        wlen = d.int_(w["length"], "$.weights.length", 0, total - woff)
        if woff + wlen != total:
            raise d.fail("$.weights", "the weights section must be the last bytes")
        if weights is not None:
            if woff != len(graphs):
                raise d.fail("$.weights", f"the section starts at {woff} of the graph "
                                          f"section, but the executable given ends at "
                                          f"{len(graphs)}")
            wsec = weights
        else:
            wsec = graphs[woff:woff + wlen]
            graphs = graphs[:woff]
    elif weights is not None and len(weights):
        raise d.fail("$", "a weights section was given, but the executable has none")
    return graphs, wsec


def _decode_tensors(d: _Doc, v: Any) -> dict[str, DeviceTensor]:
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


def _decode_streams(d: _Doc, v: Any) -> dict[str, StreamSpec]:
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


def _decode_graphs(d: _Doc, v: Any, graphs: memoryview, wsec: memoryview | bytes,
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


def _decode_external(d: _Doc, e: Any, q: str, wsec_len: int) -> ExternalWeight:
    if not isinstance(e, list) or len(e) != 4:
        raise d.fail(q, "expected [name, data type, shape, offset]")
    ref = ExternalWeight(d.str_(e[0], q), d.dtype(e[1], q), d.shape(e[2], q),
                         d.int_(e[3], q, 0, _MAX_BYTES))
    if ref.offset % ALIGNMENT or ref.offset + ref.nbytes > wsec_len:
        raise d.fail(q, f"initializer {ref.name!r} at [{ref.offset}, "
                        f"+{ref.nbytes}) is not an aligned span of the "
                        f"{wsec_len}-byte weights section")
    return ref


def _decode_parts(d: _Doc, v: Any, graphs: memoryview) -> list[Executable]:
    parts: list[Executable] = []
    for k, pt in enumerate(d.lst(v, "$.parts", 1024)):
        p = f"$.parts[{k}]"
        pt = d.obj(pt, p, ("offset", "length"))
        off = d.int_(pt["offset"], p + ".offset", 0, len(graphs))
        length = d.int_(pt["length"], p + ".length", 0, len(graphs) - off)
        try:
            parts.append(decode(bytes(graphs[off:off + length])))
        except ExecutableError as exc:
            raise d.fail(p, f"IPU {k}'s part: {exc}") from None
    return parts


def _decode_body(d: _Doc, v: Any, path: str, depth: int, counter: list[int]
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
