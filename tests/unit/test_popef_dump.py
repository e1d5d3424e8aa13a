"""popef_dump: human tables and --json, on files written in the test."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from host_runtime import popef
from tests.unit.test_popef_roundtrip import write_sample
from tools.popef_dump import main


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _row(out: str, first: str) -> list[str]:
    for line in out.splitlines():
        cells = line.split()
        if cells and cells[0] == first:
            return cells
    raise AssertionError(f"no row starting with {first!r} in:\n{out}")


def test_human_dump(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "m.popef"
    write_sample(path)
    rc, out, err = _run(capsys, str(path))
    assert rc == 0 and err == ""
    assert f"PopEF file {path} ({path.stat().st_size} bytes, 5 blobs)" in out
    # Blob table: type, name, offset, checksum, compressed.
    assert re.search(r"0\s+metadata\s+simple_exe\s+16\s+\d+\s+\d+\s+0x[0-9a-f]{8}\s+ok\s+no",
                     out)
    assert re.search(r"1\s+executable\s+simple_exe\s+\d+\s+\d+\s+\d+\s+0x[0-9a-f]{8}\s+ok\s+"
                     r"yes \(1050 bytes\)", out)
    assert re.search(r"3\s+feed data\s+tensor_B", out)
    assert re.search(r"4\s+opaque\s+app/notes", out)
    # Metadata and options.
    assert re.search(r"replication factor\s+2\n", out)
    assert re.search(r"device iterations\s+3\n", out)
    assert re.search(r"engine\s+opt\.a\s+1\n", out)
    assert re.search(r"device\s+dev\s+z\n", out)
    # Anchors: name, handle, type, shape, dtype, bytes, per-replica, programs, tensor data.
    assert _row(out, "weights") == ["weights", "h_w", "INPUT", "[1,", "4]", "F32", "16", "no",
                                    "0", "(load)", "yes"]
    assert _row(out, "tensor_C") == ["tensor_C", "h_C", "OUTPUT", "[1,", "4]", "F32", "16",
                                     "yes", "1", "(main)", "no"]
    assert _row(out, "tensor_B")[-2:] == ["feed", "x3"]
    assert "none (not a fused model)" in out
    # Program flow.
    flow = out[out.index("Program flow"):]
    assert re.search(r"load\s+0\n\s+main\s+1\n\s+save\s+2\n", flow)
    assert out.rstrip().endswith("Model check: ok")
    # Columns are aligned: every anchor row starts its dtype at the same column.
    anchor_lines = [ln for ln in out.splitlines() if " F32 " in ln]
    assert len(anchor_lines) == 5 and len({ln.index(" F32 ") for ln in anchor_lines}) == 1


def test_json_dump(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "m.popef"
    write_sample(path)
    rc, out, _ = _run(capsys, str(path), "--json")
    assert rc == 0
    d = json.loads(out)
    assert [b["type"] for b in d["blobs"]] == ["metadata", "executable", "tensor data",
                                                "feed data", "opaque"]
    assert d["blobs"][0]["offset"] == 16 and all(b["checksum_ok"] for b in d["blobs"])
    assert d["blobs"][1]["compressed"] and d["blobs"][1]["decompressed_size"] == 1050
    assert d["blobs"][3]["transfers"] == 3
    assert d["metadata"]["executable"] == "simple_exe"
    assert d["metadata"]["engineOptions"] == {"opt.a": "1", "target.x": "yes"}
    w = next(a for a in d["anchors"] if a["name"] == "weights")
    assert w == {"name": "weights", "handle": "h_w", "type": "INPUT", "shape": [1, 4],
                 "dtype": "F32", "sizeInBytes": 16, "isPerReplica": False, "programs": [0],
                 "tensorData": True, "feedTransfers": 0}
    assert d["programFlow"] == {"load": [0], "main": [1], "save": [2]}
    assert d["model_check"] == {"ok": True, "error": None}


def _fused(path: Path) -> None:
    f32, f16 = popef.DataType.F32, popef.DataType.F16
    IN, OUT = popef.TensorType.INPUT, popef.TensorType.OUTPUT
    anchors = [
        popef.Anchor("index", "idx", popef.TensorInfo(popef.DataType.S32, [1]), False, IN, [1]),
        popef.Anchor("graph0/X", "g0x", popef.TensorInfo(f32, [1, 2]), False, IN, [1]),
        popef.Anchor("graph0/Y", "g0y", popef.TensorInfo(f32, [1, 2]), False, IN, [1]),
        popef.Anchor("graph0/O", "g0o", popef.TensorInfo(f32, [2]), False, OUT, [1]),
        popef.Anchor("graph1/X", "g1x", popef.TensorInfo(f16, [1, 1]), False, IN, [1]),
        popef.Anchor("graph1/O", "g1o", popef.TensorInfo(f16, [1, 3]), False, OUT, [1]),
    ]
    md = popef.Metadata(anchors=anchors, program_flow=popef.ProgramFlow([0], [1], []),
                        executable="fused", subgraphs={
                            "graph0": ["graph0/X", "graph0/Y", "graph0/O"],
                            "graph1": ["graph1/X", "graph1/O"]})
    with popef.Writer(path) as w:
        w.writeMetadata(md)
        w.writeExecutable("fused", b"exe")


def test_fused_model_sub_graphs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "fused.popef"
    _fused(path)
    rc, out, _ = _run(capsys, str(path))
    assert rc == 0
    sub = out[out.index("Sub-graphs"):out.index("Program flow")]
    assert re.search(r"graph0\s+graph0/X, graph0/Y, graph0/O\n", sub)
    assert re.search(r"graph1\s+graph1/X, graph1/O\n", sub)
    assert re.search(r"\(all\)\s+index\n", sub)
    assert _row(out, "graph1/O")[:6] == ["graph1/O", "g1o", "OUTPUT", "[1,", "3]", "F16"]
    assert re.search(r"save\s+-\n", out)
    rc, out, _ = _run(capsys, str(path), "--json")
    assert json.loads(out)["subgraphs"] == {"graph0": ["graph0/X", "graph0/Y", "graph0/O"],
                                           "graph1": ["graph1/X", "graph1/O"]}


def test_several_files_are_one_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    full = tmp_path / "full.popef"
    write_sample(full)
    model = popef.load_model(full)
    meta, data = tmp_path / "meta.popef", tmp_path / "data.popef"
    with popef.Writer(meta) as w:
        w.writeMetadata(model.metadata)
        w.writeExecutableBlob(model.executable)
    with popef.Writer(data) as w:
        w.writeTensorData("weights", model.tensors[0].data)
    rc, out, _ = _run(capsys, str(meta), str(data))
    assert rc == 0
    assert re.search(r"data\.popef\s+0\s+tensor data\s+weights\s+16", out)
    assert _row(out, "weights")[-1] == "yes"
    # The metadata file alone is readable but not a complete model: exit 1.
    rc, out, err = _run(capsys, str(data))
    assert rc == 1
    assert "Metadata: none" in out
    assert "popef_dump: the files do not form a model: no metadata blob" in err


def test_errors_are_one_line_and_exit_2(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "m.popef"
    write_sample(path)
    data = bytearray(path.read_bytes())
    data[-33] ^= 1   # the last payload byte (before the 32-byte end record)
    bad = tmp_path / "bad.popef"
    bad.write_bytes(bytes(data))
    rc, out, err = _run(capsys, str(bad))
    assert rc == 2 and out == ""
    assert err.count("\n") == 1
    assert err.startswith("popef_dump: error: payload checksum mismatch")
    assert str(bad) in err and "opaque 'app/notes'" in err
    rc, out, err = _run(capsys, str(tmp_path / "missing.popef"))
    assert rc == 2 and "cannot open PopEF file" in err and err.count("\n") == 1


def test_files_that_disagree_exit_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "m.popef"
    write_sample(path)
    other = tmp_path / "o.popef"
    with popef.Writer(other) as w:
        w.writeTensorData("weights", np.zeros(4, np.float32))
    rc, out, err = _run(capsys, str(path), str(other))
    assert rc == 1
    assert "Model check: FAILED: two tensor data blobs named 'weights' disagree" in out
    assert "two tensor data blobs named 'weights' disagree" in err


def test_dump_of_the_seeds_example_model(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    gen = pytest.importorskip("tools.generate_simple_popef",
                              reason="the compiler part's example generator is not there yet")
    path = tmp_path / "simple.popef"
    gen.write_simple_popef(path)
    rc, out, err = _run(capsys, str(path))
    assert rc == 0 and err == ""
    for name, kind in (("tensor_A", "INPUT"), ("tensor_B", "INPUT"), ("weights", "INPUT"),
                       ("tensor_C", "OUTPUT")):
        row = _row(out, name)
        assert row[2] == kind and row[3:6] == ["[1,", "4]", "F32"] and row[6] == "16", row
    assert _row(out, "weights")[-1] == "yes"
    assert _row(out, "tensor_A")[-1] == "no"
    assert re.search(r"\d+\s+tensor data\s+weights\s+\d+\s+\d+\s+16\s", out)
    rc, out, _ = _run(capsys, str(path), "--json")
    d = json.loads(out)
    flow = d["programFlow"]
    assert flow["load"] and flow["main"]
    w = next(a for a in d["anchors"] if a["name"] == "weights")
    assert w["tensorData"] and set(w["programs"]) <= set(flow["load"])
    c = next(a for a in d["anchors"] if a["name"] == "tensor_C")
    assert set(c["programs"]) <= set(flow["main"])
    model = popef.load_model(path)
    td = model.tensorData("weights")
    assert td is not None and len(td.data) == 16


def test_control_characters_in_names_are_escaped(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    info = popef.TensorInfo(popef.DataType.U8, [3])
    md = popef.Metadata(anchors=[
        popef.Anchor("evil\n\x1b[2Jname", "h1", info, False, popef.TensorType.INPUT, [0]),
        popef.Anchor("naïve", "h2", info, False, popef.TensorType.OUTPUT, [0])],
        program_flow=popef.ProgramFlow([], [0], []), executable="e")
    path = tmp_path / "odd.popef"
    with popef.Writer(path) as w:
        w.writeMetadata(md)
        w.writeExecutable("e", b"")
    rc, out, _ = _run(capsys, str(path))
    assert rc == 0
    assert "\x1b" not in out
    assert _row(out, "evil\\n\\x1b[2Jname")[:3] == ["evil\\n\\x1b[2Jname", "h1", "INPUT"]
    assert _row(out, "naïve")[:3] == ["naïve", "h2", "OUTPUT"]
    assert json.loads(main_json(capsys, path))["anchors"][0]["name"] == "evil\n\x1b[2Jname"


def main_json(capsys: pytest.CaptureFixture[str], path: Path) -> str:
    assert main([str(path), "--json"]) == 0
    return capsys.readouterr().out
