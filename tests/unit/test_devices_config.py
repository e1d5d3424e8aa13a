"""Wait configs, constraints, the emulated system's configuration and its IPU locks.

No IPU process is started here: DeviceManager's busy and wait paths are driven
by locks this test holds itself.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from datetime import timedelta

import pytest

from host_runtime.devices._manager import (DeviceConstraints, DeviceManager, DeviceWaitConfig,
                                  DeviceWaitStrategy)
from host_runtime.errors import BadRequestError, DeviceUnavailableError
from ipu_emulator.system import (IpuLocks, SystemConfig, SystemConfigError, device_groups,
                                 emulator_home, load_system_config)


# -- DeviceWaitConfig / DeviceConstraints ---------------------------------------------------

def test_wait_config_defaults_are_the_seeds():
    wc = DeviceWaitConfig()
    assert (wc.strategy, wc.timeout, wc.sleepTime) == (
        DeviceWaitStrategy.NO_WAIT, timedelta(0), timedelta(seconds=15))


def test_wait_config_strategy_constructor_as_in_the_python_listings():
    wc = DeviceWaitConfig(DeviceWaitStrategy.WAIT_WITH_TIMEOUT, timeout=timedelta(seconds=600),
                          sleepTime=timedelta(seconds=1))
    assert wc.strategy is DeviceWaitStrategy.WAIT_WITH_TIMEOUT
    assert wc.timeout == timedelta(seconds=600) and wc.sleepTime == timedelta(seconds=1)
    assert DeviceWaitConfig(DeviceWaitStrategy.WAIT_FOREVER).sleepTime == timedelta(seconds=15)


def test_wait_config_timeout_constructor_means_wait_with_timeout():
    wc = DeviceWaitConfig(timedelta(seconds=600), timedelta(seconds=1))
    assert wc == DeviceWaitConfig(DeviceWaitStrategy.WAIT_WITH_TIMEOUT,
                                  timedelta(seconds=600), timedelta(seconds=1))
    assert DeviceWaitConfig(timedelta(seconds=3)).sleepTime == timedelta(seconds=15)


def test_wait_config_rejects_bad_values():
    with pytest.raises(BadRequestError, match="strategy must be a DeviceWaitStrategy"):
        DeviceWaitConfig("forever")
    with pytest.raises(BadRequestError, match="must not be negative"):
        DeviceWaitConfig(DeviceWaitStrategy.WAIT_FOREVER, sleepTime=timedelta(seconds=-1))
    with pytest.raises(BadRequestError, match="unexpected"):
        DeviceWaitConfig(DeviceWaitStrategy.NO_WAIT, wait=1)


def test_device_constraints():
    assert not DeviceConstraints()
    assert DeviceConstraints(True) and DeviceConstraints(True).requiresRemoteBuffersSupport


# -- system configuration ----------------------------------------------------------------

def test_system_defaults(tmp_path):
    cfg = load_system_config({"IPU_EMULATOR_HOME": str(tmp_path)})
    assert (cfg.num_ipus, cfg.ipu_version, cfg.tiles_per_ipu, cfg.memory_per_tile,
            cfg.compute_threads) == (4, "ipu21", 1472, 624 * 1024, 1)
    assert cfg.lock_dir == os.path.join(str(tmp_path), "locks")
    assert cfg.ipu_version_number == 21


def test_home_fallbacks():
    assert emulator_home({"IPU_EMULATOR_HOME": "/x/y"}) == "/x/y"
    home = emulator_home({})
    assert home.endswith(".ipu_emulator") or home == f"/tmp/ipu_emulator-{os.getuid()}"


def test_config_file_then_env_overrides(tmp_path):
    path = tmp_path / "machine.yaml"
    path.write_text("num_ipus: 8\nipu_version: ipu2\ntiles_per_ipu: 16\nmemory_per_tile: 1KiB\n")
    env = {"IPU_EMULATOR_HOME": str(tmp_path), "IPU_EMULATOR_CONFIG": str(path)}
    cfg = load_system_config(env)
    assert (cfg.num_ipus, cfg.ipu_version, cfg.tiles_per_ipu, cfg.memory_per_tile) == (
        8, "ipu2", 16, 1024)
    env["IPU_EMULATOR_NUM_IPUS"] = "2"
    env["IPU_EMULATOR_IPU_VERSION"] = "21"
    cfg = load_system_config(env)
    assert (cfg.num_ipus, cfg.ipu_version_number, cfg.memory_per_ipu) == (2, 21, 16 * 1024)
    assert DeviceManager(cfg).ipuHardwareVersion() == 21
    assert DeviceManager(SystemConfig(num_ipus=0, home=str(tmp_path))).ipuHardwareVersion() == 0


def test_config_errors_name_the_setting(tmp_path):
    with pytest.raises(SystemConfigError, match=r"^IPU_EMULATOR_IPU_VERSION='ipu3': expected "
                                                r"one of ipu2, ipu21, 2, 21$"):
        load_system_config({"IPU_EMULATOR_IPU_VERSION": "ipu3"})
    with pytest.raises(SystemConfigError, match=r"^IPU_EMULATOR_NUM_IPUS='four': expected an "
                                                r"integer in 0\.\.64$"):
        load_system_config({"IPU_EMULATOR_NUM_IPUS": "four"})
    bad = tmp_path / "bad.yaml"
    bad.write_text("num_ipu: 3\n")
    with pytest.raises(SystemConfigError, match="unknown keys \\['num_ipu'\\]"):
        load_system_config({"IPU_EMULATOR_CONFIG": str(bad)})
    with pytest.raises(SystemConfigError, match="cannot read"):
        load_system_config({"IPU_EMULATOR_CONFIG": str(tmp_path / "missing.yaml")})


def test_device_groups_follow_poplar_numbering():
    assert device_groups(4) == [(0,), (1,), (2,), (3,), (0, 1), (2, 3), (0, 1, 2, 3)]
    assert device_groups(1) == [(0,)]
    assert device_groups(0) == []


# -- locks -------------------------------------------------------------------------------------

def test_locks_are_exclusive_all_or_none_and_record_the_holder(tmp_path):
    d = str(tmp_path)
    held = IpuLocks.try_acquire(d, (0, 1))
    assert isinstance(held, IpuLocks)
    busy = IpuLocks.try_acquire(d, (1, 2))
    assert busy == {1: os.getpid()}
    # all or none: ipu 2 was not kept by the failed attempt
    two = IpuLocks.try_acquire(d, (2,))
    assert isinstance(two, IpuLocks)
    two.release()
    held.release()
    held.release()  # idempotent
    again = IpuLocks.try_acquire(d, (0, 1, 2))
    assert isinstance(again, IpuLocks)
    again.release()


def test_a_dead_holder_releases_its_ipus(tmp_path):
    d = str(tmp_path)
    script = textwrap.dedent(f"""
        import sys, time
        from ipu_emulator.system import IpuLocks
        locks = IpuLocks.try_acquire({d!r}, (0,))
        assert isinstance(locks, IpuLocks)
        print("held", flush=True)
        sys.stdin.readline()
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "held"
        assert IpuLocks.try_acquire(d, (0,)) == {0: child.pid}
        child.kill()
        child.wait(30)
        got = IpuLocks.try_acquire(d, (0,))
        assert isinstance(got, IpuLocks)
        got.release()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


