"""Models shaped like production ones (issue 21), compiled with ``poprt`` in fp32 and fp16,
run through ``ModelRunner`` and compared with onnxruntime on the same inputs.

Families (``tests/models/field.py``, built by script): a voice activity detector with
``If`` on a scalar int64 sample rate and a ``Loop`` (Silero VAD's shape, opset 15), a
``Scan``, a convolutional detector, a transformer attention block, an OCR CTC head, and
an MLP pipelined over 2 IPUs. fp32 must equal onnxruntime on the original model; fp16
must equal onnxruntime running the converted graph (``--output_model``), stay finite,
and be close to fp32 (the error ``poprt`` reports).

Each model is compiled once per precision (module-scope fixture) and runs on one IPU
process shared by the module's runners. Production models of your own (no download
here): ``IPU_EMULATOR_FIELD_MODELS=DIR`` runs every ``DIR/*.onnx`` the same way.
"""

from __future__ import annotations

import glob
import os
import warnings

import numpy as np
import numpy.testing as npt
import onnx
import pytest

from host_runtime import popef
from host_runtime.poprt.compiler import compile as poprt_compile
from host_runtime.runner import ModelRunner
from host_runtime.runner.config import ModelRunnerConfig
from ipu_emulator.compiler import Fp16RangeWarning
from ipu_emulator.errors import CompileError
from tests.models import field
from tests.models import run_reference

pytestmark = pytest.mark.usefixtures("private_machine")

FAMILIES = {
    # name: (builder, --input_shape)
    "silero_like": (field.silero_like, {"input": [1, 512], "state": [2, 1, 16]}),
    "scan_smoother": (field.scan_smoother, {"x": [6, 5]}),
    "detector_like": (field.detector_like, {}),
    "attention_block": (field.attention_block, {}),
    "ctc_head": (field.ctc_head, {}),
}
FP16_RTOL = {"silero_like": 2e-2, "scan_smoother": 1e-2, "detector_like": 2e-2,
             "attention_block": 5e-2, "ctc_head": 2e-2}


@pytest.fixture(scope="module")
def device():
    from host_runtime.devices import DeviceManager

    dev = DeviceManager().getDevice(1)
    yield dev
    dev.close()


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """(family, precision) -> (popef model, transformed ONNX model, compile result)."""
    out = {}
    for name, (build, shapes) in FAMILIES.items():
        model, _ = build()
        for precision in ("fp32", "fp16"):
            d = tmp_path_factory.mktemp(f"{name}_{precision}")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Fp16RangeWarning)
                res = poprt_compile(model, d, output_model=f"{name}.{precision}.onnx",
                                    input_shapes=shapes, precision=precision)
            out[name, precision] = (popef.load_model([str(res.popef_path)]),
                                    onnx.load(str(res.output_model_path)), res.result)
    return out


def run(popef_model, device, feeds):
    cfg = ModelRunnerConfig()
    cfg.replica_to_device = {0: device}
    runner = ModelRunner(popef_model, cfg)
    try:
        return runner.execute(feeds)
    finally:
        runner.close()


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_fp32_equals_onnxruntime(name, compiled, device):
    model, feeds = FAMILIES[name][0]()
    want = run_reference(model, feeds)
    got = run(compiled[name, "fp32"][0], device, feeds)
    assert sorted(got) == sorted(want)
    for k in want:
        npt.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_fp16_equals_onnxruntime_on_the_converted_graph_and_is_near_fp32(name, compiled, device):
    model, feeds = FAMILIES[name][0]()
    popef_model, converted, result = compiled[name, "fp16"]
    in16 = {k: (v.astype(np.float16) if v.dtype == np.float32 else v) for k, v in feeds.items()}
    got = run(popef_model, device, in16)
    same_graph = run_reference(converted, in16)
    fp32 = run_reference(model, feeds)
    for k, v in fp32.items():
        assert np.isfinite(got[k].astype(np.float64)).all(), k
        npt.assert_array_equal(got[k], same_graph[k], err_msg=k)
        if v.dtype == np.float32:
            npt.assert_allclose(got[k].astype(np.float32), v, rtol=FP16_RTOL[name],
                                atol=FP16_RTOL[name] * max(1.0, float(np.abs(v).max())),
                                err_msg=k)
    # poprt's report: every float output, finite figures within the tolerance
    assert set(result.fp16_error) == {k for k, v in fp32.items() if v.dtype == np.float32}
    for worst, mean in result.fp16_error.values():
        assert 0 <= mean <= worst < 1.0


