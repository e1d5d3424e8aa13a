"""Daemon mode: hosts use the warm IPU processes of an ``ipu-emulator daemon``.

One daemon (2 IPUs, its own socket and shared-memory tag) serves the module.
The seeds' example model computes ``tensor_C = tensor_A * weights + tensor_B``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import host_runtime as model_runtime
from host_runtime.devices._manager import DeviceManager
from host_runtime.errors import DeviceUnavailableError
from host_runtime.session._session import Session
from ipu_emulator import titles
from ipu_emulator.daemon import socket_protocol as wire
from ipu_emulator.ipu_protocol import Op
from tests._helpers import PATIENT, run_in_threads
from tests.daemon_rig import REPO, DaemonRig

SHAPE = (1, 4)


def rand(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32)


def run_session(model, dev, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    out: list[np.ndarray] = []
    with Session(model) as s:
        s.bindToDevice(dev)
        s.setCallbackForAnchor("tensor_A", lambda v: np.frombuffer(v, np.float32).__setitem__(
            slice(None), a.ravel()))
        s.setCallbackForAnchor("tensor_B", lambda v: np.frombuffer(v, np.float32).__setitem__(
            slice(None), b.ravel()))
        s.setCallbackForAnchor("tensor_C", lambda v: out.append(
            np.frombuffer(v, np.float32).reshape(SHAPE).copy()))
        s.setCallbackForAnchor("weights_saved", lambda v: None)
        s.runMainPrograms()
    assert len(out) == 1
    return out[0]


def holders(daemon: DaemonRig) -> dict[int, tuple[str, int | None]]:
    return {i["ipu"]: (i["state"], i["holder"]) for i in daemon.status()["ipus"]}


def test_session_over_the_daemon_computes_a_times_weights_plus_b(daemon, model, weights):
    dm = DeviceManager(daemon=daemon.socket)
    assert dm.daemon == daemon.socket and dm.system.num_ipus == 2
    with dm.getDevice(1, wait_config=PATIENT) as dev:
        assert dev.pids()[0] in daemon.pool_pids          # the daemon's warm process
        assert holders(daemon)[dev.ipus()[0]] == ("held", os.getpid())
        for seed in range(3):
            a, b = rand(seed), rand(seed + 10)
            np.testing.assert_allclose(run_session(model, dev, a, b), a * weights + b, rtol=1e-6)
        ipu = dev.ipus()[0]
    assert holders(daemon)[ipu] == ("free", None)          # close() handed it back, reset


def test_model_runner_over_the_daemon(daemon, model_path, weights, monkeypatch):
    monkeypatch.setenv(wire.ENV_VAR, daemon.socket)
    runner = model_runtime.ModelRunner(model_runtime.PopefPaths([model_path]))
    try:
        assert ("held", os.getpid()) in holders(daemon).values()
        for seed in range(4):
            a, b = rand(seed), rand(seed + 20)
            out = runner.execute({"tensor_A": a, "tensor_B": b})
            np.testing.assert_allclose(out["tensor_C"], a * weights + b, rtol=1e-6)
    finally:
        runner.close()
    assert set(holders(daemon).values()) == {("free", None)}


HOST = textwrap.dedent("""
    import json, sys
    import numpy as np
    from datetime import timedelta
    from host_runtime import popef
    from host_runtime.devices._manager import DeviceManager, DeviceWaitConfig
    from tests.integration.test_daemon import run_session
    model = popef.load_model([sys.argv[1]])
    a = np.full((1, 4), 2.0, np.float32); b = np.full((1, 4), 0.5, np.float32)
    with DeviceManager().getSpecificDevice(0, wait_config=DeviceWaitConfig(
            timedelta(seconds=120), timedelta(seconds=0.05))) as dev:
        c = run_session(model, dev, a, b)
        print(json.dumps({"pids": dev.pids(), "c": c.ravel().tolist()}), flush=True)
