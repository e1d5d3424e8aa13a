"""Every model onnxruntime runs at fixed input shapes compiles (issue 30, item 5).

The models (``tests/models/compile_cases.py``, built by script) are compiled in fp32 and
fp16 through ``host_runtime.poprt.compile`` and the ``poprt`` command, run with
``ModelRunner`` and compared with onnxruntime: fp32 with the original model, fp16 with
the converted graph (``output_model``) exactly and with the fp32 model closely. Shapes
that inference leaves open come from onnxruntime at the fixed shapes (the quantized
model); outputs follow what their nodes compute (PopRT's light-runner and pack-runner
examples); a ``ZipMap`` tail runs on the host; a data-dependent shape is refused by name;
a compile writes nothing outside its output directory, failed or not.
"""

from __future__ import annotations

import logging
import os
import pathlib
import subprocess
import sys
import warnings

import numpy as np
import numpy.testing as npt
import onnx
import pytest

from host_runtime import popef
from host_runtime.poprt.compiler import compile as poprt_compile
from host_runtime.runner import ModelRunner
from host_runtime.runner.config import ModelRunnerConfig
from ipu_emulator.compiler import CompileError, Fp16RangeWarning
from tests.models import compile_cases as cases
from tests.models import run_reference
from tools.poprt import main as poprt_cli

pytestmark = pytest.mark.usefixtures("private_machine")

ROOT = pathlib.Path(__file__).resolve().parents[2]
# fp16 against fp32: relative to the output's largest magnitude
FP16_TOL = {"quantized": 0.1, "vad_lstm": 2e-2}


@pytest.fixture(scope="module")
def device():
    from host_runtime.devices import DeviceManager

    dev = DeviceManager().getDevice(1)
    yield dev
    dev.close()


@pytest.fixture(scope="module")
def built():
    return {name: build() for name, build in cases.CASES.items()}


@pytest.fixture(scope="module")
def compiled(built, tmp_path_factory):
    """(case, precision) -> (output folder, CompileOutput), through the Python API."""
    out = {}
    for name, (model, _, shapes) in built.items():
        for precision in ("fp32", "fp16"):
            d = tmp_path_factory.mktemp(f"{name}_{precision}")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Fp16RangeWarning)
                out[name, precision] = (d, poprt_compile(
                    model, d, output_model="model.onnx", input_shapes=shapes,
                    precision=precision))
    return out


def run(path, device, feeds, **kwargs):
    cfg = ModelRunnerConfig()
    cfg.replica_to_device = {0: device}
    runner = ModelRunner(popef.load_model([str(path)]), cfg)
    try:
        return runner.execute(feeds, **kwargs)
    finally:
        runner.close()


def reference(name, model, feeds):
    if name == "pack_runner":   # onnxruntime refuses the declared FLOAT16 of a float Mul
        return {"output": (feeds["input_ids"] * feeds["attention_mask"]).astype(np.float16)}
    if name == "int8_sub_add":  # onnxruntime refuses int8 Sub/Add at opset 11
        with np.errstate(over="ignore"):
            return {"O": feeds["X"] - np.int8(3), "O2": feeds["X"] + np.int8(3)}
    return run_reference(model, feeds)


def as16(feeds):
    return {k: (v.astype(np.float16) if v.dtype == np.float32 else v) for k, v in feeds.items()}


