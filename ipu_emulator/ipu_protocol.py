"""Control and event messages between a host and an IPU process.

Every message is one ring slot. The ring tag is the opcode; the payload is a
fixed 16-byte header ``<iiq`` (seq, index, value) optionally followed by a
UTF-8 JSON body (strict JSON, no pickle: nothing executable crosses the wire)::

    control ring (host -> device)          event ring (device -> host)
    ---------------------------------      -------------------------------------
    LOAD     body {"spec_region", "faults"} READY    body {"pid", "package_hash", ...}
    MODES    body [mode per stream]        DONE     seq of the finished request
    RUN      body [program indices]        ERROR    seq; body {"kind", "message", "traceback"}
    LOOP     body [program indices]        NEED     index = stream about to be read, empty
    STOP     value 1: end a loop only      OUT      index = stream just written
    UNLOAD   body {"key": load key}        STOPPED  seq of the LOOP/RUN that stop ended
    RESET                                  BYE      the process is exiting
    SHUTDOWN
    PING
    HOST     value = host pid (0: none)

Every request carries a host-chosen ``seq``; the device answers each with one
DONE or ERROR of the same ``seq`` (a LOOP only when it ends: DONE after STOP,
ERROR on failure). MODES is not answered.

LOAD's ``faults`` (optional) names the host's fault tables, HOST's body ``faults``
the daemon's (``ipu_emulator.faults.FaultTable``: the IPU process reads the schedule
there at each Main run and counts in it).

HOST is sent only by a daemon that owns the IPU process (``--pool``), while
no host uses the rings: the device forgets its previous host (a running
program ends; cached executables are closed; if that host is dead, every
object it created is unlinked), watches the new host (value; 0 = none) and
answers DONE; HOST 0 also resets the control ring for the next host. A daemon
lending the IPU sends HOST(pid) without waiting for its answer (seq
``HANDOVER_SEQ``, which no host link uses: the host's link ignores it); the
host's first request follows it on the control ring.

A LOAD names a *spec region* the host created: ``<Q spec length><spec JSON>``
then, at ``executable_offset``, the executable bytes. The spec says which
ring serves which stream (:class:`LoadSpec`).

Stream modes (per anchor, set by LOAD and MODES):

- ``MODE_EVENT``: callback-serviced. Before reading an empty input ring the
  device posts NEED(index); after writing an output it posts OUT(index).
- ``MODE_DIRECT``: the host reads/writes the ring itself; no events.
- ``MODE_NULL``: an empty callback: inputs read as zeros, outputs discarded;
  the ring is not touched.

Input slots published with ``TAG_ABORT`` tell the device that the host could
not produce the transfer (its callback failed): the program fails.

Stream slot tags: the low ``SEQ_SHIFT`` bits are the kind (``TAG_DATA``,
``TAG_ABORT``, ``TAG_SHARED``), the bits above them the transfer's sequence
number (``stream_tag(kind, seq)``). The host numbers the transfers it sends
(1, 2, ...: every input slot of one Main iteration carries the same number);
the IPU process checks that the inputs of one iteration agree and tags every
output it writes (output rings, IPU-to-IPU link rings) with that number; the
host checks the number of every output it reads. Number 0 means "not
numbered" (transfers a callback produces on a NEED event, the device asks
for them one at a time): it agrees with any number.
"""

from __future__ import annotations

import enum
import json
import struct
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, Sequence

from ipu_emulator.errors import HostMemoryError, ProtocolError

__all__ = [
    "Op",
    "Message",
    "encode",
    "decode",
    "send",
    "to_bytes",
    "receive",
    "MODE_EVENT",
    "MODE_DIRECT",
    "MODE_NULL",
    "MODES",
    "TAG_DATA",
    "TAG_ABORT",
    "TAG_SHARED",
    "SEQ_SHIFT",
    "TAG_KIND_MASK",
    "stream_tag",
    "ErrorKind",
    "Ready",
    "encode_load_spec",
    "decode_load_spec",
    "CONTROL_SLOT_SIZE",
    "CONTROL_SLOTS",
    "EVENT_SLOT_SIZE",
    "EVENT_SLOTS",
    "RINGS_BYTES",
    "ProtocolError",
]


