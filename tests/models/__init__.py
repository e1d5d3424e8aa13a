"""ONNX model builders for tests: generated in code with random weights, no downloads.

- ``simple_model``: the seeds' example (tensor_C = tensor_A * weights + tensor_B)
- ``seed_model0`` / ``seed_model1``: seed 004's compile.py models (Add+Reshape fp32,
  Concat fp16 with a constant); ``SEED_FUSION_CONFIG``: seed 004's config.yaml fusing them
- ``resnet_like``: a ResNet-50-style network (conv/BN/ReLU bottleneck blocks, [3, 4, 6, 3])
- ``mobilenet_like``: MobileNetV2-style inverted residual blocks (depthwise convs, Clip)
- ``mixed_types_model``: several inputs and outputs with int64, int32 and bool tensors
- ``dynamic_model``: an MLP with a symbolic batch dimension
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = [
    "OPSET",
    "make_model",
    "simple_model",
    "seed_model0",
    "seed_model1",
    "SEED_FUSION_CONFIG",
    "resnet_like",
    "mobilenet_like",
    "mixed_types_model",
    "dynamic_model",
    "run_reference",
]

OPSET = 13


def make_model(graph: onnx.GraphProto, opset: int = OPSET) -> onnx.ModelProto:
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8   # loadable by every supported onnxruntime
    onnx.checker.check_model(m)
    return m


def run_reference(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run a model directly with onnxruntime (the reference the tests compare against)."""
    import onnxruntime as ort

    m = onnx.ModelProto()
    m.CopyFrom(model)
    m.ir_version = min(m.ir_version, 8)
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds)))


def simple_model(shape: tuple[int, ...] = (1, 4), seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape).astype(np.float32)
    g = helper.make_graph(
        [helper.make_node("Mul", ["tensor_A", "weights"], ["M"]),
         helper.make_node("Add", ["M", "tensor_B"], ["tensor_C"])],
        "simple",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(shape))
         for n in ("tensor_A", "tensor_B")],
        [helper.make_tensor_value_info("tensor_C", TensorProto.FLOAT, list(shape))],
        initializer=[numpy_helper.from_array(w, "weights")])
    return make_model(g)


def seed_model0(opset: int = 11) -> onnx.ModelProto:
    g = helper.make_graph(
        [helper.make_node("Add", ["X", "Y"], ["Z"]), helper.make_node("Reshape", ["Z", "C"], ["O"])],
        "graph",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, (1, 2)),
         helper.make_tensor_value_info("Y", TensorProto.FLOAT, (1, 2))],
        [helper.make_tensor_value_info("O", TensorProto.FLOAT, (2,))],
        initializer=[numpy_helper.from_array(np.array([2], np.int64), "C")])
    return make_model(g, opset)


SEED_FUSION_CONFIG = """\
output_dir: './'
output_model: 'model_fusion.onnx'
export_popef: True
max_tensor_size: -1
ipu_version: 'ipu21'
model_fusion:
  - input_model: 'model0.onnx'
    input_shape: ['X=1,2', 'Y=1,2']
    precision: 'fp32'

  - input_model: 'model1.onnx'
    input_shape: ['X=1,1']
    precision: 'fp16'
"""
"""Seed 004's ``config.yaml``: fuse model0.onnx (fp32) and model1.onnx (fp16) into a PopEF."""


def seed_model1(opset: int = 11) -> onnx.ModelProto:
    g = helper.make_graph(
        [helper.make_node("Concat", ["X", "C"], ["O"], axis=1)],
        "graph",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT16, (1, 1))],
        [helper.make_tensor_value_info("O", TensorProto.FLOAT16, (1, 3))],
        initializer=[numpy_helper.from_array(np.array([[1.5, 2.0]], np.float16), "C")])
    return make_model(g, opset)


