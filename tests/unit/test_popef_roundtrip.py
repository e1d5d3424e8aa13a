"""PopEF round trips: write every kind of blob, read it back, compare every field."""

from __future__ import annotations

import io
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from host_runtime import popef
from host_runtime.errors import BadRequestError, InvalidStateError, PopefError

F32 = popef.DataType.F32


def sample_metadata(executable: str = "simple_exe", shape: tuple[int, ...] = (1, 4),
                    subgraphs: dict[str, list[str]] | None = None) -> popef.Metadata:
    """The seeds' example model: A, B inputs, weights (Load), C output."""
    info = popef.TensorInfo(F32, shape)
    anchors = [
        popef.Anchor("tensor_A", "h_A", info, False, popef.TensorType.INPUT, [1]),
        popef.Anchor("tensor_B", "h_B", info, False, popef.TensorType.INPUT, [1]),
        popef.Anchor("weights", "h_w", info, False, popef.TensorType.INPUT, [0]),
        popef.Anchor("tensor_C", "h_C", info, True, popef.TensorType.OUTPUT, [1]),
        popef.Anchor("weights_saved", "h_ws", info, False, popef.TensorType.OUTPUT, [2]),
    ]
    return popef.Metadata(
        anchors=anchors, program_flow=popef.ProgramFlow([0], [1], [2]),
        replication_factor=2, num_ipus=2, ipu_version=21, executable=executable,
        is_inference=True, device_iterations=3,
        engine_options={"opt.a": "1", "target.x": "yes"},
        device_options={"dev": "z"}, subgraphs=subgraphs or {})


def weights(shape: tuple[int, ...] = (1, 4)) -> np.ndarray:
    return np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) + 0.5


EXE = b"\x00emulator-executable\x01" * 50


def write_sample(target, *, compress: bool = True, extra: bool = True) -> popef.Metadata:
    md = sample_metadata()
    with popef.Writer(target) as w:
        w.writeMetadata(md)
        w.writeExecutable(md.executable(), EXE, compress=compress)
        w.writeTensorData("weights", weights())
        if extra:
            w.writeFeedData("tensor_B", np.ones((3, 1, 4), np.float32), num_transfers=3)
            w.writeOpaque("app/notes", b"\xffopaque bytes\x00")
    return md


def test_round_trip_every_field(tmp_path: Path) -> None:
    path = tmp_path / "m.popef"
    md = write_sample(path)
    r = popef.Reader()
    r.parseFile(path)

    [got_md] = r.metadata()
    assert got_md == md
    a = got_md.anchor("tensor_C")
    assert a is not None
    assert (a.name(), a.handle(), a.type(), a.isPerReplica(), a.programs()) == (
        "tensor_C", "h_C", popef.TensorType.OUTPUT, True, [1])
    assert a.tensorInfo().shape() == [1, 4]
    assert a.tensorInfo().dataType() is F32
    assert a.tensorInfo().sizeInBytes() == 16
    assert got_md.programFlow().load() == [0]
    assert got_md.programFlow().main() == [1]
    assert got_md.programFlow().save() == [2]
    assert (got_md.replicationFactor(), got_md.numIpus(), got_md.ipuVersion(),
            got_md.deviceIterations(), got_md.isInference()) == (2, 2, 21, 3, True)
    assert got_md.engineOptions() == {"opt.a": "1", "target.x": "yes"}
    assert got_md.deviceOptions() == {"dev": "z"}

    [(_, exe)] = [e for e in r.entries() if isinstance(e[1], popef.ExecutableBlob)]
    assert exe.name() == "simple_exe" and exe.compressed
    assert exe.data == zlib.compress(EXE, 6)
    assert exe.payload() == EXE
    [exe_reader] = r.executables()     # the real module's shape
    assert (exe_reader.name, exe_reader.isCompressed, exe_reader.executable()) == (
        "simple_exe", True, EXE)

    [t] = r.tensors()
    assert t.info.name() == "weights" and t.info.tensorInfo() == popef.TensorInfo(F32, [1, 4])
    np.testing.assert_array_equal(t.data(), weights())

    [fd] = r.feeds()
    assert (fd.info.name(), fd.numTransfers, fd.data().tobytes()) == (
        "tensor_B", 3, np.ones((3, 1, 4), np.float32).tobytes())
    assert fd.data().shape == (3, 1, 4)

    [o] = r.opaqueBlobs()
    assert (o.name, o.data(), o.executable) == ("app/notes", b"\xffopaque bytes\x00",
                                                "simple_exe")

    types = [b.type for b in r.blobs()]
    assert types == [popef.BlobType.METADATA, popef.BlobType.EXECUTABLE,
                     popef.BlobType.TENSOR_DATA, popef.BlobType.FEED_DATA, popef.BlobType.OPAQUE]
    assert r.blobs()[0].offset == 16
    assert all(b.path == str(path) for b in r.blobs())