@pytest.mark.parametrize("name", sorted(cases.CASES))
def test_fp32_equals_onnxruntime(name, built, compiled, device):
    model, feeds, _ = built[name]
    want = reference(name, model, feeds)
    got = run(compiled[name, "fp32"][1].popef_path, device, feeds)
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].shape == v.shape and got[k].dtype == v.dtype, k
        npt.assert_allclose(got[k], v, rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("name", sorted(cases.CASES))
def test_fp16_equals_the_converted_graph_and_is_near_fp32(name, built, compiled, device):
    model, feeds, _ = built[name]
    folder, res = compiled[name, "fp16"]
    converted = onnx.load(str(res.output_model_path))
    got = run(res.popef_path, device, as16(feeds))
    npt.assert_equal(got, run_reference(converted, as16(feeds)))
    for k, v in reference(name, model, feeds).items():
        assert got[k].shape == v.shape, k
        if v.dtype.kind == "f":
            assert got[k].dtype == np.float16, k
            tol = FP16_TOL.get(name, 1e-2) * max(1.0, float(np.abs(v).max()))
            npt.assert_allclose(got[k].astype(np.float32), v, rtol=0, atol=tol, err_msg=k)
        else:
            npt.assert_array_equal(got[k], v, err_msg=k)


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_the_poprt_command_compiles_them_alike(precision, built, compiled, device, tmp_path):
    """``poprt`` (in process) on each model: the same anchors (int64 ones int32), and
    results equal to the API's compilation on the same inputs."""
    for name, (model, feeds, shapes) in built.items():
        src = tmp_path / f"{name}.onnx"
        onnx.save(model, str(src))
        out = tmp_path / f"{name}_{precision}"
        args = ["--input_model", str(src), "--output_dir", str(out), "--export_popef",
                "--precision", precision]
        for k, dims in shapes.items():
            args += ["--input_shape", f"{k}={','.join(map(str, dims))}"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Fp16RangeWarning)
            assert poprt_cli(args) == 0, name
        cli = popef.load_model([str(out / "executable.popef")])
        api_path = compiled[name, precision][1].popef_path
        api = popef.load_model([str(api_path)])
        # the command's Converter makes int64 inputs and outputs int32, as PopRT documents
        s32 = {"DataType.S64": "DataType.S32"}
        assert [(a.name(), a.tensorInfo().shape(), str(a.tensorInfo().dataType()))
                for a in cli.metadata.anchors()] == \
            [(a.name(), a.tensorInfo().shape(), s32.get(str(a.tensorInfo().dataType()),
                                                        str(a.tensorInfo().dataType())))
             for a in api.metadata.anchors()], name
        f = feeds if precision == "fp32" else as16(feeds)
        f32 = {k: v.astype(np.int32) if v.dtype == np.int64 else v for k, v in f.items()}
        npt.assert_equal(run(out / "executable.popef", device, f32), run(api_path, device, f),
                         err_msg=name)


def test_vad_lstm_follows_the_sample_rate_and_carries_its_state(built, compiled, device):
    model, feeds, _ = built["vad_lstm"]
    path = compiled["vad_lstm", "fp32"][1].popef_path
    outs = []
    for sr in (16000, 8000):
        f = dict(feeds, sr=np.array(sr, np.int64))
        want = run_reference(model, f)
        got = run(path, device, f)
        for k in want:
            npt.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=f"{sr} {k}")
        outs.append(got["output"])
        # the state it gives back is the next call's state
        again = dict(f, h=got["hn"], c=got["cn"])
        npt.assert_allclose(run(path, device, again)["output"],
                            run_reference(model, again)["output"], rtol=1e-5, atol=1e-6)
    assert not np.allclose(outs[0], outs[1])    # the branches differ: the test tells them apart


def test_open_shapes_are_measured_by_onnxruntime(built, tmp_path, caplog):
    model, _, shapes = built["quantized"]
    ops = {n.op_type for n in model.graph.node}
    assert {"DynamicQuantizeLSTM", "DynamicQuantizeLinear", "MatMulInteger"} <= ops
    with caplog.at_level(logging.INFO, logger="ipu_emulator.compiler"):
        res = poprt_compile(model, tmp_path, input_shapes=shapes)
    assert {a.name: a.shape for a in res.result.anchors if a.direction == "out"} == \
        {"out": (5, 1, 4), "hn": (1, 1, 8), "cn": (1, 1, 8)}
    assert "by onnxruntime at the fixed input shapes" in caplog.text


def test_fp16_leaves_the_dynamic_quantization_family_in_fp32(compiled):
    g = onnx.load(str(compiled["quantized", "fp16"][1].output_model_path)).graph
    F32, F16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16
    inits = {t.name: t.data_type for t in g.initializer}
    producers = {o: n for n in g.node for o in n.output}
    seen = set()
    for node in g.node:
        if node.op_type in ("DynamicQuantizeLSTM", "DynamicQuantizeLinear"):
            seen.add(node.op_type)
            # its activation comes through a Cast to fp32 (the model's input is fp16)
            cast = producers[node.input[0]]
            assert cast.op_type == "Cast" and cast.attribute[0].i == F32, node.name
            # its float initializers (LSTM bias, scales) stay fp32
            floats = [inits[i] for i in node.input if inits.get(i) in (F32, F16)]
            assert F16 not in floats, (node.name, floats)
    assert seen == {"DynamicQuantizeLSTM", "DynamicQuantizeLinear"}
    assert g.input[0].type.tensor_type.elem_type == F16


