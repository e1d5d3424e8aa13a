"""The IPU process keeps off its host's CPU (ipu_emulator.ipu._placement)."""

from __future__ import annotations

import os

import pytest

from ipu_emulator.ipu import _placement
from ipu_emulator.ipu._placement import KeepApart, _cpu_of


def test_cpu_field_is_read_after_the_command_name(tmp_path):
    stat = tmp_path / "stat"
    fields = ["S"] + [str(i) for i in range(4, 39)] + ["7"] + ["0"] * 10
    stat.write_text("1234 (a) b (c) " + " ".join(fields) + "\n")
    assert _cpu_of(str(stat)) == 7
    assert _cpu_of("/proc/thread-self/stat") in os.sched_getaffinity(0)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_moves_off_the_hosts_cpu_and_gives_the_affinity_back(monkeypatch):
    allowed = os.sched_getaffinity(0)
    monkeypatch.setattr(_placement, "PERIOD", 0.0)
    # Where the host's thread and this one last ran, as /proc would tell: set here, since
    # the scheduler may move a thread between any two reads of the real files.
    host, other = min(allowed), max(allowed)
    where = {"host": host, "mine": host}
    monkeypatch.setattr(_placement, "_cpu_of", lambda path: where[
        "mine" if path == "/proc/thread-self/stat" else "host"])
    apart = KeepApart(os.getpid())
    try:
        assert apart.enabled
        apart.check()                 # on the host's CPU: moves off it
        assert os.sched_getaffinity(0) == allowed - {host}
        where["mine"] = other
        apart.check()                 # apart: the whole affinity back
        assert os.sched_getaffinity(0) == allowed
        where["mine"] = host
        apart.check()
        assert os.sched_getaffinity(0) == allowed - {host}
        apart.release()
        assert os.sched_getaffinity(0) == allowed
    finally:
        os.sched_setaffinity(0, allowed)


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
