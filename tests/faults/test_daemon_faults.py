"""Daemon mode under faults: exclusive attach and waiting, SIGKILLed hosts, a killed IPU
process, and the daemon's own SIGTERM.

Host processes are ``python -c`` children with ``IPU_EMULATOR_DAEMON`` set;
they print one JSON line per step so the test follows them without sleeping.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import psutil
import pytest

from host_runtime.devices._manager import DeviceManager
from host_runtime import settings
from host_runtime.errors import DeviceLostError, DeviceTimeoutError, DeviceUnavailableError
from host_runtime.session._session import Session
from tests._helpers import PATIENT, running
from tests.daemon_rig import REPO, DaemonRig, shm_entries
from tests.integration.test_daemon import rand, run_session



class Host:
    """A host child process; ``line()`` reads its next JSON line."""

    def __init__(self, daemon: DaemonRig, code: str, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args],
                                     cwd=REPO, env=daemon.host_env(), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.pid = self.proc.pid

    def line(self) -> dict:
        assert self.proc.stdout is not None
        text = self.proc.stdout.readline()
        if not text:
            self.proc.wait(30)
            raise AssertionError(f"host {self.pid} exited ({self.proc.returncode}): "
                                 f"{self.proc.stderr.read() if self.proc.stderr else ''}")
        return json.loads(text)

    def finish(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate(timeout=60)


WAITER = """
    import json, sys
    from datetime import timedelta
    from host_runtime.devices._manager import DeviceManager, DeviceWaitConfig
    from host_runtime.errors import DeviceUnavailableError
    dm = DeviceManager()
    try:
        dm.getSpecificDevice(0)
        print(json.dumps({"busy": None}), flush=True)
    except DeviceUnavailableError as exc:
        print(json.dumps({"busy": str(exc)}), flush=True)
    with dm.getSpecificDevice(0, wait_config=DeviceWaitConfig(
            timedelta(seconds=120), timedelta(seconds=0.05))) as dev:
        print(json.dumps({"pids": dev.pids()}), flush=True)
"""


def test_no_wait_names_the_holder_and_a_waiting_host_gets_the_ipu_on_release(daemon):
    dev = DeviceManager(daemon=daemon.socket).getSpecificDevice(0, wait_config=PATIENT)
    held_pids = dev.pids()
    waiter = Host(daemon, WAITER)
    try:
        busy = waiter.line()["busy"]
        assert busy == (f"no device available: asked for device 0 with NO_WAIT; busy: ipu 0 by "
                        f"pid {os.getpid()} (daemon at {daemon.socket})")
        dev.close()                                   # the waiter (WAIT_WITH_TIMEOUT) gets it
        assert waiter.line() == {"pids": held_pids}   # the same warm process
        assert waiter.proc.wait(60) == 0
    finally:
        dev.close()
        waiter.finish()


RUNNER_HOST = """
    import json, sys
    import numpy as np
    import host_runtime as model_runtime
    from host_runtime.devices._manager import DeviceManager
    dev = DeviceManager().getSpecificDevice(0)
    cfg = model_runtime.ModelRunnerConfig()
    cfg.replica_to_device = {0: dev}
    runner = model_runtime.ModelRunner(model_runtime.PopefPaths([sys.argv[1]]), config=cfg)
    a = np.ones((1, 4), np.float32)
    out = runner.execute({"tensor_A": a, "tensor_B": a})   # Main now loops on the device
    print(json.dumps({"pids": dev.pids(), "c": out["tensor_C"].ravel().tolist()}), flush=True)
    sys.stdin.readline()
"""


DROPPING_HOST = RUNNER_HOST.replace("    sys.stdin.readline()\n", """\
    import os, socket, psutil
    me = psutil.Process()
    conns = me.net_connections if hasattr(me, "net_connections") else me.connections  # psutil<6
    for c in conns(kind="unix"):   # EOF for the daemon, no release
        if c.raddr == os.environ["IPU_EMULATOR_DAEMON"]:
            socket.socket(fileno=os.dup(c.fd)).shutdown(socket.SHUT_RDWR)
    print(json.dumps({"dropped": True}), flush=True)
    sys.stdin.readline()
    os._exit(0)