# -- DeviceManager refusals that start no process ---------------------------------------------------

def _manager(tmp_path, n=2):
    return DeviceManager(SystemConfig(num_ipus=n, home=str(tmp_path)))


def test_no_wait_fails_at_once_naming_the_holder(tmp_path):
    dm = _manager(tmp_path)
    held = IpuLocks.try_acquire(dm.system.lock_dir, (0, 1))
    try:
        with pytest.raises(DeviceUnavailableError) as info:
            dm.getDevice(1)
        msg = str(info.value)
        assert "asked for a device of 1 IPU(s) with NO_WAIT" in msg
        assert f"ipu 0 by pid {os.getpid()}" in msg and f"ipu 1 by pid {os.getpid()}" in msg
        assert dm.tryGetDevice(1) is None
        with pytest.raises(DeviceUnavailableError, match=f"asked for device 2 .*ipu 0 by pid {os.getpid()}"):
            dm.getSpecificDevice(2)   # device 2 = the pair (0, 1)
    finally:
        held.release()


def test_wait_with_timeout_retries_until_the_timeout(tmp_path):
    dm = _manager(tmp_path, 1)
    held = IpuLocks.try_acquire(dm.system.lock_dir, (0,))
    try:
        wc = DeviceWaitConfig(timedelta(seconds=0.3), timedelta(seconds=0.05))
        with pytest.raises(DeviceUnavailableError, match=r"WAIT_WITH_TIMEOUT \(waited .* s, \d+ attempts\)"):
            dm.getDevice(1, {}, wc)
        assert dm.tryGetSpecificDevice(0, {}, wc) is None
    finally:
        held.release()


def test_impossible_requests_fail_without_waiting(tmp_path):
    dm = _manager(tmp_path, 2)
    forever = DeviceWaitConfig(DeviceWaitStrategy.WAIT_FOREVER, sleepTime=timedelta(seconds=0.01))
    with pytest.raises(DeviceUnavailableError, match="this machine has 2 IPU"):
        dm.getDevice(4, wait_config=forever)
    with pytest.raises(DeviceUnavailableError, match="power of two"):
        dm.getDevice(3, wait_config=forever)
    with pytest.raises(DeviceUnavailableError, match="device id 3 does not exist.*0..2"):
        dm.getSpecificDevice(3, wait_config=forever)
    with pytest.raises(BadRequestError, match="popef.Model or a number of IPUs"):
        dm.getDevice("one")
    with pytest.raises(BadRequestError, match="num_ipus must be an int"):
        dm.createIpuModelDevice(0)
    with pytest.raises(BadRequestError, match="ipu_version must be 2 or 21"):
        dm.createSmallIpuModelDevice(1, ipu_version=3)


