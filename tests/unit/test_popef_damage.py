"""Bad PopEF input: every kind of damage raises PopefError naming file, blob, offset.

Generated damage (truncation at every offset, every single-byte flip, random
multi-byte mutations, inflated size fields, hypothesis byte strings) checks
that only PopefError ever comes out and that nothing much larger than the
file is allocated while parsing it.

What a parse allocates is measured in a fresh interpreter with one thread
(``_allocations``): tracemalloc counts every thread of its process, and a
pytest worker may run threads left by earlier tests, whose allocations
would count against the parse.
"""

from __future__ import annotations

import io
import json
import random
import re
import os
import struct
import subprocess
import sys
import zlib
from typing import NamedTuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from host_runtime import popef
from host_runtime.errors import PopefError
from tests.unit.test_popef_roundtrip import sample_metadata, write_sample

HDR = struct.Struct("<4sHHQIIQQII")


def _valid() -> bytes:
    buf = io.BytesIO()
    write_sample(buf, compress=True)
    return buf.getvalue()


VALID = _valid()
END = 32   # the end record's bytes


def _blob_offsets(data: bytes) -> list[int]:
    r = popef.Reader()
    r.parseStream(data)
    return [b.offset for b in r.blobs()] + [len(data)]


def _raw_blob(btype: int, name: bytes, payload: bytes, *, version: int = 1, flags: int = 0,
              aux: int = 0, total: int | None = None, payload_len: int | None = None,
              name_len: int | None = None) -> bytes:
    """A blob with valid checksums and any header fields the test wants."""
    nl = len(name) if name_len is None else name_len
    pl = len(payload) if payload_len is None else payload_len
    tot = 48 + nl + pl if total is None else total
    head = HDR.pack(b"BLOB", btype, version, tot, nl, flags, pl, aux, zlib.crc32(payload), 0)
    crc = zlib.crc32(name, zlib.crc32(head[:44]))
    return head[:44] + struct.pack("<I", crc) + name + payload


FILE_HEADER = b"IPUPOPEF" + struct.pack("<II", 1, 0)


def _parse(data: bytes, name: str = "dmg.popef") -> popef.Reader:
    r = popef.Reader()
    r.parseStream(data, name=name)
    return r


def _error(data: bytes) -> PopefError:
    with pytest.raises(PopefError) as info:
        _parse(data)
    return info.value


def _metadata_blob(doc: object | bytes, name: bytes = b"simple_exe") -> bytes:
    payload = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    return FILE_HEADER + _raw_blob(2, name, payload)


_MEASURE = """
import json, sys, threading, tracemalloc
from host_runtime import popef
from host_runtime.errors import PopefError

results = []
threads = threading.active_count()
tracemalloc.start()
for how, arg in json.load(sys.stdin):
    data = bytes.fromhex(arg) if how == "stream" else None
    base, _ = tracemalloc.get_traced_memory()
    tracemalloc.reset_peak()
    try:
        if data is None:
            popef.Reader().parseFile(arg)
        else:
            popef.Reader().parseStream(data, name="dmg.popef")
        error = None
    except PopefError as exc:
        error = ["PopefError", str(exc)]
    except BaseException as exc:
        error = [type(exc).__name__, str(exc)]
    _, peak = tracemalloc.get_traced_memory()
    results.append([error, peak - base])
json.dump({"threads": threads, "results": results}, sys.stdout)
"""


class Parsed(NamedTuple):
    error: tuple[str, str] | None   # (exception type, message); None: it parsed
    allocated: int                  # the parse's peak allocation (bytes)


