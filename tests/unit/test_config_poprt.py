"""PopRT RuntimeConfig and the Runner's filling of a fused model's ``index`` (no processes)."""

from __future__ import annotations

import numpy as np
import pytest

from host_runtime.errors import BadRequestError
from host_runtime.poprt.runtime import Runner, RuntimeConfig


def test_runtime_config_has_model_runner_fields_and_defaults():
    c = RuntimeConfig()
    assert c.timeout_ns == 5_000_000_000 and c.validate_io_params is True
    c.timeout_ns = 0
    c.validate_io_params = False
    assert repr(c).startswith("RuntimeConfig(") and "validate_io_params=False" in repr(c)
    with pytest.raises(AttributeError, match="no option 'timeout'"):
        c.timeout = 1


def fused_runner():
    r = Runner.__new__(Runner)        # the index logic only, no device
    r._fused = True
    r._subgraph_of = {"graph0/X": 0, "graph0/Y": 0, "graph0/O": 0, "graph1/X": 1, "graph1/O": 1}
    r._index_dtype = np.dtype(np.int32)
    r._index_shape = (1,)
    return r


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
