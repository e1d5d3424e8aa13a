"""Large tensors through ModelRunner (copies split across threads), checked exactly."""

from __future__ import annotations

import numpy as np
import pytest

import host_runtime as model_runtime
from shm.copy import PARALLEL_MIN_BYTES
from tools.bench.runner import _identity_popef

pytestmark = pytest.mark.usefixtures("private_machine")


def test_identity_of_a_tensor_above_the_parallel_copy_size(tmp_path):
    n = PARALLEL_MIN_BYTES // 4 + 1031          # not a multiple of a page
    path = str(tmp_path / "identity.popef")
    _identity_popef(path, n)
    x = np.random.default_rng(7).standard_normal(n).astype(np.float32)
    with model_runtime.ModelRunner(path) as runner:
        y = np.full(n, np.nan, np.float32)
        runner.execute({"x": x}, {"y": y})
        np.testing.assert_array_equal(y, x)
        np.testing.assert_array_equal(runner.execute({"x": x[::-1].copy()})["y"], x[::-1])