def _allocations(cases: list[tuple[str, str]]) -> list[Parsed]:
    """Parse each case (``("stream", data.hex())`` or ``("file", path)``) in a fresh
    interpreter that runs nothing else: the peak each parse allocates over what its
    process held before it (its input, for a stream, included)."""
    run = subprocess.run([sys.executable, "-c", _MEASURE], input=json.dumps(cases),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["threads"] == 1, f"the measuring process runs {out['threads']} threads"
    return [Parsed(None if e is None else (e[0], e[1]), n) for e, n in out["results"]]


def _valid_doc() -> dict:
    blob = VALID[16:]
    (_, _, _, _, nl, _, pl, _, _, _) = HDR.unpack(blob[:48])
    return json.loads(blob[48 + nl:48 + nl + pl])


# -- specific damage, specific messages -----------------------------------------


def test_truncated_file_header() -> None:
    err = _error(VALID[:10])
    assert "file is truncated: 10 bytes" in str(err) and "'dmg.popef'" in str(err)
    assert err.offset == 0


def test_not_a_popef_file() -> None:
    assert "not a PopEF file" in str(_error(b"PK\x03\x04" + bytes(40)))


def test_unsupported_file_version() -> None:
    data = b"IPUPOPEF" + struct.pack("<II", 7, 0) + VALID[16:]
    err = _error(data)
    assert "unsupported PopEF file format version 7" in str(err) and err.offset == 8


def test_unknown_blob_type() -> None:
    err = _error(FILE_HEADER + _raw_blob(9, b"mystery", b"x"))
    assert "unknown blob type 9" in str(err) and "mystery" in str(err)
    assert err.offset == 16 + 4 and err.path == "dmg.popef"


def test_unsupported_blob_version() -> None:
    err = _error(FILE_HEADER + _raw_blob(5, b"o", b"x", version=3))
    assert "unsupported blob format version 3" in str(err)
    assert err.blob == "#0 opaque 'o'"


def test_wrong_payload_checksum() -> None:
    data = bytearray(VALID)
    data[-END - 1] ^= 0x40   # the last payload byte, before the end record
    err = _error(bytes(data))
    assert "payload checksum mismatch" in str(err) and "opaque 'app/notes'" in str(err)


def test_wrong_header_checksum() -> None:
    data = bytearray(VALID)
    data[16 + 48] ^= 0x01   # first byte of the first blob's name
    err = _error(bytes(data))
    assert "blob header checksum mismatch" in str(err) and err.offset == 16


def test_size_larger_than_file() -> None:
    err = _error(FILE_HEADER + _raw_blob(5, b"o", b"x", total=1 << 60))
    assert f"blob size {1 << 60} is larger than the 50 bytes left" in str(err)
    assert err.offset == 24


def test_payload_length_larger_than_file() -> None:
    err = _error(FILE_HEADER + _raw_blob(5, b"o", b"x", payload_len=(1 << 63)))
    assert "larger than the" in str(err) or "disagrees" in str(err)


def test_name_length_too_large() -> None:
    err = _error(FILE_HEADER + _raw_blob(5, b"o", b"x", name_len=1 << 31))
    assert "blob name length 2147483648 exceeds" in str(err)


def test_sizes_that_disagree() -> None:
    err = _error(FILE_HEADER + _raw_blob(5, b"o", b"xy", total=48 + 1 + 1) + b"\0")
    assert "disagrees with header (48) + name (1) + payload (2)" in str(err)


def test_feed_data_with_bad_transfer_count() -> None:
    assert "feed data has 0 transfers" in str(_error(FILE_HEADER + _raw_blob(4, b"a", b"12")))
    assert "not a whole number of 3 transfers" in str(
        _error(FILE_HEADER + _raw_blob(4, b"a", b"1234", aux=3)))


def test_compressed_executable_damage() -> None:
    good = zlib.compress(b"abc" * 100)
    assert "does not decompress to the 299 bytes" in str(
        _error(FILE_HEADER + _raw_blob(1, b"e", good, flags=1, aux=299)))
    assert "more than zlib can produce" in str(
        _error(FILE_HEADER + _raw_blob(1, b"e", good, flags=1, aux=1 << 40)))
    assert "compressed executable is damaged" in str(
        _error(FILE_HEADER + _raw_blob(1, b"e", b"\x00garbage", flags=1, aux=3)))
    assert "only executable blobs may be compressed" in str(
        _error(FILE_HEADER + _raw_blob(5, b"o", good, flags=1, aux=300)))
    assert "unknown blob flags 0x4" in str(
        _error(FILE_HEADER + _raw_blob(5, b"o", good, flags=4)))


def test_zip_bomb_is_refused_without_allocating_it() -> None:
    bomb = zlib.compress(bytes(50 << 20), 9)   # 50 MiB of zeros in ~50 kB
    data = FILE_HEADER + _raw_blob(1, b"e", bomb, flags=1, aux=1000)
    [parsed] = _allocations([("stream", data.hex())])
    assert parsed.error is not None and parsed.error[0] == "PopefError", parsed.error
    assert "does not decompress to the 1000 bytes" in parsed.error[1], parsed.error
    limit = 2 * len(data) + (1 << 20)
    assert parsed.allocated < limit, (parsed.allocated, limit)


def test_bad_name_utf8() -> None:
    assert "blob name is not valid UTF-8" in str(_error(FILE_HEADER + _raw_blob(5, b"\xff", b"")))


# -- metadata schema ---------------------------------------------------------------


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.pop("numIpus"), r"missing \['numIpus'\]"),
    (lambda d: d.update(extra=1), r"unexpected \['extra'\]"),
    (lambda d: d.update(numIpus="2"), r"metadata.numIpus: expected an integer, got '2'"),
    (lambda d: d.update(numIpus=True), r"metadata.numIpus: expected an integer, got True"),
    (lambda d: d.update(numIpus=0), r"numIpus: expected an integer in \[1, 1024\], got 0"),
    (lambda d: d.update(ipuVersion=3), r"ipuVersion: expected one of \[2, 21\], got 3"),
    (lambda d: d.update(isInference=1), r"isInference: expected true or false, got 1"),
    (lambda d: d.update(schema="x"), r"metadata.schema: expected"),
    (lambda d: d.update(engineOptions={"a": 1}), r"engineOptions\['a'\]: expected a string"),
    (lambda d: d["programFlow"].update(main=[-1]), r"programFlow.main\[0\]: expected an int"),
    (lambda d: d["anchors"][0].update(shape=[1, -4]), r"anchors\[0\] \('tensor_A'\).shape\[1\]"),
    (lambda d: d["anchors"][0].update(dataType="F8152"), r"F8152 is an FP8 type"),
    (lambda d: d["anchors"][0].update(dataType="F128"), r"dataType: expected one of"),
    (lambda d: d["anchors"][0].update(type="SIDEWAYS"), r"type: expected one of"),
    (lambda d: d["anchors"][1].update(name="tensor_A"), r"two anchors have the name 'tensor_A'"),
    (lambda d: d["anchors"][1].update(handle="h_A"), r"two anchors have the handle 'h_A'"),
    (lambda d: d["anchors"][0].update(shape=[1 << 30] * 3), r"exceeds the \d+-byte tensor"),
    (lambda d: d["anchors"][0].update(shape=[1] * 33), r"rank 33 exceeds 32"),
    (lambda d: d["anchors"][0].pop("programs"), r"missing \['programs'\]"),
    (lambda d: d.update(anchors={}), r"metadata.anchors: expected a list"),
    (lambda d: d.update(subgraphs={"graph0": ["ghost"]}), r"names anchor 'ghost'"),
    (lambda d: d.update(engineOptions={"k": "\ud800"}), r"\['k'\]: string .*\(lone surrogate\)"),
    # Graphcore's optional fields
    (lambda d: d.update(isPOD=1), r"metadata.isPOD: expected true or false, got 1"),
    (lambda d: d.update(numProcesses=0), r"numProcesses: expected an integer in \[1, 65536\]"),
    (lambda d: d.update(seedHandle=7), r"metadata.seedHandle: expected a string, got 7"),
    (lambda d: d.update(isPod=True), r"unexpected \['isPod'\]; expected exactly .* \(and "
                                     r"optionally \['isPOD', 'numProcesses', 'seedHandle', "
                                     r"'programsMap'\]\)"),
    (lambda d: d.update(programsMap=[]), r"metadata.programsMap: expected an object, got list"),
    (lambda d: d.update(programsMap={"01": "main"}), r"programsMap: keys are program indexes"),
    (lambda d: d.update(programsMap={"-1": "main"}), r"programsMap: keys are program indexes"),
    (lambda d: d.update(programsMap={"1": 5}), r"metadata.programsMap\[1\]: expected a string"),
])
def test_metadata_schema_violations(mutate, message) -> None:
    doc = _valid_doc()
    mutate(doc)
    err = _error(_metadata_blob(doc))
    assert "metadata does not match its schema" in str(err)
    assert err.blob == "#0 metadata 'simple_exe'" and err.offset == 16 + 48 + 10
    assert re.search(message, str(err)), str(err)