class Op(enum.IntEnum):
    # control: host -> device
    LOAD = 1
    MODES = 2
    RUN = 3
    LOOP = 4
    STOP = 5
    UNLOAD = 6
    RESET = 7
    SHUTDOWN = 8
    PING = 9
    HOST = 10
    # events: device -> host
    READY = 101
    DONE = 102
    ERROR = 103
    NEED = 104
    OUT = 105
    STOPPED = 106
    BYE = 107


class ErrorKind(str, enum.Enum):
    """What went wrong, so the host can choose the exception class."""

    PROGRAM = "program"            # the interpreter / onnxruntime failed
    PACKAGE_HASH = "package_hash"  # executable from another emulator build
    MEMORY = "memory"              # executable does not fit the device
    EXECUTABLE = "executable"      # damaged executable bytes
    CALLBACK = "callback"          # the host aborted a transfer
    STATE = "state"                # request does not fit the device state
    REQUEST = "request"            # bad request: unknown program, incompatible executable
    PROTOCOL = "protocol"          # malformed request
    SHM_FULL = "shm_full"          # /dev/shm cannot back the device memory the load needs
    # Poplar's runtime error classes (injected faults, ipu_emulator.faults); the body also
    # has "action" (a RecoveryAction name), "ipu" (the IPU's id) and "program"
    APPLICATION = "application"    # application_runtime_error
    RECOVERABLE = "recoverable"    # recoverable_runtime_error
    UNRECOVERABLE = "unrecoverable"  # unrecoverable_runtime_error


MODE_EVENT = 0
MODE_DIRECT = 1
MODE_NULL = 3   # (2 was a direct mode that posted NEED: nothing used it)
MODES = (MODE_EVENT, MODE_DIRECT, MODE_NULL)

TAG_DATA = 0
TAG_ABORT = 1
TAG_SHARED = 2
"""An input transfer that is not in the slot: the slot holds a HOST_MEMORY
descriptor of where it is in a shared-memory region of the host's (memory from
``host_runtime.empty_shared``), and the IPU process reads it there."""

SEQ_SHIFT = 8
"""A stream slot's tag is ``kind | seq << SEQ_SHIFT`` (see the module docstring)."""
TAG_KIND_MASK = (1 << SEQ_SHIFT) - 1


def stream_tag(kind: int, seq: int) -> int:
    """The tag of a stream slot of ``kind`` (TAG_*) in transfer number ``seq``."""
    return kind | seq << SEQ_SHIFT


HOST_MEMORY = struct.Struct("<qqqq")
"""Descriptor of a TAG_SHARED input transfer: offset, byte count, length of the
region's name, number of output redirections; then the name (ASCII), then each
redirection: a HOST_OUTPUT, the region's name and the output stream's handle.

A redirection asks the IPU process to write that output of the same Main
iteration straight into the host's shared memory; it then publishes an empty
slot tagged TAG_SHARED on the output's ring, to say the data is there."""

HOST_OUTPUT = struct.Struct("<qqqq")
"""offset, byte count, length of the region's name, length of the handle."""


class Redirect(NamedTuple):
    """An output of the same Main iteration that the IPU process writes into the host's
    shared memory: ``nbytes`` at ``offset`` of ``region``."""

    handle: str
    region: str
    offset: int
    nbytes: int


class HostMemoryRef(NamedTuple):
    """A TAG_SHARED descriptor, decoded: the input is ``nbytes`` at ``offset`` of
    ``region``; ``redirects`` are the outputs written into host memory."""

    region: str
    offset: int
    nbytes: int
    redirects: tuple[Redirect, ...]


