"""The ``ipu_emulator`` pytest plugin (tools/pytest_plugin), driven by ``pytester``.

Each test writes a suite the way a user would and runs it in this process
(``runpytest``) or as ``pytest -n 2`` (``runpytest_subprocess``): the
README's example, a test that leaks, a daemon shared by two workers, the
``ipus`` marker waiting for an IPU another worker holds, and two "machines"
(two daemons) that do not see each other.

The entry point is declared in setup.cfg; where the installed package does
not know it yet, the suites load the plugin with ``-p tools.pytest_plugin``.
"""

from __future__ import annotations

import configparser
import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

# In-process runs (runpytest) forget the modules they imported; onnx's extension must not be
# imported twice in one process, so the suites' imports are made here, once.
import host_runtime.runner._model_runner  # noqa: F401
import host_runtime.poprt.compiler  # noqa: F401
import ipu_emulator.compiler  # noqa: F401
import onnx  # noqa: F401
import tools.generate_simple_popef  # noqa: F401
from tests._helpers import running
from tests.daemon_rig import REPO, DaemonRig, shm_entries

pytest_plugins = ["pytester"]

PLUGIN = "tools.pytest_plugin"


def _installed() -> bool:
    return any(ep.value == PLUGIN for ep in metadata.entry_points(group="pytest11"))


# -p for a plugin that an installed entry point already loads would register it twice
LOAD = [] if _installed() else ["-p", PLUGIN]
# (plugins the suites do not need are left out: each xdist worker would import them)
QUIET = ["-p", "no:cacheprovider", "-p", "no:hypothesispytest", "-p", "no:benchmark", "-q", "-rs"]


def readme_example() -> str:
    """The README's example suite, ``docs/examples/test_inference.py``."""
    return (REPO / "docs" / "examples" / "test_inference.py").read_text()


def test_readme_shows_lines_of_the_example() -> None:
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Testing with the pytest plugin"):]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match, "README: the plugin section has no python example"
    example = {line.strip() for line in readme_example().splitlines()}
    shown = [line.strip() for line in match.group(1).splitlines() if line.strip()]
    missing = [line for line in shown if line not in example]
    assert not missing, f"README shows lines that docs/examples/test_inference.py lacks: {missing}"


RECORD_MACHINE = '''
import json, os
from test_inference import scale_and_shift

def test_record_machine(ipu_machine, compile_onnx):
    out = os.path.join(os.environ["RECORD_DIR"], os.environ.get("PYTEST_XDIST_WORKER", "main"))
    with open(out + ".json", "w") as f:
        json.dump({"home": ipu_machine.home, "tag": ipu_machine.shm_tag,
                   "popef": compile_onnx(scale_and_shift())}, f)
'''


def recorded(folder: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]


def assert_run_left_nothing(records: list[dict]) -> None:
    assert records, "the suite did not record its machine"
    for r in records:
        assert not os.path.exists(r["home"]), f"the run's machine home {r['home']} is left"
        assert shm_entries(r["tag"]) == set(), f"the run left /dev/shm objects of {r['tag']}"


# -- installation ----------------------------------------------------------------------------

def test_setup_cfg_declares_the_entry_point():
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    lines = [s.strip() for s in cfg["options.entry_points"]["pytest11"].splitlines() if s.strip()]
    assert lines == ["ipu_emulator = tools.pytest_plugin"]


