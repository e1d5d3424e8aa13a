"""Inputs for the example model (``C = A * weights + B``, a batch of 4 samples of 3
floats) that the runner tests of this folder share, and the check that a runner still
answers it correctly."""

from __future__ import annotations

import numpy as np

SHAPE = (4, 3)        # batch of 4 samples of 3 floats


def rand(shape=SHAPE, seed=None):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def pair(shape=SHAPE):
    return rand(shape), rand(shape)


def check_healthy(runner, weights):
    a, b = pair()
    out = runner.execute({"tensor_A": a, "tensor_B": b})
    np.testing.assert_allclose(out["tensor_C"], a * weights + b, rtol=1e-6)
