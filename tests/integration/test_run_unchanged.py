"""Programs written for Graphcore's ``model_runtime``, ``popef`` and ``poprt`` run unchanged
under ``ipu-emulator run`` / ``python -m ipu_emulator.run`` (ipu_emulator.run).

Each program is written as its user writes it (no import of this project), runs in a
subprocess with its own machine and shared-memory tag, and writes what it computed to a
file; the test checks the numbers against onnxruntime, the exit status, what the command
says on stderr, and that /dev/shm holds nothing of the tag afterwards.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]

_MODEL_RUNTIME = """
import sys
import numpy as np
import model_runtime
import popef

popef_file, out = sys.argv[1], sys.argv[2]
config = model_runtime.ModelRunnerConfig()
config.device_wait_config = model_runtime.DeviceWaitConfig(
    model_runtime.DeviceWaitStrategy.NO_WAIT)
runner = model_runtime.ModelRunner(model_runtime.PopefPaths(popef_file), config=config)
rng = np.random.default_rng(0)
view = model_runtime.InputMemoryView()
inputs = {}
for desc in runner.getExecuteInputs():
    inputs[desc.name] = rng.standard_normal(desc.shape).astype(
        popef.popefTypeToNumpyDType(desc.data_type))
    view[desc.name] = inputs[desc.name]
result = runner.execute(view)
outputs = {}
for desc in runner.getExecuteOutputs():
    outputs[desc.name] = np.frombuffer(result[desc.name], dtype=popef.popefTypeToNumpyDType(
        desc.data_type)).reshape(desc.shape)
np.savez(out, **inputs, **outputs)
sys.exit(3)
"""

# Graphcore's compress tool's way through popef, then the compressed file runs
_POPEF = """
import sys
import numpy as np
import popef
import model_runtime

source, out = sys.argv[1], sys.argv[2]
reader = popef.Reader()
reader.parseFile(source)
writer = popef.Writer(source + "_compressed.popef")
for metadata in reader.metadata():
    writer.writeMetadata(metadata)
for executable in reader.executables():
    blob = writer.createExecutable(executable.name, True)
    content = executable.executable()
    blob.write(content, len(content))
for tensor in reader.tensors():
    blob = writer.createTensorData(tensor.info)
    blob.write(tensor.data().tobytes(), tensor.info.tensorInfo().sizeInBytes())
writer.close()

compressed = popef.Reader()
compressed.parseFile(source + "_compressed.popef")
assert all(e.isCompressed for e in compressed.executables())
model = popef.ModelBuilder(compressed).createModel()
runner = model_runtime.ModelRunner(model)
inputs = {d.name: np.full(d.shape, 0.5, d.numpy_data_type()) for d in runner.getExecuteInputs()}
result = runner.execute(inputs)
np.savez(out, **inputs, **{k: np.asarray(v) for k, v in result.items()})
"""

# PopRT's example, run as a module (-m)
_POPRT = """
import sys
import numpy as np
from poprt import runtime
from poprt.runtime import RuntimeConfig

popef_file, out = sys.argv[1], sys.argv[2]
runner = runtime.Runner(popef_file, RuntimeConfig())
inputs = {i.name: np.full(i.shape, 2.0, dtype=i.numpy_data_type())
          for i in runner.get_execute_inputs()}
outputs = {o.name: np.zeros(o.shape, dtype=o.numpy_data_type())
           for o in runner.get_execute_outputs()}
