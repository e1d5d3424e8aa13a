"""PopRT's compile API end to end on emulated IPUs, with models built here: Compiler and
CompilerOptions, Executable in every runner, Converter/Sharder/MFConverter, Backend and
get_session, and the ``poprt`` command writing the same PopEF bytes as the API."""

from __future__ import annotations

import os
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from host_runtime import popef, poprt
from host_runtime.errors import BadRequestError
from host_runtime.poprt._check import run_onnxruntime
from host_runtime.poprt.compiler import (Compiler, CompilerOptions, Executable,
                                         NotSupportedError, PoplarRequiredError)
from host_runtime.runner import ModelRunner

pytestmark = pytest.mark.usefixtures("private_machine")
F = TensorProto.FLOAT
RNG = np.random.default_rng(3)


def mlp(batch="N"):
    """x[N,8] -> MatMul -> Add -> Relu -> MatMul -> y[N,4] (named nodes)."""
    w1 = numpy_helper.from_array(RNG.standard_normal((8, 16)).astype(np.float32), "w1")
    b1 = numpy_helper.from_array(RNG.standard_normal(16).astype(np.float32), "b1")
    w2 = numpy_helper.from_array(RNG.standard_normal((16, 4)).astype(np.float32), "w2")
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h0"], name="mm1"),
             helper.make_node("Add", ["h0", "b1"], ["h1"], name="add1"),
             helper.make_node("Relu", ["h1"], ["h2"], name="relu1"),
             helper.make_node("MatMul", ["h2", "w2"], ["y"], name="mm2")]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", F, [batch, 8])],
                          [helper.make_tensor_value_info("y", F, [batch, 4])], [w1, b1, w2])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    return m


@pytest.fixture(scope="module")
def model():
    return mlp()


@pytest.fixture(scope="module")
def x():
    return RNG.standard_normal((2, 8)).astype(np.float32)


@pytest.fixture(scope="module")
def fp32_exe(model):
    converted = poprt.Converter(input_shape={"x": [2, 8]}).convert(model)
    options = CompilerOptions.from_dict({"batches_per_step": 2, "partials_type": "float",
                                         "available_memory_proportion": 0.3,
                                         "engine_options": {"debug.x": "1"},
                                         "opaque_blobs": {"note": "hello"}})
    return Compiler.compile(converted.SerializeToString(), None, options)


def test_executable_runs_in_every_runner(fp32_exe, model, x):
    want = run_onnxruntime(model, {"x": x})["y"]
    with poprt.Runner(fp32_exe) as r:
        out = {"y": np.zeros((2, 4), np.float32)}
        r.execute({"x": x}, out)
    np.testing.assert_allclose(out["y"], want, rtol=1e-5, atol=1e-5)
    with ModelRunner(fp32_exe.model) as mr:
        np.testing.assert_allclose(mr.execute({"x": x})["y"], want, rtol=1e-5, atol=1e-5)
    again = Executable(fp32_exe.to_bytes())
    assert again.to_bytes() == fp32_exe.to_bytes()
    with ModelRunner(again) as mr:
        np.testing.assert_allclose(mr.execute({"x": x})["y"], want, rtol=1e-5, atol=1e-5)


def test_options_reach_the_popef_file(fp32_exe):
    md = fp32_exe.metadata
    assert md.deviceIterations() == 2
    engine = md.engineOptions()
    assert engine["debug.x"] == "1"
    assert engine["poprt.available_memory_proportion"] == "0.3"
    assert "poprt.partials_type" not in engine          # it acts: not a tuning option
    assert fp32_exe.opaque("note").data == b"hello"


def test_compiler_options_fields_and_errors():
    o = CompilerOptions()
    assert (o.num_ipus, o.ipu_version, o.batches_per_step, o.partials_type, o.constant_weights,
            o.virtual_graph_mode, o.enable_engine_caching) == (1, "", 1, "half", True, "off",
                                                               False)
    assert len(o.to_dict()) == 40
    with pytest.raises(AttributeError, match="no option 'num_ipu'"):
        o.num_ipu = 2
    with pytest.raises(BadRequestError, match="partials_type must be one of"):
        o.partials_type = "double"
    with pytest.raises(BadRequestError, match="num_ipus must be an int"):
        CompilerOptions.from_dict({"num_ipus": "2"})
    for bad in (2.0, 0, -0.5, float("nan")):
        with pytest.raises(BadRequestError, match=r"available_memory_proportion is a proportion: "
                                                  r"expected a number in \(0, 1\], got"):
            o.available_memory_proportion = bad
    o.available_memory_proportion = 1
    assert o.available_memory_proportion == 1.0


