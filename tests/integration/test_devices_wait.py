"""Wait strategies across processes: a second host waits for a device the first one holds.

The holder is a real host process (it attaches with DeviceManager and so starts
an IPU process); the machine has one IPU for these tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from datetime import timedelta

import psutil
import pytest

from host_runtime.devices._manager import DeviceManager, DeviceWaitConfig, DeviceWaitStrategy
from host_runtime.errors import DeviceUnavailableError
from ipu_emulator.system import SystemConfig
from tests._helpers import processes

HOLDER = textwrap.dedent("""
    import sys
    from host_runtime.devices._manager import DeviceManager
    dev = DeviceManager().getDevice(1)
    dev.link.start()   # the IPU process is up
    print("attached", ",".join(map(str, dev.pids())), flush=True)
    for line in sys.stdin:
        if line.strip() == "release":
            dev.close()
            print("released", flush=True)
""")


@pytest.fixture
def home(tmp_path):
    """A one-IPU machine of our own (no other test process contends for it)."""
    return str(tmp_path / "machine")


@pytest.fixture
def one_ipu(home):
    return DeviceManager(SystemConfig(num_ipus=1, home=home))


@pytest.fixture
def holder(home):
    env = dict(os.environ, IPU_EMULATOR_NUM_IPUS="1", IPU_EMULATOR_HOME=home)
    child = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=env)
    line = child.stdout.readline().split()
    assert line and line[0] == "attached", f"holder did not attach: {line}"
    child.ipu_pids = [int(p) for p in line[1].split(",")]
    yield child
    if child.poll() is None:
        child.kill()
    child.wait(30)
    psutil.wait_procs(processes(child.ipu_pids), timeout=30)


def _wait_in_thread(dm, wait_config):
    result: dict[str, object] = {}

    def run():
        try:
            result["device"] = dm.getDevice(1, wait_config=wait_config)
        except Exception as exc:  # reported by the test
            result["error"] = exc
    t = threading.Thread(target=run)
    t.start()
    return t, result


def test_no_wait_names_the_holder_and_wait_forever_gets_it_on_release(one_ipu, holder):
    with pytest.raises(DeviceUnavailableError, match=f"ipu 0 by pid {holder.pid}"):
        one_ipu.getDevice(1)
    with pytest.raises(DeviceUnavailableError, match=r"WAIT_WITH_TIMEOUT \(waited"):
        one_ipu.getDevice(1, wait_config=DeviceWaitConfig(timedelta(seconds=0.2),
                                                          timedelta(seconds=0.05)))
    t, result = _wait_in_thread(one_ipu, DeviceWaitConfig(
        DeviceWaitStrategy.WAIT_FOREVER, sleepTime=timedelta(seconds=0.05)))
    holder.stdin.write("release\n")
    holder.stdin.flush()
    assert holder.stdout.readline().strip() == "released"
    t.join(120)
    assert not t.is_alive() and "error" not in result, result
    with result["device"] as dev:
        assert dev.ipus() == [0]
        with pytest.raises(DeviceUnavailableError, match=f"ipu 0 by pid {os.getpid()}"):
            one_ipu.getDevice(1)


def test_wait_with_timeout_gets_the_device_when_the_holder_dies(one_ipu, holder):
    t, result = _wait_in_thread(one_ipu, DeviceWaitConfig(timedelta(seconds=120),
                                                          timedelta(seconds=0.05)))
    holder.kill()
    holder.wait(30)
    t.join(150)
    assert not t.is_alive() and "error" not in result, result
    result["device"].close()
    # the dead holder's IPU process noticed and exited
    gone, alive = psutil.wait_procs(processes(holder.ipu_pids), timeout=30)
    assert not alive
