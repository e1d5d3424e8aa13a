"""host_runtime.session._attach: the device attaches in a thread while the session makes its
rings; errors of either side are raised, and nothing attached outlives a failure."""

from __future__ import annotations

import contextvars
import gc
import threading

import pytest

from host_runtime.session._attach import attach_meanwhile


class FakeDevice:
    def __init__(self) -> None:
        self.closed = False
        self.thread = threading.current_thread()

    def close(self) -> None:
        self.closed = True


def test_the_device_is_attached_in_another_thread_while_the_work_runs_here():
    attached = threading.Event()
    seen: list[str] = []

    def attach() -> FakeDevice:
        dev = FakeDevice()
        attached.set()
        return dev

    def work() -> None:
        # the attach runs meanwhile: the work can see it finish
        assert attached.wait(10)
        seen.append(threading.current_thread().name)

    dev = attach_meanwhile(attach, work)   # type: ignore[arg-type]
    assert isinstance(dev, FakeDevice) and not dev.closed
    assert dev.thread is not threading.current_thread()
    assert seen == [threading.current_thread().name]


def test_an_attach_error_is_raised_once_the_work_is_done():
    done = []

    def attach() -> FakeDevice:
        raise ValueError("no device: busy")

    with pytest.raises(ValueError, match="no device: busy"):
        attach_meanwhile(attach, lambda: done.append(1))   # type: ignore[arg-type]
    assert done == [1]


def test_a_work_error_closes_the_device_before_it_is_raised():
    made: list[FakeDevice] = []
    release = threading.Event()

    def attach() -> FakeDevice:
        release.wait(10)   # still attaching when the work fails
        made.append(FakeDevice())
        return made[-1]

    def work() -> None:
        release.set()
        raise OSError("out of room for the rings")

    with pytest.raises(OSError, match="out of room"):
        attach_meanwhile(attach, work)   # type: ignore[arg-type]
    assert len(made) == 1 and made[0].closed   # closed by the time the error is raised


def test_the_work_error_wins_when_both_fail():
    def attach() -> FakeDevice:
        raise ValueError("attach failed")

    def work() -> None:
        raise OSError("rings failed")

    with pytest.raises(OSError, match="rings failed"):
        attach_meanwhile(attach, work)   # type: ignore[arg-type]


def test_the_attach_runs_in_the_callers_context():
    var: contextvars.ContextVar[str] = contextvars.ContextVar("who", default="nobody")
    var.set("the runner being made")
    seen: list[str] = []

    def attach() -> FakeDevice:
        seen.append(var.get())
        return FakeDevice()

    attach_meanwhile(attach, lambda: None)   # type: ignore[arg-type]
    assert seen == ["the runner being made"]


def test_a_failed_attach_leaves_no_reference_cycle():
    def attach() -> FakeDevice:
        raise ValueError("no device")

    def fail() -> None:
        try:
            attach_meanwhile(attach, lambda: None)   # type: ignore[arg-type]
        except ValueError:
            pass   # dropped here: only a cycle would keep it

    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        fail()
        found = gc.collect()
        kinds = sorted({type(o).__name__ for o in gc.garbage})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert found == 0, kinds