def test_the_declared_entry_point_loads_the_plugin(pytester, tmp_path, monkeypatch):
    """Install setup.cfg's pytest11 entry point (a dist-info folder on the path) and run a
    suite without -p: pytest loads the plugin by itself, and -p no:ipu_emulator turns it off."""
    if _installed():
        pytest.skip("the installed package already declares the entry point")
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    dist = tmp_path / "site" / "ipu_emulator_plugin_check-0.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ipu-emulator-plugin-check\n"
                                   "Version: 0.0\n")
    (dist / "entry_points.txt").write_text(
        "[pytest11]\n" + cfg["options.entry_points"]["pytest11"].strip() + "\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "site"),
                                                      os.environ.get("PYTHONPATH", "")]))
    pytester.makepyfile(test_ep="def test_machine(ipu_machine):\n"
                                "    assert ipu_machine.num_ipus == 4\n")
    pytester.runpytest_subprocess(*QUIET).assert_outcomes(passed=1)
    result = pytester.runpytest_subprocess(*QUIET, "-p", "no:ipu_emulator")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*fixture 'ipu_machine' not found*"])
    # this project's conftest does not register the plugin a second time
    proc = subprocess.run([sys.executable, "-m", "pytest", *QUIET, "-n", "0",
                           "tests/devices/test_runner_shared.py::"
                           "test_a_failing_iteration_with_shared_memory_then_auto_reset"],
                          cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_plugin_changes_nothing_for_a_suite_that_does_not_use_it(pytester, monkeypatch):
    pytester.makepyfile(test_plain='''
        import os
        def test_env_untouched():
            assert os.environ.get("IPU_EMULATOR_SHM_TAG") == os.environ["OUTER_TAG"]
        def test_no_fixture_added(request):
            assert "ipu_machine" not in request.fixturenames
        def test_no_folder_made(pytestconfig):
            from tools.pytest_plugin import run_folder
            assert not run_folder(pytestconfig).exists()
        ''')
    monkeypatch.setenv("OUTER_TAG", os.environ["IPU_EMULATOR_SHM_TAG"])
    result = pytester.runpytest(*LOAD, *QUIET)
    result.assert_outcomes(passed=3)
    help_text = pytester.runpytest(*LOAD, "-p", "no:benchmark", "--help").stdout.str()
    for option in ("--ipu-emulator-daemon", "--ipu-emulator-num-ipus",
                   "--ipu-emulator-ipu-version", "ipu_emulator_wait_timeout"):
        assert option in help_text


# -- the README example --------------------------------------------------------------------

def test_readme_example_in_process(pytester, tmp_path, monkeypatch):
    monkeypatch.setenv("RECORD_DIR", str(tmp_path))
    pytester.makepyfile(test_inference=readme_example(), test_record=RECORD_MACHINE)
    result = pytester.runpytest(*LOAD, *QUIET)
    result.assert_outcomes(passed=5, skipped=1)
    result.stdout.fnmatch_lines(["*needs 64 IPUs (@pytest.mark.ipus(64)); the emulated "
                                 "machine has 4*"])
    assert_run_left_nothing(recorded(tmp_path))


# -- options -----------------------------------------------------------------------------

OPTIONS = '''
import numpy as np
from onnx import TensorProto, helper
from host_runtime import DeviceManager

def double(name):
    """y = x + x"""
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "x"], ["y"])], name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])

def test_the_machine_follows_the_options(ipu_machine):
    assert (ipu_machine.num_ipus, ipu_machine.ipu_version) == (2, "ipu2")
    assert DeviceManager().ipuHardwareVersion() == 2
    assert DeviceManager().system.num_ipus == 2

def test_compile_onnx_is_keyed_by_model_and_options(compile_onnx, model_runner, tmp_path):
    import onnx
    first = compile_onnx(double("a"))
    assert compile_onnx(double("a")) == first
    assert compile_onnx(double("b")) != first
    assert compile_onnx(double("a"), batches_per_step=2) != first
    onnx.save(double("a"), str(tmp_path / "a.onnx"))
    runner = model_runner(str(tmp_path / "a.onnx"))      # an ONNX path: compiled for ipu2
    np.testing.assert_array_equal(runner.execute({"x": np.array([1, 2], np.float32)})["y"],
                                  [2, 4])
'''


def test_options_set_the_machine_and_compile_onnx_caches_by_content(pytester):
    pytester.makepyfile(test_options=OPTIONS)
    result = pytester.runpytest(*LOAD, *QUIET, "--ipu-emulator-num-ipus=2",
                                "--ipu-emulator-ipu-version=ipu2")
    result.assert_outcomes(passed=2)


LOOPBACK = OPTIONS.split("def test_")[0] + '''
import host_runtime as model_runtime

def test_a_runner_on_the_loopback_device(loopback_device, compile_onnx):
    import psutil
    path = compile_onnx(double("a"), ipu_version="ipu21")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    runner = model_runtime.ModelRunner(path, model_runtime.ModelRunnerConfig(
        replica_to_device={0: loopback_device}))
    out = runner.execute({"x": np.array([1, 2], np.float32)})
    np.testing.assert_array_equal(out["y"], [2, 4])
    runner.close()
    # no new process (children of earlier tests may be reaped meanwhile)
    assert {p.pid for p in psutil.Process().children(recursive=True)} - before == set()
'''


def test_the_loopback_device_fixture_runs_a_users_model_without_a_process(pytester):
    pytester.makepyfile(test_loopback=LOOPBACK)
    result = pytester.runpytest(*LOAD, *QUIET)
    result.assert_outcomes(passed=1)


def test_a_daemon_option_that_names_no_daemon_says_so(pytester, tmp_path):
    pytester.makepyfile(test_x="def test_x(ipu_machine):\n    pass\n")
    result = pytester.runpytest(*LOAD, *QUIET, f"--ipu-emulator-daemon={tmp_path}/none.sock")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines([f"*no IPU emulator daemon answers at {tmp_path}/none.sock "
                                 "(--ipu-emulator-daemon / ipu_emulator_daemon / "
                                 "IPU_EMULATOR_DAEMON)*"])


# -- the leak check --------------------------------------------------------------------------

LEAKY = '''
import numpy as np
import pytest
from host_runtime import DeviceManager, ModelRunner, empty_shared
from tools.generate_simple_popef import write_simple_popef

KEEP = []

@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return str(write_simple_popef(tmp_path_factory.mktemp("m") / "simple.popef"))

def test_leaks_a_runner(ipu_machine, path):
    KEEP.append(ModelRunner(path))

def test_leaks_a_device(ipu_machine):
    KEEP.append(DeviceManager().getDevice(1))

def test_leaks_shared_memory(ipu_machine):
    KEEP.append(empty_shared((1024,), np.float32))

def test_leaks_an_ipu_process(ipu_machine):
    from ipu_emulator.ipu.launcher import IpuSpec, launch_ipu
    KEEP.append(launch_ipu(IpuSpec(ipu_id=-1, ipu_version=21, tiles_per_ipu=4,
                                   memory_per_tile=1 << 20, label="stray IPU")))

def test_then_all_is_clean(ipu_machine, model_runner, path):
    import psutil
    assert ipu_machine.shm_objects() == set()
    def live_ipu(p):
        try:
            return p.status() != psutil.STATUS_ZOMBIE and (
                "ipu_emulator" in p.cmdline()
                or " ".join(p.cmdline()).startswith("ipu-emulator: ipu "))
        except psutil.NoSuchProcess:   # exited since the listing
            return False
    assert [p for p in psutil.Process().children(recursive=True) if live_ipu(p)] == []
    runner = model_runner(path)       # IPU 0 is free again
    x = np.ones((1, 4), np.float32)
    assert runner.execute({"tensor_A": x, "tensor_B": x})["tensor_C"].shape == (1, 4)

def test_a_runner_of_the_fixture_is_closed(model_runner, path):
    KEEP.append(model_runner(path))
'''


@pytest.mark.parametrize("workers", [0, 2], ids=["in-process", "xdist-n2"])
def test_a_leaking_test_fails_with_what_it_left_and_the_next_one_passes(pytester, workers):
    pytester.makepyfile(test_leaky=LEAKY)
    if workers:   # a machine of 4 IPUs shared by the two workers
        result = pytester.runpytest_subprocess(*LOAD, *QUIET, "-n", str(workers), timeout=240)
        device = "device * (ipu *)"
    else:         # the next test gets the one IPU the leaking tests held
        result = pytester.runpytest(*LOAD, *QUIET, "--ipu-emulator-num-ipus", "1")
        device = "device 0 (ipu 0)"
    result.assert_outcomes(passed=6, errors=4)
    out = result.stdout.str()
    result.stdout.fnmatch_lines([
        "*ERROR at teardown of test_leaks_a_runner*",
        "*the test left emulated IPU resources behind (the ipu_emulator plugin has cleaned "
        "them up):",
        f"*- ModelRunner <ModelRunner 'simple_model'*> still attached to {device} "
        "(IPU process pid *); made at test_leaky.py:13 in test_leaks_a_runner "
        "(KEEP.append(ModelRunner(path)))",
    ])
    result.stdout.fnmatch_lines([
        "*ERROR at teardown of test_leaks_a_device*",
        f"*- {device} still attached (IPU process pid *); attached at test_leaky.py:16 "
        "in test_leaks_a_device (KEEP.append(DeviceManager().getDevice(1)))",
    ])
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_leaks_shared_memory*",
                                 "*- 1 object(s) in /dev/shm: ipuemu_p*_hostmem"])
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_leaks_an_ipu_process*",
                                 "*- IPU process(es) still running: pid * (*)",
                                 "*- 2 object(s) in /dev/shm: ipuemu_p*, ipuemu_p*"])
    shm_line = [line for line in result.outlines if "2 object(s) in /dev/shm" in line][0]
    for kind in ("_ctl", "_evt"):   # the control and event rings (their semaphores inside)
        assert kind + "," in shm_line + ",", f"{kind} missing from {shm_line}"
    assert "sem." not in shm_line
    assert "ERROR at teardown of test_then_all_is_clean" not in out
    assert "ERROR at teardown of test_a_runner_of_the_fixture_is_closed" not in out