def host_memory_descriptor(region: str, offset: int, nbytes: int,
                           redirects: Sequence[tuple[str, str, int, int]] = ()) -> bytes:
    """A TAG_SHARED descriptor; ``redirects``: a :class:`Redirect` (or the plain tuple of
    its fields, as the runner's request path builds it) for each output to redirect."""
    name = region.encode("ascii")
    parts = [HOST_MEMORY.pack(offset, nbytes, len(name), len(redirects)), name]
    for handle, out_region, out_offset, out_nbytes in redirects:
        r, h = out_region.encode("ascii"), handle.encode("utf-8")
        parts += [HOST_OUTPUT.pack(out_offset, out_nbytes, len(r), len(h)), r, h]
    return b"".join(parts)


def read_host_memory_descriptor(raw: bytes) -> HostMemoryRef:
    """The descriptor :func:`host_memory_descriptor` made (HostMemoryError if it is not
    one)."""
    if len(raw) < HOST_MEMORY.size:
        raise HostMemoryError(f"a shared-memory descriptor of {len(raw)} bytes is "
                              f"too short (at least {HOST_MEMORY.size} expected)")
    offset, size, name_len, n_out = HOST_MEMORY.unpack_from(raw)
    pos = HOST_MEMORY.size
    if name_len < 0 or pos + name_len > len(raw) or n_out < 0:
        raise HostMemoryError(f"a shared-memory descriptor of {len(raw)} bytes is "
                              f"inconsistent (name of {name_len} bytes, {n_out} outputs)")
    name = raw[pos:pos + name_len].decode("ascii", "replace")
    pos += name_len
    redirects = []
    for _ in range(n_out):
        if pos + HOST_OUTPUT.size > len(raw):
            raise HostMemoryError("a shared-memory descriptor ends inside its outputs")
        o_off, o_size, r_len, h_len = HOST_OUTPUT.unpack_from(raw, pos)
        pos += HOST_OUTPUT.size
        if r_len < 0 or h_len < 0 or pos + r_len + h_len > len(raw):
            raise HostMemoryError("a shared-memory descriptor ends inside its outputs")
        out_region = raw[pos:pos + r_len].decode("ascii", "replace")
        handle = raw[pos + r_len:pos + r_len + h_len].decode("utf-8", "replace")
        pos += r_len + h_len
        redirects.append(Redirect(handle, out_region, o_off, o_size))
    if pos != len(raw):
        raise HostMemoryError(f"a shared-memory descriptor of {len(raw)} bytes has "
                              f"{len(raw) - pos} bytes after its end")
    return HostMemoryRef(name, offset, size, tuple(redirects))


HANDOVER_SEQ = -1
"""The seq of a daemon's HOST(pid) that nobody waits for (hosts number theirs from 1)."""


def daemon_seq(n: int) -> int:
    """The seq of a daemon's ``n``-th HOST 0 (negative, below ``HANDOVER_SEQ``): the
    answers a host left unread (a closing host does not wait for its last) are numbered
    from 1, and the daemon, reading past them, must never take one for its own."""
    return -2 - (n % (1 << 30))

CONTROL_SLOT_SIZE = 4096
CONTROL_SLOTS = 16
EVENT_SLOT_SIZE = 8192
EVENT_SLOTS = 32
"""Events are small (NEED, OUT, DONE: a header) but for an ERROR's body, which
``error_body`` keeps within one slot; a full ring makes the IPU process wait for
the host to read (the ring's pages are allocated at creation: 256 KiB per IPU)."""
RINGS_BYTES = CONTROL_SLOT_SIZE * CONTROL_SLOTS + EVENT_SLOT_SIZE * EVENT_SLOTS
"""About what one IPU's control and event rings take in /dev/shm (their payload)."""

_HEAD = struct.Struct("<iiq")
_MAX_MESSAGE = 2048


