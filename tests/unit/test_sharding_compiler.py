"""Manual sharding and pipelining in the compiler (ipu_emulator.compiler._sharding).

Placement (PopRT's rule), the checks and their messages, the multi-IPU executable
(one part per IPU, links between them), the placement recorded on the written ONNX
model, the poprt command line and popef_dump. No IPU processes here.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from host_runtime import popef
from host_runtime.poprt.compiler import compile as poprt_compile
from host_runtime.poprt.compiler import load_config_yaml
from ipu_emulator.compiler import CompileOptions, ModelSpec, compile_onnx
from ipu_emulator.compiler._sharding import (IPU_ATTR, LINK_PREFIX, STAGE_ATTR, SYNC_TENSOR,
                                             parse_link, place_nodes)
from ipu_emulator.errors import CompileError
from ipu_emulator.executable import Executable, Execute, Repeat, StreamIn, StreamOut
from ipu_emulator.ipu.interpreter import CallableStreamIO, Interpreter
from tools._chain_model import chain_model, reference, shard_config, write_shard_yaml

LAYERS = 8


@pytest.fixture(scope="module")
def chain():
    return chain_model(LAYERS, width=16, batch=2)


def compile_chain(chain, ipus, pipelined=False, bps=1, **kw):
    shard, stages = shard_config(LAYERS, ipus, pipelined)
    opts = CompileOptions(num_ipus=ipus, sharding_info=shard, pipelining_info=stages or None,
                          enable_pipelining=pipelined, device_iterations=bps, machine_ipus=4,
                          **kw)
    return compile_onnx(ModelSpec(chain), opts)


def placement_of(model):
    return {n.name: ({a.name: a.i for a in n.attribute}[IPU_ATTR],
                     {a.name: a.i for a in n.attribute}[STAGE_ATTR]) for n in model.graph.node}


# -- placement ---------------------------------------------------------------------------

def test_points_walk_towards_inputs_and_the_rest_goes_to_the_last_ipu(chain):
    plan = place_nodes(chain.graph, {"relu1": 0, "relu3": 1, "relu5": 2}, {}, 4, False)
    names = [n.name for n in chain.graph.node]
    where = dict(zip(names, plan.ipu))
    assert [where[f"mm{k}"] for k in range(LAYERS)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert where["relu7"] == 3                       # reached by no point: the last IPU
    assert plan.order == [0, 1, 2, 3]
    assert set(plan.stage) == {0}                    # no pipelining: one stage


def test_pipelining_stages_default_to_the_ipu(chain):
    plan = place_nodes(chain.graph, {"relu3": 0, "relu7": 1}, {}, 2, True)
    assert plan.num_stages == 2
    assert plan.stage == plan.ipu


def test_compiled_placement_is_recorded_on_the_written_model(chain, tmp_path):
    yaml_path = write_shard_yaml(tmp_path / "shard.yaml", LAYERS, 4, pipelined=True)
    out = poprt_compile(chain, tmp_path, output_model="m.onnx", num_ipus=4,
                        manual_sharding_config=yaml_path, enable_pipelining=True,
                        batches_per_step=4)
    written = onnx.load(str(out.output_model_path))
    where = placement_of(written)
    assert where["mm0"] == (0, 0) and where["relu1"] == (0, 0)
    assert where["mm2"] == (1, 1) and where["relu5"] == (2, 2) and where["relu7"] == (3, 3)
    md = popef.load_model([str(out.popef_path)]).metadata
    assert md.numIpus() == 4


# -- the executable ---------------------------------------------------------------------------

def test_multi_ipu_executable_holds_one_part_per_ipu_with_links(chain):
    res = compile_chain(chain, 2)
    exe = Executable.from_bytes(res.executable.to_bytes())
    assert exe.num_ipus == 2 and len(exe.parts) == 2
    p0, p1 = exe.parts
    assert "x" in p0.streams and "y" not in p0.streams
    assert "y" in p1.streams and "x" not in p1.streams
    links = [h for h in p0.streams if h.startswith(LINK_PREFIX)]
    assert f"{LINK_PREFIX}0/1/r3" in links
    assert parse_link(f"{LINK_PREFIX}0/1/r3") == (0, 1, "r3")
    assert p0.streams[f"{LINK_PREFIX}0/1/r3"].direction == "out"
    assert p1.streams[f"{LINK_PREFIX}0/1/r3"].direction == "in"
    # sharding without pipelining: the last IPU hands a token back each iteration
    assert p1.streams[f"{LINK_PREFIX}1/0/{SYNC_TENSOR}"].direction == "out"
    # the host's view names every anchor
    assert set(exe.streams) == {"x", "y"}
    assert [a.name for a in res.anchors] == ["x", "y"]


def test_pipelined_parts_have_no_sync_token(chain):
    res = compile_chain(chain, 4, pipelined=True, bps=4)
    for part in res.executable.parts:
        assert not any(SYNC_TENSOR in h for h in part.streams)
    summary = json.loads(res.executable.attributes["sharding"])
    assert summary["pipelining"] is True and summary["num_stages"] == 4
    assert [i["stages"] for i in summary["ipus"]] == [[0], [1], [2], [3]]


def run_parts_in_order(exe, x):
    """Run each IPU's part in data-flow order in this process, links as dict queues."""
    links: dict[str, list[bytes]] = {}
    result = {}
    for part in exe.parts:
        inputs = {}
        outputs = {}
        for h, s in part.streams.items():
            if s.direction == "in":
                if h == "x":
                    inputs[h] = lambda dest: dest.cast("B").__setitem__(slice(None),
                                                                       x.tobytes())
                else:
                    inputs[h] = (lambda h: lambda dest: dest.cast("B").__setitem__(
                        slice(None), links.setdefault(h, [b"\0"]).pop(0)))(h)
            else:
                if h == "y":
                    outputs[h] = lambda src: result.__setitem__("y", bytes(src))
                else:
                    outputs[h] = (lambda h: lambda src: links.setdefault(h, []).append(
                        bytes(src)))(h)
        with Interpreter(part, bytearray(max(64, part.memory_bytes))) as interp:
            interp.run_program(1, CallableStreamIO(inputs=inputs, outputs=outputs))
    return np.frombuffer(result["y"], np.float32).reshape(x.shape)


