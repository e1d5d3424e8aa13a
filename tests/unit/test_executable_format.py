"""The executable container: round trip, header, strict schema, damage -> ExecutableError."""

from __future__ import annotations

import dataclasses
import json
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ipu_emulator
from ipu_emulator.compiler import CompileOptions, ModelSpec, compile_onnx
from ipu_emulator.executable import (
    HEADER_SIZE, Copy, Execute, Executable, ExecutableError, Program, Repeat, StreamIn, StreamOut,
    StreamSpec, Switch, ExecutableHeader, plan_memory, read_header)
from ipu_emulator.executable._header import _HEADER, _HEADER_CRC
from tests.models import seed_model0, seed_model1, simple_model


@pytest.fixture(scope="module")
def simple_exe() -> Executable:
    return compile_onnx(ModelSpec(simple_model()), CompileOptions(
        name="simple", weights_as_tensor_data=True, save_weights=True,
        device_iterations=3)).executable


@pytest.fixture(scope="module")
def fused_exe() -> Executable:
    return compile_onnx([ModelSpec(seed_model0()), ModelSpec(seed_model1())]).executable


def _repack(data: bytes, doc: dict | None = None, program: bytes | None = None) -> bytes:
    """Rebuild an executable with a replaced program section and valid checksums."""
    hdr = read_header(data)
    old_prog = data[hdr.program_offset:hdr.graphs_offset]
    graphs = data[hdr.graphs_offset:]
    if program is None:
        program = json.dumps(doc).encode() if doc is not None else old_prog
    body = program + graphs
    head = _HEADER.pack(
        b"IPUEMUX\x00", 1, HEADER_SIZE, 0, hdr.ipu_version, hdr.num_ipus,
        hdr.device_iterations, hdr.memory_bytes, hdr.required_bytes, HEADER_SIZE,
        len(program), HEADER_SIZE + len(program), len(graphs), HEADER_SIZE + len(body),
        zlib.crc32(body), hdr.package_hash.encode(), hdr.name.encode())
    return head + _HEADER_CRC.pack(zlib.crc32(head)) + body


def _doc(data: bytes) -> dict:
    hdr = read_header(data)
    return json.loads(data[hdr.program_offset:hdr.graphs_offset])


def test_round_trip_is_identical(simple_exe: Executable, fused_exe: Executable) -> None:
    for exe in (simple_exe, fused_exe):
        data = exe.to_bytes()
        back = Executable.from_bytes(data)
        assert back == exe
        assert back.to_bytes() == data
        assert Executable.from_bytes(bytearray(data)) == exe
        assert Executable.from_bytes(memoryview(data)) == exe


def test_header_is_readable_alone(simple_exe: Executable) -> None:
    data = simple_exe.to_bytes()
    hdr = read_header(data[:HEADER_SIZE])
    assert hdr.name == "simple"
    assert hdr.package_hash == ipu_emulator.package_hash()
    assert len(hdr.package_hash) == 64
    assert (hdr.ipu_version, hdr.num_ipus, hdr.device_iterations) == (21, 1, 3)
    assert hdr.memory_bytes == simple_exe.memory_bytes
    assert hdr.required_bytes >= hdr.memory_bytes
    assert hdr.total_length == len(data)


def test_header_encoder_and_decoder_agree(simple_exe: Executable) -> None:
    data = simple_exe.to_bytes()
    hdr = ExecutableHeader.unpack(data)
    assert hdr.pack() == data[:HEADER_SIZE]
    assert hdr.as_dict()["name"] == "simple"
    assert set(hdr.as_dict()) == {
        "name", "package_hash", "ipu_version", "num_ipus", "device_iterations",
        "memory_bytes", "required_bytes", "version", "total_length", "program_offset",
        "program_length", "graphs_offset", "graphs_length", "body_crc32"}
    with pytest.raises(AttributeError):
        hdr.name = "other"  # type: ignore[misc]


def test_a_header_changed_in_place_after_it_was_read_is_checked_again(
        simple_exe: Executable) -> None:
    """Decoded headers are kept by their bytes: a buffer rewritten in place (a damaged
    copy, a new executable over an old one) is decoded and checked anew."""
    data = bytearray(simple_exe.to_bytes())
    first = read_header(data)
    assert read_header(bytes(data)) == first
    data[40] ^= 0x01
    with pytest.raises(ExecutableError, match="header checksum mismatch"):
        read_header(data)
    data[40] ^= 0x01
    other = ExecutableHeader.unpack(data[:HEADER_SIZE])
    renamed = bytearray(dataclasses.replace(other, name="renamed").pack())
    assert read_header(renamed).name == "renamed"
    assert read_header(data).name == "simple"


