"""Metadata <-> strict JSON, checked against an explicit, hand-written schema.

The encoding is plain JSON (no pickle, no eval). Decoding accepts exactly the
document ``encode_metadata`` writes: every object has exactly the listed keys,
every value the listed type and range; duplicate keys, NaN/Infinity, floats
where integers belong and booleans where integers belong are refused.

Document shape (``schema`` is a fixed marker string)::

    {"schema": "ipu-emulator/popef-metadata/1",
     "executable": str, "replicationFactor": int, "numIpus": int,
     "ipuVersion": 2 | 21, "isInference": bool, "deviceIterations": int,
     "engineOptions": {str: str}, "deviceOptions": {str: str},
     "programFlow": {"load": [int], "main": [int], "save": [int]},
     "anchors": [{"name": str, "handle": str, "type": "INPUT"|"OUTPUT"|"UNKNOWN",
                  "dataType": str, "shape": [int], "isPerReplica": bool,
                  "programs": [int]}],
     "subgraphs": {str: [anchor name]},
     "isPOD": bool, "numProcesses": int, "seedHandle": str,   (these four only when
     "programsMap": {"<program index>": str}}                   not false, 1, "", {})

Errors are raised as ``SchemaError`` with a message that names the field
(``anchors[2].shape[1]``), what was expected and what was found; the reader
turns them into ``PopefError`` and the writer into ``BadRequestError``.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from shm.settings import is_digits

from host_runtime.popef.model import (Anchor, DataType, Metadata, ProgramFlow, TensorInfo,
                                      TensorType, programs_by_role)

SCHEMA_ID = "ipu-emulator/popef-metadata/1"

MAX_STRING = 1024  # characters; at most 4096 UTF-8 bytes, the blob-name limit
MAX_LIST = 1_000_000
MAX_RANK = 32
MAX_DIM = 1 << 40
MAX_TENSOR_BYTES = 1 << 40
MAX_PROGRAM_INDEX = 1 << 20
MAX_REPLICATION = 1 << 16
MAX_IPUS = 1 << 10
MAX_DEVICE_ITERATIONS = 1 << 31
IPU_VERSIONS = (2, 21)
FP8_TYPES = (DataType.F8143, DataType.F8152, DataType.F8)
MAX_PROCESSES = 1 << 16

_TOP_KEYS = ("schema", "executable", "replicationFactor", "numIpus", "ipuVersion",
             "isInference", "deviceIterations", "engineOptions", "deviceOptions",
             "programFlow", "anchors", "subgraphs")
_OPTIONAL_TOP_KEYS = ("isPOD", "numProcesses", "seedHandle", "programsMap")
_ANCHOR_KEYS = ("name", "handle", "type", "dataType", "shape", "isPerReplica", "programs")
_FLOW_KEYS = ("load", "main", "save")


class SchemaError(Exception):
    """The metadata document does not match the schema."""


def encode_metadata(md: Metadata) -> bytes:
    """Serialise ``md``; raises SchemaError if it would not decode back."""
    flow = md.programFlow()
    doc = {
        "schema": SCHEMA_ID,
        "executable": md.executable(),
        "replicationFactor": md.replicationFactor(),
        "numIpus": md.numIpus(),
        "ipuVersion": md.ipuVersion(),
        "isInference": md.isInference(),
        "deviceIterations": md.deviceIterations(),
        "engineOptions": md.engineOptions(),
        "deviceOptions": md.deviceOptions(),
        "programFlow": {"load": flow.load(), "main": flow.main(), "save": flow.save()},
        "anchors": [_encode_anchor(a) for a in md.anchors()],
        "subgraphs": md.subgraphs(),
    }
    # written only when set, so that files of models without them stay as they were
    if md.isPOD():
        doc["isPOD"] = True
    if md.numProcesses() != 1:
        doc["numProcesses"] = md.numProcesses()
    if md.seedHandle():
        doc["seedHandle"] = md.seedHandle()
    names = md.programsMap()
    if names != programs_by_role(flow):   # named otherwise by the producer
        doc["programsMap"] = {str(k): v for k, v in sorted(names.items())}
    # The writer must never produce a file the reader refuses.
    _check_document(doc)
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def _encode_anchor(a: Anchor) -> dict[str, Any]:
    info = a.tensorInfo()
    return {"name": a.name(), "handle": a.handle(), "type": a.type().value,
            "dataType": info.dataType().value, "shape": info.shape(),
            "isPerReplica": a.isPerReplica(), "programs": a.programs()}


def decode_metadata(raw: bytes) -> Metadata:
    """Parse and validate one metadata payload."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SchemaError(f"metadata is not valid UTF-8 (byte {exc.start})") from None
    try:
        doc = json.loads(text, object_pairs_hook=_no_duplicates,
                         parse_constant=_no_constant, parse_float=_no_float)
    except SchemaError:
        raise
    except (ValueError, RecursionError) as exc:
        # json.JSONDecodeError is a ValueError; very long integers raise
        # ValueError; absurd nesting raises RecursionError.
        raise SchemaError(f"metadata is not valid JSON: {_short(exc)}") from None
    _check_document(doc)
    return _build(doc)


