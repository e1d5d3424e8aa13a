"""Manual sharding recorded in an ONNX model: ``Sharder`` (and the ``manual_sharding``
pass) write the node -> IPU and node -> stage maps into the model's metadata_props;
``Compiler.compile`` with ``virtual_graph_mode = "manual"`` reads them back. The model
stays a valid ONNX model (onnxruntime runs it as it was)."""

from __future__ import annotations

import json

import onnx

from host_runtime.errors import BadRequestError

__all__ = ["SHARDING_KEY", "PIPELINING_KEY", "record_sharding", "read_sharding"]

SHARDING_KEY = "poprt.sharding_info"
PIPELINING_KEY = "poprt.pipelining_info"


def record_sharding(model: onnx.ModelProto, sharding_info: dict[str, int],
                    pipelining_info: dict[str, int]) -> onnx.ModelProto:
    """A copy of ``model`` carrying the maps (the nodes named must exist)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    names = {n.name for n in out.graph.node}
    unknown = sorted((set(sharding_info) | set(pipelining_info)) - names)
    if unknown:
        raise BadRequestError(f"sharding names nodes {unknown[:10]} that the model does not have")
    props = [p for p in out.metadata_props if p.key not in (SHARDING_KEY, PIPELINING_KEY)]
    del out.metadata_props[:]
    out.metadata_props.extend(props)
    for key, value in ((SHARDING_KEY, sharding_info), (PIPELINING_KEY, pipelining_info)):
        if value:
            out.metadata_props.add(key=key, value=json.dumps(value, sort_keys=True))
    return out


def read_sharding(model: onnx.ModelProto) -> tuple[dict[str, int], dict[str, int]]:
    """The maps ``record_sharding`` wrote (empty when none)."""
    props = {p.key: p.value for p in model.metadata_props}
    out = []
    for key in (SHARDING_KEY, PIPELINING_KEY):
        text = props.get(key)
        try:
            out.append({str(k): int(v) for k, v in json.loads(text).items()} if text else {})
        except (ValueError, AttributeError):
            raise BadRequestError(f"the model's metadata {key!r} is not a map of node names "
                                  "to integers") from None
    return out[0], out[1]