# -- the shared daemon -----------------------------------------------------------------------

SHARED_DAEMON = '''
import json, os, time
import numpy as np
from tools.generate_simple_popef import write_simple_popef

BARRIER = {barrier!r}

def wait_for(n):
    deadline = time.monotonic() + 120
    while len([f for f in os.listdir(BARRIER) if f.endswith(".json")]) < n:
        assert time.monotonic() < deadline, "the other worker never came"
        time.sleep(0.02)

def test_both_workers_use_one_daemon(ipu_daemon, model_runner, tmp_path):
    me = os.environ["PYTEST_XDIST_WORKER"]
    with open(os.path.join(BARRIER, me + ".json"), "w") as f:
        json.dump({{"daemon": ipu_daemon.pid, "socket": ipu_daemon.socket}}, f)
    wait_for(2)                      # both workers hold the daemon at once
    assert os.environ["IPU_EMULATOR_DAEMON"] == ipu_daemon.socket
    runner = model_runner(str(write_simple_popef(tmp_path / "simple.popef")))
    x = np.ones((1, 4), np.float32)
    assert runner.execute({{"tensor_A": x, "tensor_B": x}})["tensor_C"].shape == (1, 4)
    holders = [ipu["holder"] for ipu in ipu_daemon.status()["ipus"]]
    assert os.getpid() in holders    # the runner's IPU is the daemon's
'''


