"""PopRT's Python runtime (``poprt.runtime``) spelt as PopRT's examples spell it: Runner
and its older name, LightRunner (explicit devices, weights updated in place, stop and
reload), HostConcatRunner, DeviceManager/Device, a fused model's uint32 index, PopRT's
defaults; numbers checked against onnxruntime; dropped runners leave nothing behind."""

from __future__ import annotations

import gc
import json
import warnings

import numpy as np
import numpy.testing as npt
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from host_runtime import popef
from host_runtime.errors import BadRequestError, InvalidStateError
from host_runtime.poprt import runtime
from host_runtime.poprt.compiler import compile as poprt_compile
from host_runtime.runner import ModelRunnerConfig
from tests._helpers import tag_objects
from tests.models import SEED_FUSION_CONFIG, make_model, seed_model0, seed_model1

pytestmark = pytest.mark.usefixtures("private_machine")

RNG = np.random.default_rng(1984)
W0 = RNG.standard_normal((8, 8)).astype(np.float32)


def weights_model(w: np.ndarray = W0) -> onnx.ModelProto:
    """output = Relu(input @ Weight) + 1: a weight the PopEF file carries as tensor data."""
    g = helper.make_graph(
        [helper.make_node("MatMul", ["input", "Weight"], ["mm"]),
         helper.make_node("Relu", ["mm"], ["r"]),
         helper.make_node("Add", ["r", "one"], ["output"])], "weights",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, (4, 8))],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, (4, 8))],
        [numpy_helper.from_array(w, "Weight"),
         numpy_helper.from_array(np.ones((1,), np.float32), "one")])
    return make_model(g)


def ort_run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


@pytest.fixture(scope="module")
def weights_popef(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("weights")
    return str(poprt_compile(weights_model(), d, weights_as_tensor_data=True).popef_path)


@pytest.fixture(scope="module")
def fused_popef(tmp_path_factory) -> str:
    from tools.poprt import main as poprt_main

    d = tmp_path_factory.mktemp("fusion")
    onnx.save(seed_model0(), str(d / "model0.onnx"))
    onnx.save(seed_model1(), str(d / "model1.onnx"))
    (d / "config.yaml").write_text(SEED_FUSION_CONFIG)
    assert poprt_main(["--config_yaml", str(d / "config.yaml")]) == 0
    return str(d / "executable.popef")


def _io(runner):
    x = {d.name: RNG.uniform(0, 1, d.shape).astype(d.numpy_data_type())
         for d in runner.get_execute_inputs()}
    y = {d.name: np.zeros(d.shape, d.numpy_data_type()) for d in runner.get_execute_outputs()}
    return x, y


# -- configuration ------------------------------------------------------------------------
def test_runtime_config_has_poprts_defaults_and_model_runtime_keeps_the_seeds():
    cfg = runtime.RuntimeConfig()
    assert cfg.thread_safe is True
    assert cfg.timeout_ns == 10_000_000
    assert cfg.runner_type is runtime.RunnerType.ModelRunner
    wait = cfg.device_wait_config
    assert isinstance(wait, runtime.DeviceWaitConfig)
    assert (wait.timeout_sec, wait.sleep_time_sec) == (1, 6)
    assert cfg.batching_dim == 0xFFFFFFFF and cfg.validate_io_params is True
    pack = runtime.PackRunnerConfig(timeout_microseconds=15000, max_valid_num=40,
                                    dynamic_input_name="input_ids")
    assert pack.runner_type is runtime.RunnerType.PackRunner
    assert pack.algorithm is runtime.PackAlgorithm.next_fit
    assert (pack.timeout_microseconds, pack.max_valid_num, pack.compile_batch_size) == (15000, 40, -1)
    seeds = ModelRunnerConfig()
    assert seeds.thread_safe is False and seeds.timeout_ns == 5 * 10**9
    with pytest.raises(AttributeError, match="no option 'thread_safety'"):
        cfg.thread_safety = True
    with pytest.raises(BadRequestError, match="max_valid_num: expected an int >= 0, got -1"):
        pack.max_valid_num = -1


def test_flush_by_name_completes_a_request_that_waits_for_data(tmp_path):
    add = make_model(helper.make_graph(
        [helper.make_node("Add", ["X", "Y"], ["O"])], "add",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, (2,)) for n in ("X", "Y")],
        [helper.make_tensor_value_info("O", TensorProto.FLOAT, (2,))]))
    cfg = runtime.RuntimeConfig()
    cfg.validate_io_params = False
    cfg.timeout_ns = 5_000_000
    cfg.flush_by_name = ({"Y": np.full(2, 10, np.float32)}, {})
    runner = runtime.Runner(str(poprt_compile(add, tmp_path).popef_path), cfg)
    try:
        out = np.zeros(2, np.float32)
        runner.execute({"X": np.ones(2, np.float32)}, {"O": out})
        npt.assert_array_equal(out, [11.0, 11.0])
    finally:
        runner.close()
    with pytest.raises(BadRequestError, match="flush_by_name: expected a pair"):
        cfg.flush_by_name = {"Y": 1}


