"""The model rules (ipu_emulator/validate.py) on crafted PopEF files: valid checksums,
broken semantics. Each is refused when the model is built, with the rule, the program or
anchor and what was found; ``popef_dump`` reports it and exits 1."""

from __future__ import annotations

import pytest

from host_runtime import popef
from host_runtime.errors import ModelRuleError, PopefError
from host_runtime.popef._check import check_model
from tests.crafted import CASES, craft, load_parts
from tools import popef_dump
from tools.generate_simple_popef import write_simple_popef


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    return write_simple_popef(tmp_path_factory.mktemp("rules") / "simple.popef")


def test_the_example_keeps_every_rule(example):
    model = popef.load_model([example])
    check_model(model)   # strict: the executable must decode and keep the rules


@pytest.mark.parametrize("case", sorted(CASES))
def test_crafted_file_is_refused_by_the_builder(case, example, tmp_path):
    edits, rule, words = CASES[case]
    path = craft(example, tmp_path / f"{case}.popef", **edits)
    reader = popef.Reader()
    reader.parseFile(path)   # the file itself is sound: blobs and checksums
    with pytest.raises(ModelRuleError) as info:
        popef.ModelBuilder(reader).createModel()
    msg = str(info.value)
    assert info.value.rule == rule, msg
    assert f"rule {rule}" in msg
    for w in words:
        assert w in msg, (w, msg)
    assert str(path) in msg and "'simple_model'" in msg


@pytest.mark.parametrize("case", ["repeat_zero", "no_output_anchor", "main_names_missing_program"])
def test_popef_dump_reports_the_rule_and_exits_1(case, example, tmp_path, capsys):
    edits, rule, _ = CASES[case]
    path = craft(example, tmp_path / f"{case}.popef", **edits)
    assert popef_dump.main([str(path)]) == 1
    out, err = capsys.readouterr()
    assert f"FAILED: model 'simple_model' is inconsistent: rule {rule}" in out
    assert f"rule {rule}" in err and "Model check: ok" not in out


def test_a_model_object_is_checked_strictly(example, tmp_path):
    """A Model built in memory around a foreign executable is refused by the runtime
    (ModelBuilder leaves non-emulator executables to it)."""
    model, _ = load_parts(example)
    bad = popef.Model(model.metadata, popef.ExecutableBlob("simple_model", b"\0" * 400),
                      model.tensors)
    with pytest.raises(PopefError, match="cannot be decoded: bad magic"):
        check_model(bad)


def test_no_metadata_names_the_file_once(tmp_path):
    path = tmp_path / "weights.popef"
    with popef.Writer(path) as w:
        w.writeTensorData("weights", b"\0" * 16)
    with pytest.raises(PopefError) as info:
        popef.load_model([path])
    assert f"no metadata blob in {str(path)!r}" in str(info.value)
    assert '"' not in str(info.value)


# -- the IPU process's checks (ipu_emulator.validate.check_loop / check_loaded_streams) --

from ipu_emulator.validate import RuleError, check_loaded_streams, check_loop  # noqa: E402

_CONNECTED = ["tensor_A", "tensor_B", "tensor_C", "weights", "weights_saved"]


@pytest.mark.parametrize("case, words", [
    ("repeat_zero", "rule repeat-count: program 1 has a Repeat of count 0"),
    ("streams_input_twice", "streams 'tensor_A' in 2 times per iteration"),
    ("streams_output_twice", "streams 'tensor_C' out 2 times per iteration"),
    ("streams_out_before_execute", "rule stream-order"),
    ("empty_main", "rule main-empty"),
])
def test_device_refuses_the_main_loop(case, words, example, tmp_path, monkeypatch):
    monkeypatch.setattr("host_runtime.popef._check._check_rules", lambda *a, **k: None)
    edits, _, _ = CASES[case]
    _, exe = load_parts(craft(example, tmp_path / f"{case}.popef", **edits))
    with pytest.raises(RuleError, match=words.replace("[", r"\[").replace("]", r"\]")):
        check_loop(exe, [1], _CONNECTED)


def test_device_refuses_a_loop_over_unconnected_streams(example):
    _, exe = load_parts(example)
    check_loop(exe, [1], _CONNECTED)
    with pytest.raises(RuleError, match=r"streams \['tensor_C'\], which the host did not "
                                        "connect"):
        check_loop(exe, [1], [h for h in _CONNECTED if h != "tensor_C"])
    with pytest.raises(RuleError, match="streams nothing out"):
        check_loop(exe, [0], _CONNECTED)   # a Load program as a main loop


