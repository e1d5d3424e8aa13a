"""What one IPU of a sharded model passes to others reaches every reader, every time:
a tensor streamed to two places, and a weight one IPU's Load program forwards to another.

PopRT's manual sharding of ResNet or BERT cuts through residual connections: a tensor
made on one IPU is read on the next IPU and again one further (a skip link), or is
also a model output. Its IPU then streams that tensor out twice, through the copy
path, in the same iteration as a zero-copy input served by the fused C step. Every
output of an iteration carries the iteration's number, whichever way its inputs were
read; many requests in flight fill the IPU-Links, so the C step serves most
iterations. Each result is compared with onnxruntime in this process.
"""

from __future__ import annotations

import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import host_runtime as model_runtime
from host_runtime.poprt.compiler import compile as poprt_compile

pytestmark = pytest.mark.usefixtures("private_machine")

SHAPE = (1, 4)
IN_FLIGHT = 16


def _model(kind: str) -> onnx.ModelProto:
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array(rng.standard_normal(SHAPE).astype(np.float32), f"w{k}")
             for k in range(3)]
    if kind == "skip":     # s0 (IPU 0) read by IPU 1 and again by IPU 2
        nodes = [helper.make_node("Mul", ["x", "w0"], ["s0"], name="p0"),
                 helper.make_node("Mul", ["s0", "w1"], ["s1"], name="p1"),
                 helper.make_node("Add", ["s1", "s0"], ["s2"], name="p2"),
                 helper.make_node("Mul", ["s2", "w2"], ["y"], name="tail")]
    else:                  # s0 (IPU 0) read by IPU 1 and a model output
        nodes = [helper.make_node("Mul", ["x", "w0"], ["s0"], name="p0"),
                 helper.make_node("Mul", ["s0", "w1"], ["s1"], name="p1"),
                 helper.make_node("Add", ["s1", "w2"], ["y"], name="p2")]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(SHAPE))]
    if kind == "output":
        outputs.append(helper.make_tensor_value_info("s0", TensorProto.FLOAT, list(SHAPE)))
    g = helper.make_graph(nodes, kind, [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, list(SHAPE))], outputs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


@pytest.fixture(scope="module", params=[("skip", False), ("skip", True), ("output", False),
                                        ("output", True)],
                ids=["skip-sharded", "skip-pipelined", "output-sharded", "output-pipelined"])
def case(request, tmp_path_factory) -> tuple[onnx.ModelProto, str, int]:
    kind, pipelined = request.param
    model = _model(kind)
    shard = {"p0": 0, "p1": 1, "p2": 2} if kind == "skip" else {"p0": 0, "p2": 1}
    ipus = 4 if kind == "skip" else 2
    out = poprt_compile(model, tmp_path_factory.mktemp(kind), num_ipus=ipus,
                        sharding_info=shard, pipelining_info=shard if pipelined else None,
                        enable_pipelining=pipelined, batches_per_step=ipus if pipelined else 1)
    return model, str(out.popef_path), ipus


def test_every_result_of_many_in_flight_is_right(case) -> None:
    import onnxruntime as ort

    model, path, _ = case
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in model.graph.output]
    rng = np.random.default_rng(5)
    with model_runtime.ModelRunner(path) as runner:
        for _ in range(3):   # rounds: the IPU-Links fill and drain each time
            xs = [rng.standard_normal(SHAPE).astype(np.float32) for _ in range(IN_FLIGHT)]
            futures = [runner.executeAsync({"x": x}) for x in xs]
            for k, (x, fut) in enumerate(zip(xs, futures)):
                got = fut.result(timeout=60)
                for name, want in zip(names, ref.run(None, {"x": x})):
                    np.testing.assert_allclose(got[name], want, rtol=1e-6, atol=1e-6,
                                               err_msg=f"request {k}, output {name!r}")


def test_a_weight_forwarded_by_a_load_program_reaches_the_other_ipu(tmp_path, monkeypatch) -> None:
    """One weight read on both IPUs, as PopEF tensor data: IPU 0's Load program streams it
    to IPU 1's over an IPU-Link. A runner sends the Load programs' RUN and Main's LOOP
    together; the LOOP must not empty the links while the RUN is under way. Here each
    LOOP waits until IPU 0 has forwarded the weight, so an emptying would drop it (IPU 1's
    Load program would wait for it for ever)."""
    import onnxruntime as ort

    from host_runtime.devices._ipu_group import GroupLink
    from ipu_emulator.ipu_protocol import Op

    rng = np.random.default_rng(8)
    w = numpy_helper.from_array(rng.standard_normal((4, 4)).astype(np.float32), "W")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm0"),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("MatMul", ["r", "W"], ["y"], name="mm1")]
    g = helper.make_graph(nodes, "tied", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [2, 4])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, [2, 4])], [w])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    out = poprt_compile(model, tmp_path, num_ipus=2, sharding_info={"relu": 0},
                        weights_as_tensor_data=True)
    request = GroupLink.request
    forwarded = []

    def loop_after_the_weight_left(self, op, body=None, value=0, last=False):
        if op is Op.LOOP and self.reset_links is not None:
            links = self.reset_links.__self__.links
            ring = next(r for h, r in links.items() if h.endswith("/W"))
            deadline = time.monotonic() + 10
            while ring.counters()["published"] < 1 and time.monotonic() < deadline:
                pass   # (bounded) IPU 0's Load program streams it out now
            forwarded.append(ring.counters()["published"])
        return request(self, op, body, value, last)

    monkeypatch.setattr(GroupLink, "request", loop_after_the_weight_left)
    monkeypatch.setenv("IPU_EMULATOR_HOST_SYNC_TIMEOUT", "5")
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for k in range(3):
        x = rng.standard_normal((2, 4)).astype(np.float32)
        with model_runtime.ModelRunner(str(out.popef_path)) as runner:
            got = runner.execute({"x": x})["y"]
        np.testing.assert_allclose(got, ref.run(None, {"x": x})[0], rtol=1e-6, atol=1e-6,
                                   err_msg=f"runner {k}")
    assert forwarded == [1, 1, 1]


