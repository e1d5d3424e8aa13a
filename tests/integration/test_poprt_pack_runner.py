"""PopRT's ``PackRunner``: variable-length requests packed into the rows of a batch (first
fit, next fit, across rows with the model's own unpacking, padding removal, the
timeout), each request's outputs unpacked back to it; and the ``poprt_exec`` command.
Numbers are checked against onnxruntime run on the packed batch the docs describe."""

from __future__ import annotations

import gc
import os
import weakref

import numpy as np
import numpy.testing as npt
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from host_runtime.errors import BadRequestError, DeviceTimeoutError, InvalidStateError
from host_runtime.poprt import runtime
from host_runtime.poprt.compiler import compile as poprt_compile
from tests._helpers import tag_objects
from tests.models import make_model

pytestmark = pytest.mark.usefixtures("private_machine")

B, S, V = 3, 10, 6   # rows, tokens per row, most requests of a batch (unpack info)


def token_model() -> onnx.ModelProto:
    """output = input_ids * attention_mask + 2 * token_type_ids (per token)."""
    two = helper.make_tensor("two", TensorProto.FLOAT, (1,), [2.0])
    return make_model(helper.make_graph(
        [helper.make_node("Mul", ["input_ids", "attention_mask"], ["m"]),
         helper.make_node("Mul", ["token_type_ids", "two"], ["t"]),
         helper.make_node("Add", ["m", "t"], ["output"])], "tokens",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, (B, S))
         for n in ("attention_mask", "input_ids", "token_type_ids")],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, (B, S))], [two]))


def unpack_model() -> onnx.ModelProto:
    """Requests laid end to end over the B*S tokens; ``unpack_info`` holds their lengths.
    output[k] = request k's tokens * 3 (zeros past its length): the model's own unpacking."""
    nodes = [
        helper.make_node("Reshape", ["input_ids", "flat_shape"], ["flat"]),
        helper.make_node("CumSum", ["unpack_info", "axis0"], ["offs"], exclusive=1),
        helper.make_node("Unsqueeze", ["offs", "axis1"], ["offs2"]),
        helper.make_node("Add", ["offs2", "cols"], ["idx0"]),
        helper.make_node("Min", ["idx0", "last"], ["idx"]),
        helper.make_node("Gather", ["flat", "idx"], ["g"]),
        helper.make_node("Unsqueeze", ["unpack_info", "axis1"], ["len2"]),
        helper.make_node("Less", ["cols", "len2"], ["valid"]),
        helper.make_node("Cast", ["valid"], ["validf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["g", "validf"], ["gm"]),
        helper.make_node("Mul", ["gm", "three"], ["output"]),
    ]
    inits = [
        helper.make_tensor("flat_shape", TensorProto.INT64, (1,), [B * S]),
        helper.make_tensor("axis0", TensorProto.INT32, (), [0]),
        helper.make_tensor("axis1", TensorProto.INT64, (1,), [1]),
        helper.make_tensor("cols", TensorProto.INT32, (S,), list(range(S))),
        helper.make_tensor("last", TensorProto.INT32, (1,), [B * S - 1]),
        helper.make_tensor("three", TensorProto.FLOAT, (1,), [3.0]),
    ]
    return make_model(helper.make_graph(
        nodes, "unpack",
        [helper.make_tensor_value_info("input_ids", TensorProto.FLOAT, (B, S)),
         helper.make_tensor_value_info("unpack_info", TensorProto.INT32, (V,))],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, (V, S))], inits))


@pytest.fixture(scope="module")
def token_popef(tmp_path_factory) -> str:
    return str(poprt_compile(token_model(), tmp_path_factory.mktemp("tok")).popef_path)


@pytest.fixture(scope="module")
def unpack_popef(tmp_path_factory) -> str:
    return str(poprt_compile(unpack_model(), tmp_path_factory.mktemp("unpack")).popef_path)


