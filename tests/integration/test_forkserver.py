"""IPU processes forked by the host's template process (ipu_emulator.ipu.forkserver) keep every
guarantee of a freshly started one: their own process and log, their exit status with the
signal that killed them, liveness both ways, nothing left behind; and it can be turned off."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any

import psutil
import pytest

from ipu_emulator import ipu_protocol, titles
from ipu_emulator.ipu import forkserver
from ipu_emulator.ipu.launcher import IpuSpec, launch_ipu
from ipu_emulator.ipu_protocol import Message, Op
from shm import naming
from shm.cleanup import list_objects
from shm.settings import override
from tests.daemon_rig import REPO


def ours() -> set[str]:
    return {o.entry for o in list_objects(naming.current_tag())}


def wait_gone(pids: list[int], timeout: float = 60) -> list[int]:
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return [p.pid for p in alive if p.status() != psutil.STATUS_ZOMBIE]


@pytest.fixture(autouse=True)
def template_on(monkeypatch):
    monkeypatch.setenv("IPU_EMULATOR_FORKSERVER", "1")


def test_forked_ipu_process_is_a_child_of_the_template_logs_and_exits_cleanly(tmp_path):
    before = ours()
    proc = launch_ipu(IpuSpec(ipu_id=5, label="forked ipu"), log_dir=str(tmp_path))
    try:
        assert proc.wait_ready().pid == proc.pid != os.getpid()
        parent = psutil.Process(proc.pid).parent()
        assert parent is not None and parent.pid != os.getpid()
        # titled, as ps shows them (an IPU process titles itself before READY)
        assert titles.of_pid(parent.pid) == f"ipu-emulator: fork server (host {os.getpid()})"
        assert titles.of_pid(proc.pid) == f"ipu-emulator: ipu 5 (host {os.getpid()})"
        assert " ".join(psutil.Process(proc.pid).cmdline()).rstrip() == titles.of_pid(proc.pid)
        assert parent.ppid() == os.getpid()            # the template is our child
        proc.control.write(b"\0" * 4, tag=77)    # malformed: logged, ignored
        ipu_protocol.send(proc.control, Message(Op.PING, seq=1))
        assert ipu_protocol.receive(proc.events, timeout=60) == Message(Op.DONE, seq=1)
        ipu_protocol.send(proc.control, Message(Op.SHUTDOWN))
        assert ipu_protocol.receive(proc.events, timeout=60).op is Op.BYE
        assert proc.wait_exit(60) == 0
        assert proc.describe_exit() == f"forked ipu (IPU process pid {proc.pid}) exited with code 0"
    finally:
        proc.close()
    assert ours() == before
    log = (tmp_path / "ipu5.log").read_text()   # its own log file, lines tagged with its pid
    assert re.search(rf"ipu5\[{proc.pid}\] ERROR ipu_emulator.ipu.process: ignoring a malformed "
                     "control message", log), log


def test_a_killed_forked_process_is_reported_with_its_signal_at_once(tmp_path):
    proc = launch_ipu(IpuSpec(ipu_id=0), log_dir=str(tmp_path))
    try:
        proc.wait_ready()
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait_exit(60) == -signal.SIGKILL
        assert not proc.alive()
        assert proc.describe_exit() == \
            f"ipu 0 (IPU process pid {proc.pid}) was killed by signal SIGKILL (9)"
    finally:
        proc.close()


def _exited_ipu_process(tmp_path: Any) -> tuple[Any, int]:
    """The fork server's template and the pid of an IPU process it forked, which has been
    shut down and whose exit status its launcher took."""
    proc = launch_ipu(IpuSpec(ipu_id=0), log_dir=str(tmp_path))
    try:
        proc.wait_ready()
        ipu_protocol.send(proc.control, Message(Op.SHUTDOWN))
        assert proc.wait_exit(60) == 0
    finally:
        proc.close()
    forked = proc._popen
    assert isinstance(forked, forkserver.ForkedProcess)
    return forked._template, forked.pid


def test_a_pid_the_kernel_hands_out_again_is_a_live_process_not_the_exited_one(tmp_path):
    """A long-lived host forks more IPU processes than the kernel has pids: a new process
    may get the pid of one that exited. The template's report of the new fork replaces
    the old exit status (once a device was taken for lost at its first request: its IPU
    process "exited with code 0", the status of an earlier process of that pid)."""
    template, pid = _exited_ipu_process(tmp_path)
    # the template's messages as it sends them when its next fork gets that pid: the
    # fork's reply, later the new process's own exit
    with template._cv:
        template._take({"op": "spawned", "id": -1, "pid": pid})
        assert template._replies.pop(-1)["pid"] == pid
    again = forkserver.ForkedProcess(template, pid, -1)
    assert again.poll() is None and not again.status_lost
    with template._cv:
        template._take({"op": "exit", "pid": pid, "code": -signal.SIGKILL})
    assert again.poll() == -signal.SIGKILL
    assert pid not in template.exits   # taken: forgotten there, kept here
    assert again.wait(0) == again.wait_exit(0) == -signal.SIGKILL and not again.status_lost


def test_the_template_keeps_no_exit_status_a_process_was_given(tmp_path):
    """A long-lived host (a daemon) forks an IPU process per restart: once the launcher
    has taken a process's exit status, the template's bookkeeping forgets it (one entry
    per process ever forked before, for the host's life); a status not taken yet stays,
    and a later spawn's process of the same pid keeps its own."""
    procs = [launch_ipu(IpuSpec(ipu_id=k), log_dir=str(tmp_path)) for k in range(2)]
    try:
        for proc in procs:
            proc.wait_ready()
            ipu_protocol.send(proc.control, Message(Op.SHUTDOWN))
        assert procs[0].wait_exit(60) == 0
    finally:
        procs[0].close()
    first, second = (p._popen for p in procs)
    assert isinstance(first, forkserver.ForkedProcess)
    assert isinstance(second, forkserver.ForkedProcess)
    template = first._template
    assert first.pid not in template.exits and first.pid not in template.spawned
    assert first.poll() == 0 and first.returncode == 0     # kept by the process object
    # the second's status: reported by the template, not taken yet
    with template._cv:
        template._cv.wait_for(lambda: second.pid in template.exits, 60)
    assert template.exits[second.pid] == 0
    # a stale forget (an earlier spawn of that pid) leaves it alone
    template.forget(second.pid, -12345)
    assert second.pid in template.exits
    try:
        assert second.wait(60) == 0
    finally:
        procs[1].close()
    assert second.pid not in template.exits and second.pid not in template.spawned


def test_a_wait_for_an_exit_another_thread_took_ends_at_once(tmp_path):
    """One thread waits for a process's exit (a device closing after a kill) while another
    (the link's event thread looking at the process) takes the status first: the template
    forgets a status once it is taken, so the waiter must end on that, not sit out its
    whole timeout (close() of a killed device took the host sync timeout twice)."""
    template, pid = _exited_ipu_process(tmp_path)
    with template._cv:   # a later process of that pid, as the next fork reports it
        template._take({"op": "spawned", "id": -2, "pid": pid})
        template._replies.pop(-2)
    again = forkserver.ForkedProcess(template, pid, -2)
    got: list[tuple[int | None, float]] = []

    def waiter() -> None:
        start = time.monotonic()
        rc = again.wait_exit(30)
        got.append((rc, time.monotonic() - start))
    t = threading.Thread(target=waiter)
    t.start()
    deadline = time.monotonic() + 30
    while not template._cv._waiters:   # the waiter sleeps on the template's condition
        assert time.monotonic() < deadline and t.is_alive()
        time.sleep(0.001)
    with template._cv:   # (reentrant) the exit comes, and another thread takes it first
        template._take({"op": "exit", "pid": pid, "code": -signal.SIGKILL})
        template._cv.notify_all()
        assert again.poll() == -signal.SIGKILL
        assert pid not in template.exits
    t.join(30)
    assert not t.is_alive()
    ((rc, took),) = got
    assert rc == -signal.SIGKILL and took < 10, took


def test_the_setting_turns_the_template_off(tmp_path, monkeypatch):
    monkeypatch.setenv("IPU_EMULATOR_FORKSERVER", "0")
    proc = launch_ipu(IpuSpec(ipu_id=1), log_dir=str(tmp_path))
    try:
        proc.wait_ready()
        assert psutil.Process(proc.pid).ppid() == os.getpid()
        assert titles.of_pid(proc.pid) == f"ipu-emulator: ipu 1 (host {os.getpid()})"
    finally:
        proc.close()


def test_a_setting_changed_between_launches_reaches_the_process_one_template_forks(
        tmp_path, monkeypatch):
    """No setting is read at import: one template serves launches with other settings, and
    each forked process runs with its launch's (an override's, or the environment's)."""
    monkeypatch.delenv("IPU_EMULATOR_DEVICE_LOG_LEVEL", raising=False)
    with override(device_log_level="DEBUG", device_spin_us=7, zero_copy=False):
        first = launch_ipu(IpuSpec(ipu_id=2), log_dir=str(tmp_path))
    try:
        first.wait_ready()
        monkeypatch.setenv("IPU_EMULATOR_DEVICE_LOG_LEVEL", "debug")
        monkeypatch.setenv("IPU_EMULATOR_DEVICE_SPIN_US", "3")
        second = launch_ipu(IpuSpec(ipu_id=3), log_dir=str(tmp_path))
        try:
            second.wait_ready()
            parents = {psutil.Process(p.pid).ppid() for p in (first, second)}
            assert len(parents) == 1 and os.getpid() not in parents   # one template
        finally:
            second.close()
    finally:
        first.close()
    log2 = (tmp_path / "ipu2.log").read_text()
    log3 = (tmp_path / "ipu3.log").read_text()
    assert re.search(rf"ipu2\[{first.pid}\] DEBUG ipu_emulator.ipu.process: settings: "
                     r"IpuSettings\(.*device_spin_us=7\.0, .*zero_copy=False, ", log2), log2
    assert re.search(rf"ipu3\[{second.pid}\] DEBUG ipu_emulator.ipu.process: settings: "
                     r"IpuSettings\(.*device_spin_us=3\.0, .*zero_copy=True, ", log3), log3


_HOST = """
import os, sys, time
from ipu_emulator.ipu.launcher import IpuSpec, launch_ipu
procs = [launch_ipu(IpuSpec(ipu_id=i), log_dir=sys.argv[1]) for i in range(2)]
for p in procs:
    p.wait_ready()
import psutil
template = psutil.Process(procs[0].pid).ppid()
print("PIDS", template, *(p.pid for p in procs), flush=True)
sys.stdin.readline()      # killed here
"""


def test_a_killed_host_leaves_no_process_and_nothing_in_dev_shm(tmp_path):
    """SIGKILL the host: its forked IPU processes notice, unlink its objects and exit; the
    template exits after them."""
    tag = "f" + os.urandom(4).hex()
    env = dict(os.environ, IPU_EMULATOR_SHM_TAG=tag, IPU_EMULATOR_FORKSERVER="1",
               IPU_EMULATOR_HOME=str(tmp_path / "home"))
    host = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_HOST), str(tmp_path)],
                            cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert host.stdout is not None
        line = host.stdout.readline()
        assert line.startswith("PIDS"), line
        template, *ipus = map(int, line.split()[1:])
        assert template != host.pid and all(psutil.Process(p).ppid() == template for p in ipus)
        assert any(f"ipuemu_{tag}_" in n for n in os.listdir("/dev/shm"))
        host.kill()
        host.wait(60)
        assert wait_gone(ipus + [template]) == []
        assert [n for n in os.listdir("/dev/shm") if f"ipuemu_{tag}_" in n] == []
    finally:
        if host.poll() is None:
            host.kill()
            host.wait()


