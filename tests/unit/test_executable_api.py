"""The public surface of ipu_emulator's executable, interpreter and compiler, and package_hash."""

from __future__ import annotations

import re
import subprocess
import sys

import ipu_emulator
import ipu_emulator.compiler
import ipu_emulator.executable
import ipu_emulator.ipu.interpreter
from ipu_emulator import _hash_tree, package_hash


def test_all_is_pinned() -> None:
    assert ipu_emulator.__all__ == ["package_hash", "IpuEmulatorError", "ExecutableError",
                                    "CompileError", "DeviceProgramError"]
    assert ipu_emulator.ipu.interpreter.__all__ == ["Interpreter", "StreamIO", "CallableStreamIO",
                                                "ZeroCopyGroup", "ZeroCopyStreamIO"]
    assert sorted(ipu_emulator.compiler.__all__) == sorted([
        "compile_onnx", "check_interface", "check_map", "load_sharding_yaml", "describe_parts",
        "prepare", "to_fp16", "fix_input_shapes", "relative_error", "fuse_models", "load_model",
        "ort_session", "ModelSpec",
        "CompileOptions", "CompileResult",
        "AnchorDesc", "Target",
        "TARGETS", "CompileError", "Fp16RangeWarning", "INDEX_NAME", "LOAD_PROGRAM", "MAIN_PROGRAM", "SAVE_PROGRAM"])
    for mod in (ipu_emulator, ipu_emulator.executable, ipu_emulator.ipu.interpreter,
                ipu_emulator.compiler):
        assert [n for n in mod.__all__ if not hasattr(mod, n)] == []
    assert {"Executable", "read_header", "ExecutableError", "StreamIn", "StreamOut", "Execute",
            "Repeat", "Switch", "Copy", "plan_memory"} <= set(ipu_emulator.executable.__all__)


def test_package_hash_is_stable_and_cached() -> None:
    h = package_hash()
    assert re.fullmatch(r"[0-9a-f]{64}", h)
    assert package_hash() is h
    assert _hash_tree(ipu_emulator._ROOT) == h
    code = "import ipu_emulator; print(ipu_emulator.package_hash())"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True).stdout.strip()
    assert other == h


def test_hash_follows_the_sources_only(tmp_path) -> None:
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.py").write_text("y = 2\n")
    first = _hash_tree(tmp_path)
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "a.cpython-311.py").write_text("junk")
    (tmp_path / "notes.txt").write_text("not source")
    assert _hash_tree(tmp_path) == first
    (tmp_path / "sub" / "b.py").write_text("y = 3\n")
    assert _hash_tree(tmp_path) != first


def test_import_is_cheap() -> None:
    code = ("import sys, ipu_emulator; "
            "print(','.join(m for m in ('numpy', 'onnx', 'onnxruntime') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
