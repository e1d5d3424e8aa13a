"""An IPU is exclusive across everything on one ``IPU_EMULATOR_HOME``.

Two daemons on one home (different sockets) and embedded hosts of that home
share the home's lock files (``<home>/locks/ipuN.lock``): a daemon holds the
lock of every IPU a host holds through it, from attach until the IPU is reset
and free again; a second holder is refused (NO_WAIT) or waits (its
DeviceWaitConfig) with an error naming the IPU and the pid that holds it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

import pytest

from host_runtime.devices._manager import DeviceManager, DeviceWaitConfig, DeviceWaitStrategy
from host_runtime.errors import DeviceUnavailableError
from ipu_emulator.daemon import socket_protocol as wire
from ipu_emulator.system import IpuLocks, load_system_config
from tests.daemon_rig import DaemonRig
from tests._paths import child_pythonpath

NO_WAIT = DeviceWaitConfig(DeviceWaitStrategy.NO_WAIT)


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory):
    return tmp_path_factory.mktemp("home")


@pytest.fixture(scope="module")
def two_daemons(tmp_path_factory: pytest.TempPathFactory, home):
    first = DaemonRig(tmp_path_factory.mktemp("d1"), num_ipus=1, home=home)
    try:
        second = DaemonRig(tmp_path_factory.mktemp("d2"), num_ipus=1, home=home)
    except BaseException:
        first.stop()
        raise
    try:
        yield first, second
    finally:
        try:
            second.stop()
        finally:
            first.stop()


def daemon_pid(rig: DaemonRig) -> int:
    return int(rig.status()["daemon_pid"])


def states(rig: DaemonRig) -> list[tuple[str, int | None]]:
    return [(i["state"], i["holder"]) for i in rig.status()["ipus"]]


def test_two_daemons_on_one_home_never_hand_out_the_same_ipu(two_daemons):
    first, second = two_daemons
    holder = daemon_pid(first)
    with DeviceManager(daemon=first.socket).getSpecificDevice(0, wait_config=NO_WAIT) as dev:
        assert dev.ipus() == [0] and states(first) == [("held", os.getpid())]
        with pytest.raises(DeviceUnavailableError) as info:
            DeviceManager(daemon=second.socket).getSpecificDevice(0, wait_config=NO_WAIT)
        assert str(info.value) == (
            f"no device available: asked for device 0 with NO_WAIT; busy: ipu 0 by pid "
            f"{holder} (daemon at {second.socket})")
        # waiting per the wait config: refused after the timeout, not before
        wait = DeviceWaitConfig(timedelta(seconds=0.3), timedelta(seconds=0.05))
        start = time.monotonic()
        with pytest.raises(DeviceUnavailableError, match=rf"busy: ipu 0 by pid {holder} "):
            DeviceManager(daemon=second.socket).getSpecificDevice(0, wait_config=wait)
        assert 0.3 <= time.monotonic() - start < 5.0
        assert states(second) == [("free", None)]   # the second daemon's pool is untouched
        # the daemon's own busy reply names where the IPU is held
        with wire.LineConnection(second.socket, 10.0) as conn:
            reply = conn.call({"op": "attach", "ipus": [0], "device_id": 0}, 10.0)
        assert reply["ok"] is False and reply["busy"] == {"0": holder}
        assert re.fullmatch(rf"ipus \[0\] are held outside this daemon, on its home \S+ "
                            rf"\(lock files in \S+\): ipu 0 by pid {holder}", reply["message"])
    # released (reset, then the lock dropped): the other daemon hands it out now
    assert states(first) == [("free", None)]
    with DeviceManager(daemon=second.socket).getSpecificDevice(0, wait_config=NO_WAIT) as dev:
        assert dev.ipus() == [0] and states(second) == [("held", os.getpid())]
        with pytest.raises(DeviceUnavailableError, match=rf"busy: ipu 0 by pid "
                                                          rf"{daemon_pid(second)} "):
            DeviceManager(daemon=first.socket).getSpecificDevice(0, wait_config=NO_WAIT)
    assert states(second) == [("free", None)]


def test_a_daemon_and_an_embedded_host_on_one_home_exclude_each_other(two_daemons, home,
                                                                       monkeypatch):
    first, _ = two_daemons
    monkeypatch.setenv("IPU_EMULATOR_HOME", str(home))
    monkeypatch.delenv(wire.ENV_VAR, raising=False)
    holder = daemon_pid(first)
    # held through the daemon: an embedded host of the home is refused
    with DeviceManager(daemon=first.socket).getSpecificDevice(0, wait_config=NO_WAIT):
        with pytest.raises(DeviceUnavailableError) as info:
            DeviceManager().getSpecificDevice(0, wait_config=NO_WAIT)
        assert str(info.value) == (f"no device available: asked for device 0 with NO_WAIT; "
                                   f"busy: ipu 0 by pid {holder}")
    # released: the daemon keeps the lock file until the IPU is reset (status answers then)
    assert states(first) == [("free", None)]
    # held by an embedded host (its lock file): the daemon refuses to hand it out
    locks = IpuLocks.try_acquire(load_system_config().lock_dir, (0,))
    assert isinstance(locks, IpuLocks)
    try:
        with pytest.raises(DeviceUnavailableError) as info:
            DeviceManager(daemon=first.socket).getSpecificDevice(0, wait_config=NO_WAIT)
        assert str(info.value) == (
            f"no device available: asked for device 0 with NO_WAIT; busy: ipu 0 by pid "
            f"{os.getpid()} (daemon at {first.socket})")
        assert states(first) == [("free", None)]
    finally:
        locks.release()
    with DeviceManager(daemon=first.socket).getSpecificDevice(0, wait_config=NO_WAIT) as dev:
        assert dev.ipus() == [0]


# -- from the outside: host programs (tests/integration/ipu_holder_program.py) -----------------

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def holder(args: list[str], home, daemon: DaemonRig | None, **popen: Any) -> subprocess.Popen:
    """A host program of ``home``: through ``daemon``, or embedded on a machine of one IPU
    (the daemons' pools hold IPU 0 only: every holder wants the same one)."""
    env = dict(os.environ, IPU_EMULATOR_HOME=str(home), IPU_EMULATOR_NUM_IPUS="1",
               PYTHONPATH=child_pythonpath())
    env.pop(wire.ENV_VAR, None)
    if daemon is not None:
        env[wire.ENV_VAR] = daemon.socket
    return subprocess.Popen([sys.executable, "-m", "tests.integration.ipu_holder_program", *args],
                            env=env, cwd=ROOT, text=True, **popen)


def test_hosts_of_two_daemons_and_embedded_hosts_never_hold_one_ipu_at_once(two_daemons, home):
    """Six host programs at once, two through each daemon and two embedded, attach and
    release IPU 0 ten times each, waiting for it: every attach succeeds in turn and no
    two holds of it overlap in time."""
    first, second = two_daemons
    rounds = 10
    procs = [holder(["churn", str(rounds)], home, rig, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE)
             for rig in (first, second, None, first, second, None)]
    holds = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert lines, err[-3000:]
        holds += [(t0, t1, p.pid) for ipus, t0, t1 in json.loads(lines[0][7:]) if ipus == [0]]
    assert len(holds) == rounds * len(procs)
    holds.sort()
    overlaps = [(a, b) for a, b in zip(holds, holds[1:]) if b[0] < a[1]]
    assert overlaps == []
    assert states(first) == [("free", None)] and states(second) == [("free", None)]


def test_an_embedded_host_program_holding_an_ipu_keeps_it_from_a_daemon(two_daemons, home):
    """A real embedded host (not a lock taken by the test): the daemon refuses its IPU,
    naming the host's pid, and hands it out once the host has let it go."""
    first, _ = two_daemons
    host = holder(["hold"], home, None, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert host.stdout is not None and host.stdin is not None
        assert host.stdout.readline().strip() == "HOLDING [0]"
        with pytest.raises(DeviceUnavailableError) as info:
            DeviceManager(daemon=first.socket).getSpecificDevice(0, wait_config=NO_WAIT)
        assert str(info.value) == (
            f"no device available: asked for device 0 with NO_WAIT; busy: ipu 0 by pid "
            f"{host.pid} (daemon at {first.socket})")
        host.stdin.close()
        assert host.wait(60) == 0
    finally:
        if host.poll() is None:
            host.kill()
            host.wait()
    with DeviceManager(daemon=first.socket).getSpecificDevice(0, wait_config=NO_WAIT) as dev:
        assert dev.ipus() == [0]