@dataclass(frozen=True)
class Ready:
    """READY's body: the IPU process is attached and serves (``pid`` its process, or the
    host's for a loopback IPU); what it is (``ipu_id``, ``ipu_version``, ``capacity``:
    bytes of device memory) and which build runs it (``package_hash``)."""

    pid: int
    package_hash: str
    ipu_id: int
    ipu_version: int
    capacity: int

    def body(self) -> dict[str, Any]:
        return {"pid": self.pid, "package_hash": self.package_hash, "ipu_id": self.ipu_id,
                "ipu_version": self.ipu_version, "capacity": self.capacity}

    @classmethod
    def decode(cls, body: Any) -> "Ready":
        """The READY of ``body`` (ProtocolError if it is not one)."""
        ints = ("pid", "ipu_id", "ipu_version", "capacity")
        if not (isinstance(body, dict) and set(body) == set(ints) | {"package_hash"}
                and all(isinstance(body[k], int) for k in ints)
                and isinstance(body["package_hash"], str)):
            raise ProtocolError(f"READY body must be {{pid, package_hash, ipu_id, ipu_version, "
                                f"capacity}}, got {body!r:.200}")
        return cls(body["pid"], body["package_hash"], body["ipu_id"], body["ipu_version"],
                   body["capacity"])


@dataclass(frozen=True)
class Message:
    op: Op
    seq: int = 0
    index: int = 0
    value: int = 0
    body: Any = None


def encode(msg: Message, dest: memoryview) -> int:
    """Write ``msg`` into ``dest``; return the bytes used."""
    _HEAD.pack_into(dest, 0, msg.seq, msg.index, msg.value)
    n = _HEAD.size
    if msg.body is not None:
        raw = json.dumps(msg.body, separators=(",", ":")).encode()
        if n + len(raw) > len(dest):
            raise ProtocolError(
                f"{msg.op.name} message body of {len(raw)} bytes does not fit a "
                f"{len(dest)}-byte slot")
        dest[n:n + len(raw)] = raw
        n += len(raw)
    return n


def decode(view: memoryview, tag: int) -> Message:
    """Parse one slot (``view`` holds exactly the published bytes)."""
    try:
        op = Op(tag)
    except ValueError:
        raise ProtocolError(f"unknown opcode {tag}") from None
    if len(view) < _HEAD.size:
        raise ProtocolError(f"{op.name} message of {len(view)} bytes is shorter than "
                            f"its {_HEAD.size}-byte header")
    seq, index, value = _HEAD.unpack_from(view, 0)
    body = None
    if len(view) > _HEAD.size:
        try:
            body = json.loads(bytes(view[_HEAD.size:]).decode())
        except (UnicodeDecodeError, ValueError) as exc:
            raise ProtocolError(f"{op.name} message body is not valid JSON: {exc}") from None
    return Message(op, seq, index, value, body)


def to_bytes(msg: Message, limit: int) -> bytes:
    """``msg`` encoded; raises ProtocolError if longer than ``limit`` bytes."""
    head = _HEAD.pack(msg.seq, msg.index, msg.value)
    if msg.body is None:
        return head
    raw = json.dumps(msg.body, separators=(",", ":")).encode()
    if len(head) + len(raw) > limit:
        raise ProtocolError(
            f"{msg.op.name} message body of {len(raw)} bytes does not fit a {limit}-byte slot")
    return head + raw


def send(ring: Any, msg: Message, timeout: float | None = None) -> None:
    """Encode ``msg`` and write it as one slot of ``ring`` (its tag is the opcode)."""
    ring.write(to_bytes(msg, ring.slot_size), tag=int(msg.op), timeout=timeout)


def receive(ring: Any, timeout: float | None = None) -> Message:
    """Wait for the next message of ``ring`` and decode it."""
    view, tag = ring.acquire_read(timeout)
    try:
        return decode(view, tag)
    finally:
        ring.release()


def error_body(kind: ErrorKind, message: str, traceback: str = "", **extra: Any) -> dict[str, Any]:
    """The body of an ERROR event, kept within one event slot: an over-long message keeps
    its start, an over-long traceback its end (the innermost frames)."""
    if len(message) > _MAX_MESSAGE:
        message = message[:_MAX_MESSAGE] + "...(truncated)"
    body = {"kind": kind.value, "message": "", "traceback": ""}
    body.update(extra)
    room = EVENT_SLOT_SIZE - _HEAD.size - _encoded(body)   # for the message and traceback
    body["message"] = _longest(message, room, tail=False)
    room -= _encoded(body["message"]) - 2
    body["traceback"] = _longest(traceback, room, tail=True)
    return body


