"""``ipu-emulator daemon --metrics-port 0``: its /metrics scraped over real HTTP and parsed
with ``prometheus_client.parser`` after known attaches, waits, releases and a killed IPU."""

from __future__ import annotations

import os
import re
import select
import subprocess
import sys
from typing import Iterator

import psutil
import pytest
from tests.scrape import scrape, value

from host_runtime.devices._manager import DeviceManager
from tests._helpers import PATIENT, kill_and_wait
from tests.daemon_rig import REPO, DaemonRig


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[DaemonRig, str]]:
    rig = DaemonRig(tmp_path_factory.mktemp("metrics-daemon"), num_ipus=2,
                    args=("--metrics-port", "0"))
    try:
        found = [m for ln in rig.lines
                 if (m := re.search(r"serving /metrics at (http://127\.0\.0\.1:\d+/metrics)", ln))]
        assert found, "the daemon did not log where /metrics is:\n" + "\n".join(rig.lines)
        yield rig, found[0].group(1)
    finally:
        rig.stop()


P = "ipu_emulator_daemon_"


def test_pool_attach_release_and_a_wait(rig):
    daemon, url = rig
    fams = scrape(url)
    assert value(fams, P + "ipus") == 2
    assert value(fams, P + "ipus_attached") == 0
    assert value(fams, P + "ipus_by_state", state="free") == 2
    assert value(fams, P + "attach_requests_total", result="ok") == 0
    dm = DeviceManager(daemon=daemon.socket)
    with dm.getSpecificDevice(0, wait_config=PATIENT):
        fams = scrape(url)
        assert value(fams, P + "ipus_attached") == 1
        assert value(fams, P + "ipus_held", holder=str(os.getpid())) == 1
        assert value(fams, P + "attach_requests_total", result="ok") == 1
        assert value(fams, P + "attach_seconds_count") == 1
        assert value(fams, P + "ipu_hosts_served_total", ipu="0") == 1
        # another host asks for ipu 0 while we hold it: busy; it waits, then gets it
        waiter = subprocess.Popen(
            [sys.executable, "-c", "import sys\n"
             "from host_runtime.devices._manager import DeviceManager\n"
             "from tests._helpers import PATIENT\n"
             "with DeviceManager(daemon=sys.argv[1]).getSpecificDevice(0, wait_config=PATIENT):\n"
             "    print('GOT IT', flush=True)\n", daemon.socket],
            cwd=REPO, env=daemon.host_env(), stdout=subprocess.PIPE, text=True)
        try:
            for _ in range(600):   # bounded: until the daemon has answered it busy
                fams = scrape(url)
                if value(fams, P + "attach_requests_total", result="busy") >= 1:
                    break
                select.select([waiter.stdout], [], [], 0.05)
            assert value(fams, P + "attach_requests_total", result="busy") >= 1
        except BaseException:
            waiter.kill()
            raise
    out, _ = waiter.communicate(timeout=120)
    assert waiter.returncode == 0 and "GOT IT" in out
    daemon.status()   # answered once the waiter's release (reset) is done
    fams = scrape(url)
    assert value(fams, P + "attach_requests_total", result="ok") == 2
    assert value(fams, P + "attach_waits_total") == 1
    assert value(fams, P + "attach_wait_seconds_count") == 1
    assert value(fams, P + "attach_wait_seconds_sum") > 0
    assert value(fams, P + "ipu_hosts_served_total", ipu="0") == 2
    assert value(fams, P + "ipu_held_seconds_total", ipu="0") > 0
    assert value(fams, P + "ipu_held_seconds_total", ipu="1") == 0
    assert value(fams, P + "ipu_resets_total", ipu="0") == 2     # each host's IPU taken back
    assert value(fams, P + "ipus_attached") == 0
    assert value(fams, P + "ipu_process_deaths_total", ipu="0") == 0
    cpu = value(fams, P + "ipu_process_cpu_seconds_total", ipu="0")
    t = psutil.Process(daemon.pool_pids[0]).cpu_times()
    assert 0 <= cpu <= t.user + t.system   # clock ticks: an idle fork may show 0


def test_a_killed_ipu_process_is_a_death_and_a_restart(rig):
    daemon, url = rig
    before = scrape(url)
    restarts = value(before, P + "ipu_restarts_total", ipu="1")
    with DeviceManager(daemon=daemon.socket).getSpecificDevice(1, wait_config=PATIENT) as dev:
        pid = dev.pids()[0]
        kill_and_wait(pid)
    # released: the daemon restarts the dead process; wait (bounded) until ipu 1 is free again
    for _ in range(1200):
        fams = scrape(url)
        if value(fams, P + "ipu_restarts_total", ipu="1") > restarts \
                and value(fams, P + "ipus_by_state", state="free") == 2:
            break
        select.select([], [], [], 0.05)
    assert value(fams, P + "ipu_process_deaths_total", ipu="1") == 1
    assert value(fams, P + "ipu_restarts_total", ipu="1") == restarts + 1
    assert value(fams, P + "ipus_by_state", state="free") == 2


def test_a_metrics_port_in_use_is_a_clear_error_before_any_ipu_starts(tmp_path):
    import socket

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    env = dict(os.environ, IPU_EMULATOR_HOME=str(tmp_path / "home"),
               IPU_EMULATOR_SHM_TAG="m" + os.urandom(4).hex())
    env.pop("IPU_EMULATOR_DAEMON", None)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "tools.cli", "daemon", "--socket", str(tmp_path / "d.sock"),
             "--num-ipus", "1", "--metrics-port", str(port)], cwd=REPO, env=env,
            capture_output=True, text=True, timeout=120)
    finally:
        busy.close()
    assert proc.returncode == 1, proc.stderr
    assert f"cannot serve /metrics at 127.0.0.1:{port}" in proc.stderr
    assert "is ready" not in proc.stderr            # no IPU process was started
    assert not [n for n in os.listdir("/dev/shm") if f"ipuemu_{env['IPU_EMULATOR_SHM_TAG']}_" in n]


def test_program_runs_count_the_requests_an_ipu_served(rig, tmp_path):
    import numpy as np

    import host_runtime as model_runtime
    from tools.generate_simple_popef import write_simple_popef

    daemon, url = rig
    path = str(tmp_path / "simple.popef")
    write_simple_popef(path, shape=(1, 4))
    runs = {i: value(scrape(url), P + "ipu_program_runs_total", ipu=str(i)) for i in (0, 1)}
    dm = DeviceManager(daemon=daemon.socket)
    cfg = model_runtime.ModelRunnerConfig()
    with dm.getSpecificDevice(1, wait_config=PATIENT) as dev:
        cfg.replica_to_device = {0: dev}
        with model_runtime.ModelRunner(path, config=cfg) as runner:
            x = {"tensor_A": np.ones((1, 4), np.float32), "tensor_B": np.ones((1, 4), np.float32)}
            for _ in range(7):
                runner.execute(x)
            fams = scrape(url)
    # seven Main runs (one request each) and the Load program; nothing on the other IPU
    assert value(fams, P + "ipu_program_runs_total", ipu="1") - runs[1] == 8
    assert value(fams, P + "ipu_program_runs_total", ipu="0") == runs[0]