def test_device_refuses_streams_no_program_transfers(example, tmp_path, monkeypatch):
    monkeypatch.setattr("host_runtime.popef._check._check_rules", lambda *a, **k: None)
    _, exe = load_parts(example)
    check_loaded_streams(exe, [("tensor_A", "in"), ("tensor_C", "out")])
    with pytest.raises(RuleError, match="out stream 'tensor_A', which is never streamed out"):
        check_loaded_streams(exe, [("tensor_A", "out")])
    # a stream the executable does not declare is another IPU's (multi-IPU devices)
    check_loaded_streams(exe, [("nope", "in")])


def _fused(tmp_path):
    import onnx

    from host_runtime.poprt.compiler import compile
    from ipu_emulator.compiler import ModelSpec
    from tools.generate_simple_popef import build_simple_model
    onnx.save(build_simple_model((1, 4)), str(tmp_path / "m0.onnx"))
    onnx.save(build_simple_model((2, 3), seed=1), str(tmp_path / "m1.onnx"))
    out = compile([ModelSpec(tmp_path / "m0.onnx"), ModelSpec(tmp_path / "m1.onnx")],
                  tmp_path / "fused", fuse=True)
    return out.popef_path


def test_a_fused_model_keeps_the_rules(tmp_path):
    check_model(popef.load_model([_fused(tmp_path)]))


def test_fused_branches_must_stream_their_own_subgraph(tmp_path):
    """Switch branches swapped: each branch streams the other sub-graph's anchors."""
    import dataclasses

    from ipu_emulator.executable import Program, Repeat, Switch
    path = _fused(tmp_path)

    def swap(progs):
        rep = progs[1].body[0]
        sw = rep.body[1]
        assert isinstance(rep, Repeat) and isinstance(sw, Switch)
        new = dataclasses.replace(sw, branches=tuple(reversed(sw.branches)))
        return [progs[0], Program("main", (Repeat(rep.count, (rep.body[0], new)),)), progs[2]]
    bad = craft(path, tmp_path / "swapped.popef", programs=swap)
    with pytest.raises(ModelRuleError) as info:
        popef.load_model([bad])
    msg = str(info.value)
    assert info.value.rule == "stream-count"
    assert "branch 0 of the switch on 'index' streams ['graph1/" in msg
    assert "sub-graph graph0 of the metadata has the Main anchors ['graph0/" in msg


def test_stream_order_concerns_computed_tensors_only(example):
    """A token or forwarded input streamed out before any Execute is fine; a computed
    output streamed out before its Execute is not."""
    from ipu_emulator.executable import Program, Repeat, StreamIn, StreamOut
    _, exe = load_parts(example)
    rep = exe.programs[1].body[0]
    fwd = Program("main", (Repeat(1, (StreamIn("tensor_A", "tensor_A"),
                                      StreamOut("tensor_A", "tensor_C"),)),))
    exe.programs[1] = fwd
    check_loop(exe, [1], _CONNECTED)   # tensor_A is not computed: forwarded as it is
    exe.programs[1] = Program("main", (Repeat(1, (rep.body[0], rep.body[1], rep.body[3],
                                                  rep.body[2])),))
    with pytest.raises(RuleError, match="rule stream-order"):
        check_loop(exe, [1], _CONNECTED)


def test_the_host_decodes_programs_without_the_graphs(example):
    from ipu_emulator.executable import Executable
    model, full = load_parts(example)
    light = Executable.from_bytes(model.executable.payload(), graphs=False)
    assert light.programs == full.programs and light.streams == full.streams
    assert [g.model for g in light.graphs] == [b""] and full.graphs[0].model


def test_the_builder_leaves_an_undecodable_executable_to_the_runtime(example):
    model, _ = load_parts(example)
    bad = popef.Model(model.metadata, popef.ExecutableBlob("simple_model", b"IPUEMUX\0"),
                      model.tensors)
    check_model(bad, strict=False)   # PopEF as a format: the file is sound
    with pytest.raises(PopefError, match="cannot be decoded: executable is 8 bytes"):
        check_model(bad)
