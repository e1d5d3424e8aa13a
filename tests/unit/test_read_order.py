"""``main_read_order``: the order the Main programs read their inputs (no processes)."""

from __future__ import annotations

import dataclasses

import onnx

from host_runtime import popef
from host_runtime.runner._read_order import main_read_order
from tests.models import SEED_FUSION_CONFIG, seed_model0, seed_model1
from tools.generate_simple_popef import write_simple_popef


def test_program_order_not_anchor_order(tmp_path):
    path = tmp_path / "m.popef"
    write_simple_popef(path, shape=(4, 3))
    model = popef.load_model([str(path)])
    assert main_read_order(model) == ["tensor_A", "tensor_B"]     # weights: load program only
    anchors = model.metadata.anchors()
    model.metadata._anchors = (anchors[1], anchors[0], *anchors[2:])
    assert [a.name() for a in model.metadata.anchors()][:2] == ["tensor_B", "tensor_A"]
    assert main_read_order(model) == ["tensor_A", "tensor_B"]


def test_fused_model_reads_index_first_then_each_branch(tmp_path):
    from tools.poprt import main as poprt_main

    onnx.save(seed_model0(), str(tmp_path / "model0.onnx"))
    onnx.save(seed_model1(), str(tmp_path / "model1.onnx"))
    (tmp_path / "config.yaml").write_text(SEED_FUSION_CONFIG)
    assert poprt_main(["--config_yaml", str(tmp_path / "config.yaml")]) == 0
    model = popef.load_model([str(tmp_path / "executable.popef")])
    assert main_read_order(model) == ["index", "graph0/X", "graph0/Y", "graph1/X"]


def test_undecodable_executable_falls_back_to_the_anchors(tmp_path):
    path = tmp_path / "m.popef"
    write_simple_popef(path, shape=(1, 4))
    model = popef.load_model([str(path)])
    broken = dataclasses.replace(model.executable, data=b"not an executable")
    model = dataclasses.replace(model, executable=broken)
    assert main_read_order(model) == ["tensor_A", "tensor_B"]
