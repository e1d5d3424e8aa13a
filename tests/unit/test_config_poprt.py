"""PopRT RuntimeConfig and the Runner's filling of a fused model's ``index`` (no processes)."""

from __future__ import annotations

import numpy as np
import pytest

from host_runtime.errors import BadRequestError
from host_runtime import popef
from host_runtime.poprt.runtime import RuntimeConfig
from host_runtime.poprt.runtime._runner import FusedIndex


def test_runtime_config_has_model_runner_fields_and_defaults():
    c = RuntimeConfig()
    assert c.timeout_ns == 10_000_000 and c.validate_io_params is True   # PopRT's 10 ms
    c.timeout_ns = 0
    c.validate_io_params = False
    assert repr(c).startswith("RuntimeConfig(") and "validate_io_params=False" in repr(c)
    with pytest.raises(AttributeError, match="no option 'timeout'"):
        c.timeout = 1


class _Metadata:
    """What FusedIndex reads of a fused model's metadata."""

    def anchor(self, name: str) -> popef.Anchor | None:
        if name != "index":
            return None
        return popef.Anchor("index", "index", popef.TensorInfo(popef.DataType.S32, [1]),
                            type=popef.TensorType.INPUT, programs=[1])

    def subgraphs(self) -> dict[str, list[str]]:
        return {"graph0": ["graph0/X", "graph0/Y", "graph0/O"],
                "graph1": ["graph1/X", "graph1/O"]}


class _Model:
    metadata = _Metadata()


class _Fused:
    def __init__(self) -> None:
        self._index = FusedIndex(_Model())  # type: ignore[arg-type]

    def _with_index(self, ins: dict[str, object], outs: dict[str, object]) -> dict[str, object]:
        return self._index.fill(ins, outs)


def fused_runner() -> _Fused:
    return _Fused()


def test_index_filled_from_names():
    r = fused_runner()
    ins = r._with_index({"graph1/X": np.zeros((1, 1))}, {"graph1/O": np.zeros((1, 3))})
    assert ins["index"].dtype == np.int32 and ins["index"].tolist() == [1]
    ins = r._with_index({"graph0/X": 1, "graph0/Y": 2}, {})
    assert ins["index"].tolist() == [0]


def test_explicit_index_kept_and_mixed_names_refused():
    r = fused_runner()
    given = np.array([1], np.int32)
    assert r._with_index({"index": given, "graph0/X": 1}, {})["index"] is given
    with pytest.raises(BadRequestError, match="expected tensors of exactly one sub-graph"):
        r._with_index({"graph0/X": 1}, {"graph1/O": 2})
    with pytest.raises(BadRequestError, match="got no sub-graph tensors"):
        r._with_index({"X": 1}, {})
    as_uint32 = r._with_index({"index": np.array([1], np.uint32)}, {})["index"]
    assert as_uint32.dtype == np.int32 and as_uint32.tolist() == [1]