""")


@pytest.mark.allow_shm_leak   # the host's objects are checked here, after the reset
def test_a_host_exiting_just_after_its_connection_drops_leaves_nothing(daemon, model_path):
    """A host killed by a signal closes its socket an instant before it exits: the daemon
    gives it time to exit, then removes its objects (here the host exits once told to,
    after its connection dropped)."""
    host = Host(daemon, DROPPING_HOST, model_path)
    try:
        host.line()
        got: list = []
        waiter = threading.Thread(target=lambda: got.append(
            DeviceManager(daemon=daemon.socket).getSpecificDevice(0, wait_config=PATIENT)))
        waiter.start()
        assert host.line() == {"dropped": True}
        assert shm_entries(pid=host.pid)
        host.proc.stdin.write("exit\n")
        host.proc.stdin.flush()
        assert host.proc.wait(30) == 0
        waiter.join(150)
        assert got, "the waiting host never got the IPU"
        with got[0]:
            assert shm_entries(pid=host.pid) == set()   # removed before the IPU was free
    finally:
        host.finish()


@pytest.mark.allow_shm_leak   # the dead host's objects are checked here, after the reset
def test_a_sigkilled_host_releases_its_ipu_clean_and_warm(daemon, model_path, model, weights):
    host = Host(daemon, RUNNER_HOST, model_path)
    try:
        first = host.line()
        np.testing.assert_allclose(first["c"], (weights + 1).ravel(), rtol=1e-6)
        assert shm_entries(pid=host.pid)              # its rings and regions exist
        dm = DeviceManager(daemon=daemon.socket)
        with pytest.raises(DeviceUnavailableError, match=f"busy: ipu 0 by pid {host.pid} "):
            dm.getSpecificDevice(0)
        got: list = []
        waiter = threading.Thread(target=lambda: got.append(
            dm.getSpecificDevice(0, wait_config=PATIENT)))
        waiter.start()
        host.proc.kill()                              # SIGKILL while its main loop runs
        host.proc.wait(30)
        waiter.join(150)
        assert got, "the waiting host never got the IPU"
        with got[0] as dev:
            assert dev.pids() == first["pids"]        # the same process: still warm
            assert shm_entries(pid=host.pid) == set() # nothing of the dead host is left
            for seed in range(2):
                a, b = rand(seed), rand(seed + 1)
                np.testing.assert_allclose(run_session(model, dev, a, b), a * weights + b,
                                           rtol=1e-6)
    finally:
        host.finish()
    assert shm_entries(pid=host.pid) == set()


def test_a_killed_ipu_process_is_reported_and_replaced(daemon, model, weights):
    dm = DeviceManager(daemon=daemon.socket)
    with dm.getSpecificDevice(1, wait_config=PATIENT) as dev:
        old = dev.pids()[0]
        os.kill(old, signal.SIGKILL)
        with pytest.raises(DeviceLostError, match=f"device 1 \\(ipu 1\\): IPU process {old} "
                                                  "was killed by signal SIGKILL \\(9\\)"):
            run_session(model, dev, rand(1), rand(2))
    with dm.getSpecificDevice(1, wait_config=PATIENT) as dev:   # restarted once released
        assert dev.pids()[0] != old
        a, b = rand(3), rand(4)
        np.testing.assert_allclose(run_session(model, dev, a, b), a * weights + b, rtol=1e-6)
    assert any(f"{old}" in ln and "killed by signal SIGKILL" in ln for ln in daemon.lines)


def test_a_free_ipu_whose_process_died_is_restarted_by_the_next_attach(daemon, model, weights):
    """An IPU process that dies while nobody holds it (killed, the OOM killer) is replaced
    when the next host attaches it, not handed to it dead (the daemon's own look, woken
    by the exit, may not have come yet)."""
    dm = DeviceManager(daemon=daemon.socket)
    with dm.getSpecificDevice(1, wait_config=PATIENT) as dev:
        old = dev.pids()[0]
    proc = psutil.Process(old)
    os.kill(old, signal.SIGKILL)
    psutil.wait_procs([proc], timeout=60)
    with dm.getSpecificDevice(1, wait_config=PATIENT) as dev:
        assert dev.pids()[0] != old
        a, b = rand(5), rand(6)
        np.testing.assert_allclose(run_session(model, dev, a, b), a * weights + b, rtol=1e-6)


def test_a_free_ipu_whose_process_died_is_replaced_by_the_daemon_itself(tmp_path, model,
                                                                        weights):
    """An idle daemon sleeps until one of its IPU processes exits (their pidfds are read
    by its event loop): the exit of a free one wakes it, and it logs the exit and starts
    a new process on its own, with no host asking."""
    rig = DaemonRig(tmp_path, num_ipus=2)
    try:
        pid = rig.status()["daemon_pid"]

        def sleeps() -> int:   # times the daemon's event loop went to sleep so far
            with open(f"/proc/{pid}/task/{pid}/status") as f:
                return int(re.search(r"^voluntary_ctxt_switches:\s+(\d+)", f.read(),
                                     re.M).group(1))
        before = sleeps()
        time.sleep(1.5)   # a window of idleness, not a synchronisation
        # (the status request's connection may end after its answer: 2 wakes at most; a
        # look every 0.2 s would be 7)
        woke = sleeps() - before
        assert woke <= 2
        old = rig.pool_pids[1]
        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while True:   # the daemon's own work, seen from outside: bounded
            ipu = rig.status()["ipus"][1]
            if ipu["state"] == "free" and ipu["pid"] not in (None, old):
                break
            assert time.monotonic() < deadline, (ipu, rig.lines)
            time.sleep(0.02)
        assert any(f"ipu 1: " in ln and f"{old}" in ln and "killed by signal SIGKILL" in ln
                   for ln in rig.lines), rig.lines
        assert rig.status()["ipus"][0]["pid"] == rig.pool_pids[0]   # the other untouched
        with DeviceManager(daemon=rig.socket).getSpecificDevice(1) as dev:
            assert dev.pids() == [ipu["pid"]]
            a, b = rand(7), rand(8)
            np.testing.assert_allclose(run_session(model, dev, a, b), a * weights + b,
                                       rtol=1e-6)
        rig.stop()
    finally:
        rig.kill()


_FORKING_HOLDER = textwrap.dedent("""
    import os, sys
    from host_runtime.devices._manager import DeviceManager
    dev = DeviceManager(daemon=sys.argv[1]).getSpecificDevice(0)
    child = os.fork()
    if child == 0:          # keeps the daemon connection open, holds nothing itself
        sys.stdin.read()
        os._exit(0)
    print(child, flush=True)
    os._exit(0)             # the holder dies without releasing; its connection stays open
