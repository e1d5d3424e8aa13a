"""Hostile configs, from the outside: the ``poprt`` command in a fresh process, as a user
(or an attacker who controls a config or the output folder) runs it.

- A YAML alias bomb of about 600 bytes, at the top of a fusion config or as a model's
  ``input_shape``, is refused at once: exit 2, one short error line, a fraction of a
  second of CPU (the bomb itself would take minutes and gigabytes).
- An expansion just under the loader's bound, used as an ``input_shape``, gets an
  error line of a few hundred characters, not the megabytes its value prints to.
- Symlinks planted at the output paths while the compile runs are replaced by the
  outputs; the files they point to are never written.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import onnx
import pytest

from tests.models import seed_model0, seed_model1
from tests._paths import child_pythonpath
from tools.generate_simple_popef import build_simple_model

ROOT = Path(__file__).resolve().parents[2]
MAX_LINE = 600
CPU_BOUND = 20.0   # seconds of the command's CPU, start-up included; the bomb takes minutes


def poprt(*args: str, cwd: Path) -> tuple[subprocess.CompletedProcess[str], float]:
    """``python -m tools.poprt ARGS`` in ``cwd``; its result and the CPU seconds it used."""
    env = dict(os.environ, PYTHONPATH=child_pythonpath())
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-m", "tools.poprt", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return proc, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def chain(levels: int, word: str = "lol") -> str:
    """A flow list of ``levels`` anchors, each nine aliases of the one before (9**levels)."""
    doc = "[&a0 [" + ",".join([word] * 9) + "]"
    for k in range(1, levels):
        doc += f", &a{k} [" + ",".join([f"*a{k - 1}"] * 9) + "]"
    return doc + "]"


def fusion_config(folder: Path, first_shape: str, head: str = "") -> Path:
    onnx.save(seed_model0(), str(folder / "model0.onnx"))
    onnx.save(seed_model1(), str(folder / "model1.onnx"))
    cfg = folder / "config.yaml"
    cfg.write_text(f"""{head}output_dir: 'out'
export_popef: True
model_fusion:
  - input_model: 'model0.onnx'
    input_shape: {first_shape}
    precision: 'fp32'
  - input_model: 'model1.onnx'
    input_shape: ['X=1,1']
    precision: 'fp16'
""")
    return cfg


def one_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, \
        proc.stderr[:3000]
    assert len(lines[0]) < MAX_LINE, len(lines[0])
    return lines[0]


@pytest.mark.parametrize("where", ["input_shape", "top"])
def test_a_600_byte_alias_bomb_is_refused_at_once(tmp_path, where):
    bomb = chain(9)
    if where == "input_shape":
        cfg = fusion_config(tmp_path, bomb)
    else:
        cfg = fusion_config(tmp_path, "['X=1,2', 'Y=1,2']", head=f"name: {bomb}\n")
    assert len(cfg.read_bytes()) < 800
    proc, cpu = poprt("--config_yaml", str(cfg), cwd=tmp_path)
    line = one_line(proc)
    assert line.startswith(f"poprt: error: config {str(cfg)!r}: its aliases expand past "), line
    assert "(a 'billion laughs' document?)" in line
    assert cpu < CPU_BOUND, cpu
    assert not (tmp_path / "out").exists()


def test_an_expansion_under_the_bound_as_an_input_shape_gets_a_short_line(tmp_path):
    """9**4 shapes of 'X=1,...' (about 600 kB printed): the error names the shape, capped."""
    cfg = fusion_config(tmp_path, chain(4, "'X=" + "1," * 30 + "1'"))
    proc, cpu = poprt("--config_yaml", str(cfg), cwd=tmp_path)
    line = one_line(proc)
    assert line.startswith("poprt: error: input shape [") and "(9 items)" in line, line
    assert cpu < CPU_BOUND, cpu


def test_symlinks_planted_while_poprt_compiles_are_never_written_through(tmp_path):
    """While the command runs, symlinks to a victim file are put at both output names,
    again whenever they are gone; the victim keeps its bytes, the outputs are files."""
    model = tmp_path / "big.onnx"
    onnx.save(build_simple_model((64, 1024)), str(model))
    out = tmp_path / "out"
    out.mkdir()
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    names = [out / "executable.popef", out / "big.fp32.onnx"]
    env = dict(os.environ, PYTHONPATH=child_pythonpath())
    proc = subprocess.Popen([sys.executable, "-m", "tools.poprt", "--input_model", str(model),
                             "--export_popef", "--output_dir", str(out)], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    planted = 0
    while proc.poll() is None:
        for name in names:
            try:
                name.symlink_to(victim)
                planted += 1
            except FileExistsError:
                pass
        time.sleep(0.0005)   # pace the loop (the compile takes about a second)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert planted >= len(names)
    assert victim.read_bytes() == b"precious"
    for name in names:
        assert name.is_file() and not name.is_symlink(), name
    assert sorted(p.name for p in out.iterdir()) == sorted(n.name for n in names)
