"""Graphcore's ``popef`` Python shapes (host_runtime.popef.blobs) over this project's files.

A file the compiler wrote, copied blob by blob through the real module's blob writers (as
Graphcore's compress_popef tool does), is the same file byte for byte, and popef_dump
shows the same; files written from scratch through the blob writers read back equal; bad
use is refused by name.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from host_runtime import popef
from host_runtime.errors import BadRequestError, InvalidStateError

ROOT = Path(__file__).resolve().parents[2]
F32 = popef.DataType.F32


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example model compiled here, weights as tensor data, executable compressed."""
    import onnx

    from host_runtime.poprt.compiler import compile
    from tools.generate_simple_popef import build_simple_model

    folder = tmp_path_factory.mktemp("compiled")
    onnx.save(build_simple_model((2, 3), seed=3), str(folder / "m.onnx"))
    out = compile(folder / "m.onnx", folder, weights_as_tensor_data=True, compress=True)
    return Path(out.popef_path)


def copy_through_blob_writers(source: Path, dest: Path) -> None:
    """What a program written for the real module does to rewrite a file."""
    reader = popef.Reader()
    reader.parseFile(str(source))
    writer = popef.Writer(str(dest))
    for metadata in reader.metadata():
        writer.writeMetadata(metadata)
    for exe in reader.executables():
        blob = writer.createExecutable(exe.name, exe.isCompressed)
        content = exe.executable()
        blob.write(content, len(content))
    for tensor in reader.tensors():
        blob = writer.createTensorData(tensor.info)
        blob.write(tensor.data().tobytes(), tensor.info.tensorInfo().sizeInBytes())
    for feed in reader.feeds():
        blob = writer.createFeedData(feed.info)
        blob.stream.write(feed.data().tobytes())
    for opaque in reader.opaqueBlobs():
        blob = writer.createOpaqueBlob(opaque.name, opaque.executable)
        data = opaque.data()
        blob.write(data, len(data))
    writer.close()


def dump(path: Path) -> dict:
    done = subprocess.run([sys.executable, "-m", "tools.popef_dump", "--json", str(path)],
                          capture_output=True, text=True, cwd=ROOT, check=True)
    return json.loads(done.stdout)


def test_a_compiled_file_copied_through_blob_writers_is_the_same_file(compiled, tmp_path):
    reader = popef.Reader()
    reader.parseFile(str(compiled))
    [exe] = reader.executables()
    assert exe.isCompressed and exe.name == reader.metadata()[0].executable()
    [weights] = reader.tensors()
    anchor = reader.metadata()[0].anchor(weights.info.name())
    assert anchor is not None and weights.info.tensorInfo() == anchor.tensorInfo()
    assert weights.data().shape == (2, 3) and weights.data().dtype == np.float32

    copy = tmp_path / "copy.popef"
    copy_through_blob_writers(compiled, copy)
    assert copy.read_bytes() == compiled.read_bytes()
    got, want = dump(copy), dump(compiled)
    for d in (got, want):
        for f in d["files"]:
            f.pop("path")
        for b in d["blobs"]:
            b.pop("file")
    assert got == want and got["model_check"]["ok"]


def test_a_file_written_from_scratch_reads_back(tmp_path):
    info = popef.TensorInfo()
    info.setDataType(popef.DataType.S16)
    info.setShape([2, 2])
    anchor = popef.Anchor()
    for setter, value in (("setName", "w"), ("setHandle", "h_w"), ("setTensorInfo", info),
                          ("setIsPerReplica", True), ("setType", popef.TensorType.INPUT),
                          ("setPrograms", [0])):
        getattr(anchor, setter)(value)
    flow = popef.ProgramFlow()
    flow.setLoad([0])
    flow.setMain([1])
    flow.setSave([])
    md = popef.Metadata()
    md.setAnchors([anchor])
    md.setProgramFlow(flow)
    md.setExecutable("exe")
    md.setReplicationFactor(2)
    md.setNumIpus(1)
    md.setIpuVersion(2)
    md.setIsInference(True)
    md.setIsPOD(True)
    md.setNumProcesses(2)
    md.setSeedHandle("seed")
    assert md.programsMap() == {0: "load", 1: "main"}   # none set: named by their roles
    md.setProgramsMap({0: "load_program", 1: "main_program"})
    with pytest.raises(BadRequestError, match=r"setProgramsMap expects a dict of program "
                                              r"index \(int >= 0\) -> name \(str\), got \{'0'"):
        md.setProgramsMap({"0": "load"})
    md.setEngineOptions([popef.Option("opt.a", "1")])
    md.setDeviceOptions({"d": "x"})
    weights = np.arange(4, dtype=np.int16).reshape(2, 2)
    feeds = np.arange(12, dtype=np.int16).reshape(3, 2, 2)
    path = tmp_path / "scratch.popef"
    with popef.Writer(str(path)) as writer:
        writer.writeMetadata(md)
        with writer.createExecutable("exe") as blob:
            blob.write(b"executable bytes" * 3)
        writer.createTensorData(popef.TensorDataInfo("w", info)).write(weights, weights.nbytes)
        feed_info = popef.FeedDataInfo()
        feed_info.setName("w")
        feed_info.setTensorInfo(info)
        feed = writer.createFeedData(feed_info)
        feed.write(feeds[:1])
        feed.stream.write(feeds[1:].tobytes())
        writer.createOpaqueBlob("notes", "exe").write(b"\x00\xffabc", 4)   # first 4 bytes
    reader = popef.Reader()
    reader.parseFile(str(path))
    [got] = reader.metadata()
    assert got == md
    assert (got.isPOD(), got.numProcesses(), got.seedHandle()) == (True, 2, "seed")
    assert got.programsMap() == {0: "load_program", 1: "main_program"}
    assert got.engineOptions() == {"opt.a": "1"} and got.deviceOptions() == {"d": "x"}
    assert reader.executables()[0].executable() == b"executable bytes" * 3
    [t] = reader.tensors()
    assert t.info == popef.TensorDataInfo("w", info)
    np.testing.assert_array_equal(t.data(), weights)
    assert t.getStandaloneDataStream().read() == weights.tobytes()
    [f] = reader.feeds()
    assert f.info == popef.FeedDataInfo("w", info) and f.numTransfers == 3
    np.testing.assert_array_equal(f.data(), feeds)
    [o] = reader.opaqueBlobs()
    assert (o.name, o.executable, o.data()) == ("notes", "exe", b"\x00\xffab")
    # changing what the reader gave changes nothing in it
    got.setReplicationFactor(4)
    assert reader.metadata()[0].replicationFactor() == 2