@pytest.mark.parametrize("ipus", [2, 4])
def test_parts_compute_the_unsharded_model(chain, ipus):
    res = compile_chain(chain, ipus)
    x = np.random.default_rng(3).standard_normal((2, 16)).astype(np.float32)
    np.testing.assert_allclose(run_parts_in_order(res.executable, x), reference(chain, x),
                               rtol=1e-5, atol=1e-6)


def test_part_programs_stream_then_execute_then_stream(chain):
    part = compile_chain(chain, 2, pipelined=True, bps=2).executable.parts[1]
    (rep,) = part.programs[1].body
    assert isinstance(rep, Repeat) and rep.count == 2
    kinds = [type(i) for i in rep.body]
    assert kinds == [StreamIn, Execute, StreamOut]


# -- checks -----------------------------------------------------------------------------------

def test_num_ipus_must_be_a_power_of_two(chain):
    with pytest.raises(CompileError, match=r"num_ipus must be a power of two .* got 3"):
        compile_onnx(ModelSpec(chain), CompileOptions(num_ipus=3, sharding_info={"relu1": 0},
                                                      machine_ipus=4))


def test_num_ipus_the_machine_does_not_have(chain):
    with pytest.raises(CompileError, match=r"num_ipus 8 is more than the 4 IPUs of this machine"):
        compile_onnx(ModelSpec(chain), CompileOptions(num_ipus=8, sharding_info={"relu1": 0},
                                                      machine_ipus=4))