@pytest.mark.parametrize("payload, message", [
    (b"\xff\xfe", "not valid UTF-8"),
    (b"{", "not valid JSON"),
    (b"[" * 100000 + b"]" * 100000, "not valid JSON"),
    (b'{"a": 1, "a": 2}', "duplicate key 'a'"),
    (b'{"a": NaN}', "contains NaN"),
    (b'{"a": 1.5}', "non-integer number 1.5"),
    (b'{"a": ' + b"9" * 5000 + b"}", "not valid JSON"),
    (b"[]", "metadata: expected an object"),
])
def test_metadata_that_is_not_strict_json(payload: bytes, message: str) -> None:
    assert message in str(_error(_metadata_blob(payload)))


def test_metadata_name_must_match_its_executable() -> None:
    err = _error(_metadata_blob(_valid_doc(), name=b"other"))
    assert "metadata blob is named 'other' but its metadata names executable 'simple_exe'" \
        in str(err)


# -- generated damage --------------------------------------------------------------


def _parse_or_popef_error(data: bytes) -> bool:
    """True if parsed; False if PopefError. Anything else fails the test."""
    try:
        _parse(data)
    except PopefError as exc:
        assert "'dmg.popef'" in str(exc)
        return False
    return True


def test_truncation_at_every_offset() -> None:
    """A file cut anywhere is refused, exactly between two blobs too (the end record
    the file header announces is missing)."""
    boundaries = set(_blob_offsets(VALID))
    for cut in range(len(VALID)):
        assert not _parse_or_popef_error(VALID[:cut]), cut
    for cut in sorted((boundaries - {len(VALID)}) | {len(VALID) - END}):
        err = _error(VALID[:cut])
        assert "without the end record its header announces" in str(err), (cut, err)
        assert "is missing" in str(err) and f"ends at byte {cut}" in str(err)


