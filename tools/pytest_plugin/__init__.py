"""The ``ipu_emulator`` pytest plugin: emulated IPUs for a user's test suite.

Installed with the package (entry point ``pytest11``: ``ipu_emulator``). It
changes nothing for tests that do not use it; a test uses it by asking for
one of its fixtures or carrying its marker:

- ``ipu_machine`` (session): a private emulated machine for the run, its own
  ``IPU_EMULATOR_HOME`` and shared-memory tag, ``--ipu-emulator-num-ipus``
  IPUs of ``--ipu-emulator-ipu-version``; every xdist worker of the run shares
  it (and waits for its IPUs), each with its own tag. An :class:`IpuMachine`.
- ``ipu_daemon`` (session): one ``ipu-emulator daemon`` for the whole run,
  started by the first worker that asks, stopped when the last one ends
  (see :mod:`tools.pytest_plugin.daemon`); or the daemon of
  ``--ipu-emulator-daemon`` / ``IPU_EMULATOR_DAEMON``. Hosts of the session
  attach through it from then on. A :class:`DaemonHandle`.
- ``model_runner``: ``model_runner(path_or_model, config=None, **config_fields)``
  -> a ``ModelRunner`` closed at teardown; a PopEF path (or list), a
  ``popef.Model``, or an ONNX model or path (compiled by ``compile_onnx``).
  Its runners wait up to ``ipu_emulator_wait_timeout`` for their IPUs.
- ``compile_onnx`` (session): ``compile_onnx(model, **poprt_options)`` -> the
  PopEF path, compiled once per run (cached by the content hash).
- ``ipu_faults``: a fault schedule (``ipu_emulator.faults.FaultPlan``) for the
  IPUs of the runners the test makes: ``ipu_faults.add(kind="hang", after=2)``
  (before or after making them: live), ``.counts()``, ``.clear()``; only runners
  made in this test follow it, and it is removed at teardown (docs/faults.md).
- ``@pytest.mark.ipus(n)``: the test needs ``n`` IPUs: skipped when the machine
  has fewer; runners made in it wait (``WAIT_WITH_TIMEOUT``,
  ``ipu_emulator_wait_timeout`` seconds) for IPUs other workers hold.
- Leak check: a test that uses the plugin and leaves a runner or device
  attached, an IPU process running or objects in /dev/shm fails (at
  teardown) with what it left and where it was made; then it is cleaned up.

``--ipu-trace-dir DIR``: a timeline of each failing test in DIR
(:mod:`tools.pytest_plugin.tracing`).

Options (and ini keys): ``--ipu-emulator-daemon=SOCKET`` (``ipu_emulator_daemon``),
``--ipu-emulator-num-ipus`` (``ipu_emulator_num_ipus``),
``--ipu-emulator-ipu-version`` (``ipu_emulator_ipu_version``),
``--ipu-emulator-modules`` (``ipu_emulator_modules = true``: Graphcore's module names
``model_runtime``, ``popef``, ``poprt`` resolve to this project, see ``ipu_emulator.run``); ini
``ipu_emulator_wait_timeout`` (seconds, default 60).

Importing this module is cheap (the runtime is imported when a fixture runs).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Callable, Generator, Iterator

import pytest

from tools.pytest_plugin.daemon import DaemonHandle
from tools.pytest_plugin.leaks import LeakGuard, creation_summary
from tools.pytest_plugin.machine import ENV_VARS, IpuMachine, RunFolder

__all__ = ["IpuMachine", "DaemonHandle", "RunFolder", "FIXTURES", "wait_config", "run_folder"]

FIXTURES = ("ipu_machine", "ipu_daemon", "model_runner", "compile_onnx", "ipu_faults")

_RUN = pytest.StashKey[RunFolder]()
_GUARD = pytest.StashKey[LeakGuard]()
_WAIT_PATCH = pytest.StashKey[pytest.MonkeyPatch]()
_TRACED = pytest.StashKey[Any]()
_WORKERINPUT_KEY = "ipu_emulator_run_token"
_DEFAULT_WAIT = 60.0


# -- options ---------------------------------------------------------------------------------

def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("ipu-emulator", "emulated IPUs (ipu_emulator plugin)")
    group.addoption("--ipu-emulator-daemon", metavar="SOCKET", default=None,
                    help="attach through the running daemon at SOCKET instead of a private "
                    "machine (default: ini ipu_emulator_daemon, else $IPU_EMULATOR_DAEMON)")
    group.addoption("--ipu-emulator-num-ipus", type=int, metavar="N", default=None,
                    help="IPUs of the private emulated machine (default: ini "
                    "ipu_emulator_num_ipus, else the machine configuration, 4)")
    group.addoption("--ipu-emulator-ipu-version", choices=("ipu2", "ipu21"), default=None,
                    help="IPU version of the private emulated machine (default: ini "
                    "ipu_emulator_ipu_version, else the machine configuration, ipu21)")
    group.addoption("--ipu-emulator-modules", action="store_true", default=None,
                    help="map Graphcore's module names model_runtime, popef and poprt onto "
                    "the emulator for the tests (default: ini ipu_emulator_modules); "
                    "refused where the real ones are installed, unless "
                    "IPU_EMULATOR_FORCE_MODULES=1")
    group.addoption("--ipu-trace-dir", metavar="DIR", default=None,
                    help="write a timeline (Chrome trace JSON, docs/tracing.md) of each "
                    "failing test into DIR")
    parser.addini("ipu_emulator_daemon", "socket of a running ipu-emulator daemon to use",
                  default="")
    parser.addini("ipu_emulator_num_ipus", "IPUs of the private emulated machine", default="")
    parser.addini("ipu_emulator_ipu_version", "ipu2 or ipu21", default="")
    parser.addini("ipu_emulator_modules", "map model_runtime, popef and poprt onto the "
                  "emulator (as --ipu-emulator-modules)", type="bool", default=False)
    parser.addini("ipu_emulator_wait_timeout",
                  "seconds a test waits for the IPUs it needs (ipus marker, model_runner)",
                  default=str(_DEFAULT_WAIT))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "ipus(n): the test needs n emulated IPUs; it waits for them "
        "(ipu_emulator_wait_timeout) and is skipped when the machine has fewer")
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:
        run = RunFolder.new()
    elif _WORKERINPUT_KEY in workerinput:
        run = RunFolder(workerinput[_WORKERINPUT_KEY])
    else:   # a controller without the plugin: the run's uid is all the workers share
        run = RunFolder.for_testrun(str(workerinput.get("testrunuid", "0")))
    config.stash[_RUN] = run
    _map_modules(config)


def _map_modules(config: pytest.Config) -> None:
    """--ipu-emulator-modules: Graphcore's names resolve to this project before the test
    modules are collected (ipu_emulator.run); refused over a real SDK."""
    wanted = config.getoption("ipu_emulator_modules")
    if not (wanted if wanted is not None else config.getini("ipu_emulator_modules")):
        return
    from ipu_emulator import run
    from ipu_emulator.errors import RealModulesError

    if run.installed():
        return
    try:
        run.install()
    except RealModulesError as exc:
        raise pytest.UsageError(f"--ipu-emulator-modules: {exc}") from None
    config.add_cleanup(run.uninstall)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """xdist controller: hand the run's folder to each worker."""
    node.workerinput[_WORKERINPUT_KEY] = node.config.stash[_RUN].token


