"""host_runtime.session._attach: the session makes its rings while the attach waits on
another process (``waiting_elsewhere``: its request sent), in the caller's thread and
context; errors of either side are raised, and nothing attached outlives a failure."""

from __future__ import annotations

import contextvars
import gc
import threading

import pytest

from host_runtime.devices import waiting_elsewhere
from host_runtime.session._attach import attach_meanwhile


class FakeDevice:
    def __init__(self) -> None:
        self.closed = False
        self.thread = threading.current_thread()

    def close(self) -> None:
        self.closed = True


def test_the_work_runs_while_the_attach_waits_on_another_process():
    seen: list[str] = []

    def attach() -> FakeDevice:
        seen.append("request sent")
        waiting_elsewhere()   # as the daemon client does once its request is sent
        waiting_elsewhere()   # (run once)
        seen.append("answered")
        return FakeDevice()

    dev = attach_meanwhile(attach, lambda: seen.append("work"))   # type: ignore[arg-type]
    assert isinstance(dev, FakeDevice) and not dev.closed
    assert dev.thread is threading.current_thread()   # one thread
    assert seen == ["request sent", "work", "answered"]
    waiting_elsewhere()   # outside attach_meanwhile: nothing runs
    assert seen == ["request sent", "work", "answered"]


def test_the_work_waits_for_an_attach_that_never_waits_elsewhere():
    """Nothing to overlap (say, an error before any request): the work starts once the
    attach is over, rather than taking the interpreter while the attach has sent nothing."""
    seen: list[str] = []

    def attach() -> FakeDevice:
        seen.append("attach")
        return FakeDevice()

    attach_meanwhile(attach, lambda: seen.append("work"))   # type: ignore[arg-type]
    assert seen == ["attach", "work"]


def test_the_work_starts_once_the_attach_has_sent_its_request_to_the_daemon(tmp_path):
    """The real client against a daemon stand-in that the work itself plays: when the
    work starts, the attach request is already in the connection (read without waiting);
    the answer comes only from the work."""
    import socket as socket_mod

    from host_runtime.devices._daemon_client import DaemonClient
    from ipu_emulator.daemon import socket_protocol as wire

    path = str(tmp_path / "d.sock")
    server = socket_mod.socket(socket_mod.AF_UNIX, socket_mod.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    server.settimeout(10)
    accepted: list[socket_mod.socket] = []
    seen: list[str] = []

    def work() -> None:
        conn, _ = server.accept()   # the attach connected before the work started
        accepted.append(conn)
        sent = conn.recv(65536, socket_mod.MSG_DONTWAIT)   # BlockingIOError: nothing sent
        seen.append(wire.decode(sent)["op"])
        conn.sendall(wire.encode({"ok": False, "error": "failed", "message": "test"}))

    client = DaemonClient(path)
    try:
        with pytest.raises(Exception, match="could not attach ipus \\[0\\]: test"):
            attach_meanwhile(lambda: client.try_attach(0, (0,)), work)   # type: ignore
    finally:
        for c in accepted:
            c.close()
        server.close()
    assert seen == ["attach"]


def test_an_attach_error_is_raised_once_the_work_is_done():
    done = []

    def attach() -> FakeDevice:
        waiting_elsewhere()
        raise ValueError("no device: busy")

    with pytest.raises(ValueError, match="no device: busy"):
        attach_meanwhile(attach, lambda: done.append(1))   # type: ignore[arg-type]
    assert done == [1]


def test_a_work_error_closes_the_device_before_it_is_raised():
    made: list[FakeDevice] = []
    seen: list[str] = []

    def attach() -> FakeDevice:
        waiting_elsewhere()   # the work fails here: the attach goes on to its end
        seen.append("attach goes on")
        made.append(FakeDevice())
        return made[-1]

    def work() -> None:
        raise OSError("out of room for the rings")

    with pytest.raises(OSError, match="out of room"):
        attach_meanwhile(attach, work)   # type: ignore[arg-type]
    assert seen == ["attach goes on"]
    assert len(made) == 1 and made[0].closed   # closed by the time the error is raised


def test_an_interrupt_in_the_work_closes_the_device_and_is_raised():
    made: list[FakeDevice] = []

    def attach() -> FakeDevice:
        waiting_elsewhere()
        made.append(FakeDevice())
        return made[-1]

    def work() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        attach_meanwhile(attach, work)   # type: ignore[arg-type]
    assert made[0].closed


def test_the_work_error_wins_when_both_fail():
    def attach() -> FakeDevice:
        waiting_elsewhere()
        raise ValueError("attach failed")

    def work() -> None:
        raise OSError("rings failed")

    with pytest.raises(OSError, match="rings failed"):
        attach_meanwhile(attach, work)   # type: ignore[arg-type]


def test_an_attach_that_fails_before_waiting_has_no_work_done():
    seen: list[str] = []

    def attach() -> FakeDevice:
        raise ValueError("no such device")

    with pytest.raises(ValueError, match="no such device"):
        attach_meanwhile(attach, lambda: seen.append("work"))   # type: ignore[arg-type]
    assert seen == []   # no rings made for a device it does not get


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
