"""The device executable: programs, device tensors, streams and ONNX graphs.

An executable is what the IPU process interprets. It is a small program
language over *device tensors* (named, typed regions of device memory):

- ``StreamIn(handle, tensor)``   host -> device: one transfer of a stream into a tensor
- ``StreamOut(tensor, handle)``  device -> host: one transfer of a tensor into a stream
- ``Execute(graph, inputs, outputs)`` run ONNX graph ``graph`` (index into
  ``graphs``) with its inputs bound to device tensors, writing its outputs
  into device tensors (``inputs``/``outputs`` map ONNX names to tensor names)
- ``Repeat(count, body)``        run ``body`` ``count`` times (device iterations)
- ``Switch(index, branches)``    run ``branches[value of tensor index]`` (fused models)
- ``Copy(src, dst)``             copy one device tensor into another of the same size

Programs are numbered (``programs[i]``); PopEF's program flow names which are
load, main and save.

Binary layout (all integers little-endian)::

    offset  size  field
    0       288   header (struct _HEADER, below), ends with a CRC-32 of its first 284 bytes
    288     P     program section: strict JSON (UTF-8), schema-checked on load
    288+P   G     graph section: the ONNX ModelProto bytes of every graph, concatenated;
                  each graph's (offset, length) inside this section is in the JSON; then
                  the parts of a multi-IPU executable; last, the weights section

The weights section (optional; its (offset, length) inside the graph section is
the JSON's ``weights``) holds the raw bytes of the graphs' large initializers,
each ``ALIGNMENT``-aligned from the section's start: in the ONNX graphs they are
external data, and each graph lists them (``external``: name, type, shape,
offset). So the graphs stay small (no protobuf limit of 2 GiB on the weights),
and an IPU process gives onnxruntime the weights where they lie (one read-only
copy in shared memory for every replica), without parsing or copying them. A
host may send an executable without its weights section and the section apart
(``Executable.from_bytes(head, weights=section)``, ``weights_span``).

The header alone (``read_header``) tells a host what it needs before loading:
name, package hash of the compiling emulator, IPU version and count, device
iterations and memory sizes. The body is covered by a CRC-32 in the header.
Every size, count and reference is bounded and checked; damage raises
``ExecutableError`` naming the byte offset (never another exception).
"""

from __future__ import annotations

import dataclasses
import json
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any, Iterator, NamedTuple, Union

import numpy as np

from ipu_emulator.errors import ExecutableError

__all__ = [
    "IDLE_ATTR",
    "LINK_PREFIX",
    "SYNC_TENSOR",
    "is_link",
    "is_sync",
    "parse_link",
    "MAGIC",
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "ALIGNMENT",
    "DTYPES",
    "numpy_dtype",
    "DeviceTensor",
    "StreamSpec",
    "TensorSig",
    "Graph",
    "StreamIn",
    "StreamOut",
    "Execute",
    "Repeat",
    "Switch",
    "Copy",
    "Instruction",
    "Program",
    "Executable",
    "ExecutableError",
    "plan_memory",
    "read_header",
    "ExecutableHeader",
    "ExternalWeight",
    "weights_span",
    "body_crc32",
]

# -- inter-IPU links (emulated IPU-Links) -------------------------------------------
# A sharded executable's parts exchange tensors through streams whose handles name the
# link: "__ipulink/<source ipu>/<destination ipu>/<tensor>". The compiler writes them, the
# host wires them IPU to IPU (never through itself), the device runs them as streams.

LINK_PREFIX = "__ipulink/"
SYNC_TENSOR = "__ipusync"
"""The tensor of the link that carries the sharding token (one is put in when links start)."""


def is_link(handle: str) -> bool:
    """True if the stream ``handle`` is an inter-IPU link, not a host anchor."""
    return handle.startswith(LINK_PREFIX)