def pytest_unconfigure(config: pytest.Config) -> None:
    """The end of the run (the controller, or a plain process): stop a daemon a crashed
    worker left, remove what dead processes of the run left in /dev/shm, and the folder."""
    if getattr(config, "workerinput", None) is not None or _RUN not in config.stash:
        return
    run = config.stash[_RUN]
    if not run.exists():
        return
    from tools.pytest_plugin.daemon import stop_recorded

    stop_recorded(os.path.join(run.location, "home"))
    from shm.cleanup import list_objects

    from tools.pytest_plugin.machine import remove_shm_entries

    # Every process of the run is done: whatever is left of its tags is a leftover.
    remove_shm_entries({o.entry for o in list_objects(all_tags=True)
                        if o.tag.startswith(f"p{run.token}")})
    run.remove()


def run_folder(config: pytest.Config) -> RunFolder:
    """The run's folder (made only when a fixture needs it; removed at the end of the run)."""
    return config.stash[_RUN]


# -- settings ----------------------------------------------------------------------------------

def _setting(config: pytest.Config, option: str, ini: str) -> Any:
    value = config.getoption(option)
    if value is None or value == "":
        value = config.getini(ini) or None
    return value


def _daemon_socket(config: pytest.Config) -> str | None:
    value = _setting(config, "ipu_emulator_daemon", "ipu_emulator_daemon")
    from host_runtime.settings import HostSettings   # (the plugin imports it when used)

    return value or HostSettings.read("daemon") or None