def test_readme_example_and_a_shared_daemon_under_xdist(pytester, tmp_path, monkeypatch):
    """One ``pytest -n 2 --dist each`` run of the README's example (the workers share one
    machine and compile_onnx's cache) followed by a suite using ``ipu_daemon`` (the workers
    share one daemon, gone at the end). The daemon's file sorts last: a worker reaches it
    after its README tests, and attaches only once both workers are there."""
    records, barrier = tmp_path / "records", tmp_path / "barrier"
    records.mkdir()
    barrier.mkdir()
    monkeypatch.setenv("RECORD_DIR", str(records))
    pytester.makepyfile(test_inference=readme_example(), test_record=RECORD_MACHINE,
                        test_shared_daemon=SHARED_DAEMON.format(barrier=str(barrier)))
    result = pytester.runpytest_subprocess(*LOAD, *QUIET, "-n", "2", "--dist", "each",
                                           "--ipu-emulator-num-ipus", "2", timeout=240)
    result.assert_outcomes(passed=12, skipped=2)
    # the README example: one machine, a tag per worker, one compile cache, nothing left
    machines = recorded(records)
    assert len(machines) == 2
    assert machines[0]["home"] == machines[1]["home"], "xdist workers must share one machine"
    assert machines[0]["tag"] != machines[1]["tag"], "each worker needs its own shm tag"
    assert machines[0]["popef"] == machines[1]["popef"], "compile_onnx caches for the whole run"
    assert_run_left_nothing(machines)
    # the daemon: one for both workers, stopped at the end with its socket and home
    seen = [json.loads(p.read_text()) for p in sorted(barrier.glob("*.json"))]
    assert len(seen) == 2
    assert seen[0] == seen[1], f"the workers used different daemons: {seen}"
    pid = seen[0]["daemon"]
    assert not running(pid), f"the daemon (pid {pid}) still runs after the test run"
    assert not os.path.exists(seen[0]["socket"])
    assert not os.path.exists(os.path.dirname(seen[0]["socket"])), "the run's home is left"