def is_sync(handle: str) -> bool:
    """A link that carries the sharding token."""
    return is_link(handle) and handle.endswith("/" + SYNC_TENSOR)


IDLE_ATTR = "idle"
"""Attribute ``"1"`` of a multi-IPU executable's part: that IPU holds no node of the model.
The device has it (a model compiled for N IPUs is loaded on N), the host gives it nothing
to run, and such a part must have nothing in it (no graph, stream, tensor or instruction)."""


def parse_link(handle: str) -> tuple[int, int, str]:
    """``"__ipulink/0/1/x"`` -> ``(0, 1, "x")`` (source IPU, destination IPU, tensor)."""
    src, dst, tensor = handle[len(LINK_PREFIX):].split("/", 2)
    return int(src), int(dst), tensor


MAGIC = b"IPUEMUX\x00"
FORMAT_VERSION = 1
ALIGNMENT = 64

# magic, version, header_len, flags, ipu_version, num_ipus, device_iterations,
# memory_bytes, required_bytes, program_offset, program_length, graphs_offset,
# graphs_length, total_length, body_crc32, package_hash, name, header_crc32
_HEADER = struct.Struct("<8sIIIIIIQQQQQQQI64s128s")
HEADER_SIZE = _HEADER.size + 4
_HEADER_CRC = struct.Struct("<I")

# Bounds: checked before anything is allocated or walked.
_MAX_JSON = 256 << 20
_MAX_ITEMS = 1 << 20
_MAX_RANK = 32
_MAX_DIM = 1 << 40
_MAX_BYTES = 1 << 48
_MAX_NAME = 1024
_MAX_NAME_BYTES = 128
_MAX_DEPTH = 16
_MAX_REPEAT = (1 << 31) - 1
_IPU_VERSIONS = (2, 21)

DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "S8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "S16": np.dtype(np.int16),
    "U16": np.dtype(np.uint16),
    "S32": np.dtype(np.int32),
    "U32": np.dtype(np.uint32),
    "S64": np.dtype(np.int64),
    "U64": np.dtype(np.uint64),
}
_INDEX_DTYPES = ("S8", "U8", "S16", "U16", "S32", "U32", "S64", "U64")


def numpy_dtype(dtype: str) -> np.dtype:
    """The numpy dtype of a PopEF data type name (``"F32"``...)."""
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ExecutableError(
            f"unknown data type {dtype!r}; expected one of {', '.join(DTYPES)}") from None


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    n = numpy_dtype(dtype).itemsize
    for d in shape:
        n *= d
    return n


@dataclass(frozen=True)
class DeviceTensor:
    """A named, typed region of device memory at ``offset``."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return _nbytes(self.dtype, self.shape)


class StreamSpec(NamedTuple):
    """One stream (anchor handle): direction ``"in"`` (host->device) or ``"out"``."""

    direction: str
    dtype: str
    shape: list[int]
    nbytes: int


@dataclass(frozen=True)
class TensorSig:
    """Name, type and shape of one ONNX graph input or output."""

    name: str
    dtype: str
    shape: tuple[int, ...]


class ExternalWeight(NamedTuple):
    """An initializer of a graph whose bytes are in the executable's weights section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int          # in the weights section, ``ALIGNMENT``-aligned

    @property
    def nbytes(self) -> int:
        return _nbytes(self.dtype, self.shape)


@dataclass(frozen=True)
class Graph:
    """A serialized ONNX ModelProto with its interface.

    ``external``: its initializers stored in the executable's weights section (the
    model names them as external data; see the module docstring)."""

    inputs: tuple[TensorSig, ...]
    outputs: tuple[TensorSig, ...]
    model: bytes = field(repr=False)
    external: tuple[ExternalWeight, ...] = ()


@dataclass(frozen=True)
class StreamIn:
    handle: str
    tensor: str


@dataclass(frozen=True)
class StreamOut:
    tensor: str
    handle: str