def wait_timeout(config: pytest.Config) -> float:
    text = config.getini("ipu_emulator_wait_timeout")
    try:
        value = float(text)
    except ValueError:
        raise pytest.UsageError(f"ini ipu_emulator_wait_timeout must be a number of seconds, "
                                f"got {text!r}") from None
    if value < 0:
        raise pytest.UsageError(f"ini ipu_emulator_wait_timeout must be >= 0, got {text!r}")
    return value


def wait_config(config: pytest.Config) -> Any:
    """``DeviceWaitConfig(WAIT_WITH_TIMEOUT, ipu_emulator_wait_timeout)`` of this run."""
    from host_runtime.devices import DeviceWaitConfig, DeviceWaitStrategy

    return DeviceWaitConfig(DeviceWaitStrategy.WAIT_WITH_TIMEOUT,
                            timeout=timedelta(seconds=wait_timeout(config)),
                            sleepTime=timedelta(milliseconds=20))


def _machine_shape(config: pytest.Config) -> tuple[int | None, str | None]:
    num = _setting(config, "ipu_emulator_num_ipus", "ipu_emulator_num_ipus")
    version = _setting(config, "ipu_emulator_ipu_version", "ipu_emulator_ipu_version")
    if num is not None:
        try:
            num = int(num)
        except ValueError:
            raise pytest.UsageError(f"ipu_emulator_num_ipus must be an integer, got {num!r}") \
                from None
    if version is not None and version not in ("ipu2", "ipu21"):
        raise pytest.UsageError(f"ipu_emulator_ipu_version must be ipu2 or ipu21, got {version!r}")
    return num, version


def _worker(config: pytest.Config) -> str:
    workerinput = getattr(config, "workerinput", None)
    return str(workerinput.get("workerid", "main")) if workerinput else "main"


# -- which tests use the plugin ----------------------------------------------------------------

@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """--ipu-trace-dir: each test traced, the timeline of a failing one kept."""
    folder = item.config.getoption("--ipu-trace-dir", None)
    if not folder:
        return (yield)
    from tools.pytest_plugin.tracing import TracedTest

    traced = item.stash[_TRACED] = TracedTest(os.path.abspath(folder))
    try:
        return (yield)
    finally:
        traced.finish(item.nodeid)   # DIR/<test id>.json if it failed


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    traced = item.stash.get(_TRACED, None)
    if traced is not None:
        traced.report(report)
    return report


def _uses_plugin(item: pytest.Item) -> bool:
    names = getattr(item, "fixturenames", ())
    return item.get_closest_marker("ipus") is not None or any(f in names for f in FIXTURES)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test marked ``ipus`` gets the machine even if it does not ask for it, and the check
    of its size before the test's own function-scoped fixtures."""
    for item in items:
        names = getattr(item, "fixturenames", None)
        if item.get_closest_marker("ipus") is not None and isinstance(names, list):
            for k, name in enumerate(("ipu_machine", "_ipu_emulator_enough_ipus")):
                if name not in names:
                    names.insert(k, name)