def _encoded(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":")).encode())


def _longest(text: str, room: int, tail: bool) -> str:
    """``text``, or the longest start (``tail``: end) of it, marked as cut, whose JSON
    string takes at most ``room`` - 2 more bytes than an empty one."""
    if _encoded(text) - 2 <= room:
        return text
    mark = "...(truncated)...\n" if tail else "...(truncated)"
    room -= _encoded(mark) - 2
    lo, hi = 0, min(len(text), max(room, 0))   # every character takes at least one byte
    while lo < hi:   # the longest part that fits
        mid = (lo + hi + 1) // 2
        part = text[len(text) - mid:] if tail else text[:mid]
        if _encoded(part) - 2 <= room:
            lo = mid
        else:
            hi = mid - 1
    if lo == 0:
        return ""
    return mark + text[len(text) - lo:] if tail else text[:lo] + mark


__all__ += ["error_body", "HANDOVER_SEQ", "daemon_seq"]

# -- load spec ----------------------------------------------------------------------

_SPEC_LEN = struct.Struct("<Q")
_SPEC_KEYS = {"key", "executable_offset", "executable_size", "memory_region",
              "check_package_hash", "streams", "fresh"}
_SPEC_OPTIONAL = {"weights_region", "weights_file", "prepack", "constants"}
_STREAM_KEYS = {"handle", "ring", "direction", "nbytes", "mode"}


@dataclass(frozen=True)
class LoadStream:
    """Which ring serves one stream, in which direction and mode (MODE_*)."""

    handle: str
    ring: str
    direction: str   # "in" or "out"
    nbytes: int      # bytes of one transfer
    mode: int


@dataclass(frozen=True)
class LoadConstant:
    """A constant stream's value: ``nbytes`` at ``offset`` of the constants region."""

    handle: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class LoadConstants:
    """Constant streams, whose values are in one read-only region (shared by every
    session of the same values): the IPU process never reads their rings
    (``ipu_emulator.ipu._constants``)."""

    region: str
    streams: tuple[LoadConstant, ...]


@dataclass(frozen=True)
class WeightsFile:
    """Where the weights section lies in the PopEF file the host read, and that file's
    ``identity`` then (``[st_dev, st_ino, st_size, st_mtime_ns]``; empty: unknown): an
    IPU process that finds the file so before and after it read the weights need not
    checksum them again (the host checks the file's checksum)."""

    path: str   # absolute
    offset: int
    length: int
    identity: tuple[int, ...] = ()


@dataclass(frozen=True)
class LoadSpec:
    """What a LOAD's spec region says (encoded by :func:`encode_load_spec`).

    ``key`` identifies the loaded session; ``fresh``: drop any cached copy; the
    executable is ``executable_size`` bytes at ``executable_offset`` of the region (the
    length of the encoded spec); ``memory_region``: the device memory region (None:
    none); ``weights_region``: the executable's weights section is not in the spec
    region but in that one (shared by every session of the same weights; mapped
    read-only); ``weights_file``: with prepacking on, the IPU process reads the weights
    section from that file itself; ``prepack``: the host's choice of the setting
    ``prepack`` for this load (None: the IPU process's own setting)."""

    key: str
    executable_size: int
    streams: tuple[LoadStream, ...]
    memory_region: str | None = None
    check_package_hash: bool = True
    fresh: bool = False
    executable_offset: int = 0
    weights_region: str | None = None
    weights_file: WeightsFile | None = None
    prepack: bool | None = None
    constants: LoadConstants | None = None