class _FakeConnection:
    """Stands in for an IPU process (what a daemon would hand out)."""

    def __init__(self, spec, log_dir=None):
        self.spec = spec
        self.log_dir = log_dir
        self.closed = False
        self.pid = 10_000 + max(spec.ipu_id, 0)

    def alive(self):
        return not self.closed

    def close(self):
        self.closed = True


def test_launcher_seam_gets_one_spec_per_ipu_and_close_releases_everything(tmp_path):
    made: list[_FakeConnection] = []

    def launcher(spec, log_dir=None):
        made.append(_FakeConnection(spec, log_dir))
        return made[-1]
    dm = DeviceManager(SystemConfig(num_ipus=4, home=str(tmp_path), compute_threads=3),
                       launcher=launcher)
    dev = dm.getDevice(2)
    assert (dev.id, dev.ipus(), dev.numIpus(), dev.pids()) == (4, [0, 1], 2, [10000, 10001])
    assert [(c.spec.ipu_id, c.spec.num_ipus, c.spec.compute_threads, c.spec.label) for c in made] \
        == [(0, 2, 3, "device 4 (ipu 0)"), (1, 1, 3, "device 4 (ipu 1)")]
    assert made[0].log_dir == os.path.join(str(tmp_path), "logs")
    second = dm.getDevice(2)       # the other pair
    assert second.ipus() == [2, 3]
    with pytest.raises(DeviceUnavailableError, match="ipu 0 by pid"):
        dm.getSpecificDevice(0)
    dev.close()
    dev.close()                    # idempotent
    assert made[0].closed and made[1].closed and not dev.isAttached()
    with dm.getSpecificDevice(0) as again:   # released
        assert again.ipus() == [0]
    second.close()


def test_ipu_model_overloads(tmp_path):
    from host_runtime import popef

    made = []
    dm = DeviceManager(SystemConfig(num_ipus=0, home=str(tmp_path)),
                       launcher=lambda spec, log_dir=None: made.append(spec) or _FakeConnection(spec))
    model = popef.Model(popef.Metadata(num_ipus=2, ipu_version=21),
                        popef.ExecutableBlob("x", b""))
    with dm.createIpuModelDevice(model, 8) as dev:
        assert (dev.numIpus(), dev.ipuVersion(), dev.tilesPerIpu(), dev.isIpuModel()) == (2, 21, 8, True)
    with dm.createIpuModelDevice(1, 21) as dev:
        assert (dev.ipuVersion(), dev.tilesPerIpu(), dev.id, dev.ipus()) == (21, 1472, -1, [])
    with dm.createSmallIpuModelDevice(model) as dev:
        assert (dev.numIpus(), dev.tilesPerIpu(), dev.memoryBytes()) == (2, 4, 2 * 4 * 624 * 1024)
    assert all(spec.ipu_id == -1 for spec in made)   # IPU models take no machine IPU
    with pytest.raises(BadRequestError, match="takes \\(tiles_per_ipu\\)"):
        dm.createIpuModelDevice(model, 8, 2)


def test_public_surface_of_devices_and_session():
    import host_runtime.devices._manager as devices
    import host_runtime.session._session as session

    assert devices.__all__ == ["DeviceWaitStrategy", "DeviceWaitConfig", "DeviceConstraints",
                               "Device", "DeviceManager"]
    assert session.__all__ == ["LaunchPolicy", "SessionConfig", "CallbackInfo", "CallbackHandle",
                               "CallbackFactory", "Session"]
    assert [m.name for m in DeviceWaitStrategy] == ["NO_WAIT", "WAIT_WITH_TIMEOUT", "WAIT_FOREVER"]
    assert [m.name for m in session.LaunchPolicy] == ["Deferred", "Immediate"]
    cfg = session.SessionConfig()
    assert (cfg.policy, cfg.pred_tensor_data, cfg.check_package_hash, cfg.wait_config,
            cfg.max_look_ahead) == (session.LaunchPolicy.Deferred, None, True, DeviceWaitConfig(),
                                    "unlimited")


def test_a_forked_child_does_not_release_its_parents_device(tmp_path):
    dm = DeviceManager(SystemConfig(num_ipus=1, home=str(tmp_path)),
                       launcher=lambda spec, log_dir=None: _FakeConnection(spec))
    dev = dm.getDevice(1)
    try:
        pid = os.fork()
        if pid == 0:   # child: closing (explicitly or at exit) must not touch the parent's IPUs
            try:
                dev.close()
            finally:
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert status == 0
        assert dev.isAttached()
        assert IpuLocks.try_acquire(dm.system.lock_dir, (0,)) == {0: os.getpid()}
    finally:
        dev.close()
    assert isinstance(IpuLocks.try_acquire(dm.system.lock_dir, (0,)), IpuLocks)
