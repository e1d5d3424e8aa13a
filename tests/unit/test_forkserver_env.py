"""The template process (ipu_emulator.ipu.forkserver) forks an IPU process for any launch
whose import path and math-library threads agree with it: an IPU process reads its settings
after the fork, from its launch's environment, so settings never split templates
(tests/unit/test_settings.py checks that no module reads a setting at import)."""

from __future__ import annotations

from ipu_emulator.ipu.forkserver import IMPORT_TIME_ENV, _env_key


def test_env_key_tells_import_environments_apart_and_ignores_settings() -> None:
    base = {"PYTHONPATH": "/x", "HOME": "/h"}
    assert IMPORT_TIME_ENV == ("PYTHONPATH", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")
    assert _env_key(base) == _env_key(dict(base, HOME="/other", IPU_EMULATOR_SHM_TAG="t",
                                           IPU_EMULATOR_KEEP_APART="0",
                                           IPU_EMULATOR_ZERO_COPY="0",
                                           IPU_EMULATOR_DEVICE_SPIN_US="7"))
    assert _env_key(base) != _env_key(dict(base, PYTHONPATH="/y"))
    assert _env_key(base) != _env_key(dict(base, OMP_NUM_THREADS="2"))