def _spec_json(spec: LoadSpec) -> dict[str, Any]:
    out: dict[str, Any] = {
        "key": spec.key, "fresh": int(spec.fresh), "executable_offset": spec.executable_offset,
        "executable_size": spec.executable_size, "memory_region": spec.memory_region,
        "check_package_hash": spec.check_package_hash,
        "streams": [{"handle": s.handle, "ring": s.ring, "direction": s.direction,
                     "nbytes": s.nbytes, "mode": s.mode} for s in spec.streams]}
    if spec.prepack is not None:
        out["prepack"] = spec.prepack
    wf = spec.weights_file
    if wf is not None:
        out["weights_file"] = {"path": wf.path, "offset": wf.offset, "length": wf.length,
                               "identity": list(wf.identity)}
    if spec.weights_region is not None:
        out["weights_region"] = spec.weights_region
    if spec.constants is not None:
        out["constants"] = {"region": spec.constants.region,
                            "streams": [{"handle": c.handle, "offset": c.offset,
                                         "nbytes": c.nbytes} for c in spec.constants.streams]}
    return out


def encode_load_spec(spec: LoadSpec) -> bytes:
    """The spec region's prefix: length + JSON, padded to 64 bytes (the executable
    follows at ``spec.executable_offset``, which must equal its length: see
    :func:`spec_prefix_size`)."""
    raw = json.dumps(_spec_json(spec), separators=(",", ":")).encode()
    n = _SPEC_LEN.size + len(raw)
    pad = -n % 64
    return _SPEC_LEN.pack(len(raw)) + raw + b"\0" * pad


def spec_prefix_size(spec: LoadSpec) -> int:
    """Length of :func:`encode_load_spec`'s output, given a spec whose offset is not yet set."""
    return len(spec_prefix(spec))


def spec_prefix(spec: LoadSpec) -> bytes:
    """:func:`encode_load_spec` of ``spec`` with the executable right after the prefix
    (``executable_offset`` set to the prefix's own length, whatever ``spec`` had)."""
    # The offset's digits change the JSON length; iterate to a fixed point.
    prefix = encode_load_spec(replace(spec, executable_offset=0))
    for _ in range(4):
        again = encode_load_spec(replace(spec, executable_offset=len(prefix)))
        if len(again) == len(prefix):
            return again
        prefix = again
    raise AssertionError("the load spec's length did not settle")   # (digits grow 4 times)


__all__ += ["Redirect", "HostMemoryRef", "host_memory_descriptor", "read_host_memory_descriptor",
            "spec_prefix_size", "spec_prefix", "LoadSpec", "LoadStream", "LoadConstant",
            "LoadConstants", "WeightsFile"]