def test_named_refusals(model):
    with pytest.raises(PoplarRequiredError, match="needs Poplar's profiler"):
        Compiler.compile_and_get_summary_report(model, None)
    with pytest.raises(NotSupportedError, match="virtual_graph_mode 'auto'"):
        Compiler.compile(model, None, CompilerOptions.from_dict({"virtual_graph_mode": "auto"}))
    with pytest.raises(NotSupportedError, match="quantize is not supported"):
        poprt.Converter(precision="fp8", quantize=True)
    with pytest.raises(NotSupportedError, match="pack_args"):
        poprt.Converter(pack_args={"max_valid_num": 90})
    with pytest.raises(BadRequestError, match=r"outputs \['nope'\] are not tensors"):
        Compiler.compile(model, ["nope"])


def test_outputs_pick_intermediate_tensors(model, x):
    m = poprt.Converter(input_shape={"x": [2, 8]}).convert(model)
    exe = Compiler.compile(m, ["h2"])
    with ModelRunner(exe) as r:
        got = r.execute({"x": x})
    assert list(got) == ["h2"]
    want = run_onnxruntime(poprt.get_pass("add_checkpoints", ["h2"])(m), {"x": x})["h2"]
    np.testing.assert_allclose(got["h2"], want, rtol=1e-5, atol=1e-5)


def test_fp16_converter_with_constant_weights_off(model, x):
    conv = poprt.Converter(input_shape={"x": [2, 8]}, precision="fp16",
                           fp16_skip_op_types="Relu")
    m = conv.convert(model)
    assert m.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT16
    exe = Compiler.compile(m, None, CompilerOptions.from_dict({"constant_weights": False}))
    assert {t.anchor for t in exe.tensors} == {"w1", "b1", "w2"}
    with ModelRunner(exe) as r:
        got = r.execute({"x": x.astype(np.float16)})["y"]
    assert got.dtype == np.float16
    want = run_onnxruntime(model, {"x": x})["y"]
    np.testing.assert_allclose(got.astype(np.float32), want, rtol=2e-2, atol=5e-2)


def test_sharder_shards_over_two_ipus(model, x):
    m = poprt.Converter(input_shape={"x": [2, 8]}).convert(model)
    m = poprt.converter.Sharder({"mm1": 0, "relu1": 1}, {"mm1": 0, "relu1": 1}).run(m)
    opts = CompilerOptions.from_dict({"num_ipus": 2, "virtual_graph_mode": "manual",
                                      "enable_pipelining": True, "batches_per_step": 2})
    exe = Compiler.compile(m, None, opts)
    assert exe.metadata.numIpus() == 2
    with ModelRunner(exe) as r:
        got = r.execute({"x": x})["y"]
    np.testing.assert_allclose(got, run_onnxruntime(model, {"x": x})["y"], rtol=1e-5, atol=1e-5)


def test_mfconverter_fuses_for_the_compiler(x):
    a, b = mlp(2), mlp(2)
    fused = poprt.converter.MFConverter().convert([a, b])
    exe = Compiler.compile(fused, None, CompilerOptions.from_dict({"enable_model_fusion": True}))
    assert sorted(exe.metadata.subgraphs()) == ["graph0", "graph1"]
    cfg = poprt.RuntimeConfig()
    cfg.validate_io_params = False
    with poprt.Runner(exe, cfg) as r:
        out = {"graph1/y": np.zeros((2, 4), np.float32)}
        r.execute({"graph1/x": x}, out)
    np.testing.assert_allclose(out["graph1/y"], run_onnxruntime(b, {"x": x})["y"], rtol=1e-5,
                               atol=1e-5)


