"""Settings without a new process: a runner, a device manager or a daemon's IPU made under
``host_runtime.settings.override`` (or given explicit settings) runs with them, its IPU
processes too, for its whole life; after the block, new objects take the old values."""

from __future__ import annotations

import logging
import os
import re
import signal
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

import host_runtime as model_runtime
from host_runtime import settings
from host_runtime.settings import HostSettings
from ipu_emulator import titles
from ipu_emulator.daemon._pool import PooledIpu
from ipu_emulator.ipu.launcher import IpuSpec
from ipu_emulator.settings import IpuSettings
from tests._helpers import PATIENT

pytestmark = pytest.mark.usefixtures("private_machine")

SHAPE = (1, 4)
SLACK = 4.0          # what a loaded 2-core machine may add to a 1 s bound


@pytest.fixture(autouse=True)
def defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """The knobs these tests change, at their defaults in the environment."""
    for name in ("forkserver", "host_sync_timeout", "device_log_level", "device_spin_us"):
        monkeypatch.delenv(HostSettings.knob(name).env, raising=False)


def _descendants() -> dict[int, psutil.Process]:
    return {p.pid: p for p in psutil.Process().children(recursive=True)}


def _fresh_ipu_children(before: dict[int, psutil.Process]) -> list[int]:
    """New direct children started as ``python -m ipu_emulator`` (not forked)."""
    found = []
    for pid, p in _descendants().items():
        if pid in before or p.ppid() != os.getpid():
            continue
        cmd = " ".join(p.cmdline()).rstrip()   # its title (ipu_emulator.titles), or argv
        if titles.parse_ipu(cmd) is not None or ("-m ipu_emulator " in cmd + " "
                                                 and "forkserver" not in cmd):
            found.append(pid)
    return found


def _settings_lines(pid: int) -> list[str]:
    """The IPU process's DEBUG line naming its settings, from the machine's logs."""
    logs = Path(os.environ["IPU_EMULATOR_HOME"]) / "logs"
    return [ln for f in logs.glob("ipu*.log") for ln in f.read_text().splitlines()
            if re.search(rf"\[{pid}\] DEBUG ipu_emulator.ipu.process: settings: ", ln)]


def _stop(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10.0
    while psutil.Process(pid).status() != psutil.STATUS_STOPPED:   # SIGSTOP is asynchronous
        assert time.monotonic() < deadline, f"process {pid} did not stop"
        time.sleep(0.001)


def test_a_runner_made_under_an_override_keeps_it_for_its_life(model_path, weights, caplog):
    default = settings.current()
    before = _descendants()
    with settings.override(forkserver=False, host_sync_timeout=1.0, device_log_level="DEBUG",
                           device_spin_us=9):
        runner = model_runtime.ModelRunner(model_runtime.PopefPaths([model_path]))
    assert settings.current() == default and default.host_sync_timeout == 60.0
    try:
        # forkserver off reached the launcher: a fresh `python -m ipu_emulator` of ours
        fresh = _fresh_ipu_children(before)
        assert len(fresh) == 1, fresh
        pid = fresh[0]
        a = np.full(SHAPE, 2, np.float32)
        np.testing.assert_allclose(runner.execute({"tensor_A": a, "tensor_B": a})["tensor_C"],
                                   a * weights + a, rtol=1e-6)
        # the IPU process runs with the override (through its environment)
        lines = _settings_lines(pid)
        assert len(lines) == 1 and "device_spin_us=9.0" in lines[0] \
            and "forkserver=False" in lines[0], lines
        # the host sync timeout the runner took, though the block has ended: close() gives
        # a stopped device 1 s, not 60
        _stop(pid)
        with caplog.at_level(logging.WARNING):
            start = time.monotonic()
            runner.close()
            took = time.monotonic() - start
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except (ProcessLookupError, UnboundLocalError):
            pass
        runner.close()
    assert 1.0 <= took < 1.0 + SLACK, took
    assert re.search(r"no progress from the device for 1 s \(the host sync timeout, "
                     r"IPU_EMULATOR_HOST_SYNC_TIMEOUT\); IPU process pid \d+, stopped",
                     caplog.text), caplog.text


def test_after_the_block_a_runner_takes_the_old_values(model_path, weights):
    with settings.override(forkserver=False, device_log_level="DEBUG"):
        pass
    before = _descendants()
    with model_runtime.ModelRunner(model_runtime.PopefPaths([model_path])) as runner:
        a = np.ones(SHAPE, np.float32)
        np.testing.assert_allclose(runner.execute({"tensor_A": a, "tensor_B": a})["tensor_C"],
                                   a * weights + a, rtol=1e-6)
        new = [p for pid, p in _descendants().items() if pid not in before]
        ipus = [p for p in new if p.ppid() != os.getpid()]    # forked by the template
        assert len(ipus) == 1, new
        assert " ".join(ipus[0].parent().cmdline()).startswith("ipu-emulator: fork server")
        assert _settings_lines(ipus[0].pid) == []            # WARNING: no DEBUG line


def test_a_device_manager_given_settings_starts_its_ipu_processes_with_them(model):
    mine = settings.current().replace(forkserver=False, device_log_level="debug")
    manager = model_runtime.DeviceManager(settings=mine)
    assert manager.settings is mine
    before = _descendants()
    with manager.getDevice(model, wait_config=PATIENT) as device, \
            model_runtime.Session(model) as session:
        [pid] = device.pids()
        assert _fresh_ipu_children(before) == [pid]
        session.bindToDevice(device)        # loads: the process is up and has logged
        assert len(_settings_lines(pid)) == 1


def test_a_daemon_made_under_an_override_gives_it_to_its_pool(tmp_path):
    from ipu_emulator.daemon.server import Daemon
    from ipu_emulator.system import SystemConfig

    system = SystemConfig(num_ipus=2, home=str(tmp_path))
    with settings.override(daemon_handover_timeout=3, device_spin_us=1):
        daemon = Daemon(system, str(tmp_path / "d.sock"))
    assert daemon.settings.daemon_handover_timeout == 3.0
    assert [(i.settings, i.handover_timeout) for i in daemon.ipus] == [(daemon.settings, 3.0)] * 2
    assert Daemon(system, str(tmp_path / "e.sock")).ipus[0].handover_timeout == 30.0


def test_a_daemons_ipu_runs_with_the_daemons_settings(tmp_path):
    mine = IpuSettings().replace(forkserver=False, device_log_level="DEBUG",
                                 daemon_handover_timeout=7)
    ipu = PooledIpu(IpuSpec(ipu_id=0, label="ipu 0"), str(tmp_path), mine)
    assert ipu.handover_timeout == 7.0
    before = _descendants()
    ipu.start()
    try:
        assert ipu.proc is not None and _fresh_ipu_children(before) == [ipu.proc.pid]
        log = (tmp_path / "ipu0.log").read_text()
        assert re.search(rf"\[{ipu.proc.pid}\] DEBUG ipu_emulator.ipu.process: settings: "
                         r"IpuSettings\(.*forkserver=False", log), log
    finally:
        ipu.close_process(polite=True)