def decode_load_spec(buf: memoryview) -> LoadSpec:
    """Parse and check the spec at the start of a spec region."""
    if len(buf) < _SPEC_LEN.size:
        raise ProtocolError("load spec region is shorter than its length field")
    (n,) = _SPEC_LEN.unpack_from(buf, 0)
    if n > len(buf) - _SPEC_LEN.size:
        raise ProtocolError(f"load spec of {n} bytes overruns its {len(buf)}-byte region")
    try:
        spec = json.loads(bytes(buf[_SPEC_LEN.size:_SPEC_LEN.size + n]).decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise ProtocolError(f"load spec is not valid JSON: {exc}") from None
    if not isinstance(spec, dict) or set(spec) - _SPEC_OPTIONAL != _SPEC_KEYS:
        got = sorted(spec) if isinstance(spec, dict) else type(spec).__name__
        raise ProtocolError(f"load spec must have keys {sorted(_SPEC_KEYS)} (and optionally "
                            f"{sorted(_SPEC_OPTIONAL)}), got {got}")
    if spec.get("prepack") not in (None, True, False):
        raise ProtocolError(f"load spec 'prepack' must be true, false or null, got "
                            f"{spec['prepack']!r:.40}")
    if not isinstance(spec["key"], str) or not isinstance(spec["memory_region"], (str, type(None))):
        raise ProtocolError(f"load spec 'key' must be a str and 'memory_region' a region name "
                            f"or null, got {spec['key']!r:.80}, {spec['memory_region']!r:.80}")
    weights_file = _weights_file(spec.get("weights_file"))
    if weights_file is not None and spec.get("weights_region") is not None:
        raise ProtocolError("load spec names both a 'weights_file' and a 'weights_region'")
    if spec.get("weights_region") is not None and not isinstance(spec["weights_region"], str):
        raise ProtocolError(f"load spec 'weights_region' must be a region name or null, got "
                            f"{spec['weights_region']!r:.80}")
    off, size = spec["executable_offset"], spec["executable_size"]
    if not (isinstance(off, int) and isinstance(size, int) and 0 <= off and 0 < size
            and off + size <= len(buf)):
        raise ProtocolError(f"executable at [{off}, +{size}) does not fit the "
                            f"{len(buf)}-byte spec region")
    return LoadSpec(
        key=spec["key"], executable_size=size, streams=_streams(spec["streams"]),
        memory_region=spec["memory_region"], check_package_hash=bool(spec["check_package_hash"]),
        fresh=bool(spec["fresh"]), executable_offset=off,
        weights_region=spec.get("weights_region"), weights_file=weights_file,
        prepack=spec.get("prepack"), constants=_constants(spec.get("constants")))


def _weights_file(wf: Any) -> WeightsFile | None:
    if wf is None:
        return None
    if not (isinstance(wf, dict) and {"path", "offset", "length"} <= set(wf)
            and set(wf) <= {"path", "offset", "length", "identity"}
            and isinstance(wf["path"], str) and wf["path"].startswith("/")
            and all(isinstance(wf[k], int) and wf[k] >= 0 for k in ("offset", "length"))
            and isinstance(wf.get("identity", []), list)
            and all(isinstance(v, int) for v in wf.get("identity", []))):
        raise ProtocolError(f"load spec 'weights_file' must be {{path (absolute), offset, "
                            f"length[, identity]}}, got {wf!r:.200}")
    return WeightsFile(wf["path"], wf["offset"], wf["length"], tuple(wf.get("identity", ())))


def _constants(consts: Any) -> LoadConstants | None:
    if consts is None:
        return None
    if not (isinstance(consts, dict) and set(consts) == {"region", "streams"}
            and isinstance(consts["region"], str) and isinstance(consts["streams"], list)
            and all(isinstance(c, dict) and set(c) == {"handle", "offset", "nbytes"}
                    and isinstance(c["handle"], str)
                    and all(isinstance(c[k], int) and c[k] >= 0 for k in ("offset", "nbytes"))
                    for c in consts["streams"])):
        raise ProtocolError(f"load spec 'constants' must be {{region, streams: [{{handle, "
                            f"offset, nbytes}}]}}, got {consts!r:.200}")
    return LoadConstants(consts["region"], tuple(
        LoadConstant(c["handle"], c["offset"], c["nbytes"]) for c in consts["streams"]))


def _streams(streams: Any) -> tuple[LoadStream, ...]:
    if not isinstance(streams, list):
        raise ProtocolError("load spec 'streams' must be a list")
    for i, s in enumerate(streams):
        if not isinstance(s, dict) or set(s) != _STREAM_KEYS:
            raise ProtocolError(f"load spec stream {i} must have keys {sorted(_STREAM_KEYS)}")
        if s["direction"] not in ("in", "out") or s["mode"] not in MODES:
            raise ProtocolError(f"load spec stream {i} ({s.get('handle')!r}) has direction "
                                f"{s['direction']!r} / mode {s['mode']!r}")
        if not isinstance(s["nbytes"], int) or s["nbytes"] < 0:
            raise ProtocolError(f"load spec stream {i} has nbytes {s['nbytes']!r}")
        if not isinstance(s["handle"], str) or not isinstance(s["ring"], str):
            raise ProtocolError(f"load spec stream {i} needs a str handle and ring name")
    return tuple(LoadStream(s["handle"], s["ring"], s["direction"], s["nbytes"], s["mode"])
                 for s in streams)
