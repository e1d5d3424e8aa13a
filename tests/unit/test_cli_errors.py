"""The command lines name errors instead of printing tracebacks (``PROG: error: ...``, exit
status 2 for a bad input or setting, 1 otherwise), and poprt leaves no temporaries behind."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time

import onnx
import pytest
from onnx import TensorProto, helper

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*argv: str, env: dict[str, str] | None = None, cwd: str = REPO
         ) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ, PYTHONPATH=REPO, **(env or {}))
    return subprocess.run([sys.executable, "-m", *argv], cwd=cwd, env=full, capture_output=True,
                          text=True, timeout=120)


def test_an_unsafe_home_is_named_by_the_daemon_without_a_traceback(tmp_path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    home.chmod(0o777)
    proc = _run("tools.cli", "daemon", "--num-ipus", "1", "--socket", str(tmp_path / "d.sock"),
                env={"IPU_EMULATOR_HOME": str(home)})
    assert proc.returncode == 1, proc.stderr
    assert f"ipu-emulator daemon: error: the emulator home {home} is writable by other users " \
           f"(mode 777); refusing to write in it: run 'chmod go-w {home}'" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("argv, code, message", [
    (["tools.cli", "demo", "--dir", "/proc/no/such"], 1,
     "ipu-emulator demo: error: /proc/no: No such file or directory"),
    (["tools.cli", "cleanup", "--temp-files", "/no/such/folder"], 1,
     "ipu-emulator cleanup: error: /no/such/folder: No such file or directory"),
    (["tools.popef_dump", "/no/such.popef"], 2,
     "popef_dump: error: cannot open PopEF file: No such file or directory"),
])
def test_command_line_errors_are_one_line(argv, code, message) -> None:
    proc = _run(*argv)
    assert proc.returncode == code, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(message), proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_bad_setting_is_named_with_its_range(tmp_path) -> None:
    proc = _run("tools.cli", "daemon", "--num-ipus", "1", "--socket", str(tmp_path / "d.sock"),
                env={"IPU_EMULATOR_DEVICE_SPIN_US": "1e20"})
    assert proc.returncode == 2, proc.stderr
    assert "IPU_EMULATOR_DEVICE_SPIN_US='1e20': expected a number of microseconds in " \
           "0..10000" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_poprt_removes_a_killed_runs_temporaries_and_keeps_the_mode(tmp_path) -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "m.onnx")
    out = tmp_path / "out"
    out.mkdir()
    stale = out / ".executable.popef.0123456789ab.tmp"   # a poprt killed mid-write
    stale.write_bytes(b"\0" * 65536)
    old = time.time() - 60
    os.utime(stale, (old, old))
    popef = out / "executable.popef"
    popef.write_bytes(b"an earlier compile")
    popef.chmod(0o600)
    proc = _run("tools.poprt", "--input_model", str(tmp_path / "m.onnx"), "--output_dir",
                str(out), "--export_popef")
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["executable.popef", "m.fp32.onnx"]
    assert stat.S_IMODE(popef.stat().st_mode) == 0o600
    assert popef.read_bytes()[:4] != b"an e"


@pytest.mark.parametrize("argv, code, start", [
    (["daemon", "status", "--socket", "{tmp}/none.sock"], 1,
     "ipu-emulator daemon status: error: no daemon answers at {tmp}/none.sock: "),
    (["daemon", "faults", "--socket", "{tmp}/none.sock"], 1,
     "ipu-emulator daemon faults: error: no daemon answers at {tmp}/none.sock: "),
    (["daemon", "--num-ipus", "-1", "--socket", "{tmp}/d.sock"], 2,
     "ipu-emulator daemon: error: "),
])
def test_daemon_command_errors_read_as_the_readme_says(tmp_path, argv, code, start) -> None:
    # README: `ipu-emulator NAME: error: ...`
    proc = _run("tools.cli", *[a.format(tmp=tmp_path) for a in argv],
                env={"IPU_EMULATOR_HOME": str(tmp_path / "home")})
    assert proc.returncode == code, proc.stderr
    assert proc.stderr.startswith(start.format(tmp=tmp_path)), proc.stderr
    assert "Traceback" not in proc.stderr


def test_vipu_is_the_command_of_its_own_name(monkeypatch, capsys, tmp_path) -> None:
    # job scripts call V-IPU's `vipu`; it is `ipu-emulator vipu`
    from tools import cli

    monkeypatch.setattr(sys, "argv", ["vipu", "--socket", str(tmp_path / "none.sock"),
                                      "list", "partitions"])
    assert cli.vipu_main() == 1
    err = capsys.readouterr().err
    assert err.startswith("ipu-emulator vipu: error: list partitions: cannot reach the V-IPU "
                          f"controller (the IPU emulator daemon) at {tmp_path}/none.sock"), err
