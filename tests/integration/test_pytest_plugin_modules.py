"""The pytest plugin's ``--ipu-emulator-modules`` (ini ``ipu_emulator_modules``): a suite
written for Graphcore's modules imports them unchanged (ipu_emulator.run's mapping, made
before collection); without the option the names are unknown; a real SDK is refused."""

from __future__ import annotations

import pytest

from tests.integration.test_pytest_plugin import LOAD, QUIET

pytest_plugins = ["pytester"]

SUITE = """
import numpy as np
import model_runtime
import popef
from poprt.runtime import RuntimeConfig

import host_runtime


def test_the_names_are_the_emulators():
    assert model_runtime is host_runtime and popef.Reader is host_runtime.popef.Reader
    assert isinstance(RuntimeConfig(), model_runtime.ModelRunnerConfig)
    assert popef.popefTypeToNumpyDType(popef.DataType.F16) == np.float16
"""


def test_the_option_maps_the_names(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_graphcore=SUITE)
    result = pytester.runpytest_subprocess(*LOAD, *QUIET, "--ipu-emulator-modules")
    result.assert_outcomes(passed=1)
    result = pytester.runpytest_subprocess(*LOAD, *QUIET)
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*No module named 'model_runtime'*"])
    pytester.makeini("[pytest]\nipu_emulator_modules = true\n")
    pytester.runpytest_subprocess(*LOAD, *QUIET).assert_outcomes(passed=1)


def test_a_real_sdk_is_refused(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_graphcore=SUITE)
    pytester.mkpydir("model_runtime")
    result = pytester.runpytest_subprocess(*LOAD, *QUIET, "--ipu-emulator-modules")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--ipu-emulator-modules: Graphcore's own modules are "
                                 "importable here (model_runtime at *)*"])
