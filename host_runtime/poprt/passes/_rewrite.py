"""Rewrites that keep what a model computes (up to float rounding) and change its ops."""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from host_runtime.poprt.passes._base import Pass
from host_runtime.poprt.passes._types import infer_lenient
from host_runtime.poprt._onnx_util import (constant_value, consumers, copy_model, main_opset,
                                          make_const, prune, subgraphs, unique)

__all__ = ["ReplaceGemmWithMatMul", "ReplaceBNWithMulAdd", "FuseBnIntoConv", "ReplaceDivWithMul",
           "ReplacePow", "ReplaceWhereWithMulAdd", "ReplaceGreaterOrEqual", "ReplaceLessOrEqual",
           "FuseMulIntoMatmul", "FillSqueezeAxes", "EliminateNopCast", "EliminateNopTranspose",
           "FuseConsecutiveTranspose", "value_types", "EliminateNopReshape",
           "EliminateNopFlatten", "EliminateNopExpand", "EliminateNopPad",
           "EliminateNopArithmetic", "ReplaceHardSwish", "FuseBnIntoGemm"]


def _attr(n: onnx.NodeProto, name: str, default: Any) -> Any:
    for a in n.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _types(model: onnx.ModelProto) -> tuple[dict[str, int], dict[str, int]]:
    """Element types and ranks of the main graph's values (from shape inference)."""
    types, shapes = _types_and_shapes(model)
    return types, {k: len(v) for k, v in shapes.items()}


def _types_and_shapes(model: onnx.ModelProto) -> tuple[dict[str, int], dict[str, list[int]]]:
    """Element types and shapes (-1: unknown dim) of the main graph's values."""
    g = infer_lenient(copy_model(model)).graph
    types: dict[str, int] = {}
    shapes: dict[str, list[int]] = {}
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        if vi.type.WhichOneof("value") == "tensor_type":
            types[vi.name] = vi.type.tensor_type.elem_type
            if vi.type.tensor_type.HasField("shape"):
                shapes[vi.name] = [d.dim_value if d.HasField("dim_value") else -1
                                   for d in vi.type.tensor_type.shape.dim]
    for t in g.initializer:
        types[t.name] = t.data_type
        shapes[t.name] = list(t.dims)
    return types, shapes


def value_types(model: onnx.ModelProto) -> dict[str, int]:
    """Element types of the main graph's values (from shape inference)."""
    return _types(model)[0]


