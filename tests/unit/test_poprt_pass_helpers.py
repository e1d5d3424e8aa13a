"""The helpers third-party pass authors import from PopRT's pass modules: the base
classes (``poprt.passes.base_pass``), graph helpers (``onnx_helper.clean_info``,
``get_dtype``, ``get_shape``), ``shape_inference.infer_shapes`` and
``pattern_helper.PatternMatcher``. Written the way a benchmark harness's own packing
pass uses them: find a sub-graph by pattern, rewrite it, clean and re-infer shapes,
then compare the rewritten model with the original on onnxruntime."""

from __future__ import annotations

import importlib

import numpy as np
import numpy.testing as npt
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from host_runtime.errors import BadRequestError
from host_runtime.poprt._check import run_onnxruntime
from tests.models import make_model

F, I64 = TensorProto.FLOAT, TensorProto.INT64


def _mask_model() -> onnx.ModelProto:
    """Two attention-like blocks: out_k = Softmax(x * Cast(Unsqueeze(mask))) per block."""
    nodes, outs = [], []
    for k in (1, 2):
        nodes += [helper.make_node("Unsqueeze", ["mask", "ax"], [f"u{k}"], name=f"Unsq{k}"),
                  helper.make_node("Cast", [f"u{k}"], [f"c{k}"], to=F, name=f"Cast{k}"),
                  helper.make_node("Mul", [f"x{k}", f"c{k}"], [f"m{k}"], name=f"Mul{k}"),
                  helper.make_node("Softmax", [f"m{k}"], [f"out{k}"], axis=-1, name=f"Sm{k}")]
        outs.append(helper.make_tensor_value_info(f"out{k}", F, (2, 1, 4)))
    ins = [helper.make_tensor_value_info("mask", I64, (2, 4))] + [
        helper.make_tensor_value_info(f"x{k}", F, (2, 1, 4)) for k in (1, 2)]
    ax = numpy_helper.from_array(np.array([1], np.int64), "ax")
    return make_model(helper.make_graph(nodes, "masks", ins, outs, [ax]))


def _modules():
    return (importlib.import_module("host_runtime.poprt.passes.base_pass"),
            importlib.import_module("host_runtime.poprt.passes.onnx_helper"),
            importlib.import_module("host_runtime.poprt.passes.pattern_helper"),
            importlib.import_module("host_runtime.poprt.passes.shape_inference"))


def test_pattern_rewrite_clean_and_infer_like_a_harness_pass():
    _, oh, ph, si = _modules()
    model = onnx.shape_inference.infer_shapes(_mask_model())
    assert oh.get_shape(model.graph, "u1") == [2, 1, 4] and oh.get_dtype(model.graph, "c2") == F
    matcher = ph.PatternMatcher(["s:0->Unsqueeze:U->Cast:C->Mul:M->e:5",
                                 "                         Mul:M->Softmax:S"])
    seen = []
    ops = matcher.next_pattern(model.graph)
    for _ in range(5):                      # bounded: two matches, then {}
        if not ops:
            break
        assert model.graph.node[ops["U"].index].name == ops["U"].node.name
        seen.append(ops["M"].node.name)
        # rewrite as the harness does: cast the mask before Unsqueeze, edit in place
        cast = helper.make_node("Cast", [ops["U"].node.input[0]],
                                [ops["U"].node.name + "_f"], to=F, name=ops["U"].node.name + "_f")
        ops["U"].node.input[0] = cast.output[0]
        model.graph.node.insert(ops["U"].index, cast)
        ops = matcher.next_pattern(model.graph)
    assert seen == ["Mul1", "Mul2"] and ops == {}
    cleaned = oh.clean_info(model)
    assert len(model.graph.value_info) > 0 and len(cleaned.graph.value_info) == 0
    assert oh.get_shape(cleaned.graph, "u1") is None and oh.get_dtype(cleaned.graph, "u1") is None
    assert oh.get_shape(cleaned.graph, "mask") == [2, 4]      # inputs keep theirs
    inferred = si.infer_shapes(cleaned)
    assert len(cleaned.graph.value_info) == 0                 # a copy, not in place
    assert oh.get_dtype(inferred.graph, "u1") == F and oh.get_shape(inferred.graph, "u1") == [2, 1, 4]
    assert oh.get_shape(inferred.graph, "ax") == [1] and oh.get_dtype(inferred.graph, "ax") == I64
    rng = np.random.default_rng(3)
    feeds = {"mask": rng.integers(0, 2, (2, 4)).astype(np.int64),
             "x1": rng.standard_normal((2, 1, 4)).astype(np.float32),
             "x2": rng.standard_normal((2, 1, 4)).astype(np.float32)}
    want = run_onnxruntime(_mask_model(), feeds)
    got = run_onnxruntime(inferred, feeds)
    for k in want:
        npt.assert_allclose(got[k], want[k], rtol=1e-6)


def test_pattern_matcher_refuses_malformed_patterns():
    ph = _modules()[2]
    with pytest.raises(BadRequestError, match=r"'Cast' in 's:0->Cast' is not 'OpType:label'"):
        ph.PatternMatcher(["s:0->Cast"])
    with pytest.raises(BadRequestError, match="label 'A' is both 'Cast' and 'Mul'"):
        ph.PatternMatcher(["Cast:A->Softmax:B", "Mul:A->Softmax:B"])
    with pytest.raises(BadRequestError, match="names no node"):
        ph.PatternMatcher(["s:0->e:1"])
    assert ph.PatternMatcher(["Softmax:S->Cast:C"]).next_pattern(_mask_model().graph) == {}


def test_immutable_pass_and_named_subclasses():
    bp = _modules()[0]
    from host_runtime.poprt.passes import Pass, get_pass, register

    @register("test_helpers_strip_outputs")
    class Strip(bp.ImmutablePass):
        def run(self, onnx_model):
            self.logger.info("stripping")
            del onnx_model.graph.output[1:]
            return onnx_model

    model = _mask_model()
    out = get_pass("test_helpers_strip_outputs")(model)
    assert [o.name for o in out.graph.output] == ["out1"]
    assert [o.name for o in model.graph.output] == ["out1", "out2"]   # caller's model kept
    assert get_pass("test_helpers_strip_outputs").logger.name == \
        "poprt.passes.test_helpers_strip_outputs"
    named = bp.get_all_named_subclasses(Pass)
    assert named["test_helpers_strip_outputs"] is Strip
    assert named["final_check"].__module__.endswith("passes.final_check")
    assert issubclass(bp.ImmutablePass, Pass) and bp.Pass is Pass
