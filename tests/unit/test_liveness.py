"""shm.liveness: one way to watch processes exit (pidfds), and the ring's peer check on it."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from shm import ExitWatch, PeerWatch

_SLEEPER = [sys.executable, "-c", "import sys; sys.stdin.read()"]


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen(_SLEEPER, stdin=subprocess.PIPE)


def test_exit_watch_names_the_process_that_exited() -> None:
    a, b = _sleeper(), _sleeper()
    try:
        w = ExitWatch([a.pid, b.pid, os.getpid()])
        assert w.exact and sorted(w.pids) == sorted([a.pid, b.pid, os.getpid()])
        assert w.dead_pid() is None
        assert w.wait(0.01) is None
        b.kill()
        assert w.wait(10) == b.pid          # a zombie (not reaped) counts as exited
        b.wait()
        assert w.dead_pid() == b.pid        # and so does a reaped one: the pidfd stays ready
        w.close()
        assert w.pids == [] and w.dead_pid() is None
    finally:
        for p in (a, b):
            p.kill()
            p.wait()


def test_exit_watch_wakes_a_blocked_waiter() -> None:
    p = _sleeper()
    w = ExitWatch([p.pid])
    got: list[int | None] = []
    t = threading.Thread(target=lambda: got.append(w.wait(None)))
    t.start()
    assert p.stdin is not None
    p.stdin.close()                          # the child's read returns: it exits
    t.join(10)
    p.wait()
    assert not t.is_alive() and got == [p.pid]


def test_exit_watch_refuses_a_bad_pid() -> None:
    with pytest.raises(ValueError, match=r"pid must be a positive int, got 0"):
        ExitWatch([0])
    with pytest.raises(ValueError, match=r"got True"):
        ExitWatch([True])


def test_exit_watch_of_a_reaped_pid_falls_back_to_pid_checks() -> None:
    p = _sleeper()
    p.kill()
    p.wait()                                 # gone: pidfd_open fails, the pid is checked instead
    w = ExitWatch([p.pid])
    assert not w.exact
    assert w.dead_pid() == p.pid


def test_peer_watch_reports_zombie_then_exit() -> None:
    p = _sleeper()
    try:
        pw = PeerWatch(p.pid)
        assert pw.alive() and pw.dead_reason() is None
        p.kill()
        ExitWatch([p.pid]).wait(10)
        assert pw.dead_reason() == "exited (zombie, not yet reaped)"
        p.wait()
        assert pw.dead_reason() == "exited (zombie, not yet reaped)"   # stays as first seen
    finally:
        p.kill()
        p.wait()
    gone = PeerWatch(p.pid)
    assert gone.dead_reason() == "does not exist"


def test_the_exit_notifier_thread_outlives_a_brief_idle_then_ends(monkeypatch) -> None:
    """A subscriber right after the last one cancelled finds the thread still running
    (no new thread per runner); idle for ``IDLE_LINGER`` it ends; a later exit is
    still reported by a new one."""
    from shm import liveness

    def notifier_threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name == "shm-peer-exits"}

    monkeypatch.setattr(liveness, "IDLE_LINGER", 30.0)   # no stall of this test outlasts it
    child = _sleeper()
    try:
        cancel = liveness.notify_on_exit(child.pid, lambda: None)
        assert cancel is not None
        first = notifier_threads()
        assert first
        cancel()
        exited = threading.Event()
        cancel = liveness.notify_on_exit(child.pid, exited.set)
        assert cancel is not None and notifier_threads() == first   # the same thread
        monkeypatch.setattr(liveness, "IDLE_LINGER", 0.01)
        cancel()   # wakes it: idle now, it lingers 10 ms and ends
        for t in first:
            t.join(10.0)
        assert not any(t.is_alive() for t in first)
        assert liveness.notify_on_exit(child.pid, exited.set) is not None
        child.stdin.close()   # type: ignore[union-attr]
        child.wait(10)
        assert exited.wait(10)   # reported by the new thread
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_every_subscriber_of_one_pid_hears_its_exit_and_only_a_new_pid_wakes_the_thread(
        monkeypatch) -> None:
    """A ring per stream watches the same IPU process: the notifier polls its pidfd once,
    is woken only to add it (not for each further subscriber), and calls them all."""
    from shm import liveness

    wakes: list[int] = []
    real = liveness._ExitNotifier._changed

    def counting(self) -> None:
        wakes.append(1)
        real(self)
    monkeypatch.setattr(liveness._ExitNotifier, "_changed", counting)
    child = _sleeper()
    heard: list[int] = []
    lock = threading.Lock()
    all_heard = threading.Event()

    def hear(k: int) -> None:
        with lock:
            heard.append(k)
            if len(heard) == 4:
                all_heard.set()
    try:
        cancels = [liveness.notify_on_exit(child.pid, lambda k=k: hear(k)) for k in range(5)]
        assert None not in cancels
        assert len(wakes) == 1   # the new pidfd only
        cancels[2]()             # one cancelled: the others still hear the exit
        assert len(wakes) == 1
        child.stdin.close()   # type: ignore[union-attr]
        child.wait(10)
        assert all_heard.wait(10)
        assert sorted(heard) == [0, 1, 3, 4]
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_a_subscriber_right_after_the_last_one_went_takes_its_pidfd_without_a_wake(
        monkeypatch) -> None:
    """A runner closed and the next made on the same IPU process (twice per runner):
    the pidfd stays polled for ``IDLE_LINGER`` after its last subscriber went, and the
    next subscriber takes it with no pidfd opened and no wake-up of the thread; the
    process's exit still reaches it, and a pidfd left with no subscriber goes."""
    from shm import liveness

    wakes: list[int] = []
    opened: list[int] = []
    real_changed, real_open = liveness._ExitNotifier._changed, os.pidfd_open

    def counting(self) -> None:
        wakes.append(1)
        real_changed(self)

    def opening(pid: int, *args: int) -> int:
        opened.append(pid)
        return real_open(pid, *args)
    monkeypatch.setattr(liveness._ExitNotifier, "_changed", counting)
    monkeypatch.setattr(liveness.os, "pidfd_open", opening)
    monkeypatch.setattr(liveness, "IDLE_LINGER", 30.0)   # no stall of this test outlasts it
    child, other = _sleeper(), _sleeper()
    try:
        cancel = liveness.notify_on_exit(child.pid, lambda: None)
        assert cancel is not None and opened == [child.pid] and len(wakes) == 1
        cancel()   # lingers: the thread learns of it (a wake-up, unless it is awake)
        before = len(wakes)
        exited = threading.Event()
        for _ in range(3):   # three runners in turn: no pidfd opened, no wake-up to
            cancel = liveness.notify_on_exit(child.pid, exited.set)   # subscribe (and
            assert cancel is not None    # one to cancel only if the thread's timeout was
            cancel()                     # not set meanwhile): two per runner before
        assert opened == [child.pid] and len(wakes) - before <= 3
        cancel = liveness.notify_on_exit(child.pid, exited.set)
        child.stdin.close()   # type: ignore[union-attr]
        child.wait(10)
        assert exited.wait(10)   # heard through the pidfd it took over
        # a pidfd whose linger is over is closed by the thread
        notifier = liveness._notifier
        assert notifier is not None
        monkeypatch.setattr(liveness, "IDLE_LINGER", 0.01)
        cancel_other = liveness.notify_on_exit(other.pid, lambda: None)
        assert cancel_other is not None
        cancel_other()
        # then, nothing left to poll, the thread ends
        for t in [t for t in threading.enumerate() if t.name == "shm-peer-exits"]:
            t.join(10.0)
            assert not t.is_alive()
        assert not notifier._fds and not notifier._idle
    finally:
        for p in (child, other):
            if p.poll() is None:
                p.kill()
                p.wait()