# -- the ipus marker -------------------------------------------------------------------------

HOLD_AND_WAIT = '''
import os, time
import numpy as np
import pytest
from host_runtime import DeviceManager
from tools.generate_simple_popef import write_simple_popef

BARRIER = {barrier!r}

def signal(name):
    open(os.path.join(BARRIER, name), "w").close()

def wait_for(name):
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(BARRIER, name)):
        assert time.monotonic() < deadline, f"never saw {{name}}"
        time.sleep(0.02)

@pytest.mark.ipus(1)
def test_take_turns(ipu_machine, model_runner, tmp_path):
    path = str(write_simple_popef(tmp_path / "simple.popef"))
    if os.environ["PYTEST_XDIST_WORKER"] == "gw0":
        device = DeviceManager().getDevice(1)        # the machine's only IPU
        signal("held")
        wait_for("ready")
        signal("releasing")
        device.close()
    else:
        wait_for("held")
        signal("ready")
        runner = model_runner(path)                  # waits for gw0's IPU
        assert os.path.exists(os.path.join(BARRIER, "releasing"))
        x = np.ones((1, 4), np.float32)
        assert runner.execute({{"tensor_A": x, "tensor_B": x}})["tensor_C"].shape == (1, 4)
'''


def test_ipus_marker_waits_for_an_ipu_another_worker_holds(pytester, tmp_path):
    pytester.makepyfile(test_turns=HOLD_AND_WAIT.format(barrier=str(tmp_path)))
    result = pytester.runpytest_subprocess(*LOAD, *QUIET, "-n", "2", "--dist", "each",
                                           "--ipu-emulator-num-ipus", "1", timeout=240)
    result.assert_outcomes(passed=2)


TIMEOUT_FROM_INI = '''
import pytest
from host_runtime import DeviceManager, DeviceUnavailableError, ModelRunner
from tools.generate_simple_popef import write_simple_popef

@pytest.fixture
def held(ipu_machine):
    device = DeviceManager().getDevice(1)     # a second attach in this process conflicts
    yield device
    device.close()

@pytest.mark.ipus(1)
def test_marked_waits_for_the_ini_timeout(held, tmp_path):
    path = str(write_simple_popef(tmp_path / "simple.popef"))
    with pytest.raises(DeviceUnavailableError,
                       match=r"WAIT_WITH_TIMEOUT \\(waited [0-9.]+ s, \\d+ attempts\\); busy: ipu 0"):
        ModelRunner(path)

def test_unmarked_keeps_no_wait(held, tmp_path):
    path = str(write_simple_popef(tmp_path / "simple.popef"))
    with pytest.raises(DeviceUnavailableError, match="with NO_WAIT; busy: ipu 0"):
        ModelRunner(path)

@pytest.mark.ipus(2)
def test_skipped_on_a_one_ipu_machine():
    raise AssertionError("should be skipped")
'''