def _requests(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.uniform(1, 2, n).astype(np.float32),
             "attention_mask": np.ones(n, np.float32),
             "token_type_ids": rng.integers(0, 2, n).astype(np.float32)} for n in lengths]


def _expected_single_row(reqs, placement):
    """What onnxruntime gives for each request on the batch the docs describe: request k
    at (row, col) with mask value = its number in its row."""
    packed = {n: np.zeros((B, S), np.float32) for n in reqs[0]}
    for r, (row, col, number) in zip(reqs, placement):
        n = len(r["input_ids"])
        for name, v in r.items():
            packed[name][row, col:col + n] = v * (number if name == "attention_mask" else 1)
    sess = ort.InferenceSession(token_model().SerializeToString(),
                                providers=["CPUExecutionProvider"])
    out = sess.run(None, packed)[0]
    return [out[row, col:col + len(r["input_ids"])] for r, (row, col, _) in zip(reqs, placement)]


# lengths 7 4 2 9 3 1 | 5 into rows of 10: first fit fills gaps above, next fit only the last row
FIRST_FIT = [(0, 0, 1), (1, 0, 1), (0, 7, 2), (2, 0, 1), (1, 4, 2), (0, 9, 3), (0, 0, 1)]
NEXT_FIT = [(0, 0, 1), (1, 0, 1), (1, 4, 2), (2, 0, 1), (0, 0, 1), (0, 3, 2), (0, 4, 3)]


@pytest.mark.parametrize("algo,placement", [("first_fit", FIRST_FIT), ("next_fit", NEXT_FIT)])
def test_single_row_packing_matches_onnxruntime(token_popef, algo, placement):
    config = runtime.PackRunnerConfig(timeout_microseconds=60_000_000, max_valid_num=40,
                                      dynamic_input_name="input_ids")
    config.algorithm = getattr(runtime.PackAlgorithm, algo)
    config.enable_input_single_row_mode("attention_mask")
    runner = runtime.Runner(token_popef, config)
    assert isinstance(runner, runtime.PackRunner)
    try:
        reqs = _requests([7, 4, 2, 9, 3, 1, 5])
        outs = [np.zeros(S, np.float32) for _ in reqs]
        futures = [runner.execute_async(r, {"output": o}) for r, o in zip(reqs, outs)]
        # the first batch is full at the request that does not fit: it runs at once
        end = 6 if algo == "first_fit" else 4
        for f in futures[:end]:
            assert f.wait(timeout=30), "a full batch must not wait for the timeout"
        runner.close()   # requests still gathering fail, nothing is left running
        assert all(f.done() for f in futures)
        want = _expected_single_row(reqs[:end], placement[:end])
        for o, w in zip(outs[:end], want):
            npt.assert_allclose(o[:len(w)], w, rtol=1e-6)
            assert not o[len(w):].any(), "only the request's own tokens are written"
        with pytest.raises(Exception, match="closed before the request ran"):
            futures[end].result()
    finally:
        runner.close()


def test_lone_request_runs_after_the_timeout(token_popef):
    config = runtime.PackRunnerConfig(timeout_microseconds=2000)
    config.enable_input_single_row_mode("attention_mask")
    runner = runtime.Runner(token_popef, config)
    try:
        req = _requests([6], seed=3)[0]
        out = np.zeros(S, np.float32)
        runner.execute(req, {"output": out})
        npt.assert_allclose(out[:6], _expected_single_row([req], [(0, 0, 1)])[0], rtol=1e-6)
    finally:
        runner.close()


def test_padding_removal_cuts_each_request_to_its_mask(token_popef):
    config = runtime.PackRunnerConfig(timeout_microseconds=1000)
    config.enable_padding_remove_mode("attention_mask", ["input_ids", "attention_mask",
                                                         "token_type_ids"])
    config.disable_data_across_rows = True
    runner = runtime.Runner(token_popef, config)
    try:
        short = _requests([4], seed=5)[0]
        padded = {n: np.concatenate([v, np.zeros(S - 4, np.float32)]) for n, v in short.items()}
        out = np.zeros(S, np.float32)
        runner.execute(padded, {"output": out})
        npt.assert_allclose(out[:4], _expected_single_row([short], [(0, 0, 1)])[0], rtol=1e-6)
        assert not out[4:].any()
    finally:
        runner.close()