# -- Runner ------------------------------------------------------------------------------
class _Executable:
    """Stands for poprt.compiler.Executable: an object carrying a PopEF file's bytes."""

    def __init__(self, data: bytes) -> None:
        self._data = data

    def to_bytes(self) -> bytes:
        return self._data


@pytest.mark.parametrize("form", ["path", "bytes", "model", "executable"])
def test_runner_loads_every_form_and_matches_onnxruntime(weights_popef, form):
    data = open(weights_popef, "rb").read()
    source = {"path": weights_popef, "bytes": data,
              "model": popef.load_model([weights_popef]), "executable": _Executable(data)}[form]
    runner = runtime.Runner(source, runtime.RuntimeConfig())
    try:
        assert [d.name for d in runner.get_execute_inputs()] == ["input"]
        model_ins = {d.name: d.popef_contains_tensor_data for d in runner.get_model_inputs()}
        assert model_ins == {"input": False, "Weight": True, "one": True}
        assert [d.name for d in runner.get_model_outputs()] == ["output"]
        x, y = _io(runner)
        runner.execute(x, y)
        npt.assert_allclose(y["output"], ort_run(weights_model(), x)[0], rtol=1e-5, atol=1e-5)
        x2, y2 = _io(runner)
        fut = runner.executeAsync(x2, y2)
        fut.wait()
        npt.assert_allclose(y2["output"], ort_run(weights_model(), x2)[0], rtol=1e-5, atol=1e-5)
    finally:
        runner.close()


def test_runner_refuses_what_it_cannot_load():
    with pytest.raises(BadRequestError, match="loads a PopEF path .* got int"):
        runtime.Runner(3)


def test_model_runner_is_the_deprecated_name(weights_popef):
    with pytest.warns(DeprecationWarning, match="use poprt.runtime.Runner"):
        runner = runtime.ModelRunner(weights_popef, runtime.RuntimeConfig())
    try:
        x, y = _io(runner)
        runner.execute(x, y)
        npt.assert_allclose(y["output"], ort_run(weights_model(), x)[0], rtol=1e-5, atol=1e-5)
    finally:
        runner.close()


# -- fused models: the index ------------------------------------------------------------------
def test_fused_index_given_as_uint32_is_accepted_and_range_checked(fused_popef):
    cfg = runtime.RuntimeConfig()
    cfg.timeout_ns = 0
    cfg.validate_io_params = False
    runner = runtime.Runner(fused_popef, cfg)
    try:
        x = np.ones([1, 2], np.float32)
        out = np.zeros([2], np.float32)
        runner.execute({"graph0/X": x, "graph0/Y": 2 * x, "index": np.array([0], np.uint32)},
                       {"graph0/O": out})
        npt.assert_array_equal(out, [3.0, 3.0])
        g1 = np.zeros([1, 3], np.float16)
        runner.execute({"graph1/X": np.full([1, 1], 4, np.float16),
                        "index": np.array([1], np.uint64)}, {"graph1/O": g1})
        npt.assert_array_equal(g1, [[4.0, 1.5, 2.0]])
        with pytest.raises(BadRequestError, match=r"sub-graph number 0\.\.1, got \[7\]"):
            runner.execute({"graph0/X": x, "graph0/Y": x, "index": np.array([7], np.uint32)},
                           {"graph0/O": out})
        with pytest.raises(BadRequestError, match="expected an integer array .* got float32"):
            runner.execute({"graph0/X": x, "graph0/Y": x, "index": np.array([0], np.float32)},
                           {"graph0/O": out})
    finally:
        runner.close()