def test_ipus_marker_waits_for_the_ini_timeout_and_skips_on_too_small_a_machine(pytester):
    pytester.makeini("[pytest]\nipu_emulator_num_ipus = 1\nipu_emulator_wait_timeout = 0.3\n")
    pytester.makepyfile(test_timeout=TIMEOUT_FROM_INI)
    result = pytester.runpytest(*LOAD, *QUIET)
    result.assert_outcomes(passed=2, skipped=1)
    result.stdout.fnmatch_lines(["*needs 2 IPUs (@pytest.mark.ipus(2)); the emulated machine "
                                 "has 1*"])


# -- beyond one machine ----------------------------------------------------------------------

ON_ITS_MACHINE = '''
import os
import numpy as np
from ipu_emulator.daemon import socket_protocol as wire
from tools.generate_simple_popef import write_simple_popef

def held(socket):
    return [i["ipu"] for i in wire.request(socket, {{"op": "status"}})["ipus"]
            if i["holder"] == os.getpid()]

def test_attaches_only_its_machines_ipus(ipu_machine, ipu_daemon, model_runner, tmp_path):
    assert ipu_machine.daemon == ipu_daemon.socket == {mine!r}
    runner = model_runner(str(write_simple_popef(tmp_path / "simple.popef")))
    x = np.ones((1, 4), np.float32)
    assert runner.execute({{"tensor_A": x, "tensor_B": x}})["tensor_C"].shape == (1, 4)
    assert held({mine!r}) == [0]
    assert held({other!r}) == []
'''


def test_two_machines_do_not_see_each_other(pytester, tmp_path, monkeypatch):
    """Two "machines" on this host (two homes, tags and daemons): a suite pointed at one,
    by option or by IPU_EMULATOR_DAEMON, attaches that one's IPUs only."""
    a = DaemonRig(tmp_path / "a", num_ipus=1)
    b = DaemonRig(tmp_path / "b", num_ipus=1)
    try:
        pytester.makepyfile(test_a=ON_ITS_MACHINE.format(mine=a.socket, other=b.socket))
        # in this process (no xdist): the suite's host is this test process
        result = pytester.runpytest(*LOAD, *QUIET, f"--ipu-emulator-daemon={a.socket}")
        result.assert_outcomes(passed=1)
        (pytester.path / "test_a.py").unlink()
        pytester.makepyfile(test_b=ON_ITS_MACHINE.format(mine=b.socket, other=a.socket))
        monkeypatch.setenv("IPU_EMULATOR_DAEMON", b.socket)
        result = pytester.runpytest(*LOAD, *QUIET)
        result.assert_outcomes(passed=1)
        for rig in (a, b):
            assert [i["holder"] for i in rig.status()["ipus"]] == [None]
            assert [i["hosts_served"] for i in rig.status()["ipus"]] == [1]
    finally:
        a.stop()
        b.stop()


FAULTS = OPTIONS.split("def test_")[0] + '''
import pytest
import host_runtime as model_runtime

def test_a_fault_for_this_tests_runners(ipu_faults, model_runner):
    ipu_faults.add(kind="application_error", after=1)
    runner = model_runner(double("a"), auto_reset=True)
    x = np.array([1, 2], np.float32)
    np.testing.assert_array_equal(runner.execute({"x": x})["y"], [2, 4])
    with pytest.raises(model_runtime.ApplicationRuntimeError, match="program 1"):
        runner.execute({"x": x})
    np.testing.assert_array_equal(runner.execute({"x": x})["y"], [2, 4])   # reset first
    assert [n for _, _, n in ipu_faults.counts()] == [1]

def test_the_next_test_has_none(model_runner):
    runner = model_runner(double("a"))
    for _ in range(3):
        np.testing.assert_array_equal(runner.execute({"x": np.ones(2, np.float32)})["y"], [2, 2])
'''


def test_the_ipu_faults_fixture_is_the_tests_own_and_cleared_after(pytester):
    pytester.makepyfile(test_faults=FAULTS)
    result = pytester.runpytest(*LOAD, *QUIET, "--ipu-emulator-ipu-version=ipu2")
    result.assert_outcomes(passed=2)
