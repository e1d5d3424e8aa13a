"""A program that knows nothing of tracing (tests/integration/test_trace.py runs it with
IPU_EMULATOR_TRACE set): a model pipelined over 2 IPUs and a model on 2 replicas, a few
requests each, checked against numpy; then it fails with an exception (the trace is
written at exit all the same).

    python trace_program.py PIPELINED.popef SIMPLE.popef CHAIN.onnx
"""

import sys

import numpy as np
import onnx

import host_runtime as model_runtime
from tools._chain_model import reference

pipelined, simple, chain = sys.argv[1:4]
chain_model = onnx.load(chain)
rng = np.random.default_rng(0)
with model_runtime.ModelRunner(pipelined) as runner:
    xs = [rng.standard_normal((2, 8)).astype(np.float32) for _ in range(3)]
    futures = [runner.executeAsync({"x": x}) for x in xs]
    for x, f in zip(xs, futures):
        np.testing.assert_allclose(f["y"].numpy() if hasattr(f["y"], "numpy") else f["y"],
                                   reference(chain_model, x), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(runner.execute({"x": xs[0]})["y"], reference(chain_model, xs[0]),
                               rtol=1e-5, atol=1e-5)

config = model_runtime.ModelRunnerConfig()
config.replication_factor = 2
with model_runtime.ModelRunner(simple, config=config) as runner:
    w = np.frombuffer(runner.model.tensorData("weights").data, np.float32).reshape(1, 4)
    for replica in (0, 1):
        for _ in range(3):
            a, b = rng.standard_normal((2, 1, 4)).astype(np.float32)
            out = runner.execute({"tensor_A": a, "tensor_B": b}, replica_id=replica)
            np.testing.assert_allclose(out["tensor_C"], a * w + b, rtol=1e-6)
print("RESULTS OK", flush=True)
raise RuntimeError("the program fails after its work: the trace is written anyway")
