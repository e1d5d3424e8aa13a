"""Test-wide fixtures.

- Each test process gets its own shared-memory tag and its own emulated
  machine (IPU_EMULATOR_HOME), so xdist workers never contend for the same
  emulated IPUs or see each other's /dev/shm objects.
- The project's pytest plugin (tools/pytest_plugin: ``model_runner``,
  ``compile_onnx``, ``@pytest.mark.ipus``, its leak check) is loaded and its
  ``ipu_machine`` is this process's private machine; the run-wide machine the
  plugin makes for users' suites is shared by all xdist workers, which this
  suite's tests (written for a machine of their own) do not expect.
- ``shm_leak_probe`` (autouse) fails any test that leaves objects of this
  process's tag in /dev/shm.
- ``loopback_device`` comes from the plugin (tools/pytest_plugin).
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

# Loaded by its entry point once the package is installed with it (and by -p): then it
# must not be registered a second time. (This file imports it only in functions.)
pytest_plugins = [] if "tools.pytest_plugin" in sys.modules else ["tools.pytest_plugin"]



def _bytecode_to_a_private_prefix() -> None:
    """With PYTHONDONTWRITEBYTECODE set (some images set it, CI's included), every xdist
    worker, nested pytest and fresh interpreter of the suite compiles the project and
    rewrites the asserts of every test module again: about a fifth of the suite's CPU.
    Bytecode is written instead under a prefix of this user's own (PYTHONPYCACHEPREFIX),
    so nothing lands next to the sources or in site-packages, as the variable intends."""
    if not (sys.dont_write_bytecode or os.environ.get("PYTHONDONTWRITEBYTECODE")):
        return
    prefix = os.path.join(tempfile.gettempdir(), f"ipu-emulator-pycache-{os.getuid()}")
    try:
        os.makedirs(prefix, mode=0o700, exist_ok=True)
        st = os.lstat(prefix)
    except OSError:
        return
    if st.st_uid != os.getuid() or not os.path.isdir(prefix) or os.path.islink(prefix):
        return   # not ours: keep the environment's choice
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    os.environ["PYTHONPYCACHEPREFIX"] = prefix
    sys.pycache_prefix = prefix
    sys.dont_write_bytecode = False


_bytecode_to_a_private_prefix()


def _installed_packages_only() -> None:
    """CI's wheel leg (.ci/run) sets IPU_EMULATOR_TEST_INSTALLED to the wheel it installed:
    every package must then come from site-packages, never from this checkout, in every
    test process (an import from the checkout would test the sources, not the wheel)."""
    if not os.environ.get("IPU_EMULATOR_TEST_INSTALLED"):
        return
    import importlib

    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name in ("shm", "ipu_emulator", "host_runtime", "tools"):
        where = os.path.abspath(importlib.import_module(name).__file__ or "")
        if where.startswith(checkout + os.sep):
            raise pytest.UsageError(f"IPU_EMULATOR_TEST_INSTALLED is set but {name} is "
                                    f"imported from the checkout ({where}); expected the "
                                    "installed wheel (run with PYTHONSAFEPATH=1 and "
                                    "PYTEST_ADDOPTS=--import-mode=append, as .ci/run "
                                    "does)")


_installed_packages_only()
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
    from tools.pytest_plugin.machine import shm_entries

    return shm_entries(_TAG)


@pytest.fixture(scope="session")
def ipu_machine():
    """The plugin's machine: this test process's own (home and tag above), or the daemon's
    pool in the daemon leg of tests/integration/test_path_matrix.py."""
    from tools.pytest_plugin import IpuMachine

    return IpuMachine.from_environ({"IPU_EMULATOR_HOME": _HOME, "IPU_EMULATOR_SHM_TAG": _TAG,
                                    "IPU_EMULATOR_DAEMON": os.environ.get("IPU_EMULATOR_DAEMON",
                                                                          "")})


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
    from tools.pytest_plugin.machine import remove_shm_entries

    remove_shm_entries(names)


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: two workers per CPU, at most two more than the CPUs. Much of the suite
    waits on other processes (IPU processes and daemons starting, fresh interpreters,
    deadlines), so one worker per CPU leaves the CPUs idle half of the time."""
    n = os.cpu_count() or 1
    return min(2 * n, n + 2)


def pytest_configure(config):
    config.addinivalue_line("markers", "allow_shm_leak: the test checks leaks itself")


def pytest_sessionfinish(session, exitstatus):
    _remove(_ours())
    shutil.rmtree(_HOME, ignore_errors=True)


_LONG_FIRST = ("tests/integration/test_path_matrix.py", "tests/unit/test_typing.py",
               "tests/integration/test_pytest_plugin.py", "tests/integration/test_stress.py",
               "tests/integration/test_metrics_stress.py", "tests/integration/test_os_limits.py",
               "tests/integration/test_lifetimes.py", "tests/faults/test_daemon_faults.py")
"""The longest modules (each test several seconds: fresh interpreters, daemons, loads):
started first on every worker, so that no worker is left with one of them while the
others idle."""


_ONE_WORKER = ("tests/faults/test_daemon_faults.py",)
"""Long modules whose tests share a daemon started for the module: kept on one worker."""


def _long_first(items: list, workers: int) -> list:
    """``items`` with the tests of _LONG_FIRST at the head of each worker's share.

    xdist's worksteal scheduler hands each of the ``workers`` a contiguous chunk of the
    list at the start (``len // workers`` each, in order) and later lets idle workers take
    the tail of another's queue: the long tests are dealt round-robin to the heads of
    those chunks (a plain sort would give them all to the first worker)."""
    rank = {path: i for i, path in enumerate(_LONG_FIRST)}
    long = sorted((item for item in items if item.nodeid.split("::")[0] in rank),
                  key=lambda item: rank[item.nodeid.split("::")[0]])
    short = [item for item in items if item.nodeid.split("::")[0] not in rank]
    if workers <= 1:
        return long + short
    # dealt one test at a time, but a module with a daemon of its own (module scope) as one
    units: list[list] = []
    for item in long:
        path = item.nodeid.split("::")[0]
        if path in _ONE_WORKER and units and units[-1][0].nodeid.split("::")[0] == path:
            units[-1].append(item)
        else:
            units.append([item])
    chunks: list[list] = [[item for unit in units[w::workers] for item in unit]
                          for w in range(workers)]
    left = len(items)
    for w, chunk in enumerate(chunks):
        size = left // (workers - w)
        left -= size
        take = max(0, size - len(chunk))
        chunk += short[:take]
        del short[:take]
    chunks[-1] += short
    return [item for chunk in chunks for item in chunk]


def pytest_collection_modifyitems(config, items):
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    items[:] = _long_first(items, workers)
    # The daemon leg of tests/integration/test_path_matrix.py runs the suite with
    # IPU_EMULATOR_DAEMON set: tests about the IPU processes a host starts itself
    # do not apply there.
    if os.environ.get("IPU_EMULATOR_DAEMON"):
        skip = pytest.mark.skip(reason="checks embedded IPU processes; attached through a daemon")
        for item in items:
            if item.get_closest_marker("embedded_only"):
                item.add_marker(skip)