def _short(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 200 else text[:200] + "..."


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise SchemaError(f"metadata has duplicate key {k[:100]!r}")
        out[k] = v
    return out


def _no_constant(name: str) -> Any:
    raise SchemaError(f"metadata contains {name}, which is not allowed")


def _no_float(text: str) -> Any:
    raise SchemaError(f"metadata contains the non-integer number {text[:40]}; "
                      "every number in PopEF metadata is an integer")


# -- the checks ------------------------------------------------------------------


def _check_document(doc: Any) -> None:
    _exact_keys(doc, _TOP_KEYS, "metadata", _OPTIONAL_TOP_KEYS)
    if doc["schema"] != SCHEMA_ID:
        raise SchemaError(f"metadata.schema: expected {SCHEMA_ID!r}, got {_show(doc['schema'])}")
    _string(doc["executable"], "metadata.executable", allow_empty=False)
    _int(doc["replicationFactor"], "metadata.replicationFactor", 1, MAX_REPLICATION)
    _int(doc["numIpus"], "metadata.numIpus", 1, MAX_IPUS)
    if type(doc["ipuVersion"]) is not int or doc["ipuVersion"] not in IPU_VERSIONS:
        raise SchemaError(f"metadata.ipuVersion: expected one of {list(IPU_VERSIONS)}, "
                          f"got {_show(doc['ipuVersion'])}")
    _bool(doc["isInference"], "metadata.isInference")
    if "isPOD" in doc:
        _bool(doc["isPOD"], "metadata.isPOD")
    if "numProcesses" in doc:
        _int(doc["numProcesses"], "metadata.numProcesses", 1, MAX_PROCESSES)
    if "seedHandle" in doc:
        _string(doc["seedHandle"], "metadata.seedHandle")
    if "programsMap" in doc:
        _programs_map(doc["programsMap"])
    _int(doc["deviceIterations"], "metadata.deviceIterations", 1, MAX_DEVICE_ITERATIONS)
    for key in ("engineOptions", "deviceOptions"):
        _str_map(doc[key], f"metadata.{key}")
    flow = doc["programFlow"]
    _exact_keys(flow, _FLOW_KEYS, "metadata.programFlow")
    for key in _FLOW_KEYS:
        _list(flow[key], f"metadata.programFlow.{key}", _program_index)
    anchors = doc["anchors"]
    _list(anchors, "metadata.anchors", _check_anchor)
    _unique([a["name"] for a in anchors], "metadata.anchors", "name")
    _unique([a["handle"] for a in anchors], "metadata.anchors", "handle")
    names = {a["name"] for a in anchors}
    subgraphs = doc["subgraphs"]
    if not isinstance(subgraphs, dict):
        raise SchemaError(f"metadata.subgraphs: expected an object, got {_show(subgraphs)}")
    if len(subgraphs) > MAX_LIST:
        raise SchemaError(f"metadata.subgraphs: more than {MAX_LIST} entries")
    for graph, members in subgraphs.items():
        where = f"metadata.subgraphs[{graph[:100]!r}]"
        _string(graph, where, allow_empty=False)
        _list(members, where, lambda v, w: _string(v, w, allow_empty=False))
        for m in members:
            if m not in names:
                raise SchemaError(f"{where}: names anchor {m[:200]!r}, which the metadata "
                                  "does not have")


def _check_anchor(a: Any, where: str) -> None:
    _exact_keys(a, _ANCHOR_KEYS, where)
    _string(a["name"], f"{where}.name", allow_empty=False)
    where = f"{where} ({a['name'][:100]!r})"
    _string(a["handle"], f"{where}.handle", allow_empty=False)
    if a["type"] not in [t.value for t in TensorType]:
        raise SchemaError(f"{where}.type: expected one of "
                          f"{[t.value for t in TensorType]}, got {_show(a['type'])}")
    dt = a["dataType"]
    if not isinstance(dt, str) or dt not in DataType.__members__:
        raise SchemaError(f"{where}.dataType: expected one of "
                          f"{[d.value for d in DataType if d not in FP8_TYPES]}, got {_show(dt)}")
    if DataType(dt) in FP8_TYPES:
        raise SchemaError(f"{where}.dataType: {dt} is an FP8 type, which the IPU emulator "
                          "does not support; expected one of "
                          f"{[d.value for d in DataType if d not in FP8_TYPES]}")
    _list(a["shape"], f"{where}.shape", lambda v, w: _int(v, w, 0, MAX_DIM))
    if len(a["shape"]) > MAX_RANK:
        raise SchemaError(f"{where}.shape: rank {len(a['shape'])} exceeds {MAX_RANK}")
    size = DataType(dt).itemsize
    for d in a["shape"]:
        size *= d
        if size > MAX_TENSOR_BYTES:
            raise SchemaError(f"{where}.shape: {a['shape']} of {dt} exceeds the "
                              f"{MAX_TENSOR_BYTES}-byte tensor limit")
    _bool(a["isPerReplica"], f"{where}.isPerReplica")
    _list(a["programs"], f"{where}.programs", _program_index)


def _program_index(v: Any, where: str) -> None:
    _int(v, where, 0, MAX_PROGRAM_INDEX)


def _exact_keys(obj: Any, keys: tuple[str, ...], where: str,
                optional: tuple[str, ...] = ()) -> None:
    if not isinstance(obj, dict):
        raise SchemaError(f"{where}: expected an object, got {_show(obj)}")
    missing = [k for k in keys if k not in obj]
    extra = [k for k in obj if k not in keys and k not in optional]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {missing}")
        if extra:
            parts.append(f"unexpected {[k[:100] for k in extra[:10]]}")
        also = f" (and optionally {list(optional)})" if optional else ""
        raise SchemaError(f"{where}: " + " and ".join(parts)
                          + f"; expected exactly {list(keys)}{also}")


def _int(v: Any, where: str, lo: int, hi: int) -> None:
    if type(v) is not int:
        raise SchemaError(f"{where}: expected an integer, got {_show(v)}")
    if not lo <= v <= hi:
        raise SchemaError(f"{where}: expected an integer in [{lo}, {hi}], got {_show(v)}")


def _bool(v: Any, where: str) -> None:
    if type(v) is not bool:
        raise SchemaError(f"{where}: expected true or false, got {_show(v)}")


def _string(v: Any, where: str, allow_empty: bool = True) -> None:
    if not isinstance(v, str):
        raise SchemaError(f"{where}: expected a string, got {_show(v)}")
    if not allow_empty and not v:
        raise SchemaError(f"{where}: expected a non-empty string")
    if len(v) > MAX_STRING:
        raise SchemaError(f"{where}: string of {len(v)} characters exceeds {MAX_STRING}")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise SchemaError(f"{where}: string {_show(v)} is not valid Unicode "
                          "(lone surrogate)") from None


def _list(v: Any, where: str, check: Callable[[Any, str], None]) -> None:
    if not isinstance(v, list):
        raise SchemaError(f"{where}: expected a list, got {_show(v)}")
    if len(v) > MAX_LIST:
        raise SchemaError(f"{where}: {len(v)} entries exceed {MAX_LIST}")
    for i, item in enumerate(v):
        check(item, f"{where}[{i}]")


def _str_map(v: Any, where: str) -> None:
    if not isinstance(v, dict):
        raise SchemaError(f"{where}: expected an object of strings, got {_show(v)}")
    if len(v) > MAX_LIST:
        raise SchemaError(f"{where}: {len(v)} entries exceed {MAX_LIST}")
    for k, val in v.items():
        _string(k, f"{where} key")
        _string(val, f"{where}[{k[:100]!r}]")


def _unique(values: list[str], where: str, what: str) -> None:
    seen: set[str] = set()
    for v in values:
        if v in seen:
            raise SchemaError(f"{where}: two anchors have the {what} {v[:200]!r}; "
                              f"each anchor {what} must be unique")
        seen.add(v)


def _show(v: Any) -> str:
    if isinstance(v, (dict, list)):
        return f"{type(v).__name__} of {len(v)} entries"
    text = repr(v)
    return text if len(text) <= 80 else text[:80] + "..."


def _programs_map(value: Any) -> None:
    if not isinstance(value, dict):
        raise SchemaError(f"metadata.programsMap: expected an object, got {_show(value)}")
    if len(value) > MAX_LIST:
        raise SchemaError(f"metadata.programsMap: more than {MAX_LIST} entries")
    for key, name in value.items():
        if not (is_digits(key) and len(key) <= 7
                and int(key) <= MAX_PROGRAM_INDEX and (key == "0" or key[0] != "0")):
            raise SchemaError(f"metadata.programsMap: keys are program indexes (decimal, "
                              f"0..{MAX_PROGRAM_INDEX}), got {_show(key)}")
        _string(name, f"metadata.programsMap[{key}]")


def _build(doc: dict[str, Any]) -> Metadata:
    anchors = [
        Anchor(a["name"], a["handle"], TensorInfo(DataType(a["dataType"]), a["shape"]),
               a["isPerReplica"], TensorType(a["type"]), a["programs"])
        for a in doc["anchors"]
    ]
    flow = doc["programFlow"]
    md = Metadata(
        anchors=anchors,
        program_flow=ProgramFlow(flow["load"], flow["main"], flow["save"]),
        replication_factor=doc["replicationFactor"], num_ipus=doc["numIpus"],
        ipu_version=doc["ipuVersion"], executable=doc["executable"],
        is_inference=doc["isInference"], device_iterations=doc["deviceIterations"],
        engine_options=doc["engineOptions"], device_options=doc["deviceOptions"],
        subgraphs=doc["subgraphs"])
    md.setIsPOD(doc.get("isPOD", False))
    md.setNumProcesses(doc.get("numProcesses", 1))
    md.setSeedHandle(doc.get("seedHandle", ""))
    md.setProgramsMap({int(k): v for k, v in doc.get("programsMap", {}).items()})
    return md