def test_tensor_data_without_metadata_reads_back_as_bytes(tmp_path):
    path = tmp_path / "weights.popef"
    with popef.Writer(str(path)) as writer:
        blob = writer.createTensorData(popef.TensorDataInfo("w", popef.TensorInfo(F32, [3])))
        blob.write(np.ones(3, np.float32), 12)
    reader = popef.Reader()
    reader.parseFile(str(path))
    [t] = reader.tensors()
    assert t.info.tensorInfo() == popef.TensorInfo(popef.DataType.U8, [12])
    assert t.data().tobytes() == np.ones(3, np.float32).tobytes()


def test_one_blob_writer_is_open_at_a_time(tmp_path):
    path = tmp_path / "two.popef"
    writer = popef.Writer(str(path))
    first = writer.createOpaqueBlob("a", "")
    first.write(b"1")
    second = writer.createOpaqueBlob("b", "")        # closes (writes) the first
    with pytest.raises(InvalidStateError, match="blob writer of opaque 'a' is closed"):
        first.write(b"2")
    second.write(b"22")
    del second                                       # the writer still holds it
    writer.close()
    reader = popef.Reader()
    reader.parseFile(str(path))
    assert [(o.name, o.data()) for o in reader.opaqueBlobs()] == [("a", b"1"), ("b", b"22")]


def test_bad_use_is_refused_by_name(tmp_path):
    info = popef.TensorInfo(F32, [2])
    md = popef.Metadata(anchors=[popef.Anchor("w", "h", info, type=popef.TensorType.INPUT,
                                              programs=[0])],
                        program_flow=popef.ProgramFlow([0], [], []), executable="e")
    with pytest.raises(BadRequestError, match="expects a popef.TensorDataInfo, got str"):
        popef.Writer(str(tmp_path / "a.popef")).createTensorData("w")
    with pytest.raises(BadRequestError, match=r"'w': 4 bytes written, its tensor info "
                       r"TensorInfo\(F32, \[2\]\) holds 8"):
        with popef.Writer(str(tmp_path / "b.popef")) as writer:
            writer.createTensorData(popef.TensorDataInfo("w", info)).write(b"1234")
    assert not (tmp_path / "b.popef").exists()       # a failed blob leaves no file
    with popef.Writer(str(tmp_path / "c.popef")) as writer:
        writer.writeMetadata(md)
        with pytest.raises(BadRequestError, match=r"anchor 'w' has tensor info "
                           r"TensorInfo\(F32, \[3\]\) but the metadata's anchor has "
                           r"TensorInfo\(F32, \[2\]\)"):
            writer.createTensorData(popef.TensorDataInfo("w", popef.TensorInfo(F32, [3])))
        feed = writer.createFeedData(popef.FeedDataInfo("w", info))
        with pytest.raises(BadRequestError, match="write of size 9 but the data holds 8"):
            feed.write(np.zeros(2, np.float32), 9)
        with pytest.raises(BadRequestError, match="got str"):
            feed.write("text")
        feed.write(np.zeros(3, np.float32))
        with pytest.raises(BadRequestError, match="12 bytes written, expected a whole number"):
            feed.close()
    with pytest.raises(BadRequestError, match="has no name"):
        popef.Writer(str(tmp_path / "d.popef")).createFeedData(popef.FeedDataInfo())


def test_dtype_conversions():
    for dt in popef.DataType:
        if dt in (popef.DataType.F8, popef.DataType.F8143, popef.DataType.F8152):
            with pytest.raises(BadRequestError, match="FP8"):
                popef.popefTypeToNumpyDType(dt)
            continue
        np_dtype = popef.popefTypeToNumpyDType(dt)
        assert isinstance(np_dtype, np.dtype)
        assert popef.numpyDTypeToPopefType(np_dtype) is dt
    assert popef.numpyDTypeToPopefType(np.float16) is popef.DataType.F16
    assert popef.numpyDTypeToPopefType("int64") is popef.DataType.S64
    with pytest.raises(BadRequestError, match="complex64 has no PopEF data type"):
        popef.numpyDTypeToPopefType(np.complex64)
