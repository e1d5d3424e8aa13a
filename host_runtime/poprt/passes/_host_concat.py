"""PopRT's ``apply_host_concat_split``: inputs of one element type and shape are merged
into one input the host fills (``HostConcatRunner`` writes each original input's bytes
one after the other), and the model takes them apart again on the device.

On an IPU the split is PopRT's HCSR custom op; here each original input becomes a
``Gather`` of its row of the merged input, which computes the same values. The merged
inputs are described in the model's metadata under ``sHostConcatRunnerConfig``
(``poprt._names``), which PopRT's examples copy into the PopEF file as an opaque blob of
that name for ``HostConcatRunner`` to read.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import numpy as np
import onnx
from onnx import helper

from host_runtime.errors import BadRequestError
from host_runtime.poprt._names import sHostConcatRunnerConfig
from host_runtime.poprt._onnx_util import copy_model, graph_inputs, make_const, unique
from host_runtime.poprt.passes._base import Pass

__all__ = ["ApplyHostConcatSplit"]


def _spec(item: Any) -> tuple[int, list[int], int]:
    """(element type, shape, most inputs per merge; 0: all) of one ``merged_inputs`` item."""
    try:
        dtype, shape = int(item[0]), [int(d) for d in item[1]]
        most = int(item[2]) if len(item) > 2 and item[2] else 0
    except (TypeError, ValueError, IndexError):
        raise BadRequestError(f"apply_host_concat_split: expected (onnx element type, shape"
                              f"[, most inputs per merge]) items, got {item!r}") from None
    if most < 0 or any(d <= 0 for d in shape):
        raise BadRequestError(f"apply_host_concat_split: {item!r} has a shape or count "
                              "that is not positive")
    return dtype, shape, most


def _static_dims(vi: onnx.ValueInfoProto) -> list[int] | None:
    if vi.type.WhichOneof("value") != "tensor_type":
        return None
    dims = vi.type.tensor_type.shape.dim
    if not all(d.HasField("dim_value") for d in dims):
        return None
    return [d.dim_value for d in dims]


class ApplyHostConcatSplit(Pass):
    """Merge the model's inputs of each ``(element type, shape[, most per merge])`` of
    ``merged_inputs`` into inputs ``[N, *shape]`` filled by the host, and take them apart
    on the device (module docstring). Groups of one input are left alone."""

    def __init__(self, merged_inputs: Sequence[Any] = (), *args: Any, **kwargs: Any) -> None:
        super().__init__(merged_inputs, *args, **kwargs)
        self.merged_inputs = [_spec(item) for item in merged_inputs]

    def run(self, onnx_model: onnx.ModelProto) -> onnx.ModelProto:
        model = copy_model(onnx_model)
        g = model.graph
        taken: set[str] = set()
        configs: list[dict[str, Any]] = []
        gathers: list[onnx.NodeProto] = []
        for dtype, shape, most in self.merged_inputs:
            group = [vi for vi in graph_inputs(g) if vi.name not in taken
                     and vi.type.tensor_type.elem_type == dtype and _static_dims(vi) == shape]
            step = most or len(group) or 1
            for start in range(0, len(group), step):
                chunk = group[start:start + step]
                if len(chunk) < 2:
                    continue
                taken.update(vi.name for vi in chunk)
                merged = unique(g, f"host_concat_{len(configs)}")
                for row, vi in enumerate(chunk):
                    index = make_const(g, f"{merged}_row{row}", np.array(row, np.int64))
                    gathers.append(helper.make_node("Gather", [merged, index], [vi.name],
                                                    axis=0, name=f"{merged}/split{row}"))
                itemsize = helper.tensor_dtype_to_np_dtype(dtype).itemsize
                merged_shape = [len(chunk), *shape]
                configs.append({"tensor_name": merged,
                                "input_tensor_names": [vi.name for vi in chunk],
                                "shape": merged_shape,
                                "data_size_bytes": int(np.prod(merged_shape)) * itemsize})
                position = list(g.input).index(chunk[0])
                g.input.insert(position, helper.make_tensor_value_info(merged, dtype,
                                                                       merged_shape))
        if not configs:
            return model
        kept = [vi for vi in g.input if vi.name not in taken]
        del g.input[:]
        g.input.extend(kept)
        nodes = gathers + list(g.node)
        del g.node[:]
        g.node.extend(nodes)
        entry = next((p for p in model.metadata_props if p.key == sHostConcatRunnerConfig),
                     None)
        if entry is None:
            entry = model.metadata_props.add()
            entry.key = sHostConcatRunnerConfig
        entry.value = json.dumps(configs)
        return model
