"""The event threads device links read their rings on (host_runtime.devices._event_threads):
a thread whose link ended serves the next one, which then waits for no thread start."""

from __future__ import annotations

import os
import threading
import types

import pytest

from host_runtime.devices import _event_threads as event_threads


def _thread(ident: int | None) -> threading.Thread:
    return next(t for t in threading.enumerate() if t.ident == ident)


def test_a_service_runs_its_function_on_a_named_thread_and_is_joined() -> None:
    seen: list[tuple[str, bool, int]] = []
    go = threading.Event()

    def fn(a: int, b: int) -> None:
        go.wait(10)
        seen.append((threading.current_thread().name, service.is_current(), a + b))

    service = event_threads.serve(fn, (2, 3), "ipu-events-test")
    assert service.is_alive() and not service.is_current()
    assert not service.join(0.0)
    go.set()
    assert service.join(10)
    assert not service.is_alive()
    assert seen == [("ipu-events-test", True, 5)]


def test_a_thread_whose_service_ended_serves_the_next_and_is_named_idle_meanwhile() -> None:
    first = event_threads.serve(lambda: None, (), "ipu-events-a")
    assert first.join(10)
    thread = _thread(first.ident)   # waiting for the next link once the service ended
    assert thread.name == event_threads.IDLE_NAME and thread.is_alive()
    count = threading.active_count()
    second = event_threads.serve(lambda: None, (), "ipu-events-b")
    assert second.join(10)
    assert second.ident == first.ident          # the same thread
    assert threading.active_count() == count    # and no new one


def test_a_new_thread_holds_nothing_of_its_first_link_once_idle() -> None:
    """A thread started for a link keeps nothing of it while idle or serving later links
    (not even as the Thread's arguments, kept until its target returns): what the link
    handed it (its event ring) is freed with the collector off."""
    import gc
    import weakref

    class Ring:   # stands for the event ring a link hands its thread
        pass

    with event_threads._lock:   # a new thread, not an idle one of another test
        idle, event_threads._idle[:] = list(event_threads._idle), []
    gc.disable()
    try:
        ring = Ring()
        gone = weakref.ref(ring)
        service = event_threads.serve(lambda r: None, (ring,), "ipu-events-first")
        del ring
        assert service.join(10)
        thread = _thread(service.ident)
        assert thread.name == event_threads.IDLE_NAME
        assert gone() is None
    finally:
        gc.enable()
        with event_threads._lock:
            event_threads._idle.extend(idle)


def test_an_idle_thread_ends_after_its_idle_time(monkeypatch) -> None:
    monkeypatch.setattr(event_threads, "IDLE_SECONDS", 0.05)
    with event_threads._lock:   # (threads idle from other tests keep their own wait)
        event_threads._idle.clear()
    service = event_threads.serve(lambda: None, (), "ipu-events-short")
    assert service.join(10)
    thread = _thread(service.ident)
    thread.join(10)
    assert not thread.is_alive()
    assert thread not in threading.enumerate()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_has_no_idle_threads_of_its_parent() -> None:
    service = event_threads.serve(lambda: None, (), "ipu-events-parent")
    assert service.join(10)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:   # the child: its serve starts a thread of its own, which runs
        code = 1
        try:
            ok = not event_threads._idle
            child = event_threads.serve(lambda: None, (), "ipu-events-child")
            code = 0 if ok and child.join(10) else 1
        finally:
            os.write(w, bytes([code]))
            os._exit(code)
    os.close(w)
    try:
        assert os.read(r, 1) == b"\x00"
    finally:
        os.close(r)
        os.waitpid(pid, 0)


class _Link:
    """What a link's event thread reads of its link (host_runtime.devices._link)."""

    _closing = _quitting = False
    _final_seq = None
    _primary = types.SimpleNamespace(pid=os.getpid())   # a loopback IPU's: in slices
    description = "a test link"

    def __init__(self) -> None:
        self.got: list[object] = []
        self.seen = threading.Event()

    def _dead_process(self) -> None:
        return None

    def _dispatch(self, msg: object) -> None:
        self.got.append(msg)
        self.seen.set()


def test_a_links_thread_reads_nothing_once_the_link_died() -> None:
    """Collected in a cycle, a device's objects are finalized in any order: its daemon
    attachment may let the IPUs go (the daemon then resets them and reads the answer on
    the same event ring) while the link's thread still waits there. The link's death
    ends that wait at once: the thread takes nothing more off the ring."""
    import functools
    import weakref

    from host_runtime.devices import _link
    from ipu_emulator import ipu_protocol
    from ipu_emulator.ipu_protocol import Message, Op
    from shm import Ring

    ring = Ring.create(4096, 4)
    reader = Ring.attach(ring.name)
    try:
        link = _Link()
        gone = functools.partial(_link._link_gone, reader, os.getpid())
        service = event_threads.serve(_link._serve, (weakref.ref(link, gone), reader),
                                      "ipu-events-test")
        ipu_protocol.send(ring, Message(Op.DONE, seq=1), timeout=5)
        assert link.seen.wait(10)                 # read and given to the live link
        assert [m.seq for m in link.got] == [1]
        del link                                  # the link dies; then the daemon's answer
        ipu_protocol.send(ring, Message(Op.DONE, seq=-2), timeout=5)
        assert service.join(10)
        assert ipu_protocol.receive(reader, timeout=0).seq == -2   # still there, unread
    finally:
        reader.close()
        ring.close()
        ring.unlink()