@dataclass(frozen=True)
class Execute:
    graph: int
    inputs: tuple[tuple[str, str], ...]    # (ONNX input name, device tensor)
    outputs: tuple[tuple[str, str], ...]   # (ONNX output name, device tensor)


@dataclass(frozen=True)
class Repeat:
    count: int
    body: tuple["Instruction", ...]


@dataclass(frozen=True)
class Switch:
    index: str
    branches: tuple[tuple["Instruction", ...], ...]


@dataclass(frozen=True)
class Copy:
    src: str
    dst: str


Instruction = Union[StreamIn, StreamOut, Execute, Repeat, Switch, Copy]


@dataclass(frozen=True)
class Program:
    """One numbered program (``name`` is informative: "load", "main", "save")."""

    name: str
    body: tuple[Instruction, ...]


def plan_memory(specs: list[tuple[str, str, tuple[int, ...]]]) -> tuple[dict[str, DeviceTensor], int]:
    """Lay ``(name, dtype, shape)`` tensors out in device memory, ``ALIGNMENT``-aligned.

    Returns the tensors and the total bytes of device memory they need.
    """
    tensors: dict[str, DeviceTensor] = {}
    offset = 0
    for name, dtype, shape in specs:
        if name in tensors:
            raise ExecutableError(f"device tensor {name!r} is planned twice")
        t = DeviceTensor(name, dtype, tuple(int(d) for d in shape), offset)
        tensors[name] = t
        offset += -(-t.nbytes // ALIGNMENT) * ALIGNMENT
    return tensors, offset


@dataclass
class Executable:
    """A compiled model for the emulated IPU. See the module docstring."""

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
        _Validator(self).run()

    # -- encoding ---------------------------------------------------------------

    def to_bytes(self) -> bytes:
        self.validate()
        blobs = bytearray()
        graphs_json = []
        for g in self.graphs:
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
            "name": self.name,
            "tensors": [{"name": t.name, "dtype": t.dtype, "shape": list(t.shape),
                         "offset": t.offset} for t in self.tensors.values()],
            "streams": [{"handle": h, "direction": s.direction, "dtype": s.dtype,
                         "shape": list(s.shape)} for h, s in self.streams.items()],
            "graphs": graphs_json,
            "programs": [{"name": p.name, "body": [_instr_json(i) for i in p.body]}
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
                             object_pairs_hook=_no_duplicate_keys)
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


@dataclass(frozen=True)
class ExecutableHeader:
    """The fixed header of an executable: what a host needs before loading it.

    ``pack()`` is its one encoder, ``unpack()`` (``read_header``) its one decoder; the
    bytes are ``HEADER_SIZE`` long and end with a CRC-32 of the rest (the module
    docstring's layout). ``version`` is the format version; the section offsets and
    lengths and ``total_length`` are byte counts from the start of the executable.
    """

    name: str
    package_hash: str
    ipu_version: int
    num_ipus: int
    device_iterations: int
    memory_bytes: int
    required_bytes: int
    version: int
    total_length: int
    program_offset: int
    program_length: int
    graphs_offset: int
    graphs_length: int
    body_crc32: int

    def pack(self) -> bytes:
        """The header's ``HEADER_SIZE`` bytes, its CRC-32 last."""
        head = _HEADER.pack(
            MAGIC, self.version, HEADER_SIZE, 0, self.ipu_version, self.num_ipus,
            self.device_iterations, self.memory_bytes, self.required_bytes,
            self.program_offset, self.program_length, self.graphs_offset,
            self.graphs_length, self.total_length, self.body_crc32,
            self.package_hash.encode("ascii"), self.name.encode())
        return head + _HEADER_CRC.pack(zlib.crc32(head))

    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview) -> "ExecutableHeader":
        """Decode and check the header at the start of ``data`` (reads ``HEADER_SIZE``
        bytes); raises ``ExecutableError`` naming the byte offset of any damage."""
        view = memoryview(data)
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        if len(view) < HEADER_SIZE:
            raise ExecutableError(
                f"executable is {len(view)} bytes, shorter than its {HEADER_SIZE}-byte "
                "header (truncated)", offset=len(view))
        raw = bytes(view[:_HEADER.size])
        (magic, version, header_len, flags, ipu_version, num_ipus, iterations, memory_bytes,
         required_bytes, p_off, p_len, g_off, g_len, total, body_crc, phash,
         name) = _HEADER.unpack(raw)
        if magic != MAGIC:
            raise ExecutableError(f"bad magic {magic!r}; expected {MAGIC!r} (not an IPU "
                                  "emulator executable)", offset=0)
        if version != FORMAT_VERSION:
            raise ExecutableError(f"unsupported executable format version {version}; this "
                                  f"emulator reads version {FORMAT_VERSION}", offset=8)
        (hcrc,) = _HEADER_CRC.unpack(bytes(view[_HEADER.size:HEADER_SIZE]))
        if zlib.crc32(raw) != hcrc:
            raise ExecutableError("header checksum mismatch (damaged header)",
                                  offset=_HEADER.size)
        if header_len != HEADER_SIZE:
            raise ExecutableError(f"header length {header_len}; expected {HEADER_SIZE}",
                                  offset=12)
        if flags != 0:
            raise ExecutableError(f"unknown header flags {flags:#x}", offset=16)
        if ipu_version not in _IPU_VERSIONS:
            raise ExecutableError(f"ipu_version {ipu_version}; expected one of "
                                  f"{_IPU_VERSIONS}", offset=20)
        if not 1 <= num_ipus <= 1024 or not 1 <= iterations <= _MAX_REPEAT:
            raise ExecutableError(f"num_ipus {num_ipus} / device_iterations {iterations} "
                                  "out of range", offset=24)
        if memory_bytes > _MAX_BYTES or required_bytes > _MAX_BYTES or total > _MAX_BYTES:
            raise ExecutableError("memory or length field out of range", offset=32)
        try:
            phash_s = phash.rstrip(b"\0").decode("ascii")
            name_s = name.rstrip(b"\0").decode("utf-8")
        except UnicodeDecodeError:
            raise ExecutableError("header name or package hash is not valid text",
                                  offset=_HEADER.size - 192) from None
        return cls(name=name_s, package_hash=phash_s, ipu_version=ipu_version,
                   num_ipus=num_ipus, device_iterations=iterations,
                   memory_bytes=memory_bytes, required_bytes=required_bytes,
                   version=version, total_length=total, program_offset=p_off,
                   program_length=p_len, graphs_offset=g_off, graphs_length=g_len,
                   body_crc32=body_crc)

    def as_dict(self) -> dict[str, Any]:
        """The fields by name (for tools that print or serialise them)."""
        return dataclasses.asdict(self)


