"""How the IPU process runs onnxruntime for an Execute (ipu_emulator.ipu._execute._runner):
through the C-level binding, with run options made once (onnxruntime makes default
ones for every run given none: 0.7 of a [1,4] run's 2.3 us)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from ipu_emulator.ipu._execute import _runner
from tools.bench.runner import _onnx_bytes
from tools.generate_simple_popef import build_simple_model


def test_runs_go_through_the_binding_with_run_options_made_once() -> None:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(_onnx_bytes(build_simple_model((1, 4))), so,
                                providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(5)
    feeds = {i.name: rng.standard_normal((1, 4)).astype(np.float32) for i in sess.get_inputs()}
    out = np.zeros((1, 4), np.float32)
    binding = sess.io_binding()
    for name, arr in feeds.items():
        binding.bind_input(name, "cpu", 0, np.float32, [1, 4], arr.ctypes.data)
    binding.bind_output(sess.get_outputs()[0].name, "cpu", 0, np.float32, [1, 4],
                        out.ctypes.data)
    fn, args = _runner(sess, binding)
    _, args2 = _runner(sess, sess.io_binding())
    assert isinstance(args[-1], ort.RunOptions) and args[-1] is args2[-1]
    fn(*args)
    np.testing.assert_allclose(out, sess.run(None, feeds)[0], rtol=1e-6)
