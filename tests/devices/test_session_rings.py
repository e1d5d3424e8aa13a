"""A session's stream rings in /dev/shm, on both kinds of IPU: the small ones share one
segment (``Ring.create_packed``), made once and unlinked once, and the IPU reads and
writes each of them right; a large one has a segment of its own."""

from __future__ import annotations

import os

import numpy as np
import pytest

import host_runtime as model_runtime
from host_runtime import popef
from shm import cleanup
from tests._helpers import weights_of, write_example

SMALL = (1, 4)            # 16-byte transfers: every ring small
LARGE = (1, 1 << 15)      # 128 KiB transfers: every ring larger than a packed one may be


def _kinds() -> dict[str, int]:
    """This process's /dev/shm objects, counted by kind."""
    counts: dict[str, int] = {}
    for obj in cleanup.list_objects():
        if obj.pid == os.getpid():
            counts[obj.kind] = counts.get(obj.kind, 0) + 1
    return counts


@pytest.mark.parametrize("shape, rings", [(SMALL, {"rings": 1}),
                                          (LARGE, {"in": 3, "out": 2})])
def test_small_rings_share_one_segment_and_a_large_one_has_its_own(
        make_runner, tmp_path, shape, rings) -> None:
    path = write_example(tmp_path, shape)
    w = weights_of(popef.load_model([path]), shape)
    before = _kinds()
    runner = make_runner(model_runtime.PopefPaths([path]))
    during = _kinds()
    made = {k: during.get(k, 0) - before.get(k, 0) for k in ("rings", "in", "out")}
    assert {k: v for k, v in made.items() if v} == rings
    rng = np.random.default_rng(3)
    for _ in range(3):   # every ring carries its own transfers
        a, b = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
        out = runner.execute({"tensor_A": a, "tensor_B": b})
        np.testing.assert_allclose(out["tensor_C"], a * w + b, rtol=1e-6)
    runner.close()
    after = _kinds()
    assert {k: after.get(k, 0) for k in ("rings", "in", "out")} == {
        k: before.get(k, 0) for k in ("rings", "in", "out")}