def read_header(data: bytes | bytearray | memoryview) -> ExecutableHeader:
    """Decode and check the fixed header only (cheap: reads ``HEADER_SIZE`` bytes):
    ``ExecutableHeader.unpack(data)``."""
    return ExecutableHeader.unpack(data)


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
    d = _Doc(hdr.program_offset)
    keys = ("format", "name", "tensors", "streams", "graphs", "programs", "attributes")
    optional = tuple(k for k in ("parts", "weights") if isinstance(doc, dict) and k in doc)
    top = d.obj(doc, "$", keys + optional)
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
    if top["format"] != FORMAT_VERSION:
        raise d.fail("$.format", f"expected {FORMAT_VERSION}, got {top['format']!r}")
    if top["name"] != hdr.name:
        raise d.fail("$.name", f"{top['name']!r:.80} differs from the header's {hdr.name!r}")
    tensors: dict[str, DeviceTensor] = {}
    for k, t in enumerate(d.lst(top["tensors"], "$.tensors")):
        p = f"$.tensors[{k}]"
        t = d.obj(t, p, ("name", "dtype", "shape", "offset"))
        name = d.str_(t["name"], p + ".name")
        if name in tensors:
            raise d.fail(p + ".name", f"duplicate device tensor {name!r}")
        tensors[name] = DeviceTensor(name, d.dtype(t["dtype"], p + ".dtype"),
                                     d.shape(t["shape"], p + ".shape"),
                                     d.int_(t["offset"], p + ".offset", 0, _MAX_BYTES))
    streams: dict[str, StreamSpec] = {}
    for k, s in enumerate(d.lst(top["streams"], "$.streams")):
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
    graph_list: list[Graph] = []
    for k, g in enumerate(d.lst(top["graphs"], "$.graphs")):
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
        ext = []
        for j, e in enumerate(d.lst(g.get("external", []), p + ".external")):
            q = f"{p}.external[{j}]"
            if not isinstance(e, list) or len(e) != 4:
                raise d.fail(q, "expected [name, data type, shape, offset]")
            ref = ExternalWeight(d.str_(e[0], q), d.dtype(e[1], q), d.shape(e[2], q),
                                 d.int_(e[3], q, 0, _MAX_BYTES))
            if ref.offset % ALIGNMENT or ref.offset + ref.nbytes > len(wsec):
                raise d.fail(q, f"initializer {ref.name!r} at [{ref.offset}, "
                                f"+{ref.nbytes}) is not an aligned span of the "
                                f"{len(wsec)}-byte weights section")
            ext.append(ref)
        graph_list.append(Graph(sigs[0], sigs[1],
                                bytes(graphs[off:off + length]) if with_graphs else b"",
                                tuple(ext)))
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
    parts: list[Executable] = []
    for k, pt in enumerate(d.lst(top.get("parts", []), "$.parts", 1024)):
        p = f"$.parts[{k}]"
        pt = d.obj(pt, p, ("offset", "length"))
        off = d.int_(pt["offset"], p + ".offset", 0, len(graphs))
        length = d.int_(pt["length"], p + ".length", 0, len(graphs) - off)
        try:
            parts.append(Executable.from_bytes(bytes(graphs[off:off + length])))
        except ExecutableError as exc:
            raise d.fail(p, f"IPU {k}'s part: {exc}") from None
    return Executable(
        name=hdr.name, programs=programs, graphs=graph_list, tensors=tensors,
        streams=streams, memory_bytes=hdr.memory_bytes, required_bytes=hdr.required_bytes,
        ipu_version=hdr.ipu_version, num_ipus=hdr.num_ipus,
        device_iterations=hdr.device_iterations, package_hash=hdr.package_hash,
        attributes=dict(attrs), parts=parts, weights=wsec)


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