def test_silero_like_follows_the_sample_rate(compiled, device):
    """The If on the scalar int64 input: both branches, each equal to onnxruntime."""
    model, feeds = field.silero_like()
    for sr in (16000, 8000):
        f = dict(feeds, sr=np.array(sr, np.int64))
        want = run_reference(model, f)
        got = run(compiled["silero_like", "fp32"][0], device, f)
        npt.assert_allclose(got["output"], want["output"], rtol=1e-5, err_msg=str(sr))
    a = run_reference(model, dict(feeds, sr=np.array(16000, np.int64)))["output"]
    b = run_reference(model, dict(feeds, sr=np.array(8000, np.int64)))["output"]
    assert not np.allclose(a, b)     # the branches differ: the test can tell them apart


def test_undeclared_output_shapes_come_from_symbolic_inference(tmp_path):
    model, _ = field.silero_like(declare_outputs=False)
    res = poprt_compile(model, tmp_path, input_shapes=FAMILIES["silero_like"][1])
    shapes = {a.name: tuple(a.shape) for a in res.result.anchors}
    assert shapes["output"] == (1, 1) and shapes["stateN"] == (2, 1, 16)


def test_an_unfixed_input_is_refused_naming_it_and_the_option(tmp_path):
    model, _ = field.silero_like()
    with pytest.raises(CompileError, match=r"input 'input' has an unresolved dynamic shape .*"
                                           r"--input_shape"):
        poprt_compile(model, tmp_path, input_shapes={"state": [2, 1, 16]})


def test_a_data_dependent_output_is_refused_naming_it_and_the_option(tmp_path):
    model, _ = field.data_dependent()
    with pytest.raises(CompileError, match=r"output 'idx' has a shape that depends on the input "
                                           r"data .*--input_shape.*graph\.output"):
        poprt_compile(model, tmp_path)


def test_fp16_keeps_out_of_range_values_in_fp32_with_one_warning(tmp_path, device):
    model, feeds = field.overflowing()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = poprt_compile(model, tmp_path, output_model="o.onnx", precision="fp16")
    ours = [w for w in caught if issubclass(w.category, Fp16RangeWarning)]
    assert len(ours) == 1, [str(w.message) for w in caught]
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)]
    for name in ("'big'", "'xb'", "'ss'"):      # the weight and the two overflowing values
        assert name in str(ours[0].message)
    x16 = feeds["x"].astype(np.float16)
    got = run(popef.load_model([str(res.popef_path)]), device, {"x": x16})["y"]
    assert np.isfinite(got.astype(np.float32)).all()
    npt.assert_array_equal(got, run_reference(onnx.load(str(res.output_model_path)),
                                              {"x": x16})["y"])
    npt.assert_allclose(got.astype(np.float32), run_reference(model, feeds)["y"], rtol=1e-2,
                        atol=1e-2)
    worst, mean = res.result.fp16_error["y"]
    assert worst < 2e-2 and mean <= worst


def test_pipelined_over_two_ipus_in_fp32_and_fp16(tmp_path):
    model, feeds = field.deep_mlp()
    want = run_reference(model, feeds)["y"]
    for precision in ("fp32", "fp16"):
        res = poprt_compile(model, tmp_path / precision, precision=precision, num_ipus=2,
                            sharding_info=field.DEEP_MLP_SHARDING,
                            pipelining_info=field.DEEP_MLP_SHARDING, enable_pipelining=True,
                            batches_per_step=2)
        assert res.result.executable.num_ipus == 2
        runner = ModelRunner(popef.load_model([str(res.popef_path)]))
        try:
            x = feeds["x"] if precision == "fp32" else feeds["x"].astype(np.float16)
            futures = [runner.executeAsync({"x": x}) for _ in range(4)]   # in flight
            outs = [f.result(timeout=120)["y"] for f in futures]
        finally:
            runner.close()
        for got in outs:
            npt.assert_allclose(got.astype(np.float32), want,
                                rtol=1e-5 if precision == "fp32" else 2e-2,
                                atol=1e-6 if precision == "fp32" else 2e-3)