def test_uncompressed_executable_and_stream_variants(tmp_path: Path) -> None:
    buf = io.BytesIO()
    write_sample(buf, compress=False)
    data = buf.getvalue()
    for source in (data, bytearray(data), memoryview(data), io.BytesIO(data)):
        r = popef.Reader()
        r.parseStream(source, name="mem")
        [exe] = r.executables()
        assert not exe.isCompressed and exe.executable() == EXE
        assert r.blobs()[0].path == "mem"


def test_parse_stream_from_the_middle_of_a_stream() -> None:
    buf = io.BytesIO()
    buf.write(b"junk-prefix")
    write_sample(buf)
    buf.seek(len(b"junk-prefix"))
    r = popef.Reader()
    r.parseStream(buf)
    assert r.blobs()[0].offset == 16
    assert len(r.blobs()) == 5


def test_model_builder_seed_spelling(tmp_path: Path) -> None:
    path = tmp_path / "m.popef"
    md = write_sample(path)
    reader = popef.Reader()
    reader.parseFile(str(path))
    model = popef.ModelBuilder(reader).createModel()
    assert model.metadata == md
    assert model.executable.payload() == EXE
    td = model.tensorData("weights")
    assert td is not None and td.data == weights().tobytes()
    tensor_b_anchor = popef.Anchor()
    for anchor in model.metadata.anchors():
        if anchor.name() == "tensor_B":
            tensor_b_anchor = anchor
    info = tensor_b_anchor.tensorInfo()
    arr = np.random.randn(*info.shape()).astype(info.numpyDType())
    assert arr.dtype == np.float32 and arr.shape == (1, 4)
    assert popef.load_model([path]) == model
    assert popef.load_model(path) == model


def test_save_model_round_trip(tmp_path: Path) -> None:
    src = tmp_path / "a.popef"
    write_sample(src)
    model = popef.load_model(src)
    dst = tmp_path / "b.popef"
    popef.save_model(model, dst)
    assert popef.load_model(dst) == model


def test_every_data_type_round_trips(tmp_path: Path) -> None:
    supported = [d for d in popef.DataType if d not in (popef.DataType.F8143,
                                                         popef.DataType.F8152,
                                                         popef.DataType.F8)]
    anchors = [popef.Anchor(f"t_{d.value}", f"h{i}", popef.TensorInfo(d, [2, 3]), False,
                            popef.TensorType.INPUT, [0]) for i, d in enumerate(supported)]
    md = popef.Metadata(anchors=anchors, program_flow=popef.ProgramFlow([0], [], []),
                        executable="e", ipu_version=2)
    path = tmp_path / "t.popef"
    with popef.Writer(path) as w:
        w.writeMetadata(md)
        w.writeExecutable("e", b"x")
        for d in supported:
            w.writeTensorData(f"t_{d.value}", np.zeros((2, 3), d.numpyDType()))
    model = popef.load_model(path)
    assert model.metadata == md
    for d in supported:
        a = model.metadata.anchor(f"t_{d.value}")
        assert a is not None and a.tensorInfo().numpyDType() == d.numpyDType()


def test_fp8_is_refused_by_writer_with_clear_message(tmp_path: Path) -> None:
    md = popef.Metadata(anchors=[popef.Anchor("x", "x", popef.TensorInfo(popef.DataType.F8143,
                                                                          [4]))],
                        executable="e")
    with popef.Writer(tmp_path / "f.popef") as w:
        with pytest.raises(BadRequestError, match=r"F8143 is an FP8 type.*not support"):
            w.writeMetadata(md)


def test_writer_rejects_bad_input_and_use_after_close(tmp_path: Path) -> None:
    w = popef.Writer(tmp_path / "x.popef")
    with pytest.raises(BadRequestError, match="num_transfers"):
        w.writeFeedData("a", b"1234", num_transfers=0)
    with pytest.raises(BadRequestError, match="not a whole number of 3 transfers"):
        w.writeFeedData("a", b"1234", num_transfers=3)
    with pytest.raises(BadRequestError, match="bytes-like or a numpy array, got int"):
        w.writeOpaque("o", 5)
    with pytest.raises(BadRequestError, match="non-empty"):
        w.writeTensorData("", b"")
    with pytest.raises(BadRequestError, match="executable: expected a non-empty string"):
        w.writeMetadata(popef.Metadata(executable=""))
    w.close()
    w.close()
    assert w.closed
    with pytest.raises(InvalidStateError, match="closed"):
        w.writeOpaque("o", b"")