def test_ipu_number_out_of_range(chain):
    with pytest.raises(CompileError, match=r"node 'relu3' on IPU 2, but num_ipus is 2"):
        compile_onnx(ModelSpec(chain), CompileOptions(
            num_ipus=2, sharding_info={"relu1": 0, "relu3": 2}, machine_ipus=4))


def test_unknown_node_name(chain):
    with pytest.raises(CompileError, match=r"\['nope'\] are not node names"):
        compile_onnx(ModelSpec(chain), CompileOptions(
            num_ipus=2, sharding_info={"nope": 0}, machine_ipus=4))


def test_stages_must_be_ordered_along_the_graph(chain):
    with pytest.raises(CompileError, match=r"stages are not ordered along the graph: tensor 'r1' "
                                           r"flows from node 'relu1' \(stage 1\)"):
        compile_onnx(ModelSpec(chain), CompileOptions(
            num_ipus=2, sharding_info={"relu1": 0, "relu7": 1},
            pipelining_info={"relu1": 1, "relu7": 0}, enable_pipelining=True,
            device_iterations=2, machine_ipus=4))


def test_batches_per_step_multiple_of_stages(chain):
    with pytest.raises(CompileError, match=r"batches_per_step must be a multiple of the number "
                                           r"of pipeline stages \(4\); got 6"):
        compile_chain(chain, 4, pipelined=True, bps=6)


# -- IPUs that hold no node: idle ------------------------------------------------------------

THREE_OF_FOUR = {"relu1": 0, "relu3": 1, "relu7": 2}


def test_the_rest_goes_to_the_next_ipu_and_stage_as_poprt_documents(chain):
    """PopRT: the nodes no point reaches get the highest IPU named + 1 and the highest
    stage named + 1 (so three points on IPUs 0..2 and a tail make 4 stages on 4 IPUs)."""
    points = {"relu1": 0, "relu3": 1, "relu5": 2}
    plan = place_nodes(chain.graph, points, points, 4, True)
    where = dict(zip([n.name for n in chain.graph.node], zip(plan.ipu, plan.stage)))
    assert [where[f"relu{k}"] for k in range(LAYERS)] == [
        (0, 0), (0, 0), (1, 1), (1, 1), (2, 2), (2, 2), (3, 3), (3, 3)]
    assert plan.num_stages == 4 and plan.idle == []
    # points on IPUs 0 and 1 only: the rest on IPU 2, IPU 3 idle
    plan = place_nodes(chain.graph, {"relu1": 0, "relu3": 1}, {}, 4, False)
    assert sorted(set(plan.ipu)) == [0, 1, 2] and plan.idle == [3] and plan.order == [0, 1, 2]
    # no IPU above the highest named: the rest stays on the last IPU and stage
    points = {"relu1": 0, "relu3": 1}
    plan = place_nodes(chain.graph, points, points, 2, True)
    assert plan.ipu[-1] == 1 and plan.stage[-1] == 1 and plan.num_stages == 2


@pytest.mark.parametrize("pipelined", [False, True], ids=["sharded", "pipelined"])
def test_an_ipu_with_no_node_is_an_idle_part(chain, pipelined):
    res = compile_onnx(ModelSpec(chain), CompileOptions(
        num_ipus=4, sharding_info=THREE_OF_FOUR,
        pipelining_info=THREE_OF_FOUR if pipelined else None, enable_pipelining=pipelined,
        device_iterations=3 if pipelined else 1, machine_ipus=4))
    exe = Executable.from_bytes(res.executable.to_bytes())
    assert exe.num_ipus == 4 and [p.idle for p in exe.parts] == [False, False, False, True]
    idle = exe.parts[3]
    assert (idle.graphs, idle.streams, idle.tensors, [p.body for p in idle.programs]) == (
        [], {}, {}, [(), (), ()])
    # no IPU sends the idle one anything (links nor sharding token), nor waits for it
    for part in exe.parts[:3]:
        assert not any(h.startswith(LINK_PREFIX) and 3 in parse_link(h)[:2]
                       for h in part.streams)
    sync = {h for p in exe.parts for h in p.streams if SYNC_TENSOR in h}
    assert sync == (set() if pipelined else {f"{LINK_PREFIX}2/0/{SYNC_TENSOR}"})
    summary = json.loads(exe.attributes["sharding"])
    assert summary["idle"] == [3] and summary["order"] == [0, 1, 2]
    assert summary["num_stages"] == (3 if pipelined else 1)
    x = np.random.default_rng(5).standard_normal((2, 16)).astype(np.float32)
    np.testing.assert_allclose(run_parts_in_order(exe, x), reference(chain, x),
                               rtol=1e-5, atol=1e-6)
    assert {ipu for ipu, _stage in placement_of(res.output_model).values()} == {0, 1, 2}


