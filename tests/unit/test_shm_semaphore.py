"""shm._semaphore: a ring's process-shared semaphores, inside its segment."""

from __future__ import annotations

import os
import signal
import threading
import time

import posix_ipc
import pytest

from shm import Region, Ring, RingTimeoutError
from shm.cleanup import list_objects
from shm._semaphore import SEM_BYTES, SharedSemaphore


@pytest.fixture
def region():
    r = Region.create(4096)
    yield r
    r.close()
    r.unlink()


def test_tokens_count_and_an_empty_semaphore_is_busy(region) -> None:
    sem = SharedSemaphore(region.buf, 0, "test semaphore")
    sem.init(2)
    assert sem.value == 2
    sem.acquire(0)
    sem.acquire(None)
    assert sem.value == 0
    with pytest.raises(posix_ipc.BusyError, match="test semaphore: no token within 0 s"):
        sem.acquire(0)
    sem.release()
    assert sem.value == 1
    # a second handle on the same bytes is the same semaphore
    other = SharedSemaphore(region.buf, 0, "the same")
    other.acquire(0)
    assert sem.value == 0
    del other


def test_a_timed_wait_lasts_until_its_deadline(region) -> None:
    sem = SharedSemaphore(region.buf, SEM_BYTES, "timed")
    sem.init(0)
    start = time.monotonic()
    with pytest.raises(posix_ipc.BusyError, match=r"timed: no token within 0.05 s"):
        sem.acquire(0.05)
    assert time.monotonic() - start >= 0.05


def test_take_into_banks_the_token_it_takes_and_nothing_else(region) -> None:
    sem = SharedSemaphore(region.buf, 0, "bank")
    sem.init(1)
    spare: list[object] = []
    sem.take_into(spare, 1.0)
    assert len(spare) == 1 and sem.value == 0
    with pytest.raises(posix_ipc.BusyError):
        sem.take_into(spare, 0)
    with pytest.raises(posix_ipc.BusyError):
        sem.take_into(spare, 0.01)
    assert len(spare) == 1


def test_another_thread_wakes_an_untimed_wait(region) -> None:
    sem = SharedSemaphore(region.buf, 0, "wake")
    sem.init(0)
    poster = threading.Thread(target=sem.release)
    poster.start()
    sem.acquire(None)       # returns once the other thread posted
    poster.join()
    assert sem.value == 0


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(),
                    reason="signal handlers belong to the main thread")
def test_a_signal_ends_an_untimed_wait_with_signal_error(region) -> None:
    sem = SharedSemaphore(region.buf, 0, "signalled")
    sem.init(0)
    seen: list[int] = []
    old = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    done = threading.Event()
    main = threading.main_thread().ident
    assert main is not None

    def knock() -> None:   # until the wait has ended: a signal before it blocks is lost
        for _ in range(1000):
            signal.pthread_kill(main, signal.SIGUSR1)
            if done.wait(0.01):
                return
    knocker = threading.Thread(target=knock)
    knocker.start()
    try:
        with pytest.raises(posix_ipc.SignalError, match="signalled: the wait was interrupted"):
            sem.acquire(None)
    finally:
        done.set()
        knocker.join()
        signal.signal(signal.SIGUSR1, old)
    assert seen and sem.value == 0


def test_a_ring_is_one_object_whose_semaphores_work_across_processes() -> None:
    """A ring made here, used by a child process through its name alone."""
    import subprocess
    import sys

    def mine() -> set[str]:   # /dev/shm is shared with the tests running beside
        return {o.entry for o in list_objects() if o.pid == os.getpid()}

    before = mine()
    with Ring.create(16, 2) as ring:
        assert mine() - before == {ring.name[1:]}
        code = ("import sys; from shm import Ring; r = Ring.attach(sys.argv[1]); "
                "[r.write(b'message %d' % i, tag=i) for i in range(5)]; r.close()")
        child = subprocess.Popen([sys.executable, "-c", code, ring.name])
        # 5 messages through 2 slots: the child blocks on `free` until this process reads
        assert [ring.read(timeout=30) for _ in range(5)] == [
            (b"message %d" % i, i) for i in range(5)]
        assert child.wait(timeout=30) == 0
    assert mine() - before == set()


class _RaiseAfterTake:
    """A ring semaphore whose take_into raises KeyboardInterrupt once, right after it took
    (and banked) a token: an exception a signal handler raises as the wait returns."""

    def __init__(self, real: SharedSemaphore) -> None:
        self._real = real
        self.raised = False

    def take_into(self, spare: list, timeout: float | None) -> None:
        self._real.take_into(spare, timeout)
        if not self.raised:
            self.raised = True
            raise KeyboardInterrupt

    def __getattr__(self, name: str):
        return getattr(self._real, name)


def test_the_python_path_keeps_a_token_an_exception_interrupts() -> None:
    """Without the C core: a token the wait took is banked before anything can interrupt,
    so the next read gets the message and the semaphores still count the slots."""
    from shm.settings import ShmSettings

    python_path = ShmSettings.current().replace(ring_c=False)
    producer = Ring.create(16, 1, settings=python_path)
    consumer = Ring.attach(producer.name, settings=python_path)
    try:
        assert producer._core is None and consumer._core is None
        producer.write(b"payload", tag=3)
        stub = _RaiseAfterTake(consumer._full)
        consumer._full = stub
        with pytest.raises(KeyboardInterrupt):
            consumer.read(timeout=2)
        assert stub.raised and consumer._spare_full   # taken, banked, not used
        assert consumer.read(timeout=2) == (b"payload", 3)
        producer.write(b"next", tag=4, timeout=2)
        assert consumer.read(timeout=2) == (b"next", 4)
        assert consumer.counters()["sem_full"] == 0 and consumer.counters()["sem_free"] == 1
    finally:
        consumer.close()
        producer.close()
        producer.unlink()


