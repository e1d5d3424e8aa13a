"""How a ring waits: until the earliest of its deadline and its data, nothing else.

No signal handler and no thread of the package's own in the process (importing it,
waiting on rings, or running a model); a wait without a peer to watch sleeps
through (no periodic wake); close() and interrupt() wake this process's blocked
threads at once and leave the semaphores counting what they counted.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from shm import PeerDiedError, Ring, RingTimeoutError, ShmClosedError, WaitInterrupted
from shm import ring as ring_mod
from shm.settings import ShmSettings

from tests.daemon_rig import REPO
from tests._paths import child_pythonpath

_PROBE = """
import os, threading
def handled():
    # the kernel's view of caught signals (signal.getsignal only knows Python's)
    for line in open("/proc/self/status"):
        if line.startswith("SigCgt:"):
            return int(line.split()[1], 16)
def native_threads():
    # threads the interpreter does not know of (a C library's own)
    return len(os.listdir("/proc/self/task")) - threading.active_count()
"""


def _run(body: str) -> list[str]:
    code = _PROBE + textwrap.dedent(body)
    env = dict(os.environ, PYTHONPATH=child_pythonpath())
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.split()


@pytest.mark.skipif(ring_mod._ringcore is None, reason="the C core's waits")
def test_rings_take_no_signal_and_start_no_thread() -> None:
    out = _run("""
        import numpy
        before = handled(), native_threads()
        from shm import Ring, RingTimeoutError
        r = Ring.create(64, 2)
        for timeout in (0.01, 0.2, None):
            try:
                if timeout is None:
                    r.write(b"x"); r.read(None)
                else:
                    r.acquire_read(timeout)
            except RingTimeoutError:
                pass
        print((handled(), native_threads()) == before)
        r.close(); r.unlink()
    """)
    assert out == ["True"]


@pytest.mark.parametrize("peer_thread", ["1", "0"])
def test_a_runner_installs_no_signal_handler_and_only_the_documented_thread(
        tmp_path, monkeypatch, peer_thread) -> None:
    """Creating and using a runner takes no signal; the one thread it may start is the
    peer-exit watcher that README's settings table names, and its setting turns it off."""
    monkeypatch.setenv("IPU_EMULATOR_RING_PEER_THREAD", peer_thread)
    path = str(tmp_path / "m.popef")
    out = _run(f"""
        import numpy as np
        from tools.generate_simple_popef import write_simple_popef
        write_simple_popef({path!r})
        before = handled(), native_threads(), {{t.name for t in threading.enumerate()}}
        import host_runtime as model_runtime
        runner = model_runtime.ModelRunner(model_runtime.PopefPaths([{path!r}]))
        x = np.ones((1, 4), np.float32)
        out = runner.execute({{"tensor_A": x, "tensor_B": x}})["tensor_C"]
        print(handled() == before[0], native_threads() == before[1], out.shape == (1, 4))
        print(sorted(t.name for t in threading.enumerate()
                     if t.name == "shm-peer-exits" and t.name not in before[2]))
        runner.close()
    """)
    assert out[:3] == ["True", "True", "True"]
    assert out[3:] == (["['shm-peer-exits']"] if peer_thread == "1" else ["[]"])


def _voluntary_switches(tid: int) -> int:
    with open(f"/proc/self/task/{tid}/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches:"):
                return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches")


@pytest.mark.skipif(ring_mod._ringcore is None, reason="the C core's waits")
def test_a_wait_without_a_peer_sleeps_through_to_its_deadline() -> None:
    ring = Ring.create(64, 2)
    try:
        box: dict[str, object] = {}

        def wait() -> None:
            box["tid"] = threading.get_native_id()
            box["before"] = _voluntary_switches(threading.get_native_id())
            t0 = time.monotonic()
            try:
                ring.acquire_read(0.6)
            except RingTimeoutError:
                box["waited"] = time.monotonic() - t0
            box["after"] = _voluntary_switches(threading.get_native_id())

        t = threading.Thread(target=wait)
        t.start()
        t.join(60)
        assert box["waited"] >= 0.6                   # never early
        # one sleep to the deadline (a wait in slices of 50 ms made a dozen and more)
        assert int(box["after"]) - int(box["before"]) <= 4, box   # type: ignore[call-overload]
    finally:
        ring.close()
        ring.unlink()