def test_the_idle_mark_is_kept_strict(chain):
    """Only a part with nothing in it may be idle, not every part, and a part not marked
    idle still needs a Main program that streams out (on the host and on the IPU)."""
    from dataclasses import replace

    from ipu_emulator.executable import ExecutableError, Program
    from ipu_emulator.validate import FlowSpec, RuleError, check_loop, check_model

    exe = compile_onnx(ModelSpec(chain), CompileOptions(
        num_ipus=4, sharding_info=THREE_OF_FOUR, machine_ipus=4)).executable
    busy, idle = exe.parts[0], exe.parts[3]
    marked = replace(busy, attributes={**busy.attributes, "idle": "1"})
    with pytest.raises(ExecutableError, match=r"IPU 0's part is marked idle but has graphs, "
                                              r"streams, device tensors, instructions"):
        replace(exe, parts=[marked] + exe.parts[1:]).validate()
    with pytest.raises(ExecutableError, match=r"all 4 IPU parts are marked idle"):
        replace(exe, parts=[idle] * 4).validate()
    unmarked = replace(idle, attributes={})
    flow = FlowSpec((0,), (1,), (2,))
    with pytest.raises(RuleError, match=r"rule main-empty: IPU 3's part has no instructions "
                                        r"in Main program 1, and is not marked idle"):
        check_model(replace(exe, parts=exe.parts[:3] + [unmarked]), [], flow)
    silent = replace(busy, programs=[busy.programs[0], Program("main", (
        Repeat(1, tuple(i for i in busy.programs[1].body[0].body
                        if not isinstance(i, StreamOut))),)), busy.programs[2]])
    with pytest.raises(RuleError, match=r"rule main-empty: IPU 0's part: Main program 1 has an "
                                        r"iteration that streams nothing out"):
        check_model(replace(exe, parts=[silent] + exe.parts[1:]), [], flow)
    with pytest.raises(RuleError, match="rule main-empty"):
        check_loop(idle, [1])          # an IPU process never runs an empty Main


def test_model_bigger_than_one_ipu_compiles_only_sharded(chain):
    # 8 weights of 16x16 F32 (1 KiB each): give one IPU 6 KiB
    with pytest.raises(CompileError, match=r"does not fit the device memory of 1 .*shard it "
                                           r"over several IPUs \(--num_ipus N "
                                           r"--manual_sharding_config"):
        compile_onnx(ModelSpec(chain), CompileOptions(ipu_memory=6 * 1024))
    res = compile_chain(chain, 2, ipu_memory=6 * 1024)
    assert all(p.required_bytes <= 6 * 1024 for p in res.executable.parts)
    with pytest.raises(CompileError, match=r"IPU 0's part of model .* but one ipu21 IPU has "
                                           r"2048 bytes"):
        compile_chain(chain, 2, ipu_memory=2048)