""")


@pytest.mark.allow_shm_leak   # the dead holder's objects: the daemon removes them
def test_a_holder_that_dies_while_its_child_keeps_the_connection_open_frees_its_ipu(tmp_path):
    """The daemon sees its holder's death (the holder's pidfd wakes it), not the end of
    the connection a forked child still holds."""
    rig = DaemonRig(tmp_path, num_ipus=1)
    host = subprocess.Popen([sys.executable, "-c", _FORKING_HOLDER, rig.socket], cwd=REPO,
                            env=rig.host_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    child = None
    try:
        assert host.stdout is not None
        child = int(host.stdout.readline())
        assert host.wait(60) == 0
        deadline = time.monotonic() + 60
        while True:   # the daemon's own work, seen from outside: bounded
            ipu = rig.status()["ipus"][0]
            if ipu["state"] == "free":
                break
            assert ipu["holder"] == host.pid, ipu
            assert time.monotonic() < deadline, (ipu, rig.lines)
            time.sleep(0.02)
        assert psutil.pid_exists(child)   # its connection is still open
        with DeviceManager(daemon=rig.socket).getSpecificDevice(0) as dev:
            assert dev.pids() == rig.pool_pids   # reset, not restarted
        rig.stop()
    finally:
        if child is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        if host.poll() is None:
            host.kill()
            host.wait()
        rig.kill()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_stops_the_daemon_leaving_no_process_and_nothing_in_dev_shm(tmp_path, model,
                                                                           sig):
    rig = DaemonRig(tmp_path, num_ipus=2)
    try:
        dev = DeviceManager(daemon=rig.socket).getDevice(1)
        run_session(model, dev, rand(1), rand(2))    # held, with a loaded session, at SIGTERM
        rig.stop(sig)    # exit 0, IPU processes gone, nothing of its tag, no socket
        with pytest.raises(DeviceLostError, match=f"IPU process {dev.pids()[0]} was killed by "
                                                  "signal SIGTERM"):
            run_session(model, dev, rand(1), rand(2))
        dev.close()      # the daemon is gone: releasing must neither hang nor raise
        assert any("stopping" in ln for ln in rig.lines)
    finally:
        rig.kill()


def test_closing_a_device_under_a_running_main_loop_leaves_the_ipu_clean(daemon, model,
                                                                          weights):
    dm = DeviceManager(daemon=daemon.socket)
    dev = dm.getSpecificDevice(0, wait_config=PATIENT)
    pids = dev.pids()
    s = Session(model)
    try:
        s.bindToDevice(dev)
        for h in ("tensor_A", "tensor_B", "tensor_C"):
            s.setCallbackForAnchor(h, lambda v: None)
            s.direct.claim(h)
        s.setCallbackForAnchor("weights_saved", lambda v: None)
        loop = s.direct.start_main_loop()       # the IPU now waits on an empty input ring
        dev.close()                       # no stop(): the daemon's HOST(0) must end the loop
        assert loop.exception(timeout=30) is not None
    finally:
        s.close()
    assert {i["ipu"]: i["state"] for i in daemon.status()["ipus"]}[0] == "free"
    with dm.getSpecificDevice(0, wait_config=PATIENT) as dev:
        assert dev.pids() == pids
        a, b = rand(7), rand(8)
        np.testing.assert_allclose(run_session(model, dev, a, b), a * weights + b, rtol=1e-6)


def test_a_sigkilled_daemon_leaves_nothing_in_dev_shm(tmp_path):
    rig = DaemonRig(tmp_path, num_ipus=1)
    procs = [psutil.Process(p) for p in rig.pool_pids]
    assert shm_entries(rig.tag)                      # its control and event rings
    rig.kill()                                       # SIGKILL: no cleanup of its own
    _, alive = psutil.wait_procs(procs, timeout=60)  # its IPU processes notice and clean up
    assert not alive
    assert shm_entries(rig.tag) == set()
    again = DaemonRig(tmp_path, num_ipus=1)          # the stale socket is replaced
    again.stop()


def test_sigterm_with_a_stubborn_ipu_process_kills_it_and_names_it(tmp_path):
    rig = DaemonRig(tmp_path, num_ipus=1)
    try:
        stubborn = rig.pool_pids[0]
        os.kill(stubborn, signal.SIGSTOP)   # reads no SHUTDOWN, acts on no SIGTERM
        rig.stop()                          # still exit 0, nothing left
        warned = [ln for ln in rig.lines if "WARNING" in ln and f"pid {stubborn})" in ln]
        assert len(warned) == 1, rig.lines   # stopped: SIGKILL at once, no SIGTERM first
        assert warned[0].endswith(f"ipu 0 (IPU process pid {stubborn}) is stopped (state T) "
                                  "and ignored SHUTDOWN for 5 s; killing it"), warned
    finally:
        rig.kill()


def test_the_daemon_refuses_a_socket_path_that_is_a_file_or_served(tmp_path, daemon):
    path = tmp_path / "f.sock"
    path.write_text("precious")
    for sock, text in ((str(path), f"{path} exists and is not a socket"),
                       (daemon.socket, f"another daemon is serving at {daemon.socket}")):
        out = subprocess.run([sys.executable, "-m", "tools.cli", "daemon", "--socket", sock,
                              "--num-ipus", "0"], cwd=REPO, capture_output=True, text=True,
                             timeout=120, env=dict(daemon.env, IPU_EMULATOR_HOME=str(tmp_path)))
        assert out.returncode == 1 and text in out.stderr
    assert path.read_text() == "precious"


RACER = """
    import json, sys
    import numpy as np
    from datetime import timedelta
    from host_runtime import popef
    from host_runtime.devices._manager import DeviceManager, DeviceWaitConfig
    from tests.integration.test_daemon import run_session
    model = popef.load_model([sys.argv[1]])
    w = np.frombuffer(model.tensorData("weights").data, np.float32).reshape(1, 4)
    dm = DeviceManager()
    rng = np.random.default_rng(int(sys.argv[2]))
    results = []
    for _ in range(4):
        with dm.getSpecificDevice(0, wait_config=DeviceWaitConfig(
                timedelta(seconds=120), timedelta(seconds=0.01))) as dev:
            a, b = rng.random((1, 4), np.float32), rng.random((1, 4), np.float32)
            c = run_session(model, dev, a, b)
            results.append(bool(np.allclose(c, a * w + b, rtol=1e-6)))
    print(json.dumps({"ok": results}), flush=True)