def test_executable_contents(simple_exe: Executable) -> None:
    assert [p.name for p in simple_exe.programs] == ["load", "main", "save"]
    assert simple_exe.streams["tensor_A"] == StreamSpec("in", "F32", [1, 4], 16)
    assert simple_exe.streams["weights_saved"] == ("out", "F32", [1, 4], 16)
    assert simple_exe.programs[0].body == (StreamIn("weights", "weights"),)
    assert simple_exe.programs[2].body == (StreamOut("weights", "weights_saved"),)
    (rep,) = simple_exe.programs[1].body
    assert isinstance(rep, Repeat) and rep.count == 3
    ends = sorted((t.offset, t.offset + t.nbytes) for t in simple_exe.tensors.values())
    assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:]))
    assert ends[-1][1] <= simple_exe.memory_bytes


def test_fused_executable_has_a_switch(fused_exe: Executable) -> None:
    (rep,) = fused_exe.programs[1].body
    assert isinstance(rep, Repeat)
    first, switch = rep.body
    assert first == StreamIn("index", "index")
    assert isinstance(switch, Switch) and switch.index == "index" and len(switch.branches) == 2
    assert fused_exe.tensors["index"].dtype == "S32"
    assert fused_exe.tensors["index"].shape == (1,)
    assert {"graph0/X", "graph0/Y", "graph0/O", "graph1/X", "graph1/O"} <= set(fused_exe.streams)


def test_plan_memory_aligns_and_counts() -> None:
    tensors, total = plan_memory([("a", "F32", (3,)), ("b", "BOOL", (1,)), ("c", "F16", (2, 2))])
    assert [t.offset for t in tensors.values()] == [0, 64, 128]
    assert total == 192
    with pytest.raises(ExecutableError, match="planned twice"):
        plan_memory([("a", "F32", (1,)), ("a", "F32", (1,))])


@pytest.mark.parametrize("cut", [0, 10, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 5, -1])
def test_truncation_is_refused_with_offset(simple_exe: Executable, cut: int) -> None:
    data = simple_exe.to_bytes()
    data = data[:cut] if cut >= 0 else data[:-1]
    with pytest.raises(ExecutableError, match=r"truncated.*\[executable offset \d+\]") as ei:
        Executable.from_bytes(data)
    assert ei.value.offset is not None


def test_trailing_bytes_are_refused(simple_exe: Executable) -> None:
    with pytest.raises(ExecutableError, match="trailing bytes"):
        Executable.from_bytes(simple_exe.to_bytes() + b"\0")


def test_bad_magic_and_version(simple_exe: Executable) -> None:
    data = bytearray(simple_exe.to_bytes())
    with pytest.raises(ExecutableError, match="bad magic.*not an IPU emulator executable"):
        Executable.from_bytes(b"PK\x03\x04" + bytes(data[4:]))
    data[8] = 7
    with pytest.raises(ExecutableError, match="unsupported executable format version 7"):
        read_header(bytes(data))


def test_header_and_body_checksums(simple_exe: Executable) -> None:
    data = bytearray(simple_exe.to_bytes())
    data[40] ^= 0x01
    with pytest.raises(ExecutableError, match="header checksum mismatch") as ei:
        Executable.from_bytes(bytes(data))
    assert ei.value.offset == HEADER_SIZE - 4
    data = bytearray(simple_exe.to_bytes())
    data[-3] ^= 0xFF
    with pytest.raises(ExecutableError, match="body checksum mismatch") as ei:
        Executable.from_bytes(bytes(data))
    assert ei.value.offset == HEADER_SIZE


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pos=st.integers(min_value=0), value=st.integers(min_value=1, max_value=255))
def test_any_byte_flip_raises_only_executable_error(simple_exe: Executable, pos: int,
                                                    value: int) -> None:
    data = bytearray(simple_exe.to_bytes())
    pos %= len(data)
    data[pos] ^= value
    with pytest.raises(ExecutableError):
        Executable.from_bytes(bytes(data))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(junk=st.binary(max_size=300))
def test_garbage_program_section_raises_only_executable_error(simple_exe: Executable,
                                                               junk: bytes) -> None:
    with pytest.raises(ExecutableError):
        Executable.from_bytes(_repack(simple_exe.to_bytes(), program=junk))