def _needed_ipus(item: Any) -> int | None:
    marker = item.get_closest_marker("ipus")
    if marker is None:
        return None
    n = marker.args[0] if marker.args else marker.kwargs.get("n")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.ipus(n) needs a positive int "
                                f"number of IPUs, got {n!r}")
    return n


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    if not _uses_plugin(item):
        return (yield)
    needed = _needed_ipus(item)
    guard = item.stash[_GUARD] = LeakGuard()
    if needed is not None:
        from host_runtime.runner import config as runtime_config

        # ModelRunnerConfig() made during this test waits for its IPUs by default (the
        # config's default-maker, as the project's own tests patch it; the marker's tests
        # in tests/integration/test_pytest_plugin.py notice if it goes away).
        mp = item.stash[_WAIT_PATCH] = pytest.MonkeyPatch()
        wc = wait_config(item.config)
        mp.setattr(runtime_config, "_default_wait_config", lambda: wc, raising=False)
    result = yield
    # From here on: what the fixtures made is theirs (a module's runner lives on to the
    # next test); what the test makes must be gone once its fixtures are torn down.
    machine: IpuMachine | None = item.funcargs.get("ipu_machine") \
        if hasattr(item, "funcargs") else None
    guard.start(None if machine is None else machine.shm_tag)
    return result


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    try:
        return (yield)
    finally:
        mp = item.stash.get(_WAIT_PATCH, None)
        if mp is not None:
            mp.undo()
        guard = item.stash.get(_GUARD, None)
        if guard is not None:
            del item.stash[_GUARD]
            report = guard.finish()
            if report:
                pytest.fail(report, pytrace=False)


# -- fixtures ----------------------------------------------------------------------------------

@pytest.fixture
def _ipu_emulator_enough_ipus(ipu_machine: IpuMachine, request: pytest.FixtureRequest) -> None:
    """Skip a test marked ``ipus(n)`` when the machine has fewer than n IPUs."""
    needed = _needed_ipus(request.node)
    if needed is not None and needed > ipu_machine.num_ipus:
        pytest.skip(f"needs {needed} IPUs (@pytest.mark.ipus({needed})); the emulated "
                    f"machine has {ipu_machine.num_ipus} (--ipu-emulator-num-ipus)")


@pytest.fixture(scope="session")
def ipu_machine(pytestconfig: pytest.Config) -> Iterator[IpuMachine]:
    """This run's emulated machine; sets its ``IPU_EMULATOR_*`` variables for the session."""
    config = pytestconfig
    run = config.stash[_RUN]
    socket = _daemon_socket(config)
    num, version = _machine_shape(config)
    tag = run.shm_tag(_worker(config))
    if socket:
        from tools.pytest_plugin.daemon import connect_existing

        try:
            _, system = connect_existing(socket)
        except RuntimeError as exc:
            raise pytest.UsageError(str(exc)) from None
        machine = IpuMachine(home=run.path("home"), shm_tag=tag,
                             num_ipus=int(system["num_ipus"]),
                             ipu_version=str(system["ipu_version"]),
                             daemon=os.path.abspath(socket), run_folder=run)
    else:
        from ipu_emulator.system import load_system_config

        base = load_system_config()
        machine = IpuMachine(home=run.path("home"), shm_tag=tag,
                             num_ipus=base.num_ipus if num is None else num,
                             ipu_version=version or base.ipu_version, run_folder=run)
        machine.system()   # check the settings now, with a clear message
    mp = pytest.MonkeyPatch()
    for var in ENV_VARS:
        mp.delenv(var, raising=False)
    for var, value in machine.environ().items():
        mp.setenv(var, value)
    try:
        yield machine
    finally:
        mp.undo()
        from shm.cleanup import remove_dead

        remove_dead(machine.shm_tag)   # the rest goes at the end of the run


@pytest.fixture(scope="session")
def ipu_daemon(ipu_machine: IpuMachine, pytestconfig: pytest.Config) -> Iterator[DaemonHandle]:
    """The run's daemon (shared by every worker); hosts of this session attach through it."""
    from tools.pytest_plugin import daemon as shared

    if ipu_machine.daemon:
        handle, _ = shared.connect_existing(ipu_machine.daemon)
        yield handle
        return
    run = pytestconfig.stash[_RUN]
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    env.update(ipu_machine.environ())
    env["IPU_EMULATOR_SHM_TAG"] = run.daemon_tag
    handle = shared.acquire(ipu_machine.home, env, ipu_machine.num_ipus, ipu_machine.ipu_version)
    mp = pytest.MonkeyPatch()
    mp.setenv("IPU_EMULATOR_DAEMON", handle.socket)
    try:
        yield handle
    finally:
        mp.undo()
        shared.release(handle)