def test_padded_batch_of_one_requests_and_whole_batch_outputs(token_popef):
    """A harness feeding its data loader's batch of one: padded ``[1, S]`` inputs, output
    arrays shaped as ``get_model_outputs()`` says (``[B, S]``) or ``[1, S]``. Leading
    dimensions count as tokens, so the request's tokens land in the first entries."""
    config = runtime.PackRunnerConfig(timeout_microseconds=1000)
    config.enable_input_single_row_mode("attention_mask")
    config.enable_padding_remove_mode("attention_mask", ["input_ids", "token_type_ids"])
    runner = runtime.Runner(token_popef, config)
    try:
        shapes = {d.name: list(d.shape) for d in runner.get_model_outputs()}
        assert shapes == {"output": [B, S]}
        for n, dest_shape in ((6, [B, S]), (3, [1, S])):
            short = _requests([n], seed=n)[0]
            padded = {k: np.concatenate([v, np.zeros(S - n, np.float32)])[None, :]
                      for k, v in short.items()}
            out = np.zeros(dest_shape, np.float32)
            runner.execute_async(padded, {"output": out}).wait()
            want = _expected_single_row([short], [(0, 0, 1)])[0]
            npt.assert_allclose(out.reshape(-1)[:n], want, rtol=1e-6)
            assert not out.reshape(-1)[n:].any()
        with pytest.raises(BadRequestError, match=r"output 'output' must be \[>= 4\] \(the "
                                                  r"request's tokens\), got \[3, 1\]"):
            runner.execute_async(_requests([4])[0], {"output": np.zeros((3, 1), np.float32)})
    finally:
        runner.close()


def test_per_token_inputs_outside_the_padding_group_are_packed(token_popef):
    """ByteMLPerf's pack path: padding removal names only the data loader's inputs; the
    harness adds an unpadded per-token input of its own (``[L]`` position ids; here
    token_type_ids). It is packed with the request's tokens, not refused."""
    config = runtime.PackRunnerConfig(timeout_microseconds=1000)
    config.enable_input_single_row_mode("attention_mask")
    config.enable_padding_remove_mode("attention_mask", ["input_ids"])
    runner = runtime.Runner(token_popef, config)
    try:
        short = _requests([5], seed=9)[0]
        req = {k: np.concatenate([v, np.zeros(S - 5, np.float32)])[None, :]
               for k, v in short.items() if k != "token_type_ids"}
        req["token_type_ids"] = short["token_type_ids"]
        out = np.zeros(S, np.float32)
        runner.execute(req, {"output": out})
        npt.assert_allclose(out[:5], _expected_single_row([short], [(0, 0, 1)])[0], rtol=1e-6)
    finally:
        runner.close()


def test_across_rows_with_the_models_unpacking(unpack_popef):
    config = runtime.PackRunnerConfig(timeout_microseconds=60_000_000)
    runner = runtime.Runner(unpack_popef, config)
    try:
        rng = np.random.default_rng(7)
        lengths = [8, 9, 5, 7, 1, 3]   # 33 tokens > 30: the sixth waits for the next batch
        reqs = [{"input_ids": rng.uniform(1, 2, n).astype(np.float32),
                 "unpack_info": np.zeros(V, np.int32)} for n in lengths]
        outs = [np.zeros(S, np.float32) for _ in reqs]
        futures = [runner.execute_async(r, {"output": o}) for r, o in zip(reqs, outs)]
        for f in futures[:5]:
            assert f.wait(timeout=30)
        runner.close()
        flat = np.concatenate([r["input_ids"] for r in reqs[:5]] + [np.zeros(B * S - 30)])
        info = np.array(lengths[:5] + [0], np.int32)
        sess = ort.InferenceSession(unpack_model().SerializeToString(),
                                    providers=["CPUExecutionProvider"])
        want = sess.run(None, {"input_ids": flat.reshape(B, S).astype(np.float32),
                               "unpack_info": info})[0]
        for k in range(5):
            npt.assert_allclose(outs[k], want[k], rtol=1e-6)
            npt.assert_allclose(outs[k][:lengths[k]], reqs[k]["input_ids"] * 3, rtol=1e-6)
    finally:
        runner.close()