def test_a_file_without_end_record_flag_is_read_as_before() -> None:
    """Files written without an end record (flags 0) are parsed blob by blob: a cut
    between blobs cannot be told there, and only there."""
    data = bytearray(VALID[:-END])
    data[12:16] = b"\0\0\0\0"
    boundaries = set(_blob_offsets(bytes(data)))
    for cut in range(16, len(data) + 1):
        assert _parse_or_popef_error(bytes(data[:cut])) == (cut in boundaries), cut


def test_end_record_that_does_not_match_the_blobs() -> None:
    offsets = _blob_offsets(VALID)
    # a whole blob cut out of the middle, the end record kept: counts disagree
    cut = VALID[:offsets[1]] + VALID[offsets[2]:]
    err = _error(cut)
    assert "does not match its end record" in str(err), err
    # blobs appended after the end record
    err = _error(VALID + VALID[offsets[1]:offsets[2]])
    assert isinstance(err, PopefError)
    # unknown header flags
    data = bytearray(VALID)
    data[12] = 0x6
    assert "file header flags are 0x6" in str(_error(bytes(data)))


def test_every_single_byte_flip_is_detected() -> None:
    # The file header is validated field by field, blob headers and names by
    # header_crc32, payloads by payload_crc32: no single flip goes unnoticed.
    for i in range(len(VALID)):
        data = bytearray(VALID)
        data[i] ^= 0x10
        assert not _parse_or_popef_error(bytes(data)), i


def test_random_mutations_only_raise_popef_error() -> None:
    rng = random.Random(1234)
    for _ in range(1500):
        data = bytearray(VALID)
        for _ in range(rng.randint(1, 8)):
            kind = rng.random()
            i = rng.randrange(len(data))
            if kind < 0.5:
                data[i] = rng.randrange(256)
            elif kind < 0.75:
                del data[i:i + rng.randint(1, 64)]
            else:
                data[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        _parse_or_popef_error(bytes(data))


def test_inflated_size_fields_allocate_nothing_large() -> None:
    cases = []
    for off in _blob_offsets(VALID)[:-1]:
        for field_off, fmt in ((8, "<Q"), (16, "<I"), (24, "<Q"), (32, "<Q")):
            for value in (1 << 20, 1 << 31, (1 << 63) - 1, (1 << 64) - 1):
                data = bytearray(VALID)
                size = struct.calcsize(fmt)
                if value >= 1 << (8 * size):
                    continue
                data[off + field_off:off + field_off + size] = struct.pack(fmt, value)
                cases.append(((off, field_off, value), bytes(data)))
    results = _allocations([("stream", data.hex()) for _, data in cases])
    assert len(results) == len(cases) > 50
    limit = 4 * len(VALID) + (256 << 10)
    for (where, data), parsed in zip(cases, results):
        assert parsed.error is not None and parsed.error[0] == "PopefError", (where, parsed)
        assert "'dmg.popef'" in parsed.error[1], (where, parsed)
        assert parsed.allocated < limit, (where, parsed, limit)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=600))