def test_mfconverter_model_compiled_as_one_graph_takes_a_uint32_index(tmp_path, capsys):
    """PopRT's poprt_run_popef example compiles an MFConverter model with default options
    (no enable_model_fusion) and runs ``poprt_exec ... --index 0``: the index comes as
    uint32 and only sub-graph 0's inputs are the caller's."""
    from host_runtime.poprt.compiler import Compiler, CompilerOptions
    from host_runtime.poprt.converter import MFConverter
    from tools.poprt_exec import main as poprt_exec

    fused = MFConverter().convert([seed_model0(), seed_model1()])
    path = str(tmp_path / "fused_plain.popef")
    Compiler.compile_and_export(fused, None, path, CompilerOptions())
    assert not popef.load_model([path]).metadata.subgraphs()     # compiled as one graph
    runner = runtime.Runner(path)
    try:
        x = np.array([[1.0, 2.0]], np.float32)
        feeds = {"graph0/X": x, "graph0/Y": 3 * x, "graph1/X": np.full([1, 1], 4, np.float16),
                 "index": np.array([0], np.uint32)}
        outs = {d.name: np.zeros(d.shape, d.numpy_data_type()) for d in runner.get_execute_outputs()}
        runner.execute(feeds, outs)
        npt.assert_array_equal(outs["graph0/O"], [4.0, 8.0])
        npt.assert_array_equal(outs["graph1/O"], [[4.0, 1.5, 2.0]])
        with pytest.raises(BadRequestError, match=r"sub-graph number 0\.\.1, got \[2\]"):
            runner.execute(dict(feeds, index=np.array([2], np.uint32)), outs)
    finally:
        runner.close()
    np.save(tmp_path / "x.npy", x)
    assert poprt_exec(["poprt_run_popef", "--popef", path, "--iteration", "3", "--index", "0",
                       "--input", f"graph0/X={tmp_path / 'x.npy'}", "--input",
                       f"graph0/Y={tmp_path / 'x.npy'}", "--saveOutputs", str(tmp_path / "o")]) == 0
    assert "requests: 3 " in capsys.readouterr().out
    npt.assert_array_equal(np.load(tmp_path / "o" / "graph0_O.npy"), [2.0, 4.0])
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["graph0_O.npy"]


# -- devices -----------------------------------------------------------------------------
def _first_free_device(dm: runtime.DeviceManager) -> runtime.ReplicaIdToDevice:
    """What PopRT's lightrunner example does to choose its device."""
    replica_to_device = runtime.ReplicaIdToDevice()
    for device_id in range(dm.get_num_devices()):
        try:
            replica_to_device[0] = dm.get_specific_device(device_id)
            break
        except Exception:
            pass
    assert replica_to_device, "no IPU can be attached"
    return replica_to_device


def test_device_manager_speaks_poprt():
    dm = runtime.DeviceManager()
    assert dm.ipu_hardware_version() in ("ipu2", "ipu21")
    assert dm.get_num_devices() >= 1
    dev = dm.get_device(1)
    try:
        assert dev.ipu_version() == dm.ipu_hardware_version()
        assert dev.device().numIpus() == 1 and dev.is_attached()
    finally:
        dev.close()


