"""Small models shaped like production ones, built by script (no downloads, no binaries).

- ``silero_like``: a voice activity detector as Silero VAD ships it: opset 15, an ``If``
  on a scalar int64 sample-rate input, frames whose count is computed from the input's
  shape, a ``Loop`` over them carrying a recurrent state, symbolic dims everywhere
- ``scan_smoother``: a ``Scan`` over the time axis (running mean)
- ``detector_like``: a convolutional detector: conv backbone, upsampled feature pyramid,
  box and class heads concatenated over the anchors
- ``attention_block``: a transformer encoder block (multi-head attention with an
  additive -1e9 mask, LayerNormalization, GELU via Erf)
- ``ctc_head``: an OCR recogniser's head: conv features, a bidirectional LSTM, LogSoftmax
  over the alphabet and a greedy ArgMax decode
- ``deep_mlp``: an MLP whose layers split over 2 IPUs (``SHARDING``)
- ``data_dependent``: ``NonZero``, whose output shape depends on the input's values
- ``overflowing``: weights and an intermediate beyond the fp16 range

Each builder returns ``(model, feeds)``: the model and one sample of inputs.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = ["silero_like", "scan_smoother", "detector_like", "attention_block", "ctc_head",
           "deep_mlp", "DEEP_MLP_SHARDING", "data_dependent", "overflowing"]

F = TensorProto.FLOAT
I64 = TensorProto.INT64


def _model(graph: onnx.GraphProto, opset: int) -> onnx.ModelProto:
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=False)
    return m


def _w(rng: np.random.Generator, name: str, shape: tuple[int, ...], scale: float = 0.3
       ) -> onnx.TensorProto:
    return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)


def _i64(name: str, values: list[int]) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(values, np.int64), name)


def silero_like(hidden: int = 16, seed: int = 0, declare_outputs: bool = True
                ) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """input [batch, samples], state [2, batch, hidden], sr (scalar int64) -> output
    [batch, 1], stateN [2, batch, hidden]. 16 kHz frames are 64 samples, others 32."""
    rng = np.random.default_rng(seed)

    def branch(name: str, frame: int) -> onnx.GraphProto:
        # a strided Conv1d over the samples (4 filters of one frame), averaged over the
        # filters: [batch, samples / frame]
        return helper.make_graph(
            [helper.make_node("Unsqueeze", ["input", "ax1"], [f"{name}_x"]),
             helper.make_node("Conv", [f"{name}_x", f"{name}_w"], [f"{name}_c"],
                              strides=[frame]),
             helper.make_node("ReduceMean", [f"{name}_c"], [f"{name}_out"], axes=[1],
                              keepdims=0)],
            name, [], [helper.make_tensor_value_info(f"{name}_out", F, None)],
            initializer=[_w(rng, f"{name}_w", (4, 1, frame), 0.2)])

    # the loop body: h = tanh(x_t * Wx + h @ Wh), over the frames
    body = helper.make_graph(
        [helper.make_node("Gather", ["frames", "t"], ["x_t"], axis=1),      # [batch]
         helper.make_node("Unsqueeze", ["x_t", "ax1"], ["x_t2"]),           # [batch, 1]
         helper.make_node("MatMul", ["x_t2", "Wx"], ["xw"]),                # [batch, hidden]
         helper.make_node("MatMul", ["h_in", "Wh"], ["hw"]),
         helper.make_node("Add", ["xw", "hw"], ["pre"]),
         helper.make_node("Tanh", ["pre"], ["h_out"]),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])],
        "step",
        [helper.make_tensor_value_info("t", I64, []),
         helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
         helper.make_tensor_value_info("h_in", F, None)],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("h_out", F, None)])
    nodes = [
        helper.make_node("Equal", ["sr", "sr16k"], ["is16k"]),
        helper.make_node("If", ["is16k"], ["frames"], then_branch=branch("k16", 64),
                         else_branch=branch("k8", 32)),
        helper.make_node("Shape", ["frames"], ["fshape"]),
        helper.make_node("Gather", ["fshape", "one"], ["nframes"], axis=0),   # trip count
        helper.make_node("Gather", ["state", "zero"], ["h0"], axis=0),       # [batch, hidden]
        helper.make_node("Loop", ["nframes", "", "h0"], ["hN"], body=body),
        helper.make_node("Gather", ["state", "one"], ["c0"], axis=0),
        helper.make_node("Add", ["hN", "c0"], ["c1"]),
        helper.make_node("Unsqueeze", ["hN", "ax0"], ["hN1"]),
        helper.make_node("Unsqueeze", ["c1", "ax0"], ["c11"]),
        helper.make_node("Concat", ["hN1", "c11"], ["stateN"], axis=0),
        helper.make_node("MatMul", ["hN", "Wout"], ["logit"]),
        helper.make_node("Sigmoid", ["logit"], ["output"]),
    ]
    out_dims: list[object] = ["batch", 1] if declare_outputs else ["d0", "d1"]
    state_dims: list[object] = [2, "batch", hidden] if declare_outputs else ["d0", "d1", "d2"]
    g = helper.make_graph(
        nodes, "silero_like",
        [helper.make_tensor_value_info("input", F, ["batch", "samples"]),
         helper.make_tensor_value_info("state", F, [2, "batch", hidden]),
         helper.make_tensor_value_info("sr", I64, [])],
        [helper.make_tensor_value_info("output", F, out_dims),
         helper.make_tensor_value_info("stateN", F, state_dims)],
        initializer=[numpy_helper.from_array(np.array(16000, np.int64), "sr16k"),
                     numpy_helper.from_array(np.array(1, np.int64), "one"),
                     numpy_helper.from_array(np.array(0, np.int64), "zero"),
                     _i64("ax0", [0]), _i64("ax1", [1]),
                     _w(rng, "Wx", (1, hidden)), _w(rng, "Wh", (hidden, hidden)),
                     _w(rng, "Wout", (hidden, 1))])
    model = _model(g, 15)
    feeds = {"input": rng.standard_normal((1, 512)).astype(np.float32),
             "state": rng.standard_normal((2, 1, hidden)).astype(np.float32) * 0.1,
             "sr": np.array(16000, np.int64)}
    return model, feeds


def scan_smoother(seed: int = 1) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """x [time, features] -> running mean over time [time, features] (a Scan), opset 16."""
    body = helper.make_graph(
        [helper.make_node("Add", ["acc_in", "x_t"], ["acc_out"]),
         helper.make_node("Add", ["n_in", "onef"], ["n_out"]),
         helper.make_node("Div", ["acc_out", "n_out"], ["mean_t"])],
        "scan_body",
        [helper.make_tensor_value_info("acc_in", F, ["features"]),
         helper.make_tensor_value_info("n_in", F, []),
         helper.make_tensor_value_info("x_t", F, ["features"])],
        [helper.make_tensor_value_info("acc_out", F, ["features"]),
         helper.make_tensor_value_info("n_out", F, []),
         helper.make_tensor_value_info("mean_t", F, ["features"])],
        initializer=[numpy_helper.from_array(np.array(1.0, np.float32), "onef")])
    g = helper.make_graph(
        [helper.make_node("Shape", ["x"], ["xs"], start=1),
         helper.make_node("ConstantOfShape", ["xs"], ["acc0"],
                          value=numpy_helper.from_array(np.zeros(1, np.float32))),
         helper.make_node("Scan", ["acc0", "n0", "x"], ["accN", "nN", "means"], body=body,
                          num_scan_inputs=1)],
        "scan_smoother",
        [helper.make_tensor_value_info("x", F, ["time", "features"])],
        [helper.make_tensor_value_info("means", F, ["time", "features"])],
        initializer=[numpy_helper.from_array(np.array(0.0, np.float32), "n0")])
    model = _model(g, 16)
    rng = np.random.default_rng(seed)
    return model, {"x": rng.standard_normal((6, 5)).astype(np.float32)}


def detector_like(size: int = 16, classes: int = 3, seed: int = 2
                  ) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """images [1, 3, size, size] -> boxes [1, anchors, 4], scores [1, anchors, classes]."""
    rng = np.random.default_rng(seed)
    inits = [_w(rng, "c1", (8, 3, 3, 3)), _w(rng, "b1", (8,), 0.1),
             _w(rng, "c2", (16, 8, 3, 3), 0.2), _w(rng, "b2", (16,), 0.1),
             _w(rng, "lat", (8, 16, 1, 1), 0.3),
             _w(rng, "hb", (4, 8, 1, 1), 0.3), _w(rng, "hc", (classes, 8, 1, 1), 0.3),
             numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "up"),
             _i64("box_shape", [1, 4, -1]), _i64("cls_shape", [1, classes, -1])]
    nodes = [
        helper.make_node("Conv", ["images", "c1", "b1"], ["f1"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Relu", ["f1"], ["r1"]),                                 # [1,8,s/2,s/2]
        helper.make_node("Conv", ["r1", "c2", "b2"], ["f2"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Relu", ["f2"], ["r2"]),                                 # [1,16,s/4,s/4]
        helper.make_node("Conv", ["r2", "lat"], ["l2"]),                          # [1,8,s/4,s/4]
        helper.make_node("Resize", ["l2", "", "up"], ["u2"], mode="nearest"),     # [1,8,s/2,s/2]
        helper.make_node("Add", ["u2", "r1"], ["p1"]),
        helper.make_node("Conv", ["p1", "hb"], ["box_map"]),
        helper.make_node("Conv", ["p1", "hc"], ["cls_map"]),
        helper.make_node("Reshape", ["box_map", "box_shape"], ["box_t"]),
        helper.make_node("Transpose", ["box_t"], ["boxes"], perm=[0, 2, 1]),
        helper.make_node("Reshape", ["cls_map", "cls_shape"], ["cls_t"]),
        helper.make_node("Transpose", ["cls_t"], ["cls_l"], perm=[0, 2, 1]),
        helper.make_node("Sigmoid", ["cls_l"], ["scores"]),
    ]
    g = helper.make_graph(nodes, "detector_like",
                          [helper.make_tensor_value_info("images", F, [1, 3, size, size])],
                          [helper.make_tensor_value_info("boxes", F, [1, "anchors", 4]),
                           helper.make_tensor_value_info("scores", F, [1, "anchors", classes])], initializer=inits)
    model = _model(g, 13)
    return model, {"images": rng.random((1, 3, size, size)).astype(np.float32)}


def attention_block(seq: int = 8, dim: int = 16, heads: int = 2, seed: int = 3
                    ) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """x [1, seq, dim], mask [1, seq] (1 keep, 0 pad) -> y [1, seq, dim]; opset 17."""
    rng = np.random.default_rng(seed)
    hd = dim // heads
    inits = [_w(rng, n, (dim, dim), 0.25) for n in ("Wq", "Wk", "Wv", "Wo")] + [
        _w(rng, "W1", (dim, 2 * dim), 0.25), _w(rng, "W2", (2 * dim, dim), 0.25),
        numpy_helper.from_array(np.ones(dim, np.float32), "ln_g"),
        numpy_helper.from_array(np.zeros(dim, np.float32), "ln_b"),
        _i64("split_heads", [1, seq, heads, hd]), _i64("merge_heads", [1, seq, dim]),
        numpy_helper.from_array(np.array(1.0 / np.sqrt(hd), np.float32), "scale"),
        numpy_helper.from_array(np.array(-1e9, np.float32), "neg"),      # beyond fp16
        numpy_helper.from_array(np.array(1.0, np.float32), "onef"),
        numpy_helper.from_array(np.array(0.5, np.float32), "half"),
        numpy_helper.from_array(np.array(1 / np.sqrt(2), np.float32), "rsqrt2"),
        _i64("mask_axes", [1, 2])]
    nodes = []
    for n in ("q", "k", "v"):
        nodes += [helper.make_node("MatMul", ["x", f"W{n}"], [f"{n}0"]),
                  helper.make_node("Reshape", [f"{n}0", "split_heads"], [f"{n}1"]),
                  helper.make_node("Transpose", [f"{n}1"], [f"{n}h"],
                                   perm=[0, 2, 3, 1] if n == "k" else [0, 2, 1, 3])]
    nodes += [
        helper.make_node("MatMul", ["qh", "kh"], ["s0"]),                 # [1,h,seq,seq]
        helper.make_node("Mul", ["s0", "scale"], ["s1"]),
        helper.make_node("Sub", ["onef", "mask"], ["pad"]),
        helper.make_node("Mul", ["pad", "neg"], ["bias0"]),
        helper.make_node("Unsqueeze", ["bias0", "mask_axes"], ["bias"]),  # [1,1,1,seq]
        helper.make_node("Add", ["s1", "bias"], ["s2"]),
        helper.make_node("Softmax", ["s2"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "vh"], ["a0"]),
        helper.make_node("Transpose", ["a0"], ["a1"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["a1", "merge_heads"], ["a2"]),
        helper.make_node("MatMul", ["a2", "Wo"], ["a3"]),
        helper.make_node("Add", ["x", "a3"], ["r1"]),
        helper.make_node("LayerNormalization", ["r1", "ln_g", "ln_b"], ["n1"], axis=-1),
        helper.make_node("MatMul", ["n1", "W1"], ["h0"]),
        helper.make_node("Mul", ["h0", "rsqrt2"], ["h1"]),
        helper.make_node("Erf", ["h1"], ["h2"]),
        helper.make_node("Add", ["h2", "onef"], ["h3"]),
        helper.make_node("Mul", ["h0", "h3"], ["h4"]),
        helper.make_node("Mul", ["h4", "half"], ["gelu"]),
        helper.make_node("MatMul", ["gelu", "W2"], ["f2"]),
        helper.make_node("Add", ["n1", "f2"], ["y"]),
    ]
    g = helper.make_graph(nodes, "attention_block",
                          [helper.make_tensor_value_info("x", F, [1, seq, dim]),
                           helper.make_tensor_value_info("mask", F, [1, seq])],
                          [helper.make_tensor_value_info("y", F, [1, seq, dim])],
                          initializer=inits)
    model = _model(g, 17)
    mask = np.ones((1, seq), np.float32)
    mask[0, seq - 2:] = 0
    return model, {"x": rng.standard_normal((1, seq, dim)).astype(np.float32), "mask": mask}


def ctc_head(width: int = 16, alphabet: int = 7, hidden: int = 8, seed: int = 4
             ) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """image [1, 1, 8, width] -> log_probs [width/2, 1, alphabet], labels [1, width/2]."""
    rng = np.random.default_rng(seed)
    feat = 4 * 4      # channels * height after the conv
    inits = [_w(rng, "cw", (4, 1, 3, 3), 0.4), _w(rng, "cb", (4,), 0.1),
             _w(rng, "W", (2, 4 * hidden, feat), 0.3), _w(rng, "R", (2, 4 * hidden, hidden), 0.3),
             _w(rng, "B", (2, 8 * hidden), 0.1), _w(rng, "Wc", (2 * hidden, alphabet), 0.4),
             _i64("seq_shape", [1, feat, -1]), _i64("dir_shape", [0, 0, -1])]
    nodes = [
        helper.make_node("Conv", ["image", "cw", "cb"], ["c"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Relu", ["c"], ["cr"]),                          # [1,4,4,w/2]
        helper.make_node("Reshape", ["cr", "seq_shape"], ["s"]),          # [1,16,w/2]
        helper.make_node("Transpose", ["s"], ["seq"], perm=[2, 0, 1]),    # [w/2,1,16]
        helper.make_node("LSTM", ["seq", "W", "R", "B"], ["Y"], hidden_size=hidden,
                         direction="bidirectional"),                     # [w/2,2,1,hidden]
        helper.make_node("Transpose", ["Y"], ["Yt"], perm=[0, 2, 1, 3]),  # [w/2,1,2,hidden]
        helper.make_node("Reshape", ["Yt", "dir_shape"], ["Yc"]),         # [w/2,1,2h]
        helper.make_node("MatMul", ["Yc", "Wc"], ["logits"]),
        helper.make_node("LogSoftmax", ["logits"], ["log_probs"], axis=-1),
        helper.make_node("ArgMax", ["log_probs"], ["best"], axis=-1, keepdims=0),   # [w/2,1]
        helper.make_node("Transpose", ["best"], ["labels"], perm=[1, 0]),
    ]
    g = helper.make_graph(nodes, "ctc_head",
                          [helper.make_tensor_value_info("image", F, [1, 1, 8, width])],
                          [helper.make_tensor_value_info("log_probs", F, ["T", 1, alphabet]),
                           helper.make_tensor_value_info("labels", I64, [1, "T"])],
                          initializer=inits)
    model = _model(g, 13)
    return model, {"image": rng.random((1, 1, 8, width)).astype(np.float32)}


DEEP_MLP_SHARDING = {"fc0": 0, "act0": 0, "fc1": 0, "act1": 0,
                     "fc2": 1, "act2": 1, "fc3": 1, "out": 1}
"""Node name -> IPU for ``deep_mlp`` (also its pipeline stages)."""


def deep_mlp(batch: int = 2, width: int = 16, seed: int = 5
             ) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """x [batch, width] -> y [batch, width]: four dense layers, named for sharding."""
    rng = np.random.default_rng(seed)
    nodes, prev = [], "x"
    for k in range(4):
        nodes.append(helper.make_node("Gemm", [prev, f"w{k}", f"b{k}"], [f"z{k}"], name=f"fc{k}"))
        act = "Softmax" if k == 3 else "Relu"
        name = "out" if k == 3 else f"act{k}"
        nodes.append(helper.make_node(act, [f"z{k}"], ["y" if k == 3 else f"a{k}"], name=name))
        prev = f"a{k}"
    inits = [t for k in range(4) for t in (_w(rng, f"w{k}", (width, width), 0.4),
                                           _w(rng, f"b{k}", (width,), 0.1))]
    g = helper.make_graph(nodes, "deep_mlp", [helper.make_tensor_value_info("x", F, [batch, width])],
                          [helper.make_tensor_value_info("y", F, [batch, width])],
                          initializer=inits)
    return _model(g, 13), {"x": rng.standard_normal((batch, width)).astype(np.float32)}


def data_dependent() -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """x [4] -> idx [1, ?]: the indices of the non-zero elements."""
    g = helper.make_graph([helper.make_node("NonZero", ["x"], ["idx"])], "data_dependent",
                          [helper.make_tensor_value_info("x", F, [4])],
                          [helper.make_tensor_value_info("idx", I64, [1, "n"])])
    return _model(g, 13), {"x": np.array([0, 1, 0, 2], np.float32)}


def overflowing(seed: int = 6) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """x [2, 8] -> y [2, 8]: a weight of 1e6 (beyond fp16's 65504) scaled back down by
    1e-6, and a sum of squares that overflows fp16 before a Sqrt brings it back."""
    rng = np.random.default_rng(seed)
    g = helper.make_graph(
        [helper.make_node("Mul", ["x", "big"], ["xb"]),           # up to ~3e6
         helper.make_node("Mul", ["xb", "small"], ["xs"]),        # back to ~x
         helper.make_node("Mul", ["x", "k"], ["xk"]),             # ~ 300 * x
         helper.make_node("ReduceSumSquare", ["xk"], ["ss"], axes=[1], keepdims=1),
         helper.make_node("Sqrt", ["ss"], ["norm"]),
         helper.make_node("Div", ["xk", "norm"], ["unit"]),
         helper.make_node("Add", ["xs", "unit"], ["y"])],
        "overflowing", [helper.make_tensor_value_info("x", F, [2, 8])],
        [helper.make_tensor_value_info("y", F, [2, 8])],
        initializer=[numpy_helper.from_array(np.array(1e6, np.float32), "big"),
                     numpy_helper.from_array(np.array(1e-6, np.float32), "small"),
                     numpy_helper.from_array(np.array(300.0, np.float32), "k")])
    return _model(g, 13), {"x": (rng.standard_normal((2, 8)) * 2).astype(np.float32)}