def test_bad_requests_are_refused_by_name(token_popef):
    config = runtime.PackRunnerConfig(timeout_microseconds=1000)
    config.enable_input_single_row_mode("attention_mask")
    runner = runtime.Runner(token_popef, config)
    try:
        req = _requests([S + 1])[0]
        with pytest.raises(BadRequestError, match="'input_ids' has 11 tokens; expected 1..10"):
            runner.execute_async(req, {"output": np.zeros(S, np.float32)})
        ok = _requests([4])[0]
        with pytest.raises(BadRequestError, match=r"output 'output' must be \[>= 4\] \(the "
                                                  r"request's tokens\), got \[3\]"):
            runner.execute_async(ok, {"output": np.zeros(3, np.float32)})
        del req["input_ids"]
        with pytest.raises(BadRequestError, match=r"at least \['input_ids'\]\); missing "
                                                  r"\['input_ids'\], unexpected \[\]"):
            runner.execute_async(req, {"output": np.zeros(S, np.float32)})
        # inputs a request leaves out are zeros (PopRT's example leaves out position ids)
        partial = {"input_ids": ok["input_ids"]}
        out = np.zeros(S, np.float32)
        runner.execute(partial, {"output": out})
        full = dict(ok, token_type_ids=np.zeros(4, np.float32))
        npt.assert_allclose(out[:4], _expected_single_row([full], [(0, 0, 1)])[0], rtol=1e-6)
    finally:
        runner.close()
    with pytest.raises(BadRequestError, match="needs a PackRunnerConfig, got RuntimeConfig"):
        runtime.PackRunner(token_popef, runtime.RuntimeConfig())


def test_a_dropped_pack_runner_leaves_nothing_behind(token_popef):
    before = tag_objects()
    gc.collect()
    gc.disable()
    try:
        config = runtime.PackRunnerConfig(timeout_microseconds=100)
        config.enable_input_single_row_mode("attention_mask")
        runner = runtime.Runner(token_popef, config)
        runner.execute(_requests([3])[0], {"output": np.zeros(S, np.float32)})
        del runner
        assert tag_objects() == before
    finally:
        gc.enable()


def test_a_reloaded_pack_runner_packs_again(token_popef):
    """reload() (Runner's: load the model again after close()/stop()) gives a PackRunner
    that runs requests, not one whose packing thread is gone."""
    config = runtime.PackRunnerConfig(timeout_microseconds=1000)
    config.enable_input_single_row_mode("attention_mask")
    runner = runtime.Runner(token_popef, config)
    try:
        req = _requests([5], seed=4)[0]
        runner.close()
        runner.reload()
        out = np.zeros(S, np.float32)
        runner.execute(req, {"output": out})
        npt.assert_allclose(out[:5], _expected_single_row([req], [(0, 0, 1)])[0], rtol=1e-6)
    finally:
        runner.close()


