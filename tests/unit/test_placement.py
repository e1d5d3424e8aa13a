"""Where IPU processes run: off their host's CPU, one busy IPU process a CPU
(ipu_emulator.ipu._placement)."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys

import pytest

from ipu_emulator.ipu import _placement
from ipu_emulator.ipu._placement import CpuHold, KeepApart, _cpu_of


def test_cpu_field_is_read_after_the_command_name(tmp_path):
    stat = tmp_path / "stat"
    fields = ["S"] + [str(i) for i in range(4, 39)] + ["7"] + ["0"] * 10
    stat.write_text("1234 (a) b (c) " + " ".join(fields) + "\n")
    assert _cpu_of(str(stat)) == 7
    assert _cpu_of("/proc/thread-self/stat") in os.sched_getaffinity(0)


@pytest.fixture
def namespace():
    """CPU holds of this test only (the machine's IPU processes hold the real ones)."""
    return f"ipu-emulator-test.{os.getpid()}.{secrets.token_hex(4)}.cpu."


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_moves_off_the_hosts_cpu_and_gives_the_affinity_back(monkeypatch, namespace):
    allowed = os.sched_getaffinity(0)
    monkeypatch.setattr(_placement, "PERIOD", 0.0)
    apart = KeepApart(os.getpid(), namespace)   # this thread is its own "host": always shared
    try:
        assert apart.enabled
        cpu = _cpu_of("/proc/thread-self/stat")
        apart._look(host_cpu=cpu, mine=cpu)   # what check() reads, read once here
        now = os.sched_getaffinity(0)
        assert cpu not in now and len(now) == 1 and now <= allowed
        assert apart.hold.cpu in now
        assert not CpuHold(namespace).take(apart.hold.cpu)   # held: nobody else gets it
        apart.release()
        assert os.sched_getaffinity(0) == allowed and apart.hold.cpu == -1
        other = CpuHold(namespace)
        assert other.take(min(now))                        # given back
        other.drop()
    finally:
        os.sched_setaffinity(0, allowed)


def test_a_cpu_is_held_by_one_process_and_freed_when_it_dies(namespace):
    code = ("import sys, time; from ipu_emulator.ipu._placement import CpuHold; "
            "h = CpuHold(sys.argv[1]); print(h.take(0), flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code, namespace], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "True"
        mine = CpuHold(namespace)
        assert not mine.take(0) and mine.cpu == -1
        assert mine.take(1) and mine.cpu == 1
    finally:
        child.kill()
        child.wait()
        child.stdout.close()   # type: ignore[union-attr]
    assert mine.take(0) and mine.cpu == 0      # the kernel dropped the dead process's hold
    assert CpuHold(namespace).take(1)          # and taking 0 gave 1 back
    mine.drop()


class _Recorder(KeepApart):
    """A KeepApart whose pins are recorded instead of applied to this thread."""

    def __init__(self, namespace: str, cpus: set[int]) -> None:
        super().__init__(os.getpid(), namespace)
        self._allowed = frozenset(cpus)
        self.pins: list[int] = []

    def _pin(self, cpu: int) -> None:
        self.pins.append(cpu)

    def _unpin(self) -> None:
        self.pins.append(-1)


def test_two_ipu_processes_of_one_host_spread_over_two_cpus(namespace):
    """Both start on the host thread's CPU 0: the first takes CPU 1; the second finds it
    held and stays on CPU 0 (the host thread is the one the scheduler moves). When the
    host thread then runs on CPU 1, neither moves onto the other's CPU."""
    a, b = _Recorder(namespace, {0, 1}), _Recorder(namespace, {0, 1})
    try:
        a._look(host_cpu=0, mine=0)
        b._look(host_cpu=0, mine=0)
        assert (a.hold.cpu, a.pins) == (1, [1])
        assert (b.hold.cpu, b.pins) == (0, [0])
        a._look(host_cpu=1, mine=1)
        b._look(host_cpu=1, mine=0)
        assert (a.hold.cpu, b.hold.cpu) == (1, 0) and a.pins == [1, 1] and b.pins == [0]
        b.release()                         # b goes idle: a moves off the host's CPU
        a._look(host_cpu=1, mine=1)
        assert a.hold.cpu == 0 and a.pins[-1] == 0
        c = _Recorder(namespace, {0, 1})    # a third while both CPUs are held: floats
        b._look(host_cpu=0, mine=0)
        assert b.hold.cpu == 1
        c._look(host_cpu=0, mine=0)
        assert c.hold.cpu == -1 and c.pins == [-1]
        c.release()
    finally:
        a.release()
        b.release()


def test_off_when_asked_or_when_the_host_is_unknown(monkeypatch):
    monkeypatch.setenv("IPU_EMULATOR_KEEP_APART", "0")
    assert not KeepApart(os.getpid()).enabled
    monkeypatch.delenv("IPU_EMULATOR_KEEP_APART")
    gone = KeepApart(2 ** 22 + 12345)       # no such process: the first look turns it off
    gone.check()
    assert not gone.enabled
    assert not KeepApart(0).enabled


def test_the_host_thread_named_by_the_hint_is_the_one_looked_at(monkeypatch):
    import threading

    apart = KeepApart(os.getpid())
    seen: list[str] = []
    real = _placement._cpu_of

    def cpu_of(path: str) -> int:
        seen.append(path)
        return real(path)
    monkeypatch.setattr(_placement, "_cpu_of", cpu_of)
    ready, done = threading.Event(), threading.Event()
    worker = threading.Thread(target=lambda: (ready.set(), done.wait()))
    worker.start()
    ready.wait()
    try:
        tid = worker.native_id
        apart.hint = lambda: tid
        assert apart._host_thread_cpu() in os.sched_getaffinity(0)
        assert seen == [f"/proc/{os.getpid()}/task/{tid}/stat"]
        seen.clear()
        apart.hint = lambda: 2 ** 22 + 12345      # not a thread of the host: its main thread
        apart._host_thread_cpu()
        assert seen[-1] == f"/proc/{os.getpid()}/stat"
        seen.clear()
        apart.hint = lambda: 0                    # no hint yet
        apart._host_thread_cpu()
        assert seen == [f"/proc/{os.getpid()}/stat"]

        def closed() -> int:
            raise RuntimeError("ring closed")
        apart.hint = closed                       # its ring is gone: the hint is dropped
        apart._host_thread_cpu()
        assert apart.hint is None and apart.enabled
    finally:
        done.set()
        worker.join()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_a_run_that_starts_without_a_cpu_looks_one_period_later(monkeypatch, namespace):
    """A runner made, run once and closed within PERIOD is never moved (and back)."""
    import time

    allowed = os.sched_getaffinity(0)
    looks: list[str] = []
    monkeypatch.setattr(_placement, "_cpu_of", lambda path: looks.append(path) or 0)
    apart = KeepApart(os.getpid(), namespace)
    try:
        assert apart.enabled and apart.next_look == 0.0
        before = time.monotonic()
        apart.starting()
        assert before + _placement.PERIOD <= apart.next_look <= time.monotonic() + \
            _placement.PERIOD
        apart.check()                      # not yet time: no look, no move
        assert looks == [] and os.sched_getaffinity(0) == allowed
        apart.next_look = 0.0              # PERIOD later: it looks (and moves)
        apart.check()
        assert looks and apart.hold.cpu >= 0
        apart.next_look = 0.0
        apart.starting()                   # holding a CPU: the next run looks when due
        assert apart.next_look == 0.0
        apart.release()
        assert os.sched_getaffinity(0) == allowed and apart.next_look == 0.0
    finally:
        apart.release()
        os.sched_setaffinity(0, allowed)