def test_outputs_take_what_their_nodes_compute(compiled):
    light = compiled["light_runner", "fp32"][1].result
    assert [(a.dtype, a.shape) for a in light.anchors if a.name == "output"] == \
        [("F32", (1, 1, 16, 16))]    # declared [16, 16]: ReduceMean keeps its dims
    pack = compiled["pack_runner", "fp32"][1].result
    assert [(a.dtype, a.shape) for a in pack.anchors if a.name == "output"] == \
        [("F16", (3, 10))]           # a float Mul declared FLOAT16: cast to it


@pytest.fixture(scope="module")
def zipmap(tmp_path_factory):
    model, feeds, shapes = cases.zipmap_classifier()
    out = {}
    for precision in ("fp32", "fp16"):
        d = tmp_path_factory.mktemp(f"zipmap_{precision}")
        out[precision] = poprt_compile(model, d, input_shapes=shapes, precision=precision)
    return model, feeds, out


def _same_maps(got, want, tol):
    assert isinstance(got, list) and len(got) == len(want)
    for g, w in zip(got, want):
        assert isinstance(g, dict) and sorted(g) == sorted(w)
        for k in w:
            assert abs(g[k] - w[k]) <= tol, (k, g[k], w[k])


def test_a_zipmap_tail_runs_on_the_host(zipmap, device):
    model, feeds, out = zipmap
    want = run_reference(model, feeds)
    res = out["fp32"].result
    assert res.host_tail is not None and [n.op_type for n in res.host_tail.graph.node] == ["ZipMap"]
    assert {a.name for a in res.anchors if a.direction == "out"} == {"label", "probabilities"}
    got = run(out["fp32"].popef_path, device, feeds)
    npt.assert_array_equal(got["label"], want["label"])
    _same_maps(got["output_probability"], want["output_probability"], 1e-6)
    # fp16: the IPU streams fp16 scores; the host casts them back for ZipMap
    got16 = run(out["fp16"].popef_path, device, as16(feeds))
    npt.assert_array_equal(got16["label"], want["label"])
    _same_maps(got16["output_probability"], want["output_probability"], 2e-3)


def test_a_zipmap_tail_comes_with_futures_and_the_callers_outputs(zipmap, device):
    model, feeds, out = zipmap
    want = run_reference(model, feeds)["output_probability"]
    cfg = ModelRunnerConfig()
    cfg.replica_to_device = {0: device}
    runner = ModelRunner(popef.load_model([str(out["fp32"].popef_path)]), cfg)
    try:
        fut = runner.executeAsync(feeds)
        assert "output_probability" in list(fut)
        _same_maps(fut["output_probability"], want, 1e-6)
        mine = {"label": np.zeros(4, np.int64), "probabilities": np.zeros((4, 3), np.float32)}
        assert runner.execute(feeds, mine) is None
        _same_maps(mine["output_probability"], want, 1e-6)
    finally:
        runner.close()
    # PopRT's Runner writes into the caller's dict too
    from host_runtime.poprt.runtime import Runner, RuntimeConfig
    with Runner(str(out["fp32"].popef_path), RuntimeConfig()) as prt:
        mine = {"label": np.zeros(4, np.int64), "probabilities": np.zeros((4, 3), np.float32)}
        prt.execute(feeds, mine)
        _same_maps(mine["output_probability"], want, 1e-6)


def test_a_classifier_with_string_labels_runs_on_the_host(tmp_path, device):
    """String labels: the classifier itself is the tail; its input reaches the host
    through the IPU (``X__to_host``)."""
    model, feeds, shapes = cases.string_label_classifier()
    want = run_reference(model, feeds)
    res = poprt_compile(model, tmp_path, input_shapes=shapes)
    assert [a.name for a in res.result.anchors if a.direction == "out"] == ["X__to_host"]
    got = run(res.popef_path, device, feeds)
    npt.assert_array_equal(got["label"], want["label"])
    _same_maps(got["output_probability"], want["output_probability"], 1e-6)