"""


def test_hosts_racing_for_one_ipu_each_get_it_exclusively_and_compute_right(daemon,
                                                                            model_path):
    hosts = [Host(daemon, RACER, model_path, str(seed)) for seed in range(3)]
    try:
        for h in hosts:
            assert h.line() == {"ok": [True] * 4}
            assert h.proc.wait(60) == 0
    finally:
        for h in hosts:
            h.finish()
    ipu0 = daemon.status()["ipus"][0]
    assert (ipu0["state"], ipu0["holder"], ipu0["pid"]) == ("free", None, daemon.pool_pids[0])


def test_model_runner_auto_reset_over_the_daemon_after_a_killed_ipu(daemon, model_path,
                                                                     weights, monkeypatch):
    import host_runtime as model_runtime

    monkeypatch.setenv("IPU_EMULATOR_DAEMON", daemon.socket)
    cfg = model_runtime.ModelRunnerConfig(auto_reset=True)
    cfg.device_wait_config = PATIENT
    with model_runtime.ModelRunner(model_runtime.PopefPaths([model_path]), config=cfg) as r:
        a, b = rand(1), rand(2)
        np.testing.assert_allclose(r.execute({"tensor_A": a, "tensor_B": b})["tensor_C"],
                                   a * weights + b, rtol=1e-6)
        held = [i for i in daemon.status()["ipus"] if i["holder"] == os.getpid()]
        assert len(held) == 1
        ipu_proc = psutil.Process(held[0]["pid"])
        ipu_proc.kill()
        psutil.wait_procs([ipu_proc], timeout=30)
        for seed in range(3):   # the first one restarts the device (a fresh daemon IPU)
            a, b = rand(seed + 3), rand(seed + 4)
            np.testing.assert_allclose(r.execute({"tensor_A": a, "tensor_B": b})["tensor_C"],
                                       a * weights + b, rtol=1e-6)
        now = [i for i in daemon.status()["ipus"] if i["holder"] == os.getpid()]
        assert len(now) == 1 and now[0]["pid"] != held[0]["pid"]


def test_an_ipu_process_that_does_not_answer_is_replaced_when_taken_back(tmp_path, model,
                                                                          weights):
    # the daemon lends an IPU without waiting for its process to take HOST (the host's
    # requests follow HOST on the control ring): a hung process fails the host's first
    # request within the host sync timeout, and is replaced when the daemon takes it back
    rig = DaemonRig(tmp_path, num_ipus=1, IPU_EMULATOR_DAEMON_HANDOVER_TIMEOUT="1")
    try:
        hung = rig.pool_pids[0]
        os.kill(hung, signal.SIGSTOP)
        with settings.override(host_sync_timeout=1.0):
            dm = DeviceManager(daemon=rig.socket)
            dev = dm.getDevice(1)
            assert dev.pids() == [hung]
            with pytest.raises(DeviceTimeoutError, match=f"pid {hung}"):
                run_session(model, dev, rand(1), rand(2))
            dev.close()   # the daemon's HOST 0 goes unanswered too: the process is replaced
        # (an attach waits for the take-back: within the default host sync timeout)
        with DeviceManager(daemon=rig.socket).getDevice(1, wait_config=PATIENT) as dev:
            assert dev.pids()[0] != hung   # a fresh process
            a, b = rand(1), rand(2)
            np.testing.assert_allclose(run_session(model, dev, a, b), a * weights + b,
                                       rtol=1e-6)
        assert not running(hung)   # killed (a zombie until the daemon reaps it)
        rig.stop()
    finally:
        rig.kill()
