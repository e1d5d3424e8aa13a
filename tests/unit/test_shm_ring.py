"""Unit tests of shm.Ring within one process (threads stand in for the peer)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import shm.ring as ring_module
from tests._helpers import finish
from shm.cleanup import list_objects
from shm import (PeerDiedError, Ring, RingInvalidatedError, RingTimeoutError, ShmClosedError,
                 ShmError, WouldBlock)


@pytest.fixture(params=["c", "python", "packed"])
def pair(request, monkeypatch):
    """A producer end and a consumer end, through the C core or the pure-Python path;
    "packed": the second ring of a packed segment (``Ring.create_packed``, C core), its
    neighbours in use alongside."""
    if request.param == "python":
        monkeypatch.setattr(ring_module, "_ringcore", None)
    elif ring_module._ringcore is None:
        pytest.skip("shm._ringcore is not built (IPU_EMULATOR_RING_C=0)")
    if request.param == "packed":
        first, producer, last = Ring.create_packed([(16, 2, False), (64, 4, False),
                                                    (64, 4, False)])
        first.write(b"before", 1)
        last.write(b"after", 2)
        neighbours = [first, last]
    else:
        producer, neighbours = Ring.create(64, 4), []
    consumer = Ring.attach(producer.name)
    yield producer, consumer
    consumer.close()
    for ring in neighbours:   # untouched by whatever the test did to its neighbour
        assert ring.read(0) == ((b"before", 1) if ring is neighbours[0] else (b"after", 2))
        ring.close()
    producer.close()
    producer.unlink()


def _in_thread(fn):
    """Run fn in a thread; return (thread, box) where box gets its result or exception."""
    box: dict = {}
    started = threading.Event()

    def run():
        started.set()
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    started.wait()
    return thread, box


def test_messages_arrive_in_order_with_tags_across_wraparound(pair) -> None:
    producer, consumer = pair
    for k in range(4 * 5 + 3):
        payload = bytes([k % 256]) * (k % 65)
        producer.write(payload, tag=k - 7)
        data, tag = consumer.read()
        assert (data, tag) == (payload, k - 7)
    assert consumer.readable() == 0 and producer.writable() == 4


def test_zero_copy_acquire_publish_release_with_numpy(pair) -> None:
    producer, consumer = pair
    slot = producer.acquire_write()
    assert len(slot) == 64
    again = producer.acquire_write()  # the held slot is returned again
    again[:4] = b"held"
    assert bytes(slot[:4]) == b"held"
    np.copyto(np.frombuffer(slot, np.float32), np.arange(16, dtype=np.float32))
    producer.publish(64, tag=3)
    view, tag = consumer.acquire_read()
    assert tag == 3
    np.testing.assert_array_equal(np.frombuffer(view, np.float32), np.arange(16))
    consumer.release()
    producer.write(np.arange(3, dtype=np.int16))
    data, _ = consumer.read()
    assert np.frombuffer(data, np.int16).tolist() == [0, 1, 2]


def test_several_reads_outstanding_release_oldest_first(pair) -> None:
    producer, consumer = pair
    for k in range(4):
        producer.write(bytes([k]) * 8, tag=k)
    with pytest.raises(WouldBlock, match=r"no free slot \(4/4 slots in use, 4 readable\)"):
        producer.try_acquire_write()
    views = [consumer.acquire_read() for _ in range(3)]
    assert [(bytes(v), t) for v, t in views] == [(bytes([k]) * 8, k) for k in range(3)]
    consumer.release()
    slot = producer.try_acquire_write()  # the released slot is the oldest: slot 0
    slot[:1] = b"\xff"
    producer.publish(1, tag=9)
    assert bytes(views[1][0]) == bytes([1]) * 8  # still untouched
    consumer.release()
    consumer.release()
    assert consumer.read() == (bytes([3]) * 8, 3)
    assert consumer.read() == (b"\xff", 9)
    with pytest.raises(WouldBlock, match="no published slot"):
        consumer.try_acquire_read()


def test_timeouts_name_the_ring_and_what_was_awaited(pair) -> None:
    producer, consumer = pair
    with pytest.raises(RingTimeoutError, match=rf"ring {producer.name}: no published slot "
                                               r"within 0.02 s") as info:
        consumer.acquire_read(timeout=0.02)
    assert isinstance(info.value, TimeoutError)
    for _ in range(4):
        producer.write(b"x", timeout=0)
    with pytest.raises(RingTimeoutError, match=r"no free slot within 0.07 s \(4/4 slots in use"):
        producer.acquire_write(timeout=0.07)
    with pytest.raises(RingTimeoutError):
        producer.write(b"y", timeout=0)


def test_misuse_errors(pair) -> None:
    producer, consumer = pair
    with pytest.raises(ShmError, match=r"publish\(\) without a slot from acquire_write"):
        producer.publish(1)
    with pytest.raises(ShmError, match=r"release\(\) without a slot from acquire_read"):
        consumer.release()
    producer.acquire_write()
    with pytest.raises(ValueError, match="publish of 65 bytes; expected 0..64"):
        producer.publish(65)
    with pytest.raises(ValueError, match="message of 65 bytes does not fit a slot of 64 bytes"):
        producer.write(b"z" * 65)
    with pytest.raises(ValueError, match="num_slots must be an int in 1.."):
        Ring.create(8, 0)
    with pytest.raises(ValueError, match="slot_size must be a positive int"):
        Ring.create(0, 2)


def test_invalidate_wakes_a_blocked_reader_and_a_blocked_writer(pair) -> None:
    producer, consumer = pair
    reader, rbox = _in_thread(lambda: consumer.acquire_read())  # blocks: ring empty
    for _ in range(4):
        producer.write(b"q")
    writer_side = Ring.attach(producer.name)
    try:
        writer, wbox = _in_thread(lambda: writer_side.acquire_write())  # blocks: ring full
        consumer.invalidate()  # the reader's own ring object: it is blocked in another thread
        reader.join(10)
        writer.join(10)
        assert not reader.is_alive() and not writer.is_alive()
        # The reader may legitimately have taken the first message before the
        # invalidation; a second wait must then fail.
        if "result" in rbox:
            with pytest.raises(RingInvalidatedError):
                consumer.acquire_read()
        else:
            assert isinstance(rbox["error"], RingInvalidatedError)
        assert isinstance(wbox["error"], RingInvalidatedError)
        assert f"invalidated by process {os.getpid()}; reset() it to reuse" in str(wbox["error"])
        assert not producer.is_valid() and not writer_side.is_valid()
        with pytest.raises(RingInvalidatedError):
            consumer.try_acquire_read()
        with pytest.raises(RingInvalidatedError):
            producer.write(b"r", timeout=0)
    finally:
        writer_side.close()


def test_reset_empties_and_revalidates(pair) -> None:
    producer, consumer = pair
    producer.write(b"a")
    producer.write(b"b")
    consumer.acquire_read()
    producer.acquire_write()
    producer.invalidate()
    producer.reset()
    assert producer.is_valid() and consumer.is_valid()
    counters = consumer.counters()
    assert counters["generation"] == 1
    assert {k: counters[k] for k in ("published", "held", "acquired", "released",
                                     "sem_full", "sem_free")} == {
        "published": 0, "held": 0, "acquired": 0, "released": 0, "sem_full": 0, "sem_free": 4}
    for k in range(6):
        producer.write(bytes([k]), tag=k)
        assert consumer.read() == (bytes([k]), k)


def test_state_dump_is_readable(pair) -> None:
    producer, consumer = pair
    producer.write(b"abc", tag=1)
    producer.write(b"def", tag=2)
    consumer.acquire_read()
    consumer.set_peer(os.getpid())
    text = consumer.state()
    pid = os.getpid()
    assert text.splitlines() == [
        f"ring {producer.name}: 4 slots x 64 B (stride 128), VALID, generation 0, "
        f"creator pid {pid}",
        f"  producer pid {pid}: published 2, holding a slot: no",
        f"  consumer pid {pid}: acquired 1, released 0",
        "  readable 1, in use 2/4; semaphores: full=1 free=2",
        f"  this process {pid}: owner=False watching peer {pid}",
    ]
    consumer.invalidate()
    assert f"INVALIDATED by pid {pid}" in producer.state()
    consumer.close()
    assert consumer.state() == f"ring {producer.name}: closed in this process"


def test_close_wakes_own_blocked_thread_and_is_idempotent(pair) -> None:
    producer, consumer = pair
    reader, box = _in_thread(lambda: consumer.acquire_read())
    consumer.close()
    reader.join(10)
    assert not reader.is_alive()
    assert isinstance(box["error"], ShmClosedError), box
    consumer.close()
    for call in (consumer.try_acquire_read, consumer.release, consumer.readable,
                 lambda: consumer.read(timeout=0)):
        with pytest.raises(ShmClosedError, match="is closed in this process"):
            call()
    producer.write(b"still fine")  # the other end is unaffected


def test_many_blocked_waiters_wake_on_data_and_on_close(pair) -> None:
    """Several threads blocked at once, in both directions, on several rings."""
    producer, consumer = pair
    others = [Ring.create(16, 1) for _ in range(3)]
    try:
        # fill the one-slot rings so that writers block too
        ends = [(ring, Ring.attach(ring.name)) for ring in others]
        for ring, _ in ends:
            ring.write(b"full")
        readers = [_in_thread(lambda: consumer.read()) for _ in range(1)]
        writers = [_in_thread(lambda ring=ring: ring.write(b"more")) for ring, _ in ends]
        readers += [_in_thread(lambda: ends[0][1].acquire_read())]  # has data: returns
        producer.write(b"wake", tag=3)
        readers[0][0].join(10)
        assert readers[0][1] == {"result": (b"wake", 3)}
        readers[1][0].join(10)
        assert bytes(readers[1][1]["result"][0]) == b"full"
        ends[0][1].release()                     # frees the first writer's slot
        writers[0][0].join(10)
        assert writers[0][1] == {"result": None}
        for ring, _ in ends[1:]:
            ring.close()                         # wakes the other writers
        for thread, box in writers[1:]:
            thread.join(10)
            assert not thread.is_alive() and isinstance(box["error"], ShmClosedError), box
    finally:
        for ring in others:
            ring.close()
            ring.unlink()
        for _, end in ends:
            end.close()


def test_slot_view_outlives_close(pair) -> None:
    producer, consumer = pair
    producer.write(b"keep me")
    view, _ = consumer.acquire_read()
    arr = np.frombuffer(view, np.uint8)
    consumer.close()
    producer.close()
    assert bytes(view) == b"keep me" and arr.tobytes() == b"keep me"


def test_peer_that_exited_fails_waits_with_its_pid(pair) -> None:
    producer, consumer = pair
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    consumer.set_peer(child.pid)
    child.wait()
    with pytest.raises(PeerDiedError, match=rf"peer process {child.pid} exited while this "
                                            r"process waited for published slot") as info:
        consumer.acquire_read()
    assert info.value.pid == child.pid
    # Data published before the death is still delivered.
    producer.write(b"last words")
    assert consumer.read(timeout=1) == (b"last words", 0)


def test_zombie_peer_counts_as_dead(pair) -> None:
    producer, consumer = pair
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        producer.set_peer(child.pid)
        for _ in range(4):
            producer.write(b"f")
        with pytest.raises(PeerDiedError, match=rf"peer process {child.pid} exited"):
            producer.acquire_write(timeout=60)
    finally:
        child.wait()


def test_caller_releasing_handed_out_views_does_not_break_the_ring(pair) -> None:
    producer, consumer = pair
    for k in range(4 * 3):
        slot = producer.acquire_write()
        slot[:8] = k.to_bytes(8, "little")
        slot.release()
        producer.publish(64 if k % 2 else 8, tag=k)
        view, tag = consumer.acquire_read()
        assert (int.from_bytes(view[:8], "little"), tag, len(view)) == (k, k, 64 if k % 2 else 8)
        view.release()
        consumer.release()


def test_read_refuses_while_acquired_slots_are_unreleased(pair) -> None:
    producer, consumer = pair
    producer.write(b"one")
    producer.write(b"two")
    view, _ = consumer.acquire_read()
    with pytest.raises(ShmError, match=r"read\(\) while 1 slot\(s\) from acquire_read\(\) are not "
                                       r"released; release\(\) them first"):
        consumer.read()
    assert bytes(view) == b"one"
    consumer.release()
    assert consumer.read() == (b"two", 0)


def _mapped(name: str) -> bool:
    with open("/proc/self/maps") as maps:
        return any(f"/dev/shm{name} " in line or line.rstrip().endswith(f"/dev/shm{name}")
                   or f"/dev/shm{name} (deleted)" in line for line in maps)


def test_the_mapping_and_its_semaphores_go_with_the_last_handle() -> None:
    """The semaphores live in the ring's segment: the mapping stays while anything may
    wait on them (the Ring, a handle of one of them) and goes with the last of them,
    by reference counting alone."""
    import gc

    gc.disable()
    try:
        ring = Ring.create(8, 2)
        name = ring.name
        assert [o.entry for o in list_objects() if name[1:] in o.entry] == [name[1:]]
        free = ring._free
        ring.close()
        assert free.value == 2   # still mapped: a thread may still be leaving a wait on it
        ring.unlink()
        del ring
        assert _mapped(name)
        del free
        assert not _mapped(name)
    finally:
        gc.enable()


def test_the_c_core_is_built_and_used() -> None:
    """A missing compiler must not silently leave the slow path in place."""
    if os.environ.get("IPU_EMULATOR_RING_C") == "0":
        pytest.skip("IPU_EMULATOR_RING_C=0 asks for the pure-Python path")
    assert ring_module._ringcore is not None, "shm._ringcore did not build: see setup.py"
    with Ring.create(16, 2) as producer, Ring.attach(producer.name) as consumer:
        producer.write(b"first")  # takes the producer role through the Python path
        assert consumer.read() == (b"first", 0)
        assert producer._core.producer and consumer._core.consumer
        assert "write" in vars(producer) and "acquire_read" in vars(consumer)  # C methods
        producer.write(b"second", tag=7)
        view, tag = consumer.acquire_read()
        assert (bytes(view), tag) == (b"second", 7)
        consumer.release()
        assert producer.counters()["sem_free"] == 2


def test_c_and_python_ends_interoperate(monkeypatch) -> None:
    if ring_module._ringcore is None:
        pytest.skip("shm._ringcore is not built")
    from shm import settings as shm_settings

    with shm_settings.override(ring_c=True):     # whatever IPU_EMULATOR_RING_C says
        producer = Ring.create(32, 3)
    monkeypatch.setattr(ring_module, "_ringcore", None)
    consumer = Ring.attach(producer.name)
    try:
        assert producer._core is not None and consumer._core is None
        for k in range(10):
            producer.write(bytes([k]) * (k + 1), tag=k)
            assert consumer.read(timeout=5) == (bytes([k]) * (k + 1), k)
        slot = producer.acquire_write()
        slot[:3] = b"abc"
        producer.publish(3, tag=-5)
        view, tag = consumer.acquire_read(timeout=5)
        assert (bytes(view), tag) == (b"abc", -5)
        consumer.release()
    finally:
        consumer.close()
        producer.close()
        producer.unlink()


def test_a_signal_handler_interrupts_a_blocked_wait(pair) -> None:
    """Python signal handlers run while a thread waits (a wait without deadline too)."""
    import signal

    class Alarm(Exception):
        pass

    def handler(signum, frame):
        raise Alarm()

    _producer, consumer = pair
    if consumer._core is None:
        pytest.skip("posix_ipc's acquire() drops exceptions raised by signal handlers")
    old = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(Alarm):
            consumer.read()          # nothing is ever published
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _wait_in_forked_child(consumer) -> None:
    from shm import ShmForkedError
    try:
        consumer.read(timeout=0.3)   # the parent's end: this process may not use it
    except ShmForkedError as exc:
        if exc.owner_pid != os.getppid() or f"belongs to process {os.getppid()}" not in str(exc):
            os._exit(4)
    else:
        os._exit(5)
    ring = Ring.create(16, 2)        # a ring of its own: its waits work in the child
    code = 3
    try:
        ring.read(timeout=0.3)       # a wait to a deadline
    except RingTimeoutError:
        code = 0
    finally:
        ring.close()
        ring.unlink()
    os._exit(code)


def test_waits_still_end_in_a_forked_child(pair) -> None:
    """A child forked while the parent waits (the C core's lock held across fork) waits
    on its own rings, and its deadlines still end them."""
    import multiprocessing as mp

    producer, consumer = pair
    with pytest.raises(RingTimeoutError):
        consumer.read(timeout=0.2)
    child = mp.get_context("fork").Process(target=_wait_in_forked_child, args=(consumer,))
    child.start()
    finish(child, 20)


def test_the_user_word_carries_a_hint_between_the_ends(pair) -> None:
    producer, consumer = pair
    assert consumer.user_word() == 0 and producer.user_word() == 0
    producer.set_user_word(4242)
    assert consumer.user_word() == 4242
    consumer.set_user_word(-7)          # either end may write it; the last store wins
    assert producer.user_word() == -7
    producer.write(b"data")             # the ring itself never touches it
    assert consumer.read() == (b"data", 0)
    consumer.reset()
    assert producer.user_word() == -7   # reset() keeps it
    consumer.close()
    with pytest.raises(ShmClosedError):
        consumer.user_word()


class _RaiseAfterToken:
    """Stands in for a Ring's C core: ``wait_token``/``try_token`` run the real ones,
    then, once, an exception is raised as the token is taken (what a signal handler's
    KeyboardInterrupt or an asynchronous exception does at the next bytecode boundary).
    ``before`` runs before the real wait, to make the token there."""

    def __init__(self, core, method: str, before=lambda: None) -> None:
        object.__setattr__(self, "_real", core)
        object.__setattr__(self, "_method", method)
        object.__setattr__(self, "_before", before)
        object.__setattr__(self, "raised", 0)

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    def __setattr__(self, name: str, value) -> None:
        setattr(self._real, name, value)

    def _maybe_raise(self, name: str, got: bool) -> bool:
        if got and name == self._method and not self.raised:
            object.__setattr__(self, "raised", 1)
            raise KeyboardInterrupt
        return got

    def wait_token(self, full: bool, wait: float | None) -> bool:
        if self._method == "wait_token" and not self.raised:
            self._before()
        return self._maybe_raise("wait_token", self._real.wait_token(full, wait))

    def try_token(self, full: bool) -> bool:
        return self._maybe_raise("try_token", self._real.try_token(full))


@pytest.fixture
def c_pair():
    """A producer and a consumer end of a one-slot ring, both with the C core."""
    if ring_module._ringcore is None:
        pytest.skip("shm._ringcore is not built (IPU_EMULATOR_RING_C=0)")
    producer = Ring.create(16, 1)
    consumer = Ring.attach(producer.name)
    if producer._core is None:   # IPU_EMULATOR_RING_C=0
        consumer.close()
        producer.close()
        producer.unlink()
        pytest.skip("the C core is switched off (IPU_EMULATOR_RING_C=0)")
    yield producer, consumer
    consumer.close()
    producer.close()
    producer.unlink()


def test_c_core_keeps_a_published_token_an_exception_interrupts(c_pair) -> None:
    """An exception right after wait_token took a published-slot token (the C fast path
    gave up its wait, the Python path waits on): the next read gets the message."""
    producer, consumer = c_pair
    producer.write(b"role")
    assert consumer.read(timeout=5) == (b"role", 0)   # both roles taken: C fast paths
    stub = _RaiseAfterToken(consumer._core, "wait_token",
                            lambda: producer.write(b"payload", tag=3))
    consumer._core = stub
    with pytest.raises(KeyboardInterrupt):
        consumer.read(timeout=0.01)   # the C wait ends empty; the token comes after it
    assert stub.raised
    assert consumer.counters()["sem_full"] == 0   # the token is out of the semaphore
    assert consumer.read(timeout=2) == (b"payload", 3)
    producer.write(b"next", tag=4)
    assert consumer.read(timeout=2) == (b"next", 4)
    assert consumer.readable() == 0 and consumer.counters()["sem_full"] == 0


def test_c_core_keeps_a_free_token_an_exception_interrupts(c_pair) -> None:
    """The same on the write side: the free-slot token survives, the next write uses it."""
    producer, consumer = c_pair
    producer.write(b"first")
    assert consumer.read(timeout=5) == (b"first", 0)
    producer.write(b"fills")                          # the one slot is taken
    stub = _RaiseAfterToken(producer._core, "wait_token",
                            lambda: received.append(consumer.read(timeout=5)))
    received: list = []
    producer._core = stub
    with pytest.raises(KeyboardInterrupt):
        producer.write(b"lost?", tag=1, timeout=0.01)
    assert stub.raised and received == [(b"fills", 0)]
    producer.write(b"second", tag=2, timeout=2)
    assert consumer.read(timeout=2) == (b"second", 2)
    view = producer.acquire_write(timeout=2)
    view[:5] = b"third"
    producer.publish(5, tag=3)
    assert consumer.read(timeout=2) == (b"third", 3)
    assert producer.writable() == 1


@pytest.mark.parametrize("side", ["read", "write"])
def test_c_core_keeps_a_token_try_token_took_before_an_exception(c_pair, side) -> None:
    """try_token's token (the Python path's first try, here a first call that takes the
    role) survives an exception raised as it returns."""
    producer, consumer = c_pair
    if side == "read":
        producer.write(b"payload", tag=5)
        consumer._core = stub = _RaiseAfterToken(consumer._core, "try_token")
        with pytest.raises(KeyboardInterrupt):
            consumer.read(timeout=0.01)
        assert stub.raised
        assert consumer.read(timeout=2) == (b"payload", 5)
    else:
        producer._core = stub = _RaiseAfterToken(producer._core, "try_token")
        with pytest.raises(KeyboardInterrupt):
            producer.write(b"lost?", timeout=0.01)
        assert stub.raised
        producer.write(b"payload", tag=6, timeout=2)
        assert consumer.read(timeout=2) == (b"payload", 6)
    producer.write(b"again", tag=7, timeout=2)
    assert consumer.read(timeout=2) == (b"again", 7)