def _in_thread(fn):   # type: ignore[no-untyped-def]
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:   # noqa: BLE001 - the test looks at it
            box["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def test_interrupt_wakes_blocked_threads_until_resume_and_keeps_the_counts() -> None:
    producer = Ring.create(64, 2)
    consumer = Ring.attach(producer.name)
    try:
        producer.write(b"a")
        producer.write(b"b")                            # full: a writer blocks
        reader_ring = Ring.create(64, 2)
        reader_end = Ring.attach(reader_ring.name)
        reader, rbox = _in_thread(lambda: reader_end.read())        # empty: blocks
        writer, wbox = _in_thread(lambda: producer.write(b"c"))
        before = (producer.counters()["sem_free"], producer.counters()["sem_full"])
        producer.interrupt()
        reader_end.interrupt()
        writer.join(30)
        reader.join(30)
        assert isinstance(wbox.get("error"), WaitInterrupted), wbox
        assert isinstance(rbox.get("error"), WaitInterrupted), rbox
        assert "interrupted (Ring.interrupt)" in str(wbox["error"])
        with pytest.raises(WaitInterrupted):
            reader_end.read(timeout=5)                  # at once, until resume()
        assert (producer.counters()["sem_free"], producer.counters()["sem_full"]) == before
        producer.resume()
        reader_end.resume()
        with pytest.raises(RingTimeoutError):
            producer.write(b"c", timeout=0.01)          # blocks again: still full
        assert consumer.read() == (b"a", 0)
        producer.write(b"c")
        assert [consumer.read()[0] for _ in range(2)] == [b"b", b"c"]
        reader_ring.write(b"z")
        assert reader_end.read() == (b"z", 0)           # no stray token either way
        with pytest.raises(RingTimeoutError):
            reader_end.read(timeout=0)
    finally:
        for r in (consumer, producer, reader_end, reader_ring):
            r.close()
        producer.unlink()
        reader_ring.unlink()


def test_interrupt_all_reaches_every_ring_and_rings_made_later() -> None:
    a = Ring.create(64, 1)
    try:
        t, box = _in_thread(lambda: a.read())
        ring_mod.interrupt_all()
        try:
            t.join(30)
            assert isinstance(box.get("error"), WaitInterrupted), box
            b = Ring.create(64, 1)
            try:
                with pytest.raises(WaitInterrupted):
                    b.read()
            finally:
                b.close()
                b.unlink()
        finally:
            ring_mod.resume_all()
        a.write(b"1")
        assert a.read() == (b"1", 0)
    finally:
        a.close()
        a.unlink()


def test_close_wakes_a_wait_without_deadline_at_once() -> None:
    ring = Ring.create(64, 1)
    end = Ring.attach(ring.name)
    try:
        t, box = _in_thread(lambda: end.read())
        end.close()
        t.join(30)
        assert not t.is_alive() and isinstance(box.get("error"), ShmClosedError), box
        assert ring.counters()["sem_full"] == 0           # the wake's token was taken back
    finally:
        end.close()
        ring.close()
        ring.unlink()


@pytest.mark.parametrize("peer_thread", [True, False])
def test_a_peer_that_dies_ends_a_wait_without_deadline(peer_thread) -> None:
    """Woken by the peer-exit thread (no periodic wake), or with it off by the periodic
    check: either way PeerDiedError naming the pid, never a hang."""
    settings = dataclasses.replace(ShmSettings.current(), ring_peer_thread=peer_thread)
    peer = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                            stdin=subprocess.PIPE)
    ring = Ring.create(64, 1)
    end = Ring.attach(ring.name, settings=settings)
    try:
        end.set_peer(peer.pid)
        assert (end.c_handle() is None or
                end.c_handle().check_s == (0.0 if peer_thread else ring_mod.PEER_CHECK))
        t, box = _in_thread(lambda: end.read())
        peer.kill()
        peer.wait()
        t.join(30)
        assert not t.is_alive()
        assert isinstance(box.get("error"), PeerDiedError), box
        assert box["error"].pid == peer.pid and f"peer process {peer.pid}" in str(box["error"])
    finally:
        if peer.poll() is None:
            peer.kill()
            peer.wait()
        end.close()
        ring.close()
        ring.unlink()