@pytest.mark.parametrize("pipelined", [False, True], ids=["sharded", "pipelined"])
def test_an_output_of_an_ipu_that_reads_no_input(tmp_path, pipelined) -> None:
    """IPU 0 computes a position table from weights alone (a model output, also sent to
    IPU 1, which reads ``x``): its transfers carry no request's number, and are taken as
    such; every result is right."""
    import onnxruntime as ort

    rng = np.random.default_rng(9)
    inits = [numpy_helper.from_array(rng.standard_normal(SHAPE).astype(np.float32), n)
             for n in ("pe", "scale", "w")]
    nodes = [helper.make_node("Mul", ["pe", "scale"], ["pos"], name="p0"),
             helper.make_node("Add", ["x", "pos"], ["h"], name="add"),
             helper.make_node("Mul", ["h", "w"], ["y"], name="mm")]
    g = helper.make_graph(nodes, "inputless", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, list(SHAPE))], [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, list(SHAPE)),
            helper.make_tensor_value_info("pos", TensorProto.FLOAT, list(SHAPE))], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    shard = {"p0": 0}
    out = poprt_compile(model, tmp_path, num_ipus=2, sharding_info=shard,
                        pipelining_info=shard if pipelined else None,
                        enable_pipelining=pipelined, batches_per_step=2 if pipelined else 1)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    with model_runtime.ModelRunner(str(out.popef_path)) as runner:
        for _ in range(2):
            xs = [rng.standard_normal(SHAPE).astype(np.float32) for _ in range(IN_FLIGHT)]
            futures = [runner.executeAsync({"x": x}) for x in xs]
            for k, (x, fut) in enumerate(zip(xs, futures)):
                got = fut.result(timeout=60)
                want = dict(zip(["y", "pos"], ref.run(None, {"x": x})))
                for name in ("y", "pos"):
                    np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-6,
                                               err_msg=f"request {k}, output {name!r}")
        np.testing.assert_allclose(runner.execute({"x": xs[0]})["pos"], want["pos"])


@pytest.mark.parametrize("point", ["mm", "if"])
def test_a_branch_reads_what_another_ipu_made_and_a_weight_of_its_own(tmp_path, point) -> None:
    """An ``If`` whose branches read ``h`` from the scope around them (made on IPU 0 when
    the cut is after ``mm``) and a weight only a branch uses: both reach the IPU of the
    ``If``; results as onnxruntime's, both branches taken."""
    import onnxruntime as ort

    rng = np.random.default_rng(10)
    f = TensorProto.FLOAT

    def branch(name: str, op: str) -> onnx.GraphProto:
        node = (helper.make_node("Mul", ["h", "wt"], [name + "_out"]) if op == "Mul"
                else helper.make_node("Neg", ["h"], [name + "_out"]))
        return helper.make_graph([node], name, [], [helper.make_tensor_value_info(
            name + "_out", f, list(SHAPE))])
    nodes = [helper.make_node("ReduceSum", ["x"], ["tot"], name="tot", keepdims=0),
             helper.make_node("Greater", ["tot", "thr"], ["cond"], name="cond"),
             helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("If", ["cond"], ["br"], name="if",
                              then_branch=branch("then", "Mul"),
                              else_branch=branch("else", "Neg")),
             helper.make_node("Add", ["br", "h"], ["y"], name="out")]
    inits = [numpy_helper.from_array(rng.standard_normal((4, 4)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(SHAPE).astype(np.float32), "wt"),
             numpy_helper.from_array(np.array(0.0, np.float32), "thr")]
    g = helper.make_graph(nodes, "captures", [helper.make_tensor_value_info(
        "x", f, list(SHAPE))], [helper.make_tensor_value_info("y", f, list(SHAPE))], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    out = poprt_compile(model, tmp_path, num_ipus=2, sharding_info={point: 0})
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    signs = set()
    with model_runtime.ModelRunner(str(out.popef_path)) as runner:
        for k in range(8):
            x = (rng.standard_normal(SHAPE) * 2).astype(np.float32)
            signs.add(bool(x.sum() > 0))
            np.testing.assert_allclose(runner.execute({"x": x})["y"],
                                       ref.run(None, {"x": x})[0], rtol=1e-5, atol=1e-5,
                                       err_msg=f"request {k}")
    assert signs == {True, False}