def test_hypothesis_arbitrary_bytes_after_a_valid_header(tail: bytes) -> None:
    _parse_or_popef_error(FILE_HEADER + tail)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, len(VALID) - 1), st.binary(min_size=1, max_size=12))
def test_hypothesis_overwrites(pos: int, patch: bytes) -> None:
    data = bytearray(VALID)
    data[pos:pos + len(patch)] = patch
    _parse_or_popef_error(bytes(data))


def test_reader_is_unchanged_by_a_damaged_file() -> None:
    r = popef.Reader()
    r.parseStream(VALID)
    n = len(r.blobs())
    with pytest.raises(PopefError):
        r.parseStream(VALID[:-3], name="cut")
    assert len(r.blobs()) == n
    assert r.metadata() == [sample_metadata()]


def test_inflated_sizes_through_real_files(tmp_path) -> None:
    # parseFile reads with FileIO, which would allocate whatever size it is
    # asked for: the size checks must come before every read.
    paths = []
    for off in _blob_offsets(VALID)[:-1]:
        for field_off, value in ((8, (1 << 62)), (24, (1 << 62)), (16, 1 << 31)):
            data = bytearray(VALID)
            size = 4 if field_off == 16 else 8
            data[off + field_off:off + field_off + size] = value.to_bytes(size, "little")
            path = tmp_path / f"inflated_{off}_{field_off}.popef"
            path.write_bytes(bytes(data))
            paths.append(str(path))
    results = _allocations([("file", path) for path in paths])
    assert len(results) == len(paths) > 10
    limit = 4 * len(VALID) + (256 << 10)
    for path, parsed in zip(paths, results):
        assert parsed.error is not None and parsed.error[0] == "PopefError", (path, parsed)
        assert path in parsed.error[1], (path, parsed)
        # no read of an inflated size: the file (~1.3 kB) read whole at most, a few times
        assert parsed.allocated < limit, (path, parsed, limit)


def test_truncated_real_file(tmp_path) -> None:
    path = tmp_path / "cut.popef"
    path.write_bytes(VALID[:-END - 5])
    with pytest.raises(PopefError, match=r"larger than the .* bytes left in the file") as info:
        popef.Reader().parseFile(path)
    assert info.value.path == str(path) and "opaque 'app/notes'" in str(info.value)


def test_wrong_kinds_of_stream(tmp_path) -> None:
    with pytest.raises(PopefError, match="expects bytes or a binary stream, got int"):
        popef.Reader().parseStream(5)  # type: ignore[arg-type]
    path = tmp_path / "m.popef"
    path.write_bytes(VALID)
    with open(path, encoding="latin-1") as text:
        with pytest.raises(PopefError, match="open it in binary mode"):
            popef.Reader().parseStream(text)  # type: ignore[arg-type]

    class Pipe:
        def read(self) -> bytes:
            return VALID

    r = popef.Reader()
    r.parseStream(Pipe(), name="pipe")  # type: ignore[arg-type]
    assert len(r.blobs()) == 5 and r.paths() == ["pipe"]