def test_a_dead_template_is_replaced_and_its_orphans_still_stop(tmp_path):
    first = launch_ipu(IpuSpec(ipu_id=0), log_dir=str(tmp_path))
    second = None
    try:
        first.wait_ready()
        template = psutil.Process(first.pid).ppid()
        assert template != os.getpid(), "not forked by a template"
        os.kill(template, signal.SIGKILL)
        psutil.wait_procs([psutil.Process(template)], timeout=60)
        assert first.alive()                         # the IPU process goes on
        second = launch_ipu(IpuSpec(ipu_id=1), log_dir=str(tmp_path))
        second.wait_ready()
        assert psutil.Process(second.pid).ppid() not in (template, os.getpid())
        ipu_protocol.send(first.control, Message(Op.SHUTDOWN))
        assert ipu_protocol.receive(first.events, timeout=60).op is Op.BYE
        assert first.wait_exit(60) is not None
        assert "exit status is unknown" in first.describe_exit()
    finally:
        first.close()
        if second is not None:
            second.close()


def _child_launches(log_dir: str, conn) -> None:
    proc = launch_ipu(IpuSpec(ipu_id=4), log_dir=log_dir)
    try:
        proc.wait_ready()
        conn.send(psutil.Process(proc.pid).ppid())
    finally:
        proc.close()


def test_a_forked_host_gets_its_own_template(tmp_path):
    import multiprocessing as mp

    first = launch_ipu(IpuSpec(ipu_id=0), log_dir=str(tmp_path))   # our template is up
    try:
        first.wait_ready()
        ours_ = psutil.Process(first.pid).ppid()
        assert ours_ != os.getpid(), "not forked by a template"
        ctx = mp.get_context("fork")
        here, there = ctx.Pipe()
        child = ctx.Process(target=_child_launches, args=(str(tmp_path), there))
        child.start()
        assert here.poll(120), "the forked host did not launch its IPU process"
        theirs = here.recv()
        child.join(60)
        assert child.exitcode == 0
        assert theirs not in (ours_, child.pid)   # its own template, not ours
        assert first.alive()                      # ours still serves us
        ipu_protocol.send(first.control, Message(Op.PING, seq=9))
        assert ipu_protocol.receive(first.events, timeout=60) == Message(Op.DONE, seq=9)
    finally:
        first.close()
    assert first.returncode() == 0