# -- LightRunner --------------------------------------------------------------------------
def test_light_runner_updates_weights_in_place_then_stops_and_reloads(weights_popef):
    dm = runtime.DeviceManager()
    config = runtime.LightRunnerConfig()
    config.replica_to_device = _first_free_device(dm)
    device = config.replica_to_device[0]
    runner = runtime.LightRunner(weights_popef, config)
    try:
        pids = runner.model_runner.device_pids()
        assert pids == device.device().pids()   # the runner uses the device it was given
        x, y = _io(runner)
        runner.execute_async(x, y).wait()
        npt.assert_allclose(y["output"], ort_run(weights_model(), x)[0], rtol=1e-5, atol=1e-5)

        infos = {i.name: i for i in runner.get_model_inputs() if i.popef_contains_tensor_data}
        w1 = RNG.uniform(-1, 1, infos["Weight"].shape).astype(infos["Weight"].numpy_data_type())
        runner.set_input_anchor("Weight", w1)
        runner.update_weights()
        runner.execute_async(x, y).wait()
        npt.assert_allclose(y["output"], ort_run(weights_model(w1), x)[0], rtol=1e-5, atol=1e-5)
        assert runner.model_runner.device_pids() == pids, "updated in place, same IPU process"

        runner.stop()
        with pytest.raises(InvalidStateError, match="stopped; reload"):
            runner.execute(x, y)
        another = runtime.LightRunner(weights_popef, config)   # the same device, original weights
        y2 = {"output": np.zeros_like(y["output"])}
        another.execute(x, y2)
        npt.assert_allclose(y2["output"], ort_run(weights_model(), x)[0], rtol=1e-5, atol=1e-5)
        another.stop()

        runner.reload()
        y["output"][...] = 0
        runner.execute(x, y)
        npt.assert_allclose(y["output"], ort_run(weights_model(w1), x)[0], rtol=1e-5, atol=1e-5)
    finally:
        runner.stop()
    with pytest.raises(BadRequestError, match="'input' is not a weight .* expected one of Weight, one"):
        runtime.LightRunner(weights_popef, runtime.LightRunnerConfig()).set_input_anchor(
            "input", np.zeros((4, 8), np.float32))


def test_updated_weights_survive_an_auto_reset(weights_popef):
    import os
    import signal

    import psutil

    config = runtime.LightRunnerConfig()
    config.auto_reset = True
    runner = runtime.LightRunner(weights_popef, config)
    try:
        w1 = RNG.uniform(-1, 1, (8, 8)).astype(np.float32)
        runner.set_input_anchor("Weight", w1)
        runner.update_weights()
        pid = runner.model_runner.device_pids()[0]
        proc = psutil.Process(pid)
        os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=30)
        x, y = _io(runner)
        runner.execute(x, y)     # the replica restarts on a fresh IPU process
        assert runner.model_runner.device_pids() != [pid]
        npt.assert_allclose(y["output"], ort_run(weights_model(w1), x)[0], rtol=1e-5, atol=1e-5)
    finally:
        runner.close()


def test_light_runner_refuses_a_weight_of_the_wrong_shape(weights_popef):
    runner = runtime.LightRunner(weights_popef, runtime.LightRunnerConfig())
    try:
        with pytest.raises(BadRequestError, match=r"expected float32 of shape \[8, 8\], got "
                                                  r"float32 of shape \[8, 4\]"):
            runner.set_input_anchor("Weight", np.zeros((8, 4), np.float32))
        with pytest.raises(BadRequestError, match="no weight was staged"):
            runner.update_weights()
    finally:
        runner.close()


# -- HostConcatRunner ------------------------------------------------------------------------
W_CAT = RNG.standard_normal((3, 5)).astype(np.float32)


def concat_models() -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """The original model (three inputs [5, 1] concatenated) and the merged one (one input
    [3, 5]: the three inputs' bytes one after the other, transposed back)."""
    w = numpy_helper.from_array(W_CAT, "w")
    orig = make_model(helper.make_graph(
        [helper.make_node("Concat", ["a0", "a1", "a2"], ["c"], axis=1),
         helper.make_node("MatMul", ["c", "w"], ["output"])], "orig",
        [helper.make_tensor_value_info(f"a{i}", TensorProto.FLOAT, (5, 1)) for i in range(3)],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, (5, 5))], [w]))
    merged = make_model(helper.make_graph(
        [helper.make_node("Transpose", ["merged"], ["c"], perm=[1, 0]),
         helper.make_node("MatMul", ["c", "w"], ["output"])], "merged",
        [helper.make_tensor_value_info("merged", TensorProto.FLOAT, (3, 5))],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, (5, 5))], [w]))
    return orig, merged