@pytest.fixture(scope="session")
def compile_onnx(ipu_machine: IpuMachine, pytestconfig: pytest.Config
                 ) -> Callable[..., str]:
    """``compile_onnx(model, **poprt_options)``: an ONNX model or path -> its PopEF path.

    Options are ``host_runtime.poprt.compiler.compile``'s (``input_shapes``,
    ``precision``, ``batches_per_step``, ``weights_as_tensor_data``, ...);
    ``ipu_version`` defaults to the machine's. Compiled once per run.
    """
    from tools.pytest_plugin.compile_cache import compile_cached

    folder = pytestconfig.stash[_RUN].path("popef")

    def compile_onnx(model: Any, **options: Any) -> str:
        options.setdefault("ipu_version", ipu_machine.ipu_version)
        path, _ = compile_cached(model, folder, options)
        return path

    return compile_onnx


def _is_popef_file(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(8) == b"IPUPOPEF"
    except OSError:
        return True   # let ModelRunner say what is wrong with it


@pytest.fixture
def model_runner(ipu_machine: IpuMachine, compile_onnx: Callable[..., str],
                 request: pytest.FixtureRequest) -> Iterator[Callable[..., Any]]:
    """``model_runner(path_or_model, config=None, **config_fields)`` -> a ``ModelRunner``,
    closed at teardown. Unless told otherwise it waits for its IPUs
    (``ipu_emulator_wait_timeout``)."""
    from host_runtime.devices import DeviceWaitConfig
    from host_runtime.runner import ModelRunner, ModelRunnerConfig

    made: list[Any] = []
    guard = request.node.stash.get(_GUARD, None)

    def model_runner(path_or_model: Any, config: Any = None, **config_fields: Any) -> Any:
        source = path_or_model
        if isinstance(source, (str, os.PathLike)):
            if not _is_popef_file(os.fspath(source)):
                source = compile_onnx(source)
        elif type(source).__module__.split(".")[0] == "onnx":
            source = compile_onnx(source)   # an onnx.ModelProto
        # else PopefPaths, a list of paths or a popef.Model: ModelRunner's to check
        cfg = ModelRunnerConfig() if config is None else config.copy()
        for key, value in config_fields.items():
            setattr(cfg, key, value)
        if "device_wait_config" not in config_fields and (
                cfg.device_wait_config is None or cfg.device_wait_config == DeviceWaitConfig()):
            cfg.device_wait_config = wait_config(request.config)
        if config is not None:   # the caller reads save programs' outputs from its own dict
            cfg.replica_to_save_programs_outputs = config.replica_to_save_programs_outputs
        where = creation_summary(2)
        runner = ModelRunner(source, config=cfg)
        made.append(runner)
        if guard is not None:
            guard.note_where(runner, where)
        return runner

    yield model_runner
    errors = []
    for runner in reversed(made):
        try:
            runner.close()
        except Exception as exc:
            errors.append(exc)
    if errors:
        raise errors[0]


@pytest.fixture
def ipu_faults(ipu_machine: IpuMachine) -> Iterator[Any]:
    """A fault schedule for the runners, sessions and devices this test makes (an
    ``ipu_emulator.faults.FaultPlan``, empty to start with: ``ipu_faults.add(...)``);
    cleared and removed at teardown."""
    from ipu_emulator.faults import FaultPlan

    plan = FaultPlan()
    with plan:
        yield plan
    plan.clear()
    plan.close()


@pytest.fixture
def loopback_device() -> Iterator[Any]:
    """A one-IPU ipu21 IPU model device served by a thread of this process
    (``host_runtime.devices.loopback``): Session, QueueManager and ModelRunner run on it
    without any IPU process. Closed at teardown; the test fails if a process was started
    meanwhile."""
    import psutil

    from host_runtime.devices.loopback import loopback_device as make

    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    dev = make(1, ipu_version=21)
    try:
        yield dev
    finally:
        dev.close()
    started = {p.pid for p in me.children(recursive=True)} - before
    assert not started, f"a test on a loopback device started processes {sorted(started)}"