def test_poprt_prints_the_fp16_error_to_fp32(tmp_path, capsys):
    from tools.poprt import main as poprt_main

    model, _ = field.attention_block()
    onnx.save(model, str(tmp_path / "attn.onnx"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert poprt_main(["--input_model", str(tmp_path / "attn.onnx"), "--precision", "fp16",
                           "--output_dir", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("poprt: fp16 vs fp32"))
    worst = float(line.split("max relative error ")[1].split()[0])
    mean = float(line.split("mean ")[1])
    assert "(y)" in line and 0 < mean < 1e-2 and mean <= worst < 0.5, line
    # the -1e9 mask and what it reaches stay fp32: one warning names them
    (w,) = [w for w in caught if issubclass(w.category, Fp16RangeWarning)]
    assert "'neg'" in str(w.message) and "'s2'" in str(w.message)


# ---------------------------------------------------------------- models of your own
_LOCAL = os.environ.get("IPU_EMULATOR_FIELD_MODELS", "")


def _local_models() -> list[str]:
    return sorted(glob.glob(os.path.join(_LOCAL, "*.onnx"))) if _LOCAL else []


@pytest.mark.skipif(not _LOCAL, reason="production models of your own: set "
                    "IPU_EMULATOR_FIELD_MODELS to a folder of .onnx files (each with an "
                    "optional NAME.shapes of --input_shape lines and NAME.npz of inputs)")
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_local_production_models(precision, tmp_path, device):
    """Every ``*.onnx`` in ``$IPU_EMULATOR_FIELD_MODELS`` compiles with poprt and runs
    through ModelRunner equal to onnxruntime (fp16: onnxruntime on the converted graph)."""
    from host_runtime.poprt.compiler import parse_input_shape

    models = _local_models()
    assert models, f"no .onnx file in {_LOCAL}"
    for path in models:
        stem = path[:-len(".onnx")]
        shapes = dict(parse_input_shape(ln.strip()) for ln in open(stem + ".shapes")
                      if ln.strip()) if os.path.exists(stem + ".shapes") else {}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Fp16RangeWarning)
            res = poprt_compile(path, tmp_path / os.path.basename(stem), output_model="m.onnx",
                                input_shapes=shapes, precision=precision)
        anchors = [a for a in res.result.anchors if a.kind == "input"]
        if os.path.exists(stem + ".npz"):
            feeds = dict(np.load(stem + ".npz"))
        else:
            rng = np.random.default_rng(0)
            feeds = {a.name: (rng.standard_normal(a.shape) if a.dtype in ("F32", "F16")
                              else np.zeros(a.shape)).astype(_numpy_dtype(a.dtype))
                     for a in anchors}
        feeds = {a.name: np.asarray(feeds[a.name]).astype(_numpy_dtype(a.dtype))
                 for a in anchors}
        got = run(popef.load_model([str(res.popef_path)]), device, feeds)
        want = run_reference(onnx.load(str(res.output_model_path)), feeds)
        for k, v in want.items():
            npt.assert_allclose(np.asarray(got[k], np.float64), np.asarray(v, np.float64),
                                rtol=1e-4, atol=1e-5, err_msg=f"{path}: {k}")
        if precision == "fp16":
            worst = max((e[0] for e in res.result.fp16_error.values()), default=0.0)
            print(f"{os.path.basename(path)}: fp16 max relative error to fp32 {worst:.3g}")


def _numpy_dtype(dtype: str) -> np.dtype:
    from ipu_emulator.executable import numpy_dtype

    return np.dtype(numpy_dtype(dtype))