# -- semantic validation ----------------------------------------------------------

def _walk(body: tuple[Instruction, ...]) -> Iterator[tuple[Instruction, int]]:
    stack = [(body, 0)]
    while stack:
        b, depth = stack.pop()
        for i in b:
            yield i, depth
            if isinstance(i, Repeat):
                stack.append((i.body, depth + 1))
            elif isinstance(i, Switch):
                stack.extend((br, depth + 1) for br in i.branches)


class _Validator:
    def __init__(self, exe: Executable) -> None:
        self.exe = exe

    def fail(self, msg: str) -> ExecutableError:
        return ExecutableError(f"executable {self.exe.name!r}: {msg}")

    def run(self) -> None:
        exe = self.exe
        if not isinstance(exe.name, str) or not exe.name or "\0" in exe.name or \
                len(exe.name.encode()) > _MAX_NAME_BYTES:
            raise self.fail(f"name must be 1..{_MAX_NAME_BYTES} UTF-8 bytes without NUL")
        if len(exe.package_hash) > 64 or not exe.package_hash.isascii():
            raise self.fail(f"package hash {exe.package_hash!r:.80} is not <= 64 ASCII characters")
        if exe.ipu_version not in _IPU_VERSIONS:
            raise self.fail(f"ipu_version {exe.ipu_version}; expected one of {_IPU_VERSIONS}")
        if not 1 <= exe.num_ipus <= 1024:
            raise self.fail(f"num_ipus {exe.num_ipus} out of range [1, 1024]")
        if not 1 <= exe.device_iterations <= _MAX_REPEAT:
            raise self.fail(f"device_iterations {exe.device_iterations} out of range")
        if not 0 <= exe.memory_bytes <= _MAX_BYTES:
            raise self.fail(f"memory_bytes {exe.memory_bytes} out of range")
        if exe.required_bytes and exe.required_bytes < exe.memory_bytes:
            raise self.fail(f"required_bytes {exe.required_bytes} < memory_bytes "
                            f"{exe.memory_bytes}")
        self._tensors()
        self._parts()
        for h, s in exe.streams.items():
            numpy_dtype(s.dtype)
            if s.direction not in ("in", "out"):
                raise self.fail(f"stream {h!r} direction {s.direction!r}; expected 'in' or 'out'")
            if s.nbytes != _nbytes(s.dtype, tuple(s.shape)):
                raise self.fail(f"stream {h!r} nbytes {s.nbytes} does not match "
                                f"{s.dtype}{list(s.shape)}")
        for k, g in enumerate(exe.graphs):
            for w in g.external:
                numpy_dtype(w.dtype)
                if w.offset < 0 or w.offset % ALIGNMENT or w.offset + w.nbytes > len(exe.weights):
                    raise self.fail(f"graph {k}: initializer {w.name!r} at [{w.offset}, "
                                    f"+{w.nbytes}) is not an aligned span of the "
                                    f"{len(exe.weights)}-byte weights section")
        for k, p in enumerate(exe.programs):
            for instr, depth in _walk(p.body):
                if depth > _MAX_DEPTH:
                    raise self.fail(f"program {k}: instructions nested deeper than {_MAX_DEPTH}")
                self._instr(k, instr)

    def _parts(self) -> None:
        exe = self.exe
        if not exe.parts:
            return
        if len(exe.parts) != exe.num_ipus:
            raise self.fail(f"{len(exe.parts)} IPU parts for num_ipus {exe.num_ipus}")
        for k, part in enumerate(exe.parts):
            if part.parts or part.num_ipus != 1 or part.ipu_version != exe.ipu_version:
                raise self.fail(f"IPU {k}'s part must be a one-IPU executable for "
                                f"ipu{exe.ipu_version} without parts of its own")
            part.validate()
            if part.idle:
                held = [what for what, n in (
                    ("graphs", len(part.graphs)), ("streams", len(part.streams)),
                    ("device tensors", len(part.tensors)),
                    ("instructions", sum(len(p.body) for p in part.programs))) if n]
                if held:
                    raise self.fail(f"IPU {k}'s part is marked idle but has {', '.join(held)}; "
                                    "an idle IPU runs nothing")
        if all(part.idle for part in exe.parts):
            raise self.fail(f"all {len(exe.parts)} IPU parts are marked idle; a multi-IPU "
                            "executable runs on at least one IPU")

    def _tensors(self) -> None:
        spans = []
        for name, t in self.exe.tensors.items():
            if name != t.name:
                raise self.fail(f"tensor key {name!r} differs from its name {t.name!r}")
            numpy_dtype(t.dtype)
            end = t.offset + t.nbytes
            if t.offset < 0 or end > self.exe.memory_bytes:
                raise self.fail(f"device tensor {name!r} at [{t.offset}, {end}) lies outside "
                                f"device memory of {self.exe.memory_bytes} bytes")
            if t.offset % ALIGNMENT:
                raise self.fail(f"device tensor {name!r} offset {t.offset} is not "
                                f"{ALIGNMENT}-byte aligned")
            if t.nbytes:
                spans.append((t.offset, end, name))
        spans.sort()
        for (a0, a1, an), (b0, _b1, bn) in zip(spans, spans[1:]):
            if b0 < a1:
                raise self.fail(f"device tensors {an!r} and {bn!r} overlap at offset {b0}")

    def _tensor(self, k: int, name: str) -> DeviceTensor:
        t = self.exe.tensors.get(name)
        if t is None:
            raise self.fail(f"program {k} refers to unknown device tensor {name!r}")
        return t

    def _stream(self, k: int, handle: str, direction: str, t: DeviceTensor) -> None:
        s = self.exe.streams.get(handle)
        if s is None:
            raise self.fail(f"program {k} refers to unknown stream {handle!r}")
        if s.direction != direction:
            raise self.fail(f"program {k} uses stream {handle!r} as '{direction}' but it is "
                            f"'{s.direction}'")
        if s.dtype != t.dtype or s.nbytes != t.nbytes:
            raise self.fail(f"stream {handle!r} ({s.dtype}, {s.nbytes} bytes) does not match "
                            f"device tensor {t.name!r} ({t.dtype}, {t.nbytes} bytes)")

    def _instr(self, k: int, i: Instruction) -> None:
        if isinstance(i, StreamIn):
            self._stream(k, i.handle, "in", self._tensor(k, i.tensor))
        elif isinstance(i, StreamOut):
            self._stream(k, i.handle, "out", self._tensor(k, i.tensor))
        elif isinstance(i, Execute):
            if not 0 <= i.graph < len(self.exe.graphs):
                raise self.fail(f"program {k} executes graph {i.graph}; there are "
                                f"{len(self.exe.graphs)}")
            g = self.exe.graphs[i.graph]
            for kind, pairs, sigs in (("input", i.inputs, g.inputs), ("output", i.outputs, g.outputs)):
                names = [p[0] for p in pairs]
                want = [s.name for s in sigs]
                if sorted(names) != sorted(want) or len(set(names)) != len(names):
                    raise self.fail(f"program {k}: execute of graph {i.graph} binds {kind}s "
                                    f"{names}; the graph has {want}")
                by_name = {s.name: s for s in sigs}
                for onnx_name, tname in pairs:
                    t, s = self._tensor(k, tname), by_name[onnx_name]
                    if t.dtype != s.dtype or t.shape != s.shape:
                        raise self.fail(
                            f"graph {i.graph} {kind} {onnx_name!r} is {s.dtype}{list(s.shape)} "
                            f"but device tensor {tname!r} is {t.dtype}{list(t.shape)}")
            outs = [p[1] for p in i.outputs]
            if len(set(outs)) != len(outs) or set(outs) & {p[1] for p in i.inputs}:
                raise self.fail(f"program {k}: execute of graph {i.graph} writes a device "
                                f"tensor twice or writes one of its inputs: {outs}")
        elif isinstance(i, Switch):
            t = self._tensor(k, i.index)
            if t.dtype not in _INDEX_DTYPES or _count(t.shape) != 1:
                raise self.fail(f"switch index {i.index!r} must be one integer element, is "
                                f"{t.dtype}{list(t.shape)}")
            if not i.branches:
                raise self.fail(f"program {k}: switch on {i.index!r} has no branches")
        elif isinstance(i, Copy):
            a, b = self._tensor(k, i.src), self._tensor(k, i.dst)
            if a.nbytes != b.nbytes or a.name == b.name:
                raise self.fail(f"copy {a.name!r} ({a.nbytes} bytes) -> {b.name!r} "
                                f"({b.nbytes} bytes): sizes differ or same tensor")
        elif isinstance(i, Repeat):
            if not 0 <= i.count <= _MAX_REPEAT:
                raise self.fail(f"repeat count {i.count} out of range")
        else:
            raise self.fail(f"program {k}: not an instruction: {i!r:.80}")


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