def test_sharding_yaml_errors(chain, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("sharding_info: {relu1: -1}\n")
    with pytest.raises(CompileError, match=r"sharding_info: 'relu1': -1 must be a node name and "
                                           r"an integer >= 0"):
        poprt_compile(chain, tmp_path, export_popef=False, num_ipus=2,
                      manual_sharding_config=bad)
    bad.write_text("sharding: {}\n")
    with pytest.raises(CompileError, match=r"unknown keys \['sharding'\]"):
        poprt_compile(chain, tmp_path, export_popef=False, num_ipus=2,
                      manual_sharding_config=bad)


def test_poprt_list_form_of_shard_yaml(chain, tmp_path):
    """PopRT's shard.yaml: a list of node/device/stage items."""
    from ipu_emulator.compiler import load_sharding_yaml

    path = tmp_path / "shard.yaml"
    path.write_text("-\n  node: relu1\n  device: 0\n  stage: 0\n-\n  node: relu3\n  device: 1\n"
                    "  stage: 1\n-\n  node: relu7\n  device: 2\n  stage: 2\n")
    assert load_sharding_yaml(path) == ({"relu1": 0, "relu3": 1, "relu7": 2},
                                        {"relu1": 0, "relu3": 1, "relu7": 2})
    out = poprt_compile(chain, tmp_path, export_popef=False, output_model="m.onnx", num_ipus=4,
                        manual_sharding_config=path, enable_pipelining=True, batches_per_step=3)
    assert [p.idle for p in out.result.executable.parts] == [False, False, False, True]
    for text, message in [
            ("- {node: relu1, ipu: 0}\n", r"item 0: unknown keys \['ipu'\]; expected node, "
                                          r"device and stage"),
            ("- relu1\n", r"item 0 must be a mapping with a node name \(node\)"),
            ("- {node: relu1}\n", r"item 0: node 'relu1' has neither device nor stage"),
            ("- {node: relu1, device: 0}\n- {node: relu1, device: 1}\n",
             r"item 1: node 'relu1' is named twice"),
            ("- {node: relu1, device: -1}\n", r"device: 'relu1': -1 must be a node name and an "
                                              r"integer >= 0"),
            ("7\n", r"must be a list of node/device/stage items or a mapping with "
                    r"sharding_info and pipelining_info, got int")]:
        path.write_text(text)
        with pytest.raises(CompileError, match=message):
            load_sharding_yaml(path)


def test_fusion_config_reaches_sharding(chain, tmp_path):
    onnx.save(chain, str(tmp_path / "m.onnx"))
    sh, st = shard_config(LAYERS, 2, True)
    (tmp_path / "cfg.yaml").write_text(
        "model_fusion:\n  - input_model: m.onnx\nexport_popef: true\nnum_ipus: 2\n"
        f"enable_pipelining: true\nbatches_per_step: 2\nsharding_info: {json.dumps(sh)}\n"
        f"pipelining_info: {json.dumps(st)}\n")
    cfg = load_config_yaml(tmp_path / "cfg.yaml")
    out = poprt_compile(cfg.models, cfg.output_dir, **cfg.options)
    exe = out.result.executable
    assert exe.num_ipus == 2 and len(exe.parts) == 2 and not out.result.fused


# -- command line and dump -----------------------------------------------------------------

def test_poprt_command_line_and_popef_dump(chain, tmp_path, capsys):
    from tools import popef_dump, poprt

    onnx.save(chain, str(tmp_path / "m.onnx"))
    write_shard_yaml(tmp_path / "shard.yaml", LAYERS, 2, pipelined=True)
    rc = poprt.main(["--input_model", str(tmp_path / "m.onnx"), "--num_ipus", "2",
                     "--manual_sharding_config", str(tmp_path / "shard.yaml"),
                     "--enable_pipelining", "--batches_per_step", "2", "--export_popef",
                     "--output_dir", str(tmp_path / "out"), "--output_model", "sharded.onnx"])
    assert rc == 0
    assert "sharded over 2 IPUs (pipelined)" in capsys.readouterr().out
    where = placement_of(onnx.load(str(tmp_path / "out" / "sharded.onnx")))
    assert where["relu3"] == (0, 0) and where["mm4"] == (1, 1)
    assert popef_dump.main([str(tmp_path / "out" / "executable.popef")]) == 0
    text = capsys.readouterr().out
    assert "IPUs                2" in text
    assert "Sharding (pipelined, 2 stages) over 2 IPUs" in text
    assert "ipu 0  stage 0  8 nodes" in text and "ipu 1  stage 1  8 nodes" in text
    assert "r3 -> ipu 1" in text and "r3 <- ipu 0" in text

    rc = poprt.main(["--input_model", str(tmp_path / "m.onnx"), "--num_ipus", "2",
                     "--manual_sharding_config", str(tmp_path / "shard.yaml"),
                     "--enable_pipelining", "--batches_per_step", "3", "--export_popef",
                     "--output_dir", str(tmp_path / "out2")])
    assert rc == 2   # every poprt failure: one error line, exit 2
    assert "batches_per_step must be a multiple" in capsys.readouterr().err


def test_max_tensor_size_applies_to_sharded_models(chain):
    with pytest.raises(CompileError, match=r"more than max_tensor_size of 100 bytes"):
        compile_chain(chain, 2, max_tensor_size=100)


def test_a_damaged_part_is_refused_with_its_ipu():
    import zlib

    from ipu_emulator.executable import HEADER_SIZE, ExecutableError

    res = compile_chain(chain_model(LAYERS, width=16, batch=2), 2)
    data = bytearray(res.executable.to_bytes())
    part1 = res.executable.parts[1].to_bytes()
    at = bytes(data).rindex(part1)
    data[at + 20] ^= 0xFF                    # inside IPU 1's part header
    body = bytes(data[HEADER_SIZE:])
    import struct
    # fix the outer body checksum so that the damage is found in the part itself
    from ipu_emulator.executable import _header as ex
    head = bytearray(data[:HEADER_SIZE - 4])
    fields = list(ex._HEADER.unpack(bytes(head)))
    fields[14] = zlib.crc32(body)
    head = bytearray(ex._HEADER.pack(*fields))
    data[:HEADER_SIZE] = head + struct.pack("<I", zlib.crc32(bytes(head)))
    with pytest.raises(ExecutableError, match=r"\$\.parts\[1\]: IPU 1's part: "):
        Executable.from_bytes(bytes(data))


def test_one_ipu_with_a_sharding_config_is_an_ordinary_executable(chain):
    res = compile_onnx(ModelSpec(chain), CompileOptions(
        num_ipus=1, sharding_info={"relu3": 0, "relu7": 0}, machine_ipus=4))
    assert res.executable.num_ipus == 1 and not res.executable.parts
    assert set(placement_of(res.output_model).values()) == {(0, 0)}
    with pytest.raises(CompileError, match=r"node 'relu7' on IPU 1, but num_ipus is 1"):
        compile_onnx(ModelSpec(chain), CompileOptions(
            num_ipus=1, sharding_info={"relu7": 1}, machine_ipus=4))


def test_unnumbered_outputs_are_those_of_ipus_no_numbered_input_reaches():
    from ipu_emulator.executable import Execute, Program, Repeat, StreamIn, StreamOut
    from ipu_emulator.validate import unnumbered_outputs

    def part(reads, writes):
        body = tuple([StreamIn(h, h) for h in reads] + [Execute(0, (), ())]
                     + [StreamOut(h, h) for h in writes])
        return [Program("load", ()), Program("main", (Repeat(1, body),))]

    sync = "__ipulink/2/0/__ipusync"
    parts = [part([sync], ["__ipulink/0/1/a", "p"]),            # weights only
             part(["__ipulink/0/1/a", "x"], ["__ipulink/1/2/b"]),   # reads x
             part(["__ipulink/1/2/b"], ["y", sync])]               # numbered through b
    assert unnumbered_outputs(parts, {"x"}) == {"p"}
    assert unnumbered_outputs(parts, set()) == {"p", "y"}
    assert unnumbered_outputs(parts, {"x", "z"}) == {"p"}
    # the token carries no number: an IPU reached only through it is unnumbered
    assert unnumbered_outputs([part([sync], ["p"]), part(["x"], [sync])], {"x"}) == {"p"}
