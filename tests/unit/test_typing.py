"""The packages type-check under ``mypy --strict`` (setup.cfg's [mypy] section).

A type error is a defect like any other: this test fails with mypy's own
report, so CI shows the file, line and rule.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["shm", "ipu_emulator", "host_runtime", "tools"]


def test_packages_type_check_strict(tmp_path: Path) -> None:
    pytest.importorskip("mypy")
    cmd = [sys.executable, "-m", "mypy", "--strict", "--config-file", str(ROOT / "setup.cfg"),
           "--cache-dir", str(tmp_path / "cache"), *PACKAGES]
    env = dict(os.environ, MYPYPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"mypy --strict found problems:\n{proc.stdout}{proc.stderr}"
    assert "Success" in proc.stdout