def test_repacked_original_is_accepted(simple_exe: Executable) -> None:
    data = simple_exe.to_bytes()
    assert Executable.from_bytes(_repack(data, _doc(data))) == simple_exe


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(extra=1), r"\$: expected keys .*unexpected \['extra'\]"),
    (lambda d: d.pop("streams"), r"missing \['streams'\]"),
    (lambda d: d.update(format=2), r"\$.format: expected 1, got 2"),
    (lambda d: d.update(name="other"), "differs from the header"),
    (lambda d: d["tensors"][0].update(dtype="F8"), r"tensors\[0\].dtype: expected a data type"),
    (lambda d: d["tensors"][0].update(shape=[-1]), r"expected an integer in \[0"),
    (lambda d: d["tensors"][0].update(shape=[1] * 40), "exceed the limit of 32"),
    (lambda d: d["tensors"][0].update(offset=1 << 40), "outside device memory"),
    (lambda d: d["tensors"][1].update(offset=d["tensors"][0]["offset"]), "overlap"),
    (lambda d: d["tensors"][0].update(offset=3), "not 64-byte aligned"),
    (lambda d: d["tensors"].append(dict(d["tensors"][0])), "duplicate device tensor"),
    (lambda d: d["streams"][0].update(direction="both"), "expected 'in' or 'out'"),
    (lambda d: d["graphs"][0].update(length=1 << 30), r"graphs\[0\].length: expected an integer"),
    (lambda d: d["programs"][0]["body"].append({"op": "jump"}), "unknown instruction 'jump'"),
    (lambda d: d["programs"][0]["body"].append({"op": "copy", "src": "weights"}),
     r"missing \['dst'\]"),
    (lambda d: d["programs"][0]["body"].append(
        {"op": "stream_in", "handle": "nope", "tensor": "weights"}), "unknown stream 'nope'"),
    (lambda d: d["programs"][0]["body"].append(
        {"op": "stream_in", "handle": "tensor_C", "tensor": "tensor_C"}),
     "uses stream 'tensor_C' as 'in' but it is 'out'"),
    (lambda d: d["programs"][0]["body"].append(
        {"op": "stream_out", "tensor": "ghost", "handle": "tensor_C"}),
     "unknown device tensor 'ghost'"),
    (lambda d: d["programs"][0]["body"].append(
        {"op": "execute", "graph": 5, "inputs": [], "outputs": []}), "executes graph 5"),
    (lambda d: d["programs"][0]["body"].append(
        {"op": "execute", "graph": 0, "inputs": [], "outputs": []}), "binds inputs"),
    (lambda d: d["programs"][0]["body"].append(
        {"op": "repeat", "count": -1, "body": []}), r"count: expected an integer"),
    (lambda d: d["programs"][0]["body"].append(
        {"op": "switch", "index": "tensor_A", "branches": [[]]}), "must be one integer element"),
    (lambda d: d["programs"][0]["body"].append(
        {"op": "copy", "src": "weights", "dst": "weights"}), "sizes differ or same tensor"),
    (lambda d: d.update(attributes={"a": 1}), "string values"),
])
def test_schema_violations_are_named(simple_exe: Executable, mutate, message: str) -> None:
    data = simple_exe.to_bytes()
    doc = _doc(data)
    mutate(doc)
    with pytest.raises(ExecutableError, match=message):
        Executable.from_bytes(_repack(data, doc))


def test_deep_nesting_is_bounded(simple_exe: Executable) -> None:
    data = simple_exe.to_bytes()
    doc = _doc(data)
    body: list = []
    for _ in range(40):
        body = [{"op": "repeat", "count": 1, "body": body}]
    doc["programs"][0]["body"] = body
    with pytest.raises(ExecutableError, match="nested deeper than 16"):
        Executable.from_bytes(_repack(data, doc))
    deep = "[" * 100000 + "]" * 100000
    with pytest.raises(ExecutableError):
        Executable.from_bytes(_repack(data, program=deep.encode()))


def test_validate_refuses_inconsistent_objects(simple_exe: Executable) -> None:
    bad = Executable(name="x", programs=[Program("p", (Copy("a", "b"),))], graphs=[],
                     tensors=plan_memory([("a", "F32", (2,)), ("b", "F32", (3,))])[0],
                     streams={}, memory_bytes=128)
    with pytest.raises(ExecutableError, match="sizes differ"):
        bad.to_bytes()
    ok = Executable(name="x", programs=[], graphs=[], tensors={}, streams={}, memory_bytes=0,
                    ipu_version=3)
    with pytest.raises(ExecutableError, match="ipu_version 3"):
        ok.validate()
    g = simple_exe.graphs[0]
    wrong = Executable(
        name="y", programs=[Program("main", (Execute(0, tuple((s.name, s.name) for s in g.inputs),
                                                     (("tensor_C", "tensor_A"),)),))],
        graphs=[g], tensors=simple_exe.tensors, streams=simple_exe.streams,
        memory_bytes=simple_exe.memory_bytes)
    with pytest.raises(ExecutableError, match="writes a device tensor twice or writes one of"):
        wrong.validate()


def test_duplicate_json_keys_and_bad_names_are_refused(simple_exe: Executable) -> None:
    data = simple_exe.to_bytes()
    prog = json.dumps(_doc(data)).replace('"format": 1', '"format": 1, "format": 1', 1)
    with pytest.raises(ExecutableError, match="duplicate key 'format'"):
        Executable.from_bytes(_repack(data, program=prog.encode()))
    for name in ("", "a\0b", "x" * 129):
        bad = Executable(name=name, programs=[], graphs=[], tensors={}, streams={},
                         memory_bytes=0)
        with pytest.raises(ExecutableError, match="name must be 1..128 UTF-8 bytes"):
            bad.to_bytes()
