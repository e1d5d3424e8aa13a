"""Models onnxruntime runs at fixed input shapes that shape inference alone does not
resolve, or that declare an interface their nodes do not compute (issue 30, item 5).

- ``ocr_direction``: an OCR direction classifier: input batch declared ``-1`` (and stale
  ``-1`` intermediate shapes), a reshape computed from the shape, a softmax head
- ``named_dims``: token ids ``[batch, seq]`` with named dims, an embedding and a mean
- ``control_flow``: ``If`` on a scalar bool input, a ``Loop`` carrying a scalar input,
  a ``Scan`` adding a scalar input to each row
- ``vad_lstm``: a Silero-VAD-like detector: opset 15, ``If`` on the int64 sample rate,
  an ``LSTM`` whose state comes in and goes out
- ``light_runner``: PopRT's light-runner example (``ReduceMean`` declared ``[16, 16]``
  that computes ``[1, 1, 16, 16]``)
- ``pack_runner``: PopRT's pack-runner example (a float ``Mul`` declared FLOAT16)
- ``fusion_model0`` / ``fusion_model1`` / ``dynamic_batch`` / ``matmul_add``: the other
  models PopRT's examples build by script
- ``int8_sub_add``: PopRT's fusion example's int8 ``Sub``/``Add`` at opset 11 (whose
  schemas take int8 from opset 14; onnxruntime refuses it as it is)
- ``tree_classifier``: ``TreeEnsembleClassifier`` whose outputs declare no dims
- ``quantized``: an ``LSTM`` + ``MatMul`` model through onnxruntime's ``quantize_dynamic``
  (``DynamicQuantizeLSTM``, ``DynamicQuantizeLinear``, ``MatMulInteger``)
- ``zipmap_classifier``: ``LinearClassifier`` + ``ZipMap`` (scikit-learn's shape)
- ``string_label_classifier``: ``LinearClassifier`` with string labels + ``ZipMap``
  straight on the input (the whole classifier is the host's tail)
- ``nonzero``: ``NonZero`` of an input, whose shape depends on the data
- ``branch_shapes``: an ``If`` on the sample rate whose branches give different shapes

Each builder returns ``(model, feeds, input_shapes)``.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = ["CASES", "ocr_direction", "named_dims", "control_flow", "vad_lstm", "light_runner",
           "pack_runner", "fusion_model0", "fusion_model1", "dynamic_batch", "matmul_add",
           "tree_classifier", "quantized", "zipmap_classifier", "nonzero", "lstm_matmul",
           "branch_shapes", "int8_sub_add", "string_label_classifier"]

F, F16, I64, B = TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.INT64, TensorProto.BOOL
Case = tuple[onnx.ModelProto, dict[str, np.ndarray], dict[str, list[int]]]


def _model(nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto],
           outputs: list[onnx.ValueInfoProto], inits: list[onnx.TensorProto] = (),  # type: ignore[assignment]
           opset: int = 13, ml: bool = False, value_info: list[onnx.ValueInfoProto] = (),  # type: ignore[assignment]
           ) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits), value_info=list(value_info))
    ops = [helper.make_opsetid("", opset)] + ([helper.make_opsetid("ai.onnx.ml", 3)] if ml else [])
    m = helper.make_model(g, opset_imports=ops)
    m.ir_version = 8
    return m


def _w(rng: np.random.Generator, name: str, shape: tuple[int, ...], scale: float = 0.3
       ) -> onnx.TensorProto:
    return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)


def _i64(name: str, values: list[int] | int) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(values, np.int64), name)


def ocr_direction(seed: int = 0) -> Case:
    rng = np.random.default_rng(seed)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Shape", ["r"], ["s"]),
             helper.make_node("Gather", ["s", "i0"], ["b"], axis=0),
             helper.make_node("Concat", ["b", "m1"], ["ns"], axis=0),
             helper.make_node("Reshape", ["r", "ns"], ["flat"]),
             helper.make_node("MatMul", ["flat", "fc"], ["logits"]),
             helper.make_node("Softmax", ["logits"], ["softmax_0.tmp_0"], axis=-1)]
    inits = [_w(rng, "w", (4, 3, 3, 3)), _i64("i0", [0]), _i64("m1", [-1]),
             _w(rng, "fc", (4 * 4 * 12, 2))]
    x = helper.make_tensor_value_info("x", F, [-1, 3, 8, 24])
    vi = [helper.make_tensor_value_info("c", F, [-1, 4, 4, 12]),
          helper.make_tensor_value_info("flat", F, [-1, -1])]
    m = _model(nodes, [x], [helper.make_tensor_value_info("softmax_0.tmp_0", F, [-1, 2])],
               inits, opset=11, value_info=vi)
    return m, {"x": rng.standard_normal((1, 3, 8, 24)).astype(np.float32)}, {"x": [1, 3, 8, 24]}


def named_dims(seed: int = 0) -> Case:
    rng = np.random.default_rng(seed)
    nodes = [helper.make_node("Gather", ["emb", "ids"], ["e"], axis=0),
             helper.make_node("ReduceMean", ["e"], ["pooled"], axes=[1], keepdims=0),
             helper.make_node("Gemm", ["pooled", "w", "bias"], ["y"])]
    m = _model(nodes, [helper.make_tensor_value_info("ids", I64, ["batch", "seq"])],
               [helper.make_tensor_value_info("y", F, ["batch", 3])],
               [_w(rng, "emb", (10, 6)), _w(rng, "w", (6, 3)), _w(rng, "bias", (3,))])
    return m, {"ids": rng.integers(0, 10, (2, 5)).astype(np.int64)}, {"ids": [2, 5]}


def control_flow(seed: int = 0) -> Case:
    """flag (bool scalar), k (float scalar), x [n, 4] -> y (If), acc (Loop), rows (Scan)."""
    rng = np.random.default_rng(seed)
    then_g = helper.make_graph([helper.make_node("Mul", ["x", "k"], ["t"])], "then", [],
                               [helper.make_tensor_value_info("t", F, None)])
    else_g = helper.make_graph([helper.make_node("Sub", ["x", "k"], ["e"])], "else", [],
                               [helper.make_tensor_value_info("e", F, None)])
    body = helper.make_graph(
        [helper.make_node("Add", ["a_in", "k"], ["a_out"]),
         helper.make_node("Identity", ["c_in"], ["c_out"])], "loop",
        [helper.make_tensor_value_info("i", I64, []), helper.make_tensor_value_info("c_in", B, []),
         helper.make_tensor_value_info("a_in", F, None)],
        [helper.make_tensor_value_info("c_out", B, []), helper.make_tensor_value_info("a_out", F, None)])
    scan_body = helper.make_graph(
        [helper.make_node("Add", ["s_in", "row"], ["s_out"]),
         helper.make_node("Mul", ["row", "k"], ["scaled"])], "scan",
        [helper.make_tensor_value_info("s_in", F, None), helper.make_tensor_value_info("row", F, None)],
        [helper.make_tensor_value_info("s_out", F, None), helper.make_tensor_value_info("scaled", F, None)])
    nodes = [helper.make_node("If", ["flag"], ["y"], then_branch=then_g, else_branch=else_g),
             helper.make_node("Loop", ["trips", "", "x"], ["acc"], body=body),
             helper.make_node("Scan", ["zeros4", "x"], ["total", "rows"], body=scan_body,
                              num_scan_inputs=1)]
    m = _model(nodes, [helper.make_tensor_value_info("x", F, ["n", 4]),
                       helper.make_tensor_value_info("flag", B, []),
                       helper.make_tensor_value_info("k", F, [])],
               [helper.make_tensor_value_info(n, F, None) for n in ("y", "acc", "total", "rows")],
               [_i64("trips", 3), numpy_helper.from_array(np.zeros(4, np.float32), "zeros4")],
               opset=15)
    feeds = {"x": rng.standard_normal((3, 4)).astype(np.float32),
             "flag": np.array(True), "k": np.array(1.5, np.float32)}
    return m, feeds, {"x": [3, 4]}


def vad_lstm(hidden: int = 8, seed: int = 0) -> Case:
    """input [batch, samples], sr (int64 scalar), h, c [1, batch, hidden] -> output
    [batch, 1], hn, cn: 16 kHz frames of 64 samples, other rates 32."""
    rng = np.random.default_rng(seed)

    def branch(name: str, frame: int) -> onnx.GraphProto:
        return helper.make_graph(
            [helper.make_node("Unsqueeze", ["input", "ax1"], [f"{name}_x"]),
             helper.make_node("Conv", [f"{name}_x", f"{name}_w"], [f"{name}_c"], strides=[frame]),
             helper.make_node("Transpose", [f"{name}_c"], [f"{name}_out"], perm=[2, 0, 1])],
            name, [], [helper.make_tensor_value_info(f"{name}_out", F, None)],
            initializer=[_w(rng, f"{name}_w", (4, 1, frame), 0.2)])

    nodes = [helper.make_node("Equal", ["sr", "sr16k"], ["is16k"]),
             helper.make_node("If", ["is16k"], ["frames"], then_branch=branch("k16", 64),
                              else_branch=branch("k8", 32)),             # [T, batch, 4]
             helper.make_node("LSTM", ["frames", "W", "R", "Bias", "", "h", "c"],
                              ["", "hn", "cn"], hidden_size=hidden),
             helper.make_node("Squeeze", ["hn", "ax0"], ["last"]),
             helper.make_node("MatMul", ["last", "head"], ["logit"]),
             helper.make_node("Sigmoid", ["logit"], ["output"])]
    inits = [_i64("sr16k", 16000), _i64("ax0", [0]), _i64("ax1", [1]),
             _w(rng, "W", (1, 4 * hidden, 4)), _w(rng, "R", (1, 4 * hidden, hidden)),
             _w(rng, "Bias", (1, 8 * hidden), 0.1), _w(rng, "head", (hidden, 1))]
    state = [helper.make_tensor_value_info(n, F, [1, "batch", hidden]) for n in ("h", "c")]
    m = _model(nodes, [helper.make_tensor_value_info("input", F, ["batch", "samples"]),
                       helper.make_tensor_value_info("sr", I64, [])] + state,
               [helper.make_tensor_value_info("output", F, None),
                helper.make_tensor_value_info("hn", F, None),
                helper.make_tensor_value_info("cn", F, None)], inits, opset=15)
    feeds = {"input": rng.standard_normal((1, 512)).astype(np.float32),
             "sr": np.array(16000, np.int64),
             "h": (rng.standard_normal((1, 1, hidden)) * 0.1).astype(np.float32),
             "c": (rng.standard_normal((1, 1, hidden)) * 0.1).astype(np.float32)}
    return m, feeds, {"input": [1, 512], "h": [1, 1, hidden], "c": [1, 1, hidden]}


def light_runner(seed: int = 0) -> Case:
    rng = np.random.default_rng(seed)
    nodes = [helper.make_node("Expand", ["input", "shape"], ["Act0"])]
    for i in range(2):
        nodes.append(helper.make_node("MatMul", [f"Act{i}", "Weight"], [f"Act{i + 1}"]))
    nodes.append(helper.make_node("ReduceMean", ["Act2"], ["output"], axes=[0, 1]))
    m = _model(nodes, [helper.make_tensor_value_info("input", F, (16, 16))],
               [helper.make_tensor_value_info("output", F, (16, 16))],
               [_i64("shape", [2, 2, 16, 16]), _w(rng, "Weight", (2, 2, 16, 16), 0.25)],
               opset=11)
    return m, {"input": rng.standard_normal((16, 16)).astype(np.float32)}, {}


def pack_runner(seed: int = 0) -> Case:
    rng = np.random.default_rng(seed)
    ins = [helper.make_tensor_value_info(n, F, [3, 10]) for n in ("attention_mask", "input_ids")]
    m = _model([helper.make_node("Mul", ["input_ids", "attention_mask"], ["output"])], ins,
               [helper.make_tensor_value_info("output", F16, [3, 10])], opset=11)
    feeds = {"attention_mask": (rng.random((3, 10)) > 0.3).astype(np.float32),
             "input_ids": rng.standard_normal((3, 10)).astype(np.float32)}
    return m, feeds, {}


def fusion_model0(seed: int = 0) -> Case:
    rng = np.random.default_rng(seed)
    m = _model([helper.make_node("Add", ["X", "Y"], ["Z"]),
                helper.make_node("Reshape", ["Z", "C"], ["O"])],
               [helper.make_tensor_value_info(n, F, (1, 2)) for n in ("X", "Y")],
               [helper.make_tensor_value_info("O", F, (2,))], [_i64("C", [2])], opset=11)
    return m, {n: rng.standard_normal((1, 2)).astype(np.float32) for n in ("X", "Y")}, {}


def fusion_model1(seed: int = 0) -> Case:
    rng = np.random.default_rng(seed)
    c = numpy_helper.from_array(np.array([[1.5, 2.0]], np.float16), "C")
    m = _model([helper.make_node("Concat", ["X", "C"], ["O"], axis=1)],
               [helper.make_tensor_value_info("X", F16, (1, 1))],
               [helper.make_tensor_value_info("O", F16, (1, 3))], [c], opset=11)
    return m, {"X": rng.standard_normal((1, 1)).astype(np.float16)}, {}


def dynamic_batch(seed: int = 0) -> Case:
    rng = np.random.default_rng(seed)
    m = _model([helper.make_node("Add", ["X", "Y"], ["O"])],
               [helper.make_tensor_value_info(n, F, (4, 2)) for n in ("X", "Y")],
               [helper.make_tensor_value_info("O", F, (4, 2))], opset=11)
    return m, {n: rng.random((4, 2)).astype(np.float32) for n in ("X", "Y")}, {}


def matmul_add(seed: int = 0) -> Case:
    rng = np.random.default_rng(seed)
    m = _model([helper.make_node("MatMul", ["X", "Y"], ["Z"]),
                helper.make_node("Add", ["Z", "A"], ["B"])],
               [helper.make_tensor_value_info("X", F, (2, 2, 4, 8)),
                helper.make_tensor_value_info("Y", F, (2, 2, 8, 4)),
                helper.make_tensor_value_info("A", F, (2, 2, 4, 4))],
               [helper.make_tensor_value_info("B", F, (2, 2, 4, 4))], opset=11)
    feeds = {"X": rng.standard_normal((2, 2, 4, 8)).astype(np.float32),
             "Y": rng.standard_normal((2, 2, 8, 4)).astype(np.float32),
             "A": rng.standard_normal((2, 2, 4, 4)).astype(np.float32)}
    return m, feeds, {}


def int8_sub_add(seed: int = 0) -> Case:
    rng = np.random.default_rng(seed)
    c = numpy_helper.from_array(np.array([3], np.int8), "C")
    m = _model([helper.make_node("Sub", ["X", "C"], ["O"]),
                helper.make_node("Add", ["X", "C"], ["O2"])],
               [helper.make_tensor_value_info("X", TensorProto.INT8, (4,))],
               [helper.make_tensor_value_info(n, TensorProto.INT8, (4,)) for n in ("O", "O2")],
               [c], opset=11)
    x = np.concatenate([[-128, 127], rng.integers(-100, 100, 2)]).astype(np.int8)
    return m, {"X": x}, {}


def tree_classifier(seed: int = 0) -> Case:
    """Two trees over 3 features, classes 0/1/2; outputs declared without dims."""
    rng = np.random.default_rng(seed)
    tree = helper.make_node(
        "TreeEnsembleClassifier", ["X"], ["label", "probabilities"], domain="ai.onnx.ml",
        classlabels_int64s=[0, 1, 2], post_transform="SOFTMAX",
        nodes_treeids=[0, 0, 0, 1, 1, 1], nodes_nodeids=[0, 1, 2, 0, 1, 2],
        nodes_featureids=[0, 0, 0, 2, 0, 0], nodes_values=[0.25, 0, 0, -0.5, 0, 0],
        nodes_modes=["BRANCH_LEQ", "LEAF", "LEAF"] * 2, nodes_truenodeids=[1, 0, 0] * 2,
        nodes_falsenodeids=[2, 0, 0] * 2,
        class_treeids=[0, 0, 0, 0, 1, 1, 1, 1], class_nodeids=[1, 1, 2, 2, 1, 1, 2, 2],
        class_ids=[0, 1, 1, 2, 0, 2, 1, 2],
        class_weights=[0.7, 0.3, 0.4, 0.6, 0.5, 0.5, 0.8, 0.2])
    label = helper.make_tensor_value_info("label", I64, None)
    probs = helper.make_tensor_value_info("probabilities", F, None)
    m = _model([tree], [helper.make_tensor_value_info("X", F, [None, 3])], [label, probs], ml=True)
    return m, {"X": rng.standard_normal((5, 3)).astype(np.float32)}, {"X": [5, 3]}


def lstm_matmul(hidden: int = 8, features: int = 6, seed: int = 0) -> onnx.ModelProto:
    """The float model ``quantized`` starts from."""
    rng = np.random.default_rng(seed)
    nodes = [helper.make_node("LSTM", ["x", "W", "R", "B", "", "h0", "c0"], ["Y", "hn", "cn"],
                              hidden_size=hidden),
             helper.make_node("Squeeze", ["Y", "ax"], ["Ys"]),
             helper.make_node("MatMul", ["Ys", "W2"], ["out"])]
    inits = [_w(rng, "W", (1, 4 * hidden, features)), _w(rng, "R", (1, 4 * hidden, hidden)),
             _w(rng, "B", (1, 8 * hidden), 0.1), _w(rng, "W2", (hidden, 4)), _i64("ax", [1])]
    state = [helper.make_tensor_value_info(n, F, [1, "N", hidden]) for n in ("h0", "c0")]
    outs = [helper.make_tensor_value_info("out", F, ["T", "N", 4])] + \
        [helper.make_tensor_value_info(n, F, [1, "N", hidden]) for n in ("hn", "cn")]
    return _model(nodes, [helper.make_tensor_value_info("x", F, ["T", "N", features])] + state,
                  outs, inits)


def quantized(seed: int = 0) -> Case:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as d:
        src, dst = os.path.join(d, "f.onnx"), os.path.join(d, "q.onnx")
        onnx.save(lstm_matmul(seed=seed), src)
        quantize_dynamic(src, dst, weight_type=QuantType.QInt8,
                         op_types_to_quantize=["LSTM", "MatMul"])
        m = onnx.load(dst)
    feeds = {"x": rng.standard_normal((5, 1, 6)).astype(np.float32),
             "h0": (rng.standard_normal((1, 1, 8)) * 0.1).astype(np.float32),
             "c0": (rng.standard_normal((1, 1, 8)) * 0.1).astype(np.float32)}
    return m, feeds, {"x": [5, 1, 6], "h0": [1, 1, 8], "c0": [1, 1, 8]}


def zipmap_classifier(seed: int = 0) -> Case:
    rng = np.random.default_rng(seed)
    lc = helper.make_node("LinearClassifier", ["X"], ["label", "probabilities"],
                          domain="ai.onnx.ml", classlabels_ints=[0, 1, 2],
                          coefficients=[float(v) for v in rng.standard_normal(9)],
                          intercepts=[0.1, -0.2, 0.3], post_transform="SOFTMAX")
    zm = helper.make_node("ZipMap", ["probabilities"], ["output_probability"],
                          domain="ai.onnx.ml", classlabels_int64s=[0, 1, 2])
    seqmap = helper.make_sequence_type_proto(
        helper.make_map_type_proto(I64, helper.make_tensor_type_proto(F, [])))
    m = _model([lc, zm], [helper.make_tensor_value_info("X", F, [None, 3])],
               [helper.make_tensor_value_info("label", I64, [None]),
                helper.make_value_info("output_probability", seqmap)], ml=True)
    return m, {"X": rng.standard_normal((4, 3)).astype(np.float32)}, {"X": [4, 3]}


def string_label_classifier(seed: int = 0) -> Case:
    rng = np.random.default_rng(seed)
    labels = ["cat", "dog", "eel"]
    lc = helper.make_node("LinearClassifier", ["X"], ["label", "probabilities"],
                          domain="ai.onnx.ml", classlabels_strings=labels,
                          coefficients=[float(v) for v in rng.standard_normal(9)],
                          intercepts=[0.1, -0.2, 0.3], post_transform="SOFTMAX")
    zm = helper.make_node("ZipMap", ["probabilities"], ["output_probability"],
                          domain="ai.onnx.ml", classlabels_strings=labels)
    seqmap = helper.make_sequence_type_proto(
        helper.make_map_type_proto(TensorProto.STRING, helper.make_tensor_type_proto(F, [])))
    m = _model([lc, zm], [helper.make_tensor_value_info("X", F, [None, 3])],
               [helper.make_tensor_value_info("label", TensorProto.STRING, [None]),
                helper.make_value_info("output_probability", seqmap)], ml=True)
    return m, {"X": rng.standard_normal((4, 3)).astype(np.float32)}, {"X": [4, 3]}


def nonzero(seed: int = 0) -> Case:
    rng = np.random.default_rng(seed)
    m = _model([helper.make_node("Relu", ["x"], ["r"]), helper.make_node("NonZero", ["r"], ["idx"])],
               [helper.make_tensor_value_info("x", F, [2, 5])],
               [helper.make_tensor_value_info("idx", I64, None)])
    return m, {"x": rng.standard_normal((2, 5)).astype(np.float32)}, {}


def branch_shapes(seed: int = 0) -> Case:
    """x [2, 4], sr (int64 scalar) -> y: [4, 4] at 16 kHz (x twice), else [2, 4]."""
    rng = np.random.default_rng(seed)
    then_g = helper.make_graph([helper.make_node("Concat", ["x", "x"], ["t"], axis=0)], "then",
                               [], [helper.make_tensor_value_info("t", F, None)])
    else_g = helper.make_graph([helper.make_node("Identity", ["x"], ["e"])], "else", [],
                               [helper.make_tensor_value_info("e", F, None)])
    m = _model([helper.make_node("Equal", ["sr", "k"], ["is16k"]),
                helper.make_node("If", ["is16k"], ["y"], then_branch=then_g, else_branch=else_g)],
               [helper.make_tensor_value_info("x", F, [2, 4]),
                helper.make_tensor_value_info("sr", I64, [])],
               [helper.make_tensor_value_info("y", F, None)], [_i64("k", 16000)], opset=15)
    return m, {"x": rng.standard_normal((2, 4)).astype(np.float32),
               "sr": np.array(16000, np.int64)}, {}


CASES = {
    "ocr_direction": ocr_direction, "named_dims": named_dims, "control_flow": control_flow,
    "vad_lstm": vad_lstm, "light_runner": light_runner, "pack_runner": pack_runner,
    "fusion_model0": fusion_model0, "fusion_model1": fusion_model1,
    "dynamic_batch": dynamic_batch, "matmul_add": matmul_add,
    "tree_classifier": tree_classifier, "quantized": quantized, "int8_sub_add": int8_sub_add,
}
"""The models that compile and must equal onnxruntime (the ZipMap and NonZero cases have
tests of their own)."""