def test_missing_file_is_popef_error(tmp_path: Path) -> None:
    r = popef.Reader()
    with pytest.raises(PopefError, match=r"cannot open PopEF file.*nope\.popef"):
        r.parseFile(tmp_path / "nope.popef")


def test_public_surface() -> None:
    assert sorted(popef.__all__) == sorted([
        "Anchor", "BlobInfo", "BlobType", "DataType", "ExecutableBlob", "FeedData",
        "Metadata", "Model", "ModelBuilder", "Opaque", "ProgramFlow", "Reader", "TensorData",
        "TensorInfo", "TensorType", "Writer", "load_model", "save_model",
        # Graphcore's popef module's names (host_runtime.popef.blobs, model.Option)
        "BlobWriter", "ExecutableReader", "FeedDataInfo", "FeedReader", "OpaqueReader",
        "Option", "TensorDataInfo", "TensorReader", "numpyDTypeToPopefType",
        "popefTypeToNumpyDType"])
    for name in popef.__all__:
        assert getattr(popef, name) is not None


def test_writer_accepts_buffers_and_non_contiguous_arrays() -> None:
    arr = np.arange(12, dtype=np.float64).reshape(3, 4)[:, ::2]
    buf = io.BytesIO()
    with popef.Writer(buf) as w:
        w.writeOpaque("strided", arr)
        w.writeOpaque("scalar", np.float32(3))
        w.writeOpaque("empty", np.zeros((0, 3), np.int16))
        w.writeOpaque("bytearray", bytearray(b"xy"))
        w.writeOpaque("bools", np.array([True, False]))
        w.writeOpaque("f16", np.array([[1.5, 2.0]], np.float16))
    r = popef.Reader()
    r.parseStream(buf.getvalue())
    got = {o.name: o.data() for o in r.opaqueBlobs()}
    assert got == {"strided": arr.tobytes(), "scalar": np.float32(3).tobytes(), "empty": b"",
                   "bytearray": b"xy", "bools": b"\x01\x00",
                   "f16": np.array([[1.5, 2.0]], np.float16).tobytes()}
    with pytest.raises(BadRequestError, match="numpy objects"):
        popef.Writer(io.BytesIO()).writeOpaque("o", np.array([object()]))


_names = st.text(st.characters(min_codepoint=33, max_codepoint=0x2FFF), min_size=1,
                 max_size=12)
_supported = [d for d in popef.DataType if d not in (popef.DataType.F8143,
                                                     popef.DataType.F8152, popef.DataType.F8)]


@st.composite
def _metadata(draw: st.DrawFn) -> popef.Metadata:
    names = draw(st.lists(_names, min_size=0, max_size=6, unique=True))
    progs = st.lists(st.integers(0, 9), max_size=3)
    anchors = [popef.Anchor(n, f"h/{n}",
                            popef.TensorInfo(draw(st.sampled_from(_supported)),
                                             draw(st.lists(st.integers(0, 7), max_size=4))),
                            draw(st.booleans()), draw(st.sampled_from(list(popef.TensorType))),
                            draw(progs)) for n in names]
    subgraphs = {}
    if names and draw(st.booleans()):
        subgraphs = {"graph0": names[: len(names) // 2], "graph1": names[len(names) // 2:]}
    md = popef.Metadata(
        anchors=anchors, program_flow=popef.ProgramFlow(draw(progs), draw(progs), draw(progs)),
        replication_factor=draw(st.integers(1, 64)), num_ipus=draw(st.integers(1, 64)),
        ipu_version=draw(st.sampled_from([2, 21])), executable=draw(_names),
        is_inference=draw(st.booleans()), device_iterations=draw(st.integers(1, 10**6)),
        engine_options=draw(st.dictionaries(_names, st.text(max_size=8), max_size=3)),
        device_options=draw(st.dictionaries(_names, st.text(max_size=8), max_size=3)),
        subgraphs=subgraphs)
    md.setIsPOD(draw(st.booleans()))              # Graphcore's popef fields (optional keys)
    md.setNumProcesses(draw(st.integers(1, 64)))
    md.setSeedHandle(draw(st.one_of(st.just(""), _names)))
    return md


@settings(max_examples=150, deadline=None)
@given(_metadata(), st.binary(max_size=300), st.booleans())
def test_hypothesis_metadata_round_trip(md: popef.Metadata, exe: bytes, compress: bool) -> None:
    buf = io.BytesIO()
    with popef.Writer(buf) as w:
        w.writeMetadata(md)
        w.writeExecutable(md.executable(), exe, compress=compress)
    r = popef.Reader()
    r.parseStream(buf.getvalue())
    model = popef.ModelBuilder(r).createModel()
    assert model.metadata == md
    assert model.executable.payload() == exe and model.executable.compressed == compress
