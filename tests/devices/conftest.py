"""One suite over both kinds of IPU (the way CPython's test_concurrent_futures runs one
executor test over every start method).

Every test here that uses the ``kind`` fixture (directly, or through ``device``,
``make_runner`` or a module's own runner fixture) runs twice:

- ``thread``: loopback IPUs (``host_runtime.devices.loopback``): the IPU process's loop
  on a thread of the test process. Such a test must start no process (checked after it).
- ``process``: IPU processes the host starts (``DeviceManager``), on a machine of the
  module's own (``private_machine``), or a daemon's in the daemon leg of
  tests/integration/test_path_matrix.py.

``kind`` is module-scoped, so pytest runs a module's tests of one kind together and a
module's shared device or runner is made once per kind (and per xdist worker). A test
that only makes sense for one kind says which and why::

    @pytest.mark.ipu_kinds("process", reason="the IPU processes' pids")

Its parameter is marked too (``in_thread`` / ``in_process``): ``-m "not in_thread"``
runs the process kind alone. Tests that use none of these fixtures run once.

Fixtures:

- ``kind``: a :class:`Kind` (``kind.name``, ``kind.manager()``, ``kind.device(...)``,
  ``kind.runner(...)``, ``kind.launch(spec, log_dir)``, ``kind.lose(device)``,
  ``kind.maps(region)``).
- ``device``: one device of the kind for the module.
- ``make_runner(model, config=None, **options)``: a ModelRunner on devices of the kind,
  whose devices are closed after the test (the runner is closed by the test or then).
- the example and gather models of tests/_helpers.py, for the module's ``SHAPE``.
"""

from __future__ import annotations

import contextlib
import os
import signal
from typing import Any, Callable, Iterator

import psutil
import pytest

import host_runtime as model_runtime
from host_runtime import DeviceManager
from host_runtime.devices import Device
from host_runtime.devices.loopback import loopback_device, loopback_ipus, loopback_manager
from tests._helpers import (PATIENT, gather_model, gather_path, model, model_path,  # noqa: F401
                            private_machine, weights)

KINDS = ("thread", "process")

_PROC_CHILDREN = os.path.exists(f"/proc/self/task/{os.getpid()}/children")


def children() -> set[int]:
    """The pids of this process's children (/proc: a scan of every process with psutil
    costs milliseconds, twice a test)."""
    if not _PROC_CHILDREN:
        return {p.pid for p in psutil.Process().children()}
    pids: set[int] = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children", encoding="ascii") as f:
                pids.update(int(p) for p in f.read().split())
        except OSError:   # the thread ended meanwhile
            continue
    return pids