""")


def test_the_ipu_process_stays_warm_across_two_hosts(daemon, model, weights, model_path):
    with DeviceManager(daemon=daemon.socket).getSpecificDevice(0, wait_config=PATIENT) as dev:
        first = dev.pids()
        run_session(model, dev, rand(1), rand(2))
    out = subprocess.run([sys.executable, "-c", HOST, model_path], cwd=REPO,
                         env=daemon.host_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    second = json.loads(out.stdout)
    assert second["pids"] == first                        # same process: warm
    np.testing.assert_allclose(second["c"], (2.0 * weights + 0.5).ravel(), rtol=1e-6)
    assert holders(daemon)[0] == ("free", None)


def test_status_command_prints_each_ipu_its_state_and_holder(daemon):
    with DeviceManager(daemon=daemon.socket).getSpecificDevice(1, wait_config=PATIENT) as dev:
        out = subprocess.run([sys.executable, "-m", "tools.cli", "daemon", "status", "--socket",
                              daemon.socket], cwd=REPO, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0].startswith(f"daemon pid {daemon.proc.pid} at {daemon.socket}: 2 x ipu21")
        ipu0 = next(ln for ln in lines if ln.startswith("ipu 0 "))
        ipu1 = next(ln for ln in lines if ln.startswith("ipu 1 "))
        assert ipu0.split()[2] == "free" and f"process {daemon.pool_pids[0]}" in ipu0
        assert ipu1.split()[2] == "held" and f"held by pid {os.getpid()}" in ipu1
        assert dev.pids() == [daemon.pool_pids[1]]
    missing = subprocess.run([sys.executable, "-m", "tools.cli", "daemon", "status", "--socket",
                              daemon.socket + ".none"], cwd=REPO, capture_output=True, text=True,
                             timeout=120)
    assert missing.returncode == 1 and "no daemon answers at" in missing.stderr


def test_processes_are_titled_for_ps(daemon):
    """ps and top tell the daemon and each IPU process apart, and whom an IPU serves."""
    d = daemon.proc.pid
    assert titles.of_pid(d) == "ipu-emulator: daemon"
    # (status answers once the resets under way are done: an earlier test's release is
    # answered before its IPU's reset, which retitles the process)
    assert holders(daemon) == {0: ("free", None), 1: ("free", None)}
    assert [_title_becomes(p, f"ipu-emulator: ipu {k} (daemon {d}, free)")
            for k, p in enumerate(daemon.pool_pids)] == [True, True]
    with DeviceManager(daemon=daemon.socket).getSpecificDevice(1, wait_config=PATIENT) as dev:
        assert dev.pids() == [daemon.pool_pids[1]]
        # the daemon does not wait for the process to take HOST; the host's first request
        # follows it on the control ring, so once one is answered HOST has been taken
        dev.link.call(Op.PING, timeout=30)
        assert titles.of_pid(daemon.pool_pids[1]) == (
            f"ipu-emulator: ipu 1 (host {os.getpid()}, daemon {d})")
        assert titles.parse_ipu(titles.of_pid(daemon.pool_pids[1]) or "") == (1, os.getpid(), d)
    # handed back: free again once reset (the daemon waits for the process's DONE to
    # HOST(0); status answers once the resets under way are done)
    assert holders(daemon)[1] == ("free", None)
    assert _title_becomes(daemon.pool_pids[1], f"ipu-emulator: ipu 1 (daemon {d}, free)")


def _title_becomes(pid: int, title: str) -> bool:
    """The IPU process retitles itself right after it answered its reset (the answer is
    not held up for it): seen from outside, a moment after the daemon says it is free."""
    deadline = time.monotonic() + 30
    while titles.of_pid(pid) != title and time.monotonic() < deadline:
        time.sleep(0.01)   # another process's own work, bounded
    return titles.of_pid(pid) == title


def test_a_device_of_two_ipus_from_the_daemon(daemon, model, weights):
    with DeviceManager(daemon=daemon.socket).getDevice(2, wait_config=PATIENT) as dev:
        assert (dev.id, dev.ipus(), sorted(dev.pids())) == (2, [0, 1], sorted(daemon.pool_pids))
        a, b = rand(5), rand(6)
        np.testing.assert_allclose(run_session(model, dev, a, b), a * weights + b, rtol=1e-6)


def test_no_daemon_at_the_socket_is_a_clear_error(tmp_path):
    path = str(tmp_path / "none.sock")
    with pytest.raises(DeviceUnavailableError,
                       match=f"cannot reach the IPU emulator daemon at {path} "
                             f"\\(IPU_EMULATOR_DAEMON\\)"):
        DeviceManager(daemon=path)


def _raw(path: str, data: bytes) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(30)
        s.connect(path)
        s.sendall(data)
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
    return json.loads(buf)


def test_the_socket_protocol_refuses_bad_messages(daemon):
    assert oct(os.stat(daemon.socket).st_mode & 0o777) == "0o600"
    v = wire.VERSION
    wrong = _raw(daemon.socket, b'{"v": 1, "op": "status"}\n')   # an older client
    assert wrong == {"v": v, "ok": False, "error": "protocol",
                     "message": f"protocol version 1 is not supported; this side speaks version {v}"}
    assert _raw(daemon.socket, b"[1, 2]\n")["message"] == "message must be a JSON object, got list"
    assert _raw(daemon.socket, b'{"v": %d, "op": "fly"}\n' % v)["message"].startswith(
        "unknown op 'fly'; expected hello")
    bad = _raw(daemon.socket, b'{"v": %d, "op": "attach", "ipus": [0, 7]}\n' % v)
    assert bad["error"] == "request" and "distinct IPU numbers in 0..1" in bad["message"]
    huge = _raw(daemon.socket, b'{"v": %d, "op": "status", "pad": "' % v + b"x" * wire.MAX_MESSAGE
                + b'"}\n')
    assert huge["message"] == f"message longer than {wire.MAX_MESSAGE} bytes; closing"
    deep = _raw(daemon.socket, b"[" * 20000 + b"]" * 20000 + b"\n")
    assert deep == {"v": v, "ok": False, "error": "protocol", "message": "message is not "
                    "valid JSON: it nests arrays or objects too deeply"}
    assert set(holders(daemon).values()) == {("free", None)}   # still serving


def test_liveness_checks_from_many_threads_at_once(daemon):

    errors: list[BaseException] = []
    with DeviceManager(daemon=daemon.socket).getDevice(1, wait_config=PATIENT) as dev:
        proc = dev._processes[0]

        def check() -> None:
            try:
                for _ in range(3000):
                    assert proc.alive()
            except BaseException as exc:   # RuntimeError: concurrent poll() invocation
                errors.append(exc)
        run_in_threads(lambda _: check(), range(4))
        assert errors == [] and proc.returncode() is None
        assert proc.describe_exit().endswith(f"(daemon IPU process pid {proc.pid}) is running")


def test_an_embedded_ipu_process_refuses_host_messages(tmp_path):
    from ipu_emulator import ipu_protocol
    from ipu_emulator.ipu.launcher import IpuSpec, launch_ipu
    from ipu_emulator.ipu_protocol import Message, Op

    with launch_ipu(IpuSpec(ipu_id=0), log_dir=str(tmp_path)) as proc:
        proc.wait_ready()
        ipu_protocol.send(proc.control, Message(Op.HOST, seq=7, value=os.getpid()))
        reply = ipu_protocol.receive(proc.events, timeout=60)
        assert (reply.op, reply.seq, reply.body["kind"]) == (Op.ERROR, 7, "protocol")
        assert reply.body["message"] == ("HOST is only for IPU processes a daemon owns "
                                         "(--pool)")


def test_release_is_answered_before_the_reset_and_no_ipu_is_lent_before_it(daemon):
    """A release is answered at once; an attach right after it waits for the reset (it
    is not told busy), and a third attach meanwhile is busy naming the new holder."""
    first = wire.LineConnection(daemon.socket, 10.0)
    second = wire.LineConnection(daemon.socket, 10.0)
    third = wire.LineConnection(daemon.socket, 10.0)
    try:
        for round_ in range(5):
            assert first.call({"op": "attach", "ipus": [0], "device_id": 0}, 10.0)["ok"] is True
            assert first.call({"op": "release"}, 10.0)["ok"] is True
            got = second.call({"op": "attach", "ipus": [0], "device_id": 0}, 10.0)
            assert got["ok"] is True and [i["ipu"] for i in got["ipus"]] == [0], (round_, got)
            busy = third.call({"op": "attach", "ipus": [0], "device_id": 0}, 10.0)
            assert (busy["ok"], busy["busy"]) == (False, {"0": os.getpid()})
            assert holders(daemon)[0] == ("held", os.getpid())
            assert second.call({"op": "release"}, 10.0)["ok"] is True
    finally:
        for conn in (first, second, third):
            conn.close()
    assert holders(daemon)[0] == ("free", None)


def test_runners_right_through_fast_close_and_construct_churn(daemon, model_path, weights,
                                                              monkeypatch):
    """Runners made and closed back to back on both IPUs from two threads (each close
    answered before its reset): every result is right and nothing is held after."""
    monkeypatch.setenv(wire.ENV_VAR, daemon.socket)
    errors: list[BaseException] = []

    def churn(seed: int) -> None:
        try:
            for k in range(6):
                cfg = model_runtime.ModelRunnerConfig()
                cfg.device_wait_config = PATIENT
                runner = model_runtime.ModelRunner(model_runtime.PopefPaths([model_path]),
                                                   config=cfg)
                try:
                    a, b = rand(seed * 100 + k), rand(seed * 100 + k + 50)
                    out = runner.execute({"tensor_A": a, "tensor_B": b})["tensor_C"]
                    np.testing.assert_allclose(out, a * weights + b, rtol=1e-6)
                finally:
                    runner.close()
        except BaseException as exc:   # reported below
            errors.append(exc)

    run_in_threads(churn, [1, 2, 3])
    assert errors == []
    assert set(holders(daemon).values()) == {("free", None)}


def _connects(monkeypatch) -> list[str]:
    """The daemon connections this process opens from now on (their socket paths)."""
    opened: list[str] = []
    real = wire.LineConnection.__init__

    def counting(self, path, *args, **kwargs) -> None:
        opened.append(path)
        real(self, path, *args, **kwargs)
    monkeypatch.setattr(wire.LineConnection, "__init__", counting)
    return opened


def test_a_host_attaches_again_on_the_connection_its_last_release_was_answered_on(
        daemon, model, weights, monkeypatch):
    """Runners made and closed one after another: the first attach connects, the later
    ones use the connection the last release was answered on (no new one for the daemon
    to accept and serve), and each gets a warm, reset IPU that computes right."""
    from host_runtime.devices import _daemon_client

    kept = _daemon_client._take_idle(daemon.socket)   # another test's, if any
    if kept is not None:
        kept.close()
    DeviceManager(daemon=daemon.socket)   # its hello, asked once per daemon
    opened = _connects(monkeypatch)
    states = []
    for seed in range(3):
        with DeviceManager(daemon=daemon.socket).getSpecificDevice(
                0, wait_config=PATIENT) as dev:
            a, b = rand(seed), rand(seed + 5)
            np.testing.assert_allclose(run_session(model, dev, a, b), a * weights + b,
                                       rtol=1e-6)
        assert _daemon_client._idle.get(daemon.socket) is not None   # kept
        states.append(len(opened))
    assert states == [1, 1, 1]   # one connection, the first attach's
    assert holders(daemon)[0] == ("free", None)   # released and reset


def test_a_kept_connection_whose_daemon_stopped_gives_way_to_a_new_one(
        tmp_path, model, weights, monkeypatch):
    """The daemon a kept connection was made to stops and another starts on its socket:
    the next attach finds that connection closed, connects to the new daemon and works."""
    rig = DaemonRig(tmp_path, num_ipus=1)
    try:
        with DeviceManager(daemon=rig.socket).getSpecificDevice(0, wait_config=PATIENT) as dev:
            run_session(model, dev, rand(1), rand(2))
    finally:
        rig.stop()
    from host_runtime.devices import _daemon_client

    assert _daemon_client._idle.get(rig.socket) is not None   # kept, its daemon gone
    rig = DaemonRig(tmp_path, num_ipus=1)   # the same socket path
    try:
        manager = DeviceManager(daemon=rig.socket)   # (asks the new daemon's hello)
        opened = _connects(monkeypatch)
        with manager.getSpecificDevice(0, wait_config=PATIENT) as dev:
            assert dev.pids() == rig.pool_pids
            a, b = rand(3), rand(4)
            np.testing.assert_allclose(run_session(model, dev, a, b), a * weights + b,
                                       rtol=1e-6)
        assert opened == [rig.socket]   # the stale one given up, a new one made
    finally:
        rig.stop()