def test_a_zipmap_tail_is_refused_when_fused(tmp_path):
    from ipu_emulator.compiler import ModelSpec

    model, _, shapes = cases.zipmap_classifier()
    other, _, _ = cases.dynamic_batch()
    with pytest.raises(CompileError, match=r"ends in a non-tensor tail .* not fused"):
        poprt_compile([ModelSpec(model, shapes), ModelSpec(other)], tmp_path)


def test_a_data_dependent_shape_is_refused_by_name(tmp_path, capsys):
    model, _, _ = cases.nonzero()
    with pytest.raises(CompileError, match=r"output 'idx' has a shape that depends on the input "
                                           r"data .*\[2, 0\] and \[2, \d+\] .*graph\.output"):
        poprt_compile(model, tmp_path)
    src = tmp_path / "nz.onnx"
    onnx.save(model, str(src))
    assert poprt_cli(["--input_model", str(src), "--output_dir", str(tmp_path / "o")]) == 2
    assert "output 'idx' has a shape that depends on the input data" in capsys.readouterr().err


def test_a_shape_that_follows_the_if_branch_is_refused(tmp_path):
    """Neither sample takes the 16 kHz branch: each branch is run too."""
    model, _, _ = cases.branch_shapes()
    with pytest.raises(CompileError, match=r"output 'y' has a shape that depends on the input "
                                           r"data .*(\[2, 4\] and \[4, 4\]|\[4, 4\] and \[2, 4\])"):
        poprt_compile(model, tmp_path)


def _quantized_then_nonzero():
    """The quantized model (symbolic shape inference is incomplete on it) with a NonZero
    output: refused, after the same inference that completes for the plain model."""
    model, _, shapes = cases.quantized()
    model.graph.node.append(onnx.helper.make_node("NonZero", ["out"], ["nz"]))
    model.graph.output.append(onnx.helper.make_tensor_value_info("nz", onnx.TensorProto.INT64,
                                                                 None))
    return model, shapes


def test_a_compile_writes_only_its_output_directory(tmp_path):
    """Failed and successful compiles (the CLI, in its own process): the working
    directory and the temporary directory gain nothing; the output directory holds the
    PopEF file and the output model."""
    good, shapes = cases.quantized()[0], cases.quantized()[2]
    bad, _ = _quantized_then_nonzero()
    models = tmp_path / "models"
    models.mkdir()
    onnx.save(good, str(models / "good.onnx"))
    onnx.save(bad, str(models / "bad.onnx"))
    cwd, tmp, out = tmp_path / "cwd", tmp_path / "tmp", tmp_path / "out"
    cwd.mkdir()
    tmp.mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmp), TEMP=str(tmp), TMP=str(tmp))
    shape_args = [a for k, d in shapes.items()
                  for a in ("--input_shape", f"{k}={','.join(map(str, d))}")]
    # importing onnxruntime leaves its own ``$TMPDIR/.ses`` (a session id, once): not ours
    subprocess.run([sys.executable, "-c", "import onnxruntime"], cwd=cwd, env=env, check=True,
                   timeout=120)
    before = sorted(os.listdir(tmp))
    errors = {}
    for name, code in (("bad", 2), ("good", 0)):
        proc = subprocess.run(
            [sys.executable, "-m", "tools.poprt", "--input_model", str(models / f"{name}.onnx"),
             "--output_dir", str(out / name), "--export_popef", "--precision", "fp16",
             *shape_args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == code, proc.stderr
        errors[name] = proc.stderr
    assert "output 'nz' has a shape that depends on the input data" in errors["bad"]
    assert sorted(os.listdir(cwd)) == [] and sorted(os.listdir(tmp)) == before
    assert not (out / "bad").exists()
    assert sorted(os.listdir(out / "good")) == ["executable.popef", "good.fp16.onnx"]
    assert sorted(os.listdir(models)) == ["bad.onnx", "good.onnx"]