def test_a_failed_packed_request_is_freed_without_the_garbage_collector(token_popef):
    """A request whose batch failed on the engine, its error raised to the caller: the
    future (and what the traceback's frames hold, the runner among them) goes with the
    last reference, gc off; raising it twice gives the same error."""
    config = runtime.PackRunnerConfig(timeout_microseconds=100)
    config.enable_input_single_row_mode("attention_mask")
    runner = runtime.Runner(token_popef, config)
    gc.collect()
    gc.disable()
    try:
        runner.model_runner.close()   # the batch fails in the packing thread
        future = runner.execute_async(_requests([4])[0], {"output": np.zeros(S, np.float32)})
        assert future.wait(timeout=30)
        messages = []
        for _ in range(2):
            try:
                future.result()
            except InvalidStateError as exc:
                messages.append(str(exc))
        assert len(messages) == 2 and messages[0] == messages[1]
        runner.close()   # the packing thread ends: only the error can hold the future
        ref = weakref.ref(future)
        del future
        assert ref() is None, "the failed request's future is kept by a reference cycle"
    finally:
        gc.enable()
        runner.close()


def test_a_packed_request_not_done_in_time_raises_the_named_timeout(token_popef):
    """result(timeout)/exception(timeout) on a request still gathering: DeviceTimeoutError
    (a TimeoutError), as the engine's OutputFuture; the request still runs on close."""
    config = runtime.PackRunnerConfig(timeout_microseconds=60_000_000)
    config.enable_input_single_row_mode("attention_mask")
    runner = runtime.Runner(token_popef, config)
    try:
        future = runner.execute_async(_requests([4])[0], {"output": np.zeros(S, np.float32)})
        for call in (future.result, future.exception):
            with pytest.raises(DeviceTimeoutError, match="did not finish within 0 s"):
                call(timeout=0)
        assert not future.done()
    finally:
        runner.close()
    assert isinstance(future.exception(), InvalidStateError)


# -- poprt_exec ------------------------------------------------------------------------------
def test_poprt_exec_runs_a_popef_file(token_popef, tmp_path, capsys):
    from tools.poprt_exec import main

    inputs = {"input_ids": np.full((B, S), 2, np.float32),
              "attention_mask": np.ones((B, S), np.float32),
              "token_type_ids": np.ones((B, S), np.float32)}
    args = []
    for name, value in inputs.items():
        np.save(tmp_path / f"{name}.npy", value)
        args += ["--input", f"{name}={tmp_path / name}.npy"]
    for runner in ("modelRunner", "lightRunner"):
        assert main(["poprt_run_popef", "--popef", token_popef, "--runner", runner,
                     "--iteration", "3", "--numThreads", "2", "--saveOutputs",
                     str(tmp_path / runner), *args]) == 0
        got = np.load(tmp_path / runner / "output.npy")
        want = ort.InferenceSession(token_model().SerializeToString(),
                                    providers=["CPUExecutionProvider"]).run(None, inputs)[0]
        npt.assert_allclose(got, want)
        assert "requests: 6 (2 thread(s) x 3 iteration(s))" in capsys.readouterr().out
    assert main(["poprt_run_popef", "--popef", token_popef, "--runner", "packRunner",
                 "--numThreads", "4", "--maxValidNum", "10", "--packTimeout", "2000",
                 "--dynamicInputName", "input_ids", "--maskName", "attention_mask",
                 "--batchSize", "2"]) == 0
    assert "runner: PackRunner" in capsys.readouterr().out
    assert main(["--popef", str(tmp_path / "absent.popef")]) == 2
    assert "absent.popef" in capsys.readouterr().err


def test_poprt_exec_is_a_module_and_a_console_script(token_popef):
    import configparser
    import subprocess
    import sys

    root = os.path.join(os.path.dirname(__file__), "..", "..")
    proc = subprocess.run([sys.executable, "-m", "tools.poprt_exec", "poprt_run_popef",
                           "--popef", token_popef, "--iteration", "2"],
                          cwd=root, env=dict(os.environ, PYTHONPATH=os.path.abspath(root)),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "runner: Runner" in proc.stdout and "requests: 2 " in proc.stdout

    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(root, "setup.cfg"))
    assert "poprt_exec = tools.poprt_exec:main" in cfg["options.entry_points"]["console_scripts"]
