"""Test-wide fixtures.

- Each test process gets its own shared-memory tag and its own emulated
  machine (IPU_EMULATOR_HOME), so xdist workers never contend for the same
  emulated IPUs or see each other's /dev/shm objects.
- ``shm_leak_probe`` (autouse) fails any test that leaves objects of this
  process's tag in /dev/shm.
- A deadlock guard dumps every thread's traceback if a test hangs.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import secrets
import shutil
import sys
import tempfile

import pytest

_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "main")
_TAG = "t" + secrets.token_hex(4)
os.environ["IPU_EMULATOR_SHM_TAG"] = _TAG
# Assigned unconditionally: the xdist controller imports this file first and
# its workers inherit its environment, so a setdefault would hand every
# worker the same emulated machine.
_HOME = tempfile.mkdtemp(prefix=f"ipuemu-home-{_WORKER}-")
os.environ["IPU_EMULATOR_HOME"] = _HOME

# Deadlock guard: a test that hangs for this long dumps all stacks and exits.
_HANG_SECONDS = float(os.environ.get("IPU_EMULATOR_TEST_HANG_SECONDS", "240"))


def _ours() -> set[str]:
    try:
        names = os.listdir("/dev/shm")
    except FileNotFoundError:
        return set()
    marker = f"ipuemu_{_TAG}_"
    return {n for n in names if marker in n}


@pytest.fixture(autouse=True)
def shm_leak_probe(request):
    before = _ours()
    faulthandler.dump_traceback_later(_HANG_SECONDS, exit=True, file=sys.stderr)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
    leaked = _ours() - before
    if leaked:
        # arrays from empty_shared free their regions when collected; an exception's
        # traceback (pytest.raises) keeps the test's frame in a cycle until then
        gc.collect()
        leaked = _ours() - before
    if leaked and not request.node.get_closest_marker("allow_shm_leak"):
        # Clean up so one leak does not fail every later test, then fail.
        _remove(leaked)
        pytest.fail(f"test left shared-memory objects in /dev/shm: {sorted(leaked)}")


def _remove(names: set[str]) -> None:
    for n in names:
        try:
            os.unlink(os.path.join("/dev/shm", n))
        except OSError:
            pass


def pytest_configure(config):
    config.addinivalue_line("markers", "allow_shm_leak: the test checks leaks itself")


def pytest_sessionfinish(session, exitstatus):
    _remove(_ours())
    shutil.rmtree(_HOME, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    # The daemon leg of tests/integration/test_path_matrix.py runs the suite with
    # IPU_EMULATOR_DAEMON set: tests about the IPU processes a host starts itself
    # do not apply there.
    if os.environ.get("IPU_EMULATOR_DAEMON"):
        skip = pytest.mark.skip(reason="checks embedded IPU processes; attached through a daemon")
        for item in items:
            if item.get_closest_marker("embedded_only"):
                item.add_marker(skip)