def test_an_owner_that_drops_its_ring_or_region_gives_the_names_back() -> None:
    """Reference counting alone (collector off): a ring or region its creator lets go of
    without unlink() loses its name at once (an exception between its creation and its
    first use, e.g. an interrupt at the return of create(), leaves nothing behind); one
    this process only attached keeps its name, and views of a dropped region stay valid."""
    import gc

    def mine() -> set[str]:
        return {o.entry for o in list_objects() if o.pid == os.getpid()}

    gc.disable()
    try:
        before = mine()
        ring = Ring.create(16, 2)
        region = Region.create(4096)
        view = region.ndarray("u1", 16)
        view[:] = 7
        assert mine() - before == {ring.name[1:], region.name[1:]}

        def interrupted_at_the_return() -> None:
            Ring.create(16, 2)          # made, then lost to the exception below
            raise KeyboardInterrupt
        with pytest.raises(KeyboardInterrupt):
            interrupted_at_the_return()
        assert mine() - before == {ring.name[1:], region.name[1:]}

        other = Ring.attach(ring.name)
        del other                      # not the owner: the name stays
        assert ring.name[1:] in mine()
        del ring, region
        assert mine() - before == set()
        assert bytes(view) == b"\x07" * 16   # the mapping outlives the name
    finally:
        gc.enable()


@pytest.mark.parametrize("c_core", [True, False], ids=["c", "python"])
def test_a_token_banked_before_the_peers_reset_is_not_used_after_it(c_core) -> None:
    """A consumer whose read an exception cut short keeps the token it took (banked); the
    peer then resets the ring (a STOP ended the run). That token belonged to a message
    the reset removed: the next read waits for a new message instead of reading an
    unpublished slot ('slot 0 holds message 0, expected 1')."""
    from shm.settings import ShmSettings

    settings = ShmSettings.current().replace(ring_c=c_core)
    producer = Ring.create(16, 2, settings=settings)
    consumer = Ring.attach(producer.name, settings=settings)
    try:
        if c_core and consumer._core is None:
            pytest.skip("the C core is not built or is switched off")
        producer.write(b"role", tag=1)
        assert consumer.read(timeout=2) == (b"role", 1)   # both roles taken
        producer.write(b"removed", tag=2)
        # what a read an exception cut short right after its wait leaves (see
        # test_the_python_path_keeps_a_token_an_exception_interrupts): the token banked
        consumer._full.take_into(consumer._spare_full, 0)
        assert consumer._spare_full and consumer.counters()["sem_full"] == 0
        producer.reset()                                  # the peer's reset (owner side)
        with pytest.raises(RingTimeoutError):
            consumer.read(timeout=0.05)                   # nothing published since
        producer.write(b"after", tag=3)
        assert consumer.read(timeout=2) == (b"after", 3)
        with pytest.raises(RingTimeoutError):
            consumer.read(timeout=0.05)
        assert consumer.counters()["sem_full"] == 0 and not consumer._spare_full
    finally:
        consumer.close()
        producer.close()
        producer.unlink()


@pytest.mark.parametrize("c_core", [True, False], ids=["c", "python"])
@pytest.mark.parametrize("unread_before", [0, 1], ids=["empty", "one-unread"])
def test_a_free_token_an_invalidation_left_is_not_used_after_the_reset(c_core,
                                                                        unread_before) -> None:
    """A producer blocked on a full ring (an IPU whose outputs the host does not read)
    is woken by the host's invalidation (stop()): its wait takes the token the
    invalidation posted, and the call raises with it banked. The host resets the ring.
    Used, that token would let the producer write one message more than the ring holds,
    over the oldest unread one ('slot 0 holds message 3, expected 1'); it is dropped
    instead, whether the producer next writes into a full ring or an empty one."""
    from shm import RingInvalidatedError
    from shm.settings import ShmSettings

    settings = ShmSettings.current().replace(ring_c=c_core)
    owner = Ring.create(16, 2, settings=settings)          # the host: consumer, resets
    producer = Ring.attach(owner.name, settings=settings)
    try:
        if c_core and producer._core is None:
            pytest.skip("the C core is not built or is switched off")
        producer.write(b"a", tag=1)
        producer.write(b"b", tag=2)                       # full
        owner.invalidate()                                # stop(): posts a token to each
        # what the producer's wait, woken by it, leaves as its call raises: the token
        # banked (see test_the_python_path_keeps_a_token_an_exception_interrupts)
        producer._free.take_into(producer._spare_free, 0)
        assert producer._spare_free
        with pytest.raises(RingInvalidatedError):
            producer.write(b"late", timeout=60)
        owner.reset()
        for k in range(unread_before):
            producer.write(b"u%d" % k, tag=10 + k)
            assert owner.read(timeout=2) == (b"u%d" % k, 10 + k)
        producer.write(b"x", tag=3)
        producer.write(b"y", tag=4)                       # full again
        with pytest.raises(RingTimeoutError):
            producer.write(b"over", tag=5, timeout=0.05)  # not over the unread "x"
        assert owner.read(timeout=2) == (b"x", 3)
        assert owner.read(timeout=2) == (b"y", 4)
        producer.write(b"z", tag=6)
        assert owner.read(timeout=2) == (b"z", 6)
        assert owner.counters()["sem_free"] == 2 and not producer._spare_free
    finally:
        producer.close()
        owner.close()
        owner.unlink()