runner.execute(inputs, outputs)
np.savez(out, **inputs, **outputs)
"""


@pytest.fixture(scope="module")
def onnx_and_popef(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    import onnx

    from host_runtime.poprt.compiler import compile
    from tools.generate_simple_popef import build_simple_model

    folder = tmp_path_factory.mktemp("model")
    onnx.save(build_simple_model((2, 4), seed=5), str(folder / "m.onnx"))
    out = compile(folder / "m.onnx", folder, weights_as_tensor_data=True)
    return folder / "m.onnx", Path(out.popef_path)


def _ours(tag: str) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if f"ipuemu_{tag}_" in n)


def run(command: list[str], tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], str]:
    tag = "r" + secrets.token_hex(4)
    environ = dict(os.environ, IPU_EMULATOR_HOME=str(tmp_path / "machine"),
                   IPU_EMULATOR_SHM_TAG=tag, IPU_EMULATOR_NUM_IPUS="1", **env)
    proc = subprocess.run([sys.executable, *command], env=environ, capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    return proc, tag


def check_against_onnxruntime(model: Path, npz: Path) -> None:
    import onnxruntime as ort

    got = dict(np.load(npz))
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    feeds = {i.name: got[i.name] for i in session.get_inputs()}
    for meta, want in zip(session.get_outputs(), session.run(None, feeds)):
        np.testing.assert_allclose(got[meta.name], want, rtol=1e-6, atol=1e-6)


def test_a_model_runtime_program_runs_unchanged(onnx_and_popef, tmp_path):
    model, popef_file = onnx_and_popef
    (tmp_path / "app.py").write_text(textwrap.dedent(_MODEL_RUNTIME))
    proc, tag = run(["-m", "ipu_emulator.run", "app.py", str(popef_file), "out.npz"],
                    tmp_path)
    assert proc.returncode == 3, proc.stderr            # the program's sys.exit(3)
    assert "model_runtime, popef, poprt are the IPU emulator's (host_runtime at " \
        in proc.stderr
    check_against_onnxruntime(model, tmp_path / "out.npz")
    assert _ours(tag) == []


def test_a_popef_program_rewrites_and_runs_a_file(onnx_and_popef, tmp_path):
    model, popef_file = onnx_and_popef
    source = tmp_path / "m.popef"
    source.write_bytes(popef_file.read_bytes())
    (tmp_path / "compress.py").write_text(textwrap.dedent(_POPEF))
    proc, tag = run(["-m", "tools.cli", "run", "--quiet", "compress.py", str(source),
                     "out.npz"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""                              # --quiet
    check_against_onnxruntime(model, tmp_path / "out.npz")
    assert _ours(tag) == []


def test_a_poprt_program_runs_as_a_module(onnx_and_popef, tmp_path):
    model, popef_file = onnx_and_popef
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "__init__.py").write_text("")
    (tmp_path / "app" / "infer.py").write_text(textwrap.dedent(_POPRT))
    proc, tag = run(["-m", "ipu_emulator.run", "-q", "-m", "app.infer", str(popef_file),
                     "out.npz"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    check_against_onnxruntime(model, tmp_path / "out.npz")
    assert _ours(tag) == []


def test_poprt_cli_as_a_module_compiles_as_poprt_1_0_2_documents(onnx_and_popef, tmp_path):
    """``python -m poprt.cli --input_model ... --export_popef`` (PopRT 1.0.2's spelling of
    the command), run unchanged: the same PopEF file as the ``poprt`` command writes."""
    model, _ = onnx_and_popef
    proc, tag = run(["-m", "ipu_emulator.run", "-q", "-m", "poprt.cli", "--input_model",
                     str(model), "--export_popef", "--output_dir", "out"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    from tools.poprt import main

    assert main(["--input_model", str(model), "--export_popef", "--output_dir",
                 str(tmp_path / "direct")]) == 0
    written = sorted((tmp_path / "out").glob("*.popef"))
    assert [p.name for p in written] == [p.name for p in sorted(
        (tmp_path / "direct").glob("*.popef"))] and written
    assert written[0].read_bytes() == (tmp_path / "direct" / written[0].name).read_bytes()
    assert _ours(tag) == []


def test_an_exception_prints_the_programs_traceback(tmp_path):
    (tmp_path / "bad.py").write_text("import popef\n\ndef f():\n    raise ValueError('boom')\n"
                                     "\nf()\n")
    proc, _ = run(["-m", "ipu_emulator.run", "-q", "bad.py"], tmp_path)
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert lines[1].startswith('  File "bad.py", line 6, in <module>'), proc.stderr
    assert lines[-1] == "ValueError: boom"
    assert "run.py" not in proc.stderr and "runpy" not in proc.stderr


def test_a_real_sdk_is_not_shadowed_unless_forced(tmp_path):
    sdk = tmp_path / "sdk" / "popef"
    sdk.mkdir(parents=True)
    (sdk / "__init__.py").write_text("REAL = True\n")
    (tmp_path / "app.py").write_text("import popef\nprint('REAL' if hasattr(popef, 'REAL') "
                                     "else popef.__name__)\n")
    path = {"PYTHONPATH": os.pathsep.join([str(tmp_path / "sdk"),
                                           os.environ.get("PYTHONPATH", str(ROOT))])}
    proc, _ = run(["-m", "ipu_emulator.run", "app.py"], tmp_path, **path)
    assert proc.returncode == 2
    assert f"Graphcore's own modules are importable here (popef at {sdk / '__init__.py'})" \
        in proc.stderr and "--force" in proc.stderr and proc.stdout == ""
    proc, _ = run(["-m", "ipu_emulator.run", "--force", "app.py"], tmp_path, **path)
    assert (proc.returncode, proc.stdout) == (0, "host_runtime.popef\n"), proc.stderr
    proc, _ = run(["-m", "ipu_emulator.run", "app.py"], tmp_path,
                  IPU_EMULATOR_FORCE_MODULES="1", **path)
    assert (proc.returncode, proc.stdout) == (0, "host_runtime.popef\n"), proc.stderr
    proc, _ = run(["app.py"], tmp_path, **path)             # without the emulator: the real one
    assert (proc.returncode, proc.stdout) == (0, "REAL\n"), proc.stderr


def test_usage_errors(tmp_path):
    proc, _ = run(["-m", "ipu_emulator.run", "missing.py"], tmp_path)
    assert proc.returncode == 2 and "can't open file 'missing.py'" in proc.stderr
    proc, _ = run(["-m", "ipu_emulator.run", "--bogus", "x.py"], tmp_path)
    assert proc.returncode == 2 and "unknown option '--bogus'" in proc.stderr
    proc, _ = run(["-m", "ipu_emulator.run"], tmp_path)
    assert proc.returncode == 2 and proc.stdout.startswith("usage: ipu-emulator run")
