"""The packages type-check under ``mypy --strict`` (setup.cfg's [mypy] section).

A type error is a defect like any other: this test fails with mypy's own
report, so CI shows the file, line and rule.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["shm", "ipu_emulator", "host_runtime", "tools"]


def _numpy_stubs_with_defaults() -> bool:
    """numpy 2.3's stubs give ``ndarray`` default type parameters; the packages write a
    bare ``np.ndarray`` where any array goes, which older stubs call an error under
    --strict (setup.cfg admits numpy from 1.26 at run time)."""
    major, minor = (int(x) for x in np.__version__.split(".")[:2])
    return (major, minor) >= (2, 3)


@pytest.mark.skipif(not _numpy_stubs_with_defaults(),
                    reason=f"annotations are checked against numpy>=2.3's stubs (numpy "
                           f"{np.__version__} installed)")
def test_packages_type_check_strict(tmp_path: Path) -> None:
    pytest.importorskip("mypy")
    cmd = [sys.executable, "-m", "mypy", "--strict", "--config-file", str(ROOT / "setup.cfg"),
           "--cache-dir", str(tmp_path / "cache"), *PACKAGES]
    env = dict(os.environ, MYPYPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"mypy --strict found problems:\n{proc.stdout}{proc.stderr}"
    assert "Success" in proc.stdout