def test_host_concat_runner_concatenates_on_the_host(tmp_path):
    orig, merged = concat_models()
    path = str(poprt_compile(merged, tmp_path).popef_path)
    config = runtime.HostConcatRunnerConfig()
    config.check_package_hash = False
    config.ring_buffer_size_multiplier = 30
    config.timeout_ns = 5 * 1000 * 1000
    hcc = runtime.HostConcatConfig()
    hcc.tensor_name = "merged"
    hcc.input_tensor_names = ["a0", "a1", "a2"]
    hcc.shape = [3, 5]
    hcc.data_size_bytes = 60
    config.host_concat_config = {hcc.tensor_name: hcc}
    runner = runtime.HostConcatRunner(path, config)
    try:
        inputs = {f"a{i}": RNG.uniform(0, 1, (5, 1)).astype(np.float32) for i in range(3)}
        outputs = {"output": np.zeros((5, 5), np.float32)}
        runner.execute_async(inputs, outputs).wait()
        npt.assert_allclose(outputs["output"], ort_run(orig, inputs)[0], rtol=1e-5, atol=1e-5)
        with pytest.raises(BadRequestError, match=r"made of \['a0', 'a1', 'a2'\]; missing \['a2'\]"):
            runner.execute({"a0": inputs["a0"], "a1": inputs["a1"]}, outputs)
    finally:
        runner.close()


def test_the_host_concat_split_pass_and_runner_as_poprts_example_uses_them(tmp_path):
    """PopRT's host_concat_runner_example: ``apply_host_concat_split`` merges inputs of one
    type and shape (at most ``n`` per merge), the compile copies the pass's metadata into
    an opaque blob, and ``HostConcatRunner`` (no config) answers as the original model."""
    from host_runtime.poprt import Pass
    from host_runtime.poprt._names import sHostConcatRunnerConfig
    from host_runtime.poprt.compiler import Compiler, CompilerOptions

    orig, _ = concat_models()
    orig.graph.input.append(helper.make_tensor_value_info("b", TensorProto.FLOAT, (5, 5)))
    orig.graph.node.append(helper.make_node("Add", ["output", "b"], ["sum"]))
    orig.graph.output.append(helper.make_tensor_value_info("sum", TensorProto.FLOAT, (5, 5)))
    merged = Pass.get_pass("apply_host_concat_split", [(TensorProto.FLOAT, (5, 1), 2)]).run(orig)
    assert [vi.name for vi in merged.graph.input] == ["host_concat_0", "a2", "b"]
    [meta] = [p for p in merged.metadata_props if p.key == sHostConcatRunnerConfig]
    assert json.loads(meta.value) == [{"tensor_name": "host_concat_0",
                                       "input_tensor_names": ["a0", "a1"], "shape": [2, 5, 1],
                                       "data_size_bytes": 40}]
    options = CompilerOptions()
    options.opaque_blobs = {sHostConcatRunnerConfig: meta.value}
    exe = Compiler.compile(merged, ["output", "sum"], options)
    feeds = {f"a{i}": RNG.uniform(0, 1, (5, 1)).astype(np.float32) for i in range(3)}
    feeds["b"] = RNG.uniform(0, 1, (5, 5)).astype(np.float32)
    want = ort_run(orig, feeds)
    runner = runtime.HostConcatRunner(exe, runtime.HostConcatRunnerConfig())
    try:
        outputs = {"output": np.zeros((5, 5), np.float32), "sum": np.zeros((5, 5), np.float32)}
        runner.execute_async(feeds, outputs).wait()
        npt.assert_allclose(outputs["output"], want[0], rtol=1e-5, atol=1e-5)
        npt.assert_allclose(outputs["sum"], want[1], rtol=1e-5, atol=1e-5)
    finally:
        runner.close()


# -- lifetimes ---------------------------------------------------------------------------
def test_dropped_runners_leave_nothing_behind(weights_popef, tmp_path):
    _, merged = concat_models()
    concat_path = str(poprt_compile(merged, tmp_path).popef_path)
    hcc = runtime.HostConcatConfig()
    hcc.tensor_name, hcc.input_tensor_names = "merged", ["a0", "a1", "a2"]
    makers = [
        lambda: runtime.Runner(weights_popef),
        lambda: runtime.LightRunner(weights_popef, runtime.LightRunnerConfig()),
        lambda: runtime.HostConcatRunner(
            concat_path, runtime.HostConcatRunnerConfig(host_concat_config={"merged": hcc})),
    ]
    before = tag_objects()
    gc.collect()
    gc.disable()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for make in makers:
                runner = make()
                runner.execute_async(*_io(runner)).wait()
                del runner
                assert tag_objects() == before, make
    finally:
        gc.enable()
