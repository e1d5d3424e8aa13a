"""The IPU process runs Main with zero-copy streams: onnxruntime reads and writes ring slots.

White-box: the device memory region is created by the host's Session, so the test
reads it and sees that the zero-copy tensors were never written there, nor the
Load-streamed weights (PopEF tensor data: read where the shared constants region holds
them, docs/memory.md); the Save path reads them there.
"""

from __future__ import annotations

import numpy as np
import pytest

import host_runtime as model_runtime
from host_runtime import popef
from ipu_emulator.executable import Executable

SHAPE = (2, 3)

pytestmark = pytest.mark.usefixtures("private_machine")


def _device_tensor(runner: model_runtime.ModelRunner, exe: Executable, name: str) -> np.ndarray:
    region = runner._replicas[0].session._loader.memory_region
    t = exe.tensors[name]
    return np.frombuffer(region.buf, np.float32, int(np.prod(t.shape)), t.offset).reshape(t.shape)


@pytest.mark.parametrize("iterations", [1, 3])
def test_main_streams_bypass_device_memory(tmp_path, iterations) -> None:
    from tools.generate_simple_popef import write_simple_popef

    path = str(tmp_path / "m.popef")
    write_simple_popef(path, shape=SHAPE, batches_per_step=iterations)
    model = popef.load_model([path])
    exe = Executable.from_bytes(model.executable.payload())
    weights = np.frombuffer(model.tensors[0].data, np.float32).reshape(SHAPE)
    cfg = model_runtime.ModelRunnerConfig()
    saved: dict = {}
    cfg.run_save_programs = True
    cfg.replica_to_save_programs_outputs = {0: saved}
    rng = np.random.default_rng(iterations)
    with model_runtime.ModelRunner(path, config=cfg) as runner:
        for _ in range(2 * iterations + 1):
            a, b = (rng.standard_normal(SHAPE).astype(np.float32) for _ in range(2))
            out = runner.execute({"tensor_A": a, "tensor_B": b})
            np.testing.assert_allclose(out["tensor_C"], a * weights + b, rtol=1e-6)
        for name in ("weights", "tensor_A", "tensor_B", "tensor_C"):
            assert not _device_tensor(runner, exe, name).any(), name
    np.testing.assert_array_equal(np.asarray(saved["weights_saved"]).reshape(SHAPE), weights)