def test_backend_and_get_session(model, x):
    m = poprt.Converter(input_shape={"x": [2, 8]}).convert(model)
    want = run_onnxruntime(model, {"x": x})["y"]
    with poprt.Backend(m.SerializeToString(),
                       runtime_options={"timeoutNS": 0, "validateIOParams": True}) as be:
        assert be.executable is None                      # compiled on first use
        ins, outs = be.get_io_info()
        assert ins["x"][0] == [2, 8] and list(outs) == ["y"]
        np.testing.assert_allclose(be.run(["y"], {"x": x})[0], want, rtol=1e-5, atol=1e-5)
    sess = poprt.backend.get_session(m.SerializeToString(), 1, "poprt",
                                     options={"partials_type": "half"}).load()
    np.testing.assert_allclose(sess.run(["y"], {"x": x})[0], want, rtol=1e-5, atol=1e-5)
    sess.close()
    from host_runtime.poprt.backends import ORTBackend
    sess_like = ORTBackend(m.SerializeToString(), providers=["CPUExecutionProvider"])
    assert [(i.name, i.type, i.shape) for i in sess_like.get_inputs()] == \
        [("x", "tensor(float)", [2, 8])]
    np.testing.assert_allclose(sess_like.run(None, {"x": x})[0], want, rtol=1e-5, atol=1e-5)
    sess_like.close()
    ort = poprt.backend.get_session(m.SerializeToString(), 1, "onnxruntime").load()
    np.testing.assert_allclose(ort.run(["y"], {"x": x})[0], want, rtol=1e-6)
    # both backends describe their tensors alike: numpy dtypes (PopRT's numeric debug tool
    # feeds ``np.zeros(shape).astype(dtype)`` from either)
    for backend in ("poprt", "onnxruntime"):
        s = poprt.backend.get_session(m.SerializeToString(), 1, backend).load()
        (shape, dtype), = s.get_io_info()[0].values()
        assert list(shape) == [2, 8] and dtype == np.dtype(np.float32)
        assert np.zeros(shape).astype(dtype).dtype == np.float32
        s.close()


def test_user_pass_in_converter_and_cli(tmp_path, x):
    from tools.poprt import main

    plugin = tmp_path / "add_to_sub_pass.py"
    plugin.write_text(
        "from host_runtime.poprt.passes import Pass, register\n"
        "@register('test_cli_add_to_sub')\n"
        "class AddToSub(Pass):\n"
        "    def run(self, onnx_model):\n"
        "        for n in onnx_model.graph.node:\n"
        "            if n.op_type == 'Add':\n"
        "                n.op_type = 'Sub'\n"
        "        return onnx_model\n")
    m = mlp()
    onnx.save(m, str(tmp_path / "mlp.onnx"))
    argv = ["--input_model", str(tmp_path / "mlp.onnx"), "--input_shape", "x=2,8",
            "--output_dir", str(tmp_path), "--export_popef", "--custom_pass_config", str(plugin),
            "--passes", "test_cli_add_to_sub"]
    assert main(argv) == 0
    with ModelRunner(str(tmp_path / "executable.popef")) as r:
        got = r.execute({"x": x})["y"]
    h = np.maximum(x @ numpy_helper.to_array(m.graph.initializer[0])
                   - numpy_helper.to_array(m.graph.initializer[1]), 0)
    np.testing.assert_allclose(got, h @ numpy_helper.to_array(m.graph.initializer[2]),
                               rtol=1e-4, atol=1e-4)
    api = poprt.Converter(input_shape={"x": [2, 8]}, used_passes=["test_cli_add_to_sub"])
    exe = Compiler.compile(api.convert(m), None,
                           CompilerOptions.from_dict({"ipu_version": "ipu21"}))
    assert exe.to_bytes() == (tmp_path / "executable.popef").read_bytes()


@pytest.mark.parametrize("flags, converter, options", [
    (["--precision", "fp16"], {"precision": "fp16"}, {}),
    (["--batches_per_step", "3", "--num_io_tiles", "32", "--compiler_options",
      "enable_fast_reduce=true", "--weights_as_tensor_data"], {},
     {"batches_per_step": 3, "num_io_tiles": 32, "enable_fast_reduce": True,
      "constant_weights": False}),
])
def test_cli_and_api_write_the_same_popef(tmp_path, flags, converter, options):
    from tools.poprt import main

    m = mlp()
    onnx.save(m, str(tmp_path / "mlp.onnx"))
    assert main(["-i", str(tmp_path / "mlp.onnx"), "--input_shape", "x=2,8", "--output_dir",
                 str(tmp_path), "--export_popef", "--ipu_version", "ipu2", *flags]) == 0
    conv = poprt.Converter(input_shape={"x": [2, 8]}, **converter).convert(m)
    opts = CompilerOptions.from_dict({"ipu_version": "ipu2", **options})
    Compiler.compile_and_export(conv, [o.name for o in conv.graph.output],
                                str(tmp_path / "api.popef"), opts)
    assert (tmp_path / "api.popef").read_bytes() == (tmp_path / "executable.popef").read_bytes()
    assert popef.load_model([str(tmp_path / "api.popef")]).metadata.ipuVersion() == 2