def test_checksums_left_to_a_thread_refuse_a_damaged_payload_when_waited_for(tmp_path) -> None:
    """A reader given PendingChecksums maps the large payloads and checks them on a thread:
    parsing returns at once, ``wait()`` raises the same PopefError the reader raises
    itself (which blob, which checksums), and an intact file waits without error."""
    import numpy as np

    from host_runtime.popef.reader import MAP_MIN_BYTES, PendingChecksums

    big = np.arange(MAP_MIN_BYTES // 4 + 16, dtype=np.float32)
    path = tmp_path / "t.popef"
    with popef.Writer(str(path)) as w:
        w.writeTensorData("a", big)
        w.writeTensorData("b", big[::-1].copy())
    good = PendingChecksums()
    reader = popef.Reader(pending=good)
    reader.parseFile(str(path))
    good.wait()
    assert [t.info.name() for t in reader.tensors()] == ["a", "b"]
    data = bytearray(path.read_bytes())
    data[-100] ^= 0x08          # a byte of b's payload
    path.write_bytes(bytes(data))
    with pytest.raises(PopefError) as direct:
        popef.Reader().parseFile(str(path))
    pending = PendingChecksums()
    popef.Reader(pending=pending).parseFile(str(path))
    with pytest.raises(PopefError) as waited:
        pending.wait()
    assert re.search(r"payload checksum mismatch: stored 0x[0-9a-f]{8}, computed "
                     r"0x[0-9a-f]{8}", str(waited.value)), waited.value
    assert str(waited.value) == str(direct.value)
    assert "tensor data 'b'" in str(waited.value)
    pending.wait()              # waited once: nothing left


def _big_file(path) -> bytes:
    import numpy as np

    from host_runtime.popef.reader import MAP_MIN_BYTES

    with popef.Writer(str(path)) as w:
        w.writeTensorData("a", np.arange(MAP_MIN_BYTES // 4 + 16, dtype=np.float32))
    return path.read_bytes()


def test_a_large_file_is_read_from_a_snapshot_nobody_else_can_change(tmp_path) -> None:
    """Its payloads map an unnamed copy of the file (``/proc/<pid>/fd/<n>``), not the
    file: cut short or rewritten in place after it was read, the bytes are those read
    (no SIGBUS on reading them); the copy goes with the last view of it."""
    import gc
    import os

    from host_runtime.popef.reader import file_span

    path = tmp_path / "big.popef"
    data = _big_file(path)
    r = popef.Reader()
    r.parseFile(path)
    (td,) = [b for _, b in r.entries() if isinstance(b, popef.TensorData)]
    view = td.data
    span = file_span(view)
    assert span is not None and span[0].startswith(f"/proc/{os.getpid()}/fd/")
    assert os.readlink(span[0]).endswith("(deleted)")   # an unnamed file
    before = bytes(view)
    assert before == data[span[1]:span[1] + len(before)]
    os.truncate(path, 100)
    path.write_bytes(b"\xff" * len(data))
    os.truncate(path, 16)
    assert bytes(view) == before
    fd_path = span[0]
    del r, td, view
    gc.collect()
    assert not os.path.exists(fd_path)   # the snapshot's descriptor closed


def test_a_file_cut_while_its_snapshot_is_taken_is_refused(tmp_path, monkeypatch) -> None:
    from host_runtime.popef import reader

    path = tmp_path / "big.popef"
    data = _big_file(path)
    real = reader._copy_range

    def cut_meanwhile(src: int, dst: int, size: int) -> int:
        import os
        os.truncate(path, 4096)    # another writer, while the copy runs
        return real(src, dst, size)

    monkeypatch.setattr(reader, "_copy_range", cut_meanwhile)
    with pytest.raises(PopefError, match=rf"it had {len(data)} bytes when opened and 4096 "
                                         r"could be read \(cut short while it was read\)"):
        popef.Reader().parseFile(path)


def test_a_snapshot_goes_where_there_is_room(tmp_path, monkeypatch) -> None:
    """No room for the copy in the file's folder: the next place takes it (the temporary
    folder, then memory); no room anywhere: ResourceLimitError naming each place."""
    import errno
    import os

    from host_runtime.errors import ResourceLimitError
    from host_runtime.popef import reader

    path = tmp_path / "big.popef"
    _big_file(path)
    real = reader._copy_range
    tried: list[str] = []

    def full_first(src: int, dst: int, size: int) -> int:
        tried.append(os.readlink(f"/proc/self/fd/{dst}"))
        if len(tried) == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(src, dst, size)

    monkeypatch.setattr(reader, "_copy_range", full_first)
    r = popef.Reader()
    r.parseFile(path)
    assert len(r.tensors()) == 1 and len(tried) == 2
    assert tried[0].startswith(str(tmp_path)) and not tried[1].startswith(str(tmp_path))

    def never(src: int, dst: int, size: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(reader, "_copy_range", never)
    with pytest.raises(ResourceLimitError, match=r"no room for the private snapshot of PopEF "
                                                 r"file .*memory \(memfd\): No space left"):
        popef.Reader().parseFile(path)


def test_a_fifo_or_folder_at_the_path_is_refused_at_once(tmp_path) -> None:
    """A FIFO planted where a PopEF file was expected is refused, not waited on for a
    writer forever; a folder likewise."""
    fifo = tmp_path / "model.popef"
    os.mkfifo(fifo)
    for path, kind in ((fifo, "FIFO"), (tmp_path, "folder")):
        with pytest.raises(PopefError, match=f"the path is not a regular file but a {kind}; "
                                             "expected a PopEF file"):
            popef.Reader().parseFile(path)