class _Rewrite(Pass):
    """Rewrites the main graph node by node: ``rewrite`` returns the nodes replacing one
    (or None to keep it)."""

    def run(self, onnx_model: onnx.ModelProto) -> onnx.ModelProto:
        model = copy_model(onnx_model)
        self.types, self.ranks = _types(model)
        self.model = model
        g = model.graph
        out: list[onnx.NodeProto] = []
        for n in list(g.node):
            new = self.rewrite(g, n)
            if new is None:
                out.append(n)
                continue
            out.extend(new)
            g.node.extend(new)   # their names taken: unique() sees them (until rebuilt below)
        del g.node[:]
        g.node.extend(out)
        return model

    def rewrite(self, g: onnx.GraphProto, n: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        raise NotImplementedError


class ReplaceGemmWithMatMul(_Rewrite):
    """``Gemm`` becomes ``[Transpose] MatMul [Mul alpha] [Add beta*C]``."""

    def rewrite(self, g: onnx.GraphProto, n: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        if n.op_type != "Gemm":
            return None
        tag = n.name or unique(g, "Gemm")
        a, b = n.input[0], n.input[1]
        nodes = []
        if _attr(n, "transA", 0):
            a2 = unique(g, f"{tag}__aT")
            nodes.append(helper.make_node("Transpose", [a], [a2], perm=[1, 0], name=a2))
            a = a2
        if _attr(n, "transB", 0):
            b2 = unique(g, f"{tag}__bT")
            nodes.append(helper.make_node("Transpose", [b], [b2], perm=[1, 0], name=b2))
            b = b2
        dtype = helper.tensor_dtype_to_np_dtype(self.types.get(n.input[0], TensorProto.FLOAT))
        cur = unique(g, f"{tag}__mm")
        nodes.append(helper.make_node("MatMul", [a, b], [cur], name=cur))
        alpha, beta = float(_attr(n, "alpha", 1.0)), float(_attr(n, "beta", 1.0))
        if alpha != 1.0:
            nxt = unique(g, f"{tag}__alpha")
            nodes.append(helper.make_node("Mul", [cur, make_const(g, f"{tag}__alpha_c",
                                          np.array(alpha, dtype))], [nxt], name=nxt))
            cur = nxt
        if len(n.input) > 2 and n.input[2]:
            c = n.input[2]
            if beta != 1.0:
                c2 = unique(g, f"{tag}__beta")
                nodes.append(helper.make_node("Mul", [c, make_const(g, f"{tag}__beta_c",
                                              np.array(beta, dtype))], [c2], name=c2))
                c = c2
            nxt = unique(g, f"{tag}__add")
            nodes.append(helper.make_node("Add", [cur, c], [nxt], name=nxt))
            cur = nxt
        nodes[-1].output[0] = n.output[0]
        return nodes


def _bn_params(g: onnx.GraphProto, n: onnx.NodeProto) -> tuple[np.ndarray, np.ndarray] | None:
    """(scale, shift) of an inference BatchNormalization with constant parameters."""
    if n.op_type != "BatchNormalization" or len(n.output) > 1 and any(n.output[1:]):
        return None
    vals = [constant_value(g, i) for i in n.input[1:5]]
    if any(v is None for v in vals):
        return None
    scale, bias, mean, var = (np.asarray(v, np.float64) for v in vals)
    s = scale / np.sqrt(var + float(_attr(n, "epsilon", 1e-5)))
    return s, bias - mean * s


class ReplaceBNWithMulAdd(_Rewrite):
    """An inference ``BatchNormalization`` with constant parameters becomes
    ``Mul(X, scale') + shift'``."""

    def rewrite(self, g: onnx.GraphProto, n: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        p = _bn_params(g, n)
        rank = self.ranks.get(n.input[0])
        if p is None or rank is None or rank < 2:
            return None
        s, b = p
        dtype = helper.tensor_dtype_to_np_dtype(self.types.get(n.input[0], TensorProto.FLOAT))
        shape = [-1] + [1] * (rank - 2)
        tag = n.name or unique(g, "BN")
        mul = unique(g, f"{tag}__mul")
        return [helper.make_node("Mul", [n.input[0], make_const(g, f"{tag}__scale", s.reshape(shape).astype(dtype))], [mul], name=mul),
                helper.make_node("Add", [mul, make_const(g, f"{tag}__shift", b.reshape(shape).astype(dtype))], [n.output[0]], name=f"{tag}__add")]


def _fusable_bns(g: onnx.GraphProto, op_type: str
                 ) -> Iterator[tuple[onnx.NodeProto, onnx.NodeProto, tuple[np.ndarray, np.ndarray]]]:
    """``(node, bn, (scale, shift))`` for each inference ``BatchNormalization`` with
    constant parameters whose input is the only use of an ``op_type`` node's output (not
    a graph output): the pairs the FuseBnInto* passes fold."""
    readers = consumers(g)
    outs = {o.name for o in g.output}
    by_out = {o: n for n in g.node for o in n.output}
    for bn in [n for n in g.node if n.op_type == "BatchNormalization"]:
        node = by_out.get(bn.input[0])
        p = _bn_params(g, bn)
        if node is None or node.op_type != op_type or p is None or \
                len(readers.get(node.output[0], [])) != 1 or node.output[0] in outs:
            continue
        yield node, bn, p


def _take_output(g: onnx.GraphProto, node: onnx.NodeProto, bn: onnx.NodeProto) -> None:
    """``node`` now computes ``bn``'s output; ``bn`` goes."""
    node.output[0] = bn.output[0]
    g.node.remove(bn)


class FuseBnIntoConv(Pass):
    """``Conv`` with constant weights followed by its only reader, an inference
    ``BatchNormalization`` with constant parameters, becomes one ``Conv``."""

    def run(self, onnx_model: onnx.ModelProto) -> onnx.ModelProto:
        model = copy_model(onnx_model)
        g = model.graph
        for conv, bn, p in _fusable_bns(g, "Conv"):
            w = constant_value(g, conv.input[1])
            bias = constant_value(g, conv.input[2]) if len(conv.input) > 2 and conv.input[2] \
                else np.zeros(w.shape[0] if w is not None else 0)
            if w is None or bias is None:
                continue
            s, b = p
            w2 = (w.astype(np.float64) * s.reshape([-1] + [1] * (w.ndim - 1))).astype(w.dtype)
            b2 = (bias.astype(np.float64) * s + b).astype(w.dtype)
            tag = conv.name or "Conv"
            conv.input[1] = make_const(g, f"{tag}__W_bn", w2)
            if len(conv.input) > 2:
                conv.input[2] = make_const(g, f"{tag}__B_bn", b2)
            else:
                conv.input.append(make_const(g, f"{tag}__B_bn", b2))
            _take_output(g, conv, bn)
        return prune(model)


class ReplaceDivWithMul(_Rewrite):
    """``Div(X, C)`` with a constant float ``C`` becomes ``Mul(X, 1/C)``."""

    def rewrite(self, g: onnx.GraphProto, n: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        if n.op_type != "Div":
            return None
        c = constant_value(g, n.input[1])
        if c is None or c.dtype.kind != "f" or np.any(c == 0):
            return None
        inv = make_const(g, f"{n.name or 'Div'}__reciprocal", (1.0 / c).astype(c.dtype))
        return [helper.make_node("Mul", [n.input[0], inv], list(n.output), name=n.name)]


class ReplacePow(_Rewrite):
    """``Pow(X, 2)``, ``Pow(X, 3)`` and ``Pow(X, 0.5)`` with a constant exponent become
    ``Mul``s or ``Sqrt``."""

    def rewrite(self, g: onnx.GraphProto, n: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        if n.op_type != "Pow":
            return None
        e = constant_value(g, n.input[1])
        if e is None or e.size != 1:
            return None
        x, y, tag = n.input[0], n.output[0], n.name or unique(g, "Pow")
        if float(e) == 2.0:
            return [helper.make_node("Mul", [x, x], [y], name=tag)]
        if float(e) == 3.0:
            sq = unique(g, f"{tag}__sq")
            return [helper.make_node("Mul", [x, x], [sq], name=sq),
                    helper.make_node("Mul", [sq, x], [y], name=tag)]
        if float(e) == 0.5:
            return [helper.make_node("Sqrt", [x], [y], name=tag)]
        return None


class ReplaceWhereWithMulAdd(_Rewrite):
    """Float ``Where(c, X, Y)`` becomes ``c*X + (not c)*Y`` (equal for finite X and Y)."""

    def rewrite(self, g: onnx.GraphProto, n: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        if n.op_type != "Where":
            return None
        t = self.types.get(n.input[1])
        if t not in (TensorProto.FLOAT, TensorProto.FLOAT16):
            return None
        tag = n.name or unique(g, "Where")
        c, nc, cx, ny, cf, ncf = (unique(g, f"{tag}__{s}") for s in ("c", "nc", "cx", "ny", "cf", "ncf"))
        return [helper.make_node("Cast", [n.input[0]], [cf], to=t, name=cf),
                helper.make_node("Not", [n.input[0]], [nc], name=nc),
                helper.make_node("Cast", [nc], [ncf], to=t, name=ncf),
                helper.make_node("Mul", [cf, n.input[1]], [cx], name=cx),
                helper.make_node("Mul", [ncf, n.input[2]], [ny], name=ny),
                helper.make_node("Add", [cx, ny], [n.output[0]], name=tag)]


class _NotOf(_Rewrite):
    op, inverse = "", ""

    def rewrite(self, g: onnx.GraphProto, n: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        if n.op_type != self.op:
            return None
        tag = n.name or unique(g, self.op)
        inner = unique(g, f"{tag}__{self.inverse.lower()}")
        return [helper.make_node(self.inverse, list(n.input), [inner], name=inner),
                helper.make_node("Not", [inner], list(n.output), name=tag)]


class ReplaceGreaterOrEqual(_NotOf):
    """``GreaterOrEqual(a, b)`` becomes ``Not(Less(a, b))`` (equal unless a value is NaN)."""

    op, inverse = "GreaterOrEqual", "Less"


class ReplaceLessOrEqual(_NotOf):
    """``LessOrEqual(a, b)`` becomes ``Not(Greater(a, b))`` (equal unless a value is NaN)."""

    op, inverse = "LessOrEqual", "Greater"


class FuseMulIntoMatmul(Pass):
    """``MatMul(X, W)`` read only by ``Mul(_, s)``, with constant ``W`` and scalar constant
    ``s``, becomes ``MatMul(X, W*s)``."""

    def run(self, onnx_model: onnx.ModelProto) -> onnx.ModelProto:
        model = copy_model(onnx_model)
        g = model.graph
        readers = consumers(g)
        by_out = {o: n for n in g.node for o in n.output}
        outs = {o.name for o in g.output}
        for mul in [n for n in g.node if n.op_type == "Mul"]:
            for k in (0, 1):
                mm = by_out.get(mul.input[k])
                s = constant_value(g, mul.input[1 - k])
                if mm is None or mm.op_type != "MatMul" or s is None or s.size != 1 or \
                        len(readers.get(mm.output[0], [])) != 1 or mm.output[0] in outs:
                    continue
                w = constant_value(g, mm.input[1])
                if w is None:
                    continue
                mm.input[1] = make_const(g, f"{mm.name or 'MatMul'}__W_scaled",
                                         (w * s.reshape(())).astype(w.dtype))
                mm.output[0] = mul.output[0]
                g.node.remove(mul)
                break
        return prune(model)


class FillSqueezeAxes(_Rewrite):
    """``Squeeze`` without axes gets the axes of its input's dims of size 1."""

    def run(self, onnx_model: onnx.ModelProto) -> onnx.ModelProto:
        self.shapes = {}
        g = infer_lenient(copy_model(onnx_model)).graph
        for vi in list(g.input) + list(g.value_info):
            tt = vi.type.tensor_type
            if tt.HasField("shape"):
                self.shapes[vi.name] = [d.dim_value if d.HasField("dim_value") else -1
                                        for d in tt.shape.dim]
        return super().run(onnx_model)

    def rewrite(self, g: onnx.GraphProto, n: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        if n.op_type != "Squeeze" or len(n.input) > 1 or _attr(n, "axes", None) is not None:
            return None
        dims = self.shapes.get(n.input[0])
        if dims is None or any(d < 0 for d in dims):
            return None
        axes = [k for k, d in enumerate(dims) if d == 1]
        if main_opset(self.model) >= 13:
            return [helper.make_node("Squeeze", [n.input[0], make_const(
                g, f"{n.name or 'Squeeze'}__axes", np.array(axes, np.int64))], list(n.output),
                name=n.name)]
        return [helper.make_node("Squeeze", [n.input[0]], list(n.output), name=n.name, axes=axes)]


class EliminateNopCast(_Rewrite):
    """A ``Cast`` to the type its input already has is removed (its output renamed)."""

    def rewrite(self, g: onnx.GraphProto, n: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        if n.op_type != "Cast" or self.types.get(n.input[0]) != _attr(n, "to", -1):
            return None
        return [helper.make_node("Identity", [n.input[0]], list(n.output), name=n.name)]


class EliminateNopTranspose(_Rewrite):
    """A ``Transpose`` whose permutation is the identity is removed."""

    def rewrite(self, g: onnx.GraphProto, n: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        perm = _attr(n, "perm", None)
        if n.op_type != "Transpose" or perm is None or list(perm) != sorted(perm):
            return None
        return [helper.make_node("Identity", [n.input[0]], list(n.output), name=n.name)]


class FuseConsecutiveTranspose(Pass):
    """``Transpose(Transpose(x, p1), p2)`` whose inner Transpose has no other reader
    becomes one ``Transpose(x, p1[p2])``."""

    def run(self, onnx_model: onnx.ModelProto) -> onnx.ModelProto:
        model = copy_model(onnx_model)
        g = model.graph
        readers = consumers(g)
        by_out = {o: n for n in g.node for o in n.output}
        outs = {o.name for o in g.output}
        for outer in [n for n in g.node if n.op_type == "Transpose"]:
            inner = by_out.get(outer.input[0])
            p1, p2 = (_attr(inner, "perm", None) if inner is not None else None,
                      _attr(outer, "perm", None))
            if inner is None or inner.op_type != "Transpose" or p1 is None or p2 is None or \
                    len(readers.get(inner.output[0], [])) != 1 or inner.output[0] in outs:
                continue
            fused = [int(p1[k]) for k in p2]
            outer.input[0] = inner.input[0]
            del outer.attribute[:]
            outer.attribute.append(helper.make_attribute("perm", fused))
            g.node.remove(inner)
        return model


def _rename_all(g: onnx.GraphProto, old: str, new: str) -> None:
    for n in g.node:
        n.input[:] = [new if i == old else i for i in n.input]
        for sg in subgraphs(n):
            _rename_all(sg, old, new)


class _NopRemoval(_Rewrite):
    """Removes the nodes ``is_nop`` finds (their output renamed to their input)."""

    def run(self, onnx_model: onnx.ModelProto) -> onnx.ModelProto:
        self.shapes = _types_and_shapes(onnx_model)[1]
        self.removed: dict[str, str] = {}
        model = super().run(onnx_model)
        g = model.graph
        outs = {o.name for o in g.output}
        keep = [n for n in g.node if not (n.op_type == "Identity" and n.output[0] in self.removed
                                          and n.output[0] not in outs)]
        del g.node[:]
        g.node.extend(keep)
        for old, new in self.removed.items():
            if old not in outs:
                _rename_all(g, old, new)
        return prune(model)

    def rewrite(self, g: onnx.GraphProto, n: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        if not n.input or not self.is_nop(g, n):
            return None
        self.removed[n.output[0]] = n.input[0]
        return [helper.make_node("Identity", [n.input[0]], [n.output[0]], name=n.name)]

    def same_shape(self, a: str, b: str) -> bool:
        sa, sb = self.shapes.get(a), self.shapes.get(b)
        return sa is not None and sa == sb and all(d >= 0 for d in sa) and \
            self.types.get(a) == self.types.get(b)

    def is_nop(self, g: onnx.GraphProto, n: onnx.NodeProto) -> bool:
        raise NotImplementedError


class EliminateNopReshape(_NopRemoval):
    """``Reshape``/``Flatten``/``Expand`` whose output has its input's static shape are
    removed."""

    ops = ("Reshape",)

    def is_nop(self, g: onnx.GraphProto, n: onnx.NodeProto) -> bool:
        return n.op_type in self.ops and self.same_shape(n.input[0], n.output[0])


class EliminateNopFlatten(EliminateNopReshape):
    """A ``Flatten`` whose output has its input's static shape is removed."""

    ops = ("Flatten",)


class EliminateNopExpand(EliminateNopReshape):
    """An ``Expand`` whose output has its input's static shape is removed."""

    ops = ("Expand",)


class EliminateNopPad(_NopRemoval):
    """A ``Pad`` with constant all-zero pads is removed."""

    def is_nop(self, g: onnx.GraphProto, n: onnx.NodeProto) -> bool:
        if n.op_type != "Pad":
            return False
        pads = constant_value(g, n.input[1]) if len(n.input) > 1 and n.input[1] else \
            np.asarray(_attr(n, "pads", [1]))
        return pads is not None and not np.any(pads) and \
            self.same_shape(n.input[0], n.output[0])


class EliminateNopArithmetic(_NopRemoval):
    """``x+0``, ``x-0``, ``x*1``, ``x/1`` (a constant, with the output of x's shape and
    type) are removed."""

    _UNIT = {"Add": 0.0, "Sub": 0.0, "Mul": 1.0, "Div": 1.0}

    def is_nop(self, g: onnx.GraphProto, n: onnx.NodeProto) -> bool:
        unit = self._UNIT.get(n.op_type)
        if unit is None or len(n.input) != 2:
            return False
        c = constant_value(g, n.input[1])
        return c is not None and bool(np.all(c == unit)) and \
            self.same_shape(n.input[0], n.output[0])


class ReplaceHardSwish(_Rewrite):
    """``HardSwish(x)`` becomes ``x * HardSigmoid(x, 1/6, 0.5)`` (its definition)."""

    def rewrite(self, g: onnx.GraphProto, n: onnx.NodeProto) -> list[onnx.NodeProto] | None:
        if n.op_type != "HardSwish":
            return None
        tag = n.name or unique(g, "HardSwish")
        hs = unique(g, f"{tag}__hsig")
        return [helper.make_node("HardSigmoid", [n.input[0]], [hs], alpha=1.0 / 6, beta=0.5,
                                 name=hs),
                helper.make_node("Mul", [n.input[0], hs], [n.output[0]], name=tag)]


class FuseBnIntoGemm(Pass):
    """``Gemm`` with constant ``B`` (and ``C``) followed by its only reader, an inference
    ``BatchNormalization`` with constant parameters, becomes one ``Gemm``."""

    def run(self, onnx_model: onnx.ModelProto) -> onnx.ModelProto:
        model = copy_model(onnx_model)
        g = model.graph
        for gemm, bn, p in _fusable_bns(g, "Gemm"):
            b = constant_value(g, gemm.input[1])
            has_c = len(gemm.input) > 2 and bool(gemm.input[2])
            c = constant_value(g, gemm.input[2]) if has_c else np.zeros((), np.float32)
            if b is None or c is None:
                continue
            s, t = p
            b2 = b.astype(np.float64) * (s[:, None] if _attr(gemm, "transB", 0) else s[None, :])
            c2 = float(_attr(gemm, "beta", 1.0)) * c.astype(np.float64) * s + t
            tag = gemm.name or "Gemm"
            gemm.input[1] = make_const(g, f"{tag}__B_bn", b2.astype(b.dtype))
            cname = make_const(g, f"{tag}__C_bn", c2.astype(b.dtype))
            if has_c:
                gemm.input[2] = cname
            else:
                gemm.input.append(cname)
            kept = [a for a in gemm.attribute if a.name != "beta"]
            del gemm.attribute[:]
            gemm.attribute.extend(kept)
            _take_output(g, gemm, bn)
        return prune(model)