class _Builder:
    """Accumulates nodes and random initializers with unique names."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[TensorProto] = []
        self.n = 0

    def name(self, base: str) -> str:
        self.n += 1
        return f"{base}_{self.n}"

    def init(self, base: str, arr: np.ndarray) -> str:
        name = self.name(base)
        self.inits.append(numpy_helper.from_array(arr.astype(np.float32), name))
        return name

    def node(self, op: str, inputs: list[str], **attrs: object) -> str:
        out = self.name(op.lower())
        self.nodes.append(helper.make_node(op, inputs, [out], name=out + "_node", **attrs))
        return out

    def conv_bn(self, x: str, cin: int, cout: int, k: int, stride: int = 1, group: int = 1,
                act: str | None = "Relu") -> str:
        fan_in = cin // group * k * k
        w = self.init("w", self.rng.standard_normal((cout, cin // group, k, k)) *
                      np.sqrt(2.0 / fan_in))
        y = self.node("Conv", [x, w], kernel_shape=[k, k], strides=[stride, stride],
                      pads=[k // 2] * 4, group=group)
        scale = self.init("bn_scale", 1.0 + 0.1 * self.rng.standard_normal(cout))
        bias = self.init("bn_bias", 0.1 * self.rng.standard_normal(cout))
        mean = self.init("bn_mean", 0.1 * self.rng.standard_normal(cout))
        var = self.init("bn_var", 1.0 + 0.1 * self.rng.random(cout))
        y = self.node("BatchNormalization", [y, scale, bias, mean, var], epsilon=1e-5)
        if act == "Relu":
            y = self.node("Relu", [y])
        elif act == "Relu6":
            y = self.node("Clip", [y, self.init("zero", np.array(0.0)),
                                   self.init("six", np.array(6.0))])
        return y

    def head(self, x: str, c: int, classes: int) -> str:
        y = self.node("GlobalAveragePool", [x])
        y = self.node("Flatten", [y], axis=1)
        w = self.init("fc_w", self.rng.standard_normal((c, classes)) * 0.05)
        b = self.init("fc_b", self.rng.standard_normal(classes) * 0.01)
        y = self.node("MatMul", [y, w])
        return self.node("Add", [y, b])

    def model(self, name: str, inputs: list[onnx.ValueInfoProto], out: str, out_name: str,
              out_shape: list[int | str]) -> onnx.ModelProto:
        self.nodes.append(helper.make_node("Identity", [out], ["logits"], name="logits"))
        self.nodes.append(helper.make_node("Softmax", [out], [out_name], axis=1, name="softmax"))
        g = helper.make_graph(self.nodes, name, inputs,
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT,
                                                             out_shape),
                               helper.make_tensor_value_info(out_name, TensorProto.FLOAT,
                                                             out_shape)],
                              initializer=self.inits)
        return make_model(g)


def resnet_like(batch: int | str = 1, size: int = 32, width: int = 4,
                blocks: tuple[int, ...] = (3, 4, 6, 3), classes: int = 10,
                seed: int = 0) -> onnx.ModelProto:
    """ResNet-50 layout (bottleneck blocks, [3, 4, 6, 3]) at small width: ~180 nodes."""
    b = _Builder(seed)
    x = b.conv_bn("image", 3, width * 4, 3)
    x = b.node("MaxPool", [x], kernel_shape=[2, 2], strides=[2, 2])
    cin = width * 4
    for stage, n in enumerate(blocks):
        mid = width * (2 ** stage)
        cout = mid * 4
        for i in range(n):
            stride = 2 if i == 0 and stage > 0 else 1
            y = b.conv_bn(x, cin, mid, 1)
            y = b.conv_bn(y, mid, mid, 3, stride)
            y = b.conv_bn(y, mid, cout, 1, act=None)
            short = x if stride == 1 and cin == cout else b.conv_bn(x, cin, cout, 1, stride,
                                                                     act=None)
            x = b.node("Relu", [b.node("Add", [y, short])])
            cin = cout
    logits = b.head(x, cin, classes)
    return b.model("resnet_like", [helper.make_tensor_value_info(
        "image", TensorProto.FLOAT, [batch, 3, size, size])], logits, "probs", [batch, classes])


def mobilenet_like(batch: int | str = 1, size: int = 32, classes: int = 10,
                   seed: int = 1) -> onnx.ModelProto:
    """MobileNetV2 inverted residual layout (t, c, n, s) at small width: ~200 nodes."""
    b = _Builder(seed)
    x = b.conv_bn("image", 3, 8, 3, 2, act="Relu6")
    cin = 8
    for t, c, n, s in [(1, 8, 1, 1), (6, 12, 2, 2), (6, 16, 3, 2), (6, 24, 4, 2),
                       (6, 32, 3, 1), (6, 40, 3, 2), (6, 64, 1, 1)]:
        for i in range(n):
            stride = s if i == 0 else 1
            hidden = cin * t
            y = x if t == 1 else b.conv_bn(x, cin, hidden, 1, act="Relu6")
            y = b.conv_bn(y, hidden, hidden, 3, stride, group=hidden, act="Relu6")
            y = b.conv_bn(y, hidden, c, 1, act=None)
            x = b.node("Add", [x, y]) if stride == 1 and cin == c else y
            cin = c
    x = b.conv_bn(x, cin, 128, 1, act="Relu6")
    logits = b.head(x, 128, classes)
    return b.model("mobilenet_like", [helper.make_tensor_value_info(
        "image", TensorProto.FLOAT, [batch, 3, size, size])], logits, "probs", [batch, classes])


def mixed_types_model() -> onnx.ModelProto:
    """Inputs: x F32[2,3], ids S64[2,3], mask BOOL[2,3]; outputs: masked F32, count S32, any BOOL."""
    nodes = [
        helper.make_node("Cast", ["ids"], ["ids_f"], to=TensorProto.FLOAT),
        helper.make_node("Add", ["x", "ids_f"], ["sum"]),
        helper.make_node("Where", ["mask", "sum", "zero"], ["masked"]),
        helper.make_node("Cast", ["mask"], ["mask_i"], to=TensorProto.INT32),
        helper.make_node("ReduceSum", ["mask_i"], ["count"], keepdims=0),
        helper.make_node("Greater", ["masked", "thr"], ["gt"]),
        helper.make_node("Not", ["gt"], ["le"]),
        helper.make_node("And", ["le", "mask"], ["both"]),
    ]
    g = helper.make_graph(
        nodes, "mixed",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
         helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 3]),
         helper.make_tensor_value_info("mask", TensorProto.BOOL, [2, 3])],
        [helper.make_tensor_value_info("masked", TensorProto.FLOAT, [2, 3]),
         helper.make_tensor_value_info("count", TensorProto.INT32, []),
         helper.make_tensor_value_info("both", TensorProto.BOOL, [2, 3])],
        initializer=[numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
                     numpy_helper.from_array(np.array(2.5, np.float32), "thr")])
    return make_model(g)


def dynamic_model(features: int = 6, hidden: int = 5, seed: int = 2) -> onnx.ModelProto:
    """An MLP ``x[batch, features] -> y[batch, hidden]`` with a symbolic batch dimension."""
    rng = np.random.default_rng(seed)
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["a"]),
         helper.make_node("Tanh", ["a"], ["y"])],
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", features])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", hidden])],
        initializer=[numpy_helper.from_array(rng.standard_normal((features, hidden)).astype(
            np.float32), "w"), numpy_helper.from_array(rng.standard_normal(hidden).astype(
                np.float32), "b")])
    return make_model(g)