def test_cli_refuses_by_name_and_lists_passes(tmp_path, capsys):
    from tools.poprt import main

    onnx.save(mlp(), str(tmp_path / "mlp.onnx"))
    assert main(["-i", str(tmp_path / "mlp.onnx"), "--eightbitsio"]) == 2
    assert "eightbitsio is not supported by the IPU emulator" in capsys.readouterr().err
    assert main(["-i", str(tmp_path / "mlp.onnx"), "--custom_library_so_paths", "x.so"]) == 2
    assert "--custom_library_so_paths is not supported" in capsys.readouterr().err
    assert main(["--list_all_passes"]) == 0
    out = capsys.readouterr().out
    assert "float_to_half\tchanges the model" in out
    assert "gelu_pattern\tleaves the emulated result unchanged" in out
    assert main(["-v"]) == 0 and capsys.readouterr().out.strip() == "poprt 1.5.0+emulator"


def test_runtime_options_dict_is_checked():
    from host_runtime.poprt.backends import runtime_config

    cfg = runtime_config({"batchSizeTimeoutNS": 5, "ring_buffer_size_multiplier": 3})
    assert (cfg.batch_size_timeout_ns, cfg.ring_buffer_size_multiplier) == (5, 3)
    with pytest.raises(BadRequestError, match="'noSuchField' is not a RuntimeConfig field"):
        runtime_config({"noSuchField": 1})


def test_a_pass_file_that_imports_poprt_loads_in_the_cli(tmp_path):
    """PopRT's custom-pass example: the pass file imports ``poprt`` itself, and the
    ``poprt`` command (a process of its own) maps that name onto the emulator for it."""
    import subprocess
    import sys

    from tests._paths import child_pythonpath

    plugin = tmp_path / "replace_mul.py"
    plugin.write_text(
        "from poprt.passes import Pass, register\n"
        "@register('test_cli_pass_importing_poprt')\n"
        "class ReplaceMul(Pass):\n"
        "    def run(self, onnx_model):\n"
        "        return onnx_model\n")
    env = dict(os.environ, PYTHONPATH=child_pythonpath())
    proc = subprocess.run([sys.executable, "-m", "tools.poprt", "--list_all_passes",
                           "--custom_pass_config", str(plugin)], capture_output=True,
                          text=True, env=env, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "test_cli_pass_importing_poprt" in proc.stdout


def test_convert_with_a_logger_as_poprt_1_0_2_spells_it(model, x, caplog):
    """PopRT 1.0.2's quick start: ``converter.convert(model_proto, get_logger())`` with
    ``from poprt.utils import get_logger``; the conversion logs to the logger given."""
    from host_runtime.poprt.utils import get_logger

    logger = get_logger()
    assert logger.name == "poprt" and get_logger("mine").name == "mine"
    converter = poprt.Converter(input_shape={"x": [2, 8]}, convert_version=11)
    mine = get_logger("mine")
    with caplog.at_level("INFO", logger="mine"):
        converted = converter.convert(model, mine)   # (opset 13 kept: logged)
    assert [r.name for r in caplog.records if "newer than convert_version 11" in
            r.getMessage()] == ["mine"]
    assert converter.logger is not mine    # for that call only
    np.testing.assert_allclose(run_onnxruntime(converted, {"x": x})["y"],
                               run_onnxruntime(model, {"x": x})["y"], rtol=1e-5, atol=1e-5)
    assert converted.graph.SerializeToString() == poprt.Converter(
        input_shape={"x": [2, 8]}, convert_version=11).convert(model).graph.SerializeToString()
    with pytest.raises(BadRequestError, match="logger must be a logging.Logger, got str"):
        converter.convert(model, "log")
