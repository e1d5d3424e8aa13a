"""``Executable``: a compiled model for the emulated IPU, and its container: ``to_bytes``
and ``from_bytes`` put the header (``_header``), the program section (strict JSON,
``_json``) and the graph section together and apart (the package docstring's layout);
``validate`` is ``_validate``'s. ``body_crc32`` and ``weights_span`` read the container
without decoding it."""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from typing import Any

from ipu_emulator.errors import ExecutableError
from ipu_emulator.executable._header import (
    FORMAT_VERSION, HEADER_SIZE, ExecutableHeader, read_header)
from ipu_emulator.executable._json import (
    Doc, decode_graphs, decode_programs, decode_streams, decode_tensors, instr_json,
    no_duplicate_keys, sig_json)
from ipu_emulator.executable._limits import ALIGNMENT, _MAX_JSON
from ipu_emulator.executable._model import (
    IDLE_ATTR, DeviceTensor, Graph, Program, StreamSpec)
from ipu_emulator.executable._validate import validate

__all__ = ["Executable", "body_crc32", "weights_span"]


@dataclass
class Executable:
    """A compiled model for the emulated IPU. See the package docstring."""

    name: str
    programs: list[Program]
    graphs: list[Graph]
    tensors: dict[str, DeviceTensor]
    streams: dict[str, StreamSpec]
    memory_bytes: int
    required_bytes: int = 0
    ipu_version: int = 21
    num_ipus: int = 1
    device_iterations: int = 1
    package_hash: str = ""
    attributes: dict[str, str] = field(default_factory=dict)
    # A multi-IPU executable: one single-IPU executable per IPU (``parts[k]`` runs on the
    # device's IPU k; ipu_emulator.compiler._sharding). Empty for a one-IPU executable.
    parts: list["Executable"] = field(default_factory=list)
    # The weights section: bytes the graphs' ``external`` initializers point into (a
    # view of the bytes decoded, or of the buffer given as ``weights``: not copied).
    weights: bytes | memoryview = field(default=b"", repr=False)

    @property
    def idle(self) -> bool:
        """A part of a multi-IPU executable for an IPU that runs nothing (``IDLE_ATTR``)."""
        return self.attributes.get(IDLE_ATTR) == "1"

    # -- checks -----------------------------------------------------------------

    def validate(self) -> None:
        """Check every reference, size and bound; raises ``ExecutableError``."""
        validate(self)

    # -- encoding ---------------------------------------------------------------

    def to_bytes(self) -> bytes:
        """The executable's bytes (validated first; the package docstring's layout)."""
        self.validate()
        blobs = bytearray()
        graphs_json = []
        for g in self.graphs:
            gj: dict[str, Any] = {
                "inputs": [sig_json(s) for s in g.inputs],
                "outputs": [sig_json(s) for s in g.outputs],
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
            "name": self.name,
            "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape),
                         "offset": t.offset} for t in self.tensors.values()],
            "streams": [{"handle": h, "direction": s.direction, "dtype": s.dtype,
                         "shape": list(s.shape)} for h, s in self.streams.items()],
            "graphs": graphs_json,
            "programs": [{"name": p.name, "body": [instr_json(i) for i in p.body]}
                         for p in self.programs],
            "attributes": dict(self.attributes),
        }
        if self.parts:   # nested executables, stored after the graphs in the graph section
            parts = []
            for part in self.parts:
                data = part.to_bytes()
                parts.append({"offset": len(blobs), "length": len(data)})
                blobs += data
            doc["parts"] = parts
        if len(self.weights):
            blobs += bytes(-len(blobs) % ALIGNMENT)
            doc["weights"] = {"offset": len(blobs), "length": len(self.weights)}
            blobs += self.weights
        program = json.dumps(doc, separators=(",", ":"), sort_keys=True).encode()
        # blanks after the JSON: the graph section (and the weights in it) starts 64-aligned
        program += b" " * (-(HEADER_SIZE + len(program)) % ALIGNMENT)
        head = ExecutableHeader(
            name=self.name, package_hash=self.package_hash, ipu_version=self.ipu_version,
            num_ipus=self.num_ipus, device_iterations=self.device_iterations,
            memory_bytes=self.memory_bytes, required_bytes=self.required_bytes,
            version=FORMAT_VERSION, total_length=HEADER_SIZE + len(program) + len(blobs),
            program_offset=HEADER_SIZE, program_length=len(program),
            graphs_offset=HEADER_SIZE + len(program), graphs_length=len(blobs),
            body_crc32=zlib.crc32(blobs, zlib.crc32(program)))
        # one copy of the (maybe large) graph section, not three
        return b"".join((head.pack(), program, blobs))

    @classmethod
    def from_bytes(cls, data: bytes | bytearray | memoryview, *,
                   graphs: bool = True,
                   weights: bytes | bytearray | memoryview | None = None,
                   checksum: bool = True) -> "Executable":
        """Decode and validate; raises ``ExecutableError`` on any damage.

        ``graphs=False`` (a host checking the programs of an executable whose bytes a
        PopEF checksum already covers): the body's CRC is not computed and the graphs'
        ONNX bytes are not copied (``Graph.model`` is empty); everything else is decoded
        and validated as usual. Never for an executable that is to run.

        ``weights``: ``data`` is the executable without its weights section (its first
        ``weights_span(...)[0]`` bytes), and this is the section; it is checked by the
        body's CRC as if it followed ``data``, and not copied. Otherwise the section is
        a view of ``data`` (not copied either).
        """
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
                             object_pairs_hook=no_duplicate_keys)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise ExecutableError(f"program section is not valid JSON: {exc}",
                                  offset=p_off) from None
        exe = _decode(doc, view[g_off:g_off + g_len], g_off, hdr, graphs, wview)
        exe.validate()
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
    program = bytes(view[p_off:p_off + p_len])
    key = (program, g_off, total)
    known = _spans.get(key)
    if known is not None:
        return known
    try:
        doc = json.loads(program.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ExecutableError(f"program section is not valid JSON: {exc}",
                              offset=p_off) from None
    w = doc.get("weights") if isinstance(doc, dict) else None
    if not w:
        return _keep_span(key, (total, 0))
    off, length = w.get("offset") if isinstance(w, dict) else None, \
        w.get("length") if isinstance(w, dict) else None
    if type(off) is not int or type(length) is not int or off < 0 or length < 0 \
            or g_off + off + length != total:
        raise ExecutableError(f"program section: $.weights: {w!r:.80} is not the last "
                              f"bytes of the executable", offset=p_off)
    return _keep_span(key, (g_off + off, length))


# weights_span's answers by (program section, graphs offset, total length): a runner of
# a model made again reads its span without parsing the program section's JSON again
# (hashing and comparing its bytes is much cheaper); only spans that passed the checks
_spans: dict[tuple[bytes, int, int], tuple[int, int]] = {}
_SPANS_KEPT = 16
_SPANS_MAX_BYTES = 16 << 20


def _keep_span(key: tuple[bytes, int, int], span: tuple[int, int]) -> tuple[int, int]:
    if len(key[0]) <= _SPANS_MAX_BYTES // _SPANS_KEPT:
        if len(_spans) >= _SPANS_KEPT:
            _spans.clear()   # (rare: more than 16 models in one process)
        _spans[key] = span
    return span


def _decode(doc: Any, graphs: memoryview, g_off: int, hdr: ExecutableHeader,
            with_graphs: bool = True, weights: memoryview | None = None) -> Executable:
    """The ``Executable`` the program section ``doc`` describes over its graph section
    ``graphs`` (at ``g_off`` in the executable); ``weights``: the weights section given
    apart."""
    d = Doc(hdr.program_offset)
    keys = ("format", "name", "tensors", "streams", "graphs", "programs", "attributes")
    optional = tuple(k for k in ("parts", "weights") if isinstance(doc, dict) and k in doc)
    top = d.obj(doc, "$", keys + optional)
    graphs, wsec = _decode_weights(d, top, graphs, weights)
    if top["format"] != FORMAT_VERSION:
        raise d.fail("$.format", f"expected {FORMAT_VERSION}, got {top['format']!r}")
    if top["name"] != hdr.name:
        raise d.fail("$.name", f"{top['name']!r:.80} differs from the header's {hdr.name!r}")
    tensors = decode_tensors(d, top["tensors"])
    streams = decode_streams(d, top["streams"])
    graph_list = decode_graphs(d, top["graphs"], graphs, wsec, with_graphs)
    programs = decode_programs(d, top["programs"])
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


def _decode_weights(d: Doc, top: dict[str, Any], graphs: memoryview,
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


def _decode_parts(d: Doc, v: Any, graphs: memoryview) -> list[Executable]:
    parts: list[Executable] = []
    for k, pt in enumerate(d.lst(v, "$.parts", 1024)):
        p = f"$.parts[{k}]"
        pt = d.obj(pt, p, ("offset", "length"))
        off = d.int_(pt["offset"], p + ".offset", 0, len(graphs))
        length = d.int_(pt["length"], p + ".length", 0, len(graphs) - off)
        try:
            parts.append(Executable.from_bytes(bytes(graphs[off:off + length])))
        except ExecutableError as exc:
            raise d.fail(p, f"IPU {k}'s part: {exc}") from None
    return parts