class Kind:
    """How a test gets devices of one kind, and what differs between the kinds."""

    def __init__(self, name: str) -> None:
        assert name in KINDS, name
        self.name = name
        self.stack = contextlib.ExitStack()   # what module-scoped fixtures made; closed last

    def __repr__(self) -> str:
        return f"Kind({self.name!r})"

    @property
    def in_thread(self) -> bool:
        return self.name == "thread"

    def manager(self, system: Any = None) -> DeviceManager:
        """A DeviceManager (of the machine ``system``, a SystemConfig, or the environment's)
        whose devices are of this kind."""
        return loopback_manager(system) if self.in_thread else DeviceManager(system)

    def device(self, model_or_num_ipus: Any = 1) -> Device:
        """A new device for ``model_or_num_ipus`` (a popef.Model or a number of ipu21 IPUs);
        the caller closes it. Loopback ones are IPU model devices (``loopback_device``)."""
        if self.in_thread:
            return loopback_device(model_or_num_ipus)
        return self.manager().getDevice(model_or_num_ipus, wait_config=PATIENT)

    def launch(self, spec: Any, log_dir: str) -> Any:
        """One IPU of this kind for ``spec`` (an ``IpuSpec``), driven over its rings: an
        ``IpuConnection``."""
        if self.in_thread:
            from ipu_emulator.ipu.in_thread import launch_loopback

            return launch_loopback(spec, log_dir=log_dir)
        from ipu_emulator.ipu.launcher import launch_ipu

        return launch_ipu(spec, log_dir=log_dir)

    def runner(self, model: Any, config: model_runtime.ModelRunnerConfig | None = None, *,
               closing: contextlib.ExitStack | None = None,
               **options: Any) -> model_runtime.ModelRunner:
        """A ModelRunner for ``model`` (a popef.Model or a path). The process kind lets the
        runner attach devices itself, as users do; the thread kind gives it loopback devices
        (``replica_to_device``) that ``closing`` (the kind's own stack by default) closes."""
        config = config if config is not None else model_runtime.ModelRunnerConfig(**options)
        if self.in_thread and not config.replica_to_device:
            stack = closing if closing is not None else self.stack
            config.replica_to_device = {
                i: stack.enter_context(self.device()) for i in range(config.replication_factor)}
        return model_runtime.ModelRunner(model, config=config)

    def lose(self, device: Device, index: int = 0) -> int:
        """Kill the device's IPU ``index`` (0: the primary) as SIGKILL would; its pid, once
        it has ended."""
        if self.in_thread:
            ipu = loopback_ipus(device)[index]
            ipu.kill()
            assert not ipu.thread.is_alive()
            return ipu.pid
        pid = device.pids()[index]
        os.kill(pid, signal.SIGKILL)
        assert device.processes[index].wait_exit(30) == -signal.SIGKILL   # reaped at once
        return pid

    def maps(self, region: str) -> int:
        """How many mappings of the shared-memory ``region`` the device side holds: those
        beyond the host's own in this process (thread), or in the IPU processes (process)."""
        name = region.lstrip("/")
        if self.in_thread:
            with open("/proc/self/maps", encoding="utf-8") as f:
                return sum(1 for line in f if line.rstrip().endswith(name)) - 1
        found = 0
        for proc in psutil.Process().children(recursive=True):
            try:
                if not " ".join(proc.cmdline()).startswith("ipu-emulator: ipu "):
                    continue
                with open(f"/proc/{proc.pid}/maps", encoding="utf-8") as f:
                    found += sum(1 for line in f if line.rstrip().endswith(name))
            except (psutil.Error, OSError):
                continue
        return found


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "ipu_kinds(*kinds, reason): run the test on these "
                                       "kinds of IPU only (tests/devices/conftest.py)")
    config.addinivalue_line("markers", "in_thread: the test's loopback (in-thread) IPU leg")
    config.addinivalue_line("markers", "in_process: the test's IPU-process leg")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "kind" not in metafunc.fixturenames:
        return
    kinds = KINDS
    mark = metafunc.definition.get_closest_marker("ipu_kinds")
    if mark is not None:
        assert mark.kwargs.get("reason"), f"{metafunc.definition.nodeid}: ipu_kinds needs a reason"
        kinds = tuple(k for k in KINDS if k in mark.args)
        assert kinds and set(mark.args) <= set(KINDS), mark.args
    metafunc.parametrize("kind", [pytest.param(k, id=k, marks=getattr(pytest.mark, f"in_{k}"))
                                  for k in kinds], indirect=True, scope="module")


@pytest.fixture(scope="module")
def kind(request: pytest.FixtureRequest) -> Iterator[Kind]:
    if request.param == "process":
        request.getfixturevalue("private_machine")
    k = Kind(request.param)
    with k.stack:
        yield k


@pytest.fixture(autouse=True)
def _thread_kind_starts_no_process(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test of the thread kind starts no process (its IPUs are threads)."""
    if "kind" not in request.fixturenames or request.node.callspec.params.get("kind") != "thread":
        yield
        return
    before = children()
    yield
    started = children() - before
    assert not started, f"a test on loopback IPUs started processes {sorted(started)}"


@pytest.fixture(scope="module")
def device(kind: Kind) -> Iterator[Device]:
    with kind.device() as dev:
        yield dev


@pytest.fixture
def make_runner(kind: Kind) -> Iterator[Callable[..., model_runtime.ModelRunner]]:
    made: list[model_runtime.ModelRunner] = []
    with contextlib.ExitStack() as devices:
        def make(model: Any, config: model_runtime.ModelRunnerConfig | None = None,
                 **options: Any) -> model_runtime.ModelRunner:
            made.append(kind.runner(model, config, closing=devices, **options))
            return made[-1]
        yield make
        for r in made:
            r.close()
