"""ReplicaTimers on their own, with a fake owner (no device, no processes)."""

from __future__ import annotations

import threading
import time

import pytest

from host_runtime.errors import DeviceTimeoutError
from host_runtime.runner._replica_timers import ReplicaTimers
from host_runtime.runner._requests import Request, Transfer


class _Driver:
    def __init__(self) -> None:
        self.errors: list[BaseException] = []

    def wait_for(self, request: Request, timeout: float | None) -> bool:
        return request.is_done()

    def record_error(self, error: BaseException, request: object = None) -> None:
        self.errors.append(error)


class _Owner:
    """A TimerOwner whose submit lock is 'held' while ``busy`` is set."""

    def __init__(self) -> None:
        self.closed = False
        self.partial: Transfer | None = None
        self.busy = False
        self.sent: list[tuple[Request, int]] = []
        self.published: list[tuple[Transfer, Request | None]] = []
        self.fired = threading.Event()
        self.timers: ReplicaTimers | None = None

    def try_publish_partial(self, tr: Transfer, extra: Request | None) -> bool:
        if self.busy:
            return False
        self.published.append((tr, extra))
        self.partial = None
        return True

    def try_send(self, request: Request, transfers: int) -> bool:
        if self.busy:
            return False
        self.sent.append((request, transfers))
        return True

    def fire_timers(self) -> None:
        assert self.timers is not None
        self.timers.fire(time.monotonic())
        self.fired.set()


def _request(driver: _Driver) -> Request:
    return Request(driver, 0, 1, {}, {}, {}, [()], time.perf_counter_ns())


def _timers(owner: _Owner, callback=None, merge=None, make=None, timeout_ns=1_000_000,
            flush_ns=None, watchdog=False) -> ReplicaTimers:
    t = ReplicaTimers(owner, 0, timeout_ns=timeout_ns, partial_flush_ns=flush_ns,
                      flush_callback=callback,
                      make_flush_request=make or (lambda i, o: None),
                      merge_phantom=merge or (lambda req, extra: None),
                      waits_for="x", watchdog=watchdog)
    owner.timers = t
    return t


def test_phantom_without_callback_times_out_naming_the_input():
    driver, owner = _Driver(), _Owner()
    timers = _timers(owner, timeout_ns=2_000_000)
    req = _request(driver)
    t0 = time.monotonic()
    timers.add_phantom(req, "tensor_B", None)
    deadline = timers.next_deadline(None)
    assert t0 + 0.002 <= deadline <= time.monotonic() + 0.002
    timers.fire(deadline - 1e-3)          # not due yet
    assert not req.is_done()
    timers.fire(deadline)
    assert isinstance(req.error, DeviceTimeoutError)
    assert "timed out after 2 ms waiting for input 'tensor_B'" in str(req.error)
    assert driver.errors == [req.error]
    assert timers.next_deadline(None) == float("inf")


def test_phantom_completed_by_the_callback_is_sent_once_the_submitter_lets_go():
    driver, owner = _Driver(), _Owner()
    calls = []
    extra = _request(driver)
    timers = _timers(owner, callback=lambda t, i, o: calls.append(t) or ({"x": 1}, None),
                     make=lambda i, o: extra, merge=lambda req, e: 3)
    req = _request(driver)
    timers.add_phantom(req, "x", None)
    owner.busy = True                      # a submitter holds the lock: retried, not failed
    now = timers.next_deadline(None)
    timers.fire(now)
    assert calls == ["x"] and owner.sent == [] and not req.is_done()
    assert timers.next_deadline(None) <= time.monotonic()
    owner.busy = False
    timers.fire(time.monotonic())
    assert calls == ["x"]                  # the callback is asked once
    assert owner.sent == [(req, 3)] and not req.is_done()
    assert timers.take_phantoms() == []


def test_partial_flush_asks_once_and_packs_what_it_gave_on_the_retry():
    driver, owner = _Driver(), _Owner()
    extra = _request(driver)
    calls = []
    timers = _timers(owner, callback=lambda t, i, o: calls.append(t) or (i, o),
                     make=lambda i, o: extra, flush_ns=5_000_000)
    tr = Transfer([], (), t_open=100.0)
    owner.partial = tr
    assert timers.next_deadline(tr) == pytest.approx(100.005)
    timers.fire(100.004)
    assert calls == []
    owner.busy = True
    timers.fire(100.005)
    assert calls == ["x"] and tr.flush_extra is extra and owner.published == []
    owner.busy = False
    timers.fire(100.006)
    assert calls == ["x"] and owner.published == [(tr, extra)] and tr.flush_extra is None


def test_a_failing_callback_pads_instead(caplog):
    driver, owner = _Driver(), _Owner()

    def boom(t, i, o):
        raise RuntimeError("no data")
    timers = _timers(owner, callback=boom, flush_ns=0)
    tr = Transfer([], (), t_open=1.0)
    owner.partial = tr
    timers.fire(2.0)
    assert owner.published == [(tr, None)]
    assert "flush_callback failed for tensor 'x'" in caplog.text


def test_watchdog_fires_when_nobody_waits_and_exits_when_idle():
    driver, owner = _Driver(), _Owner()
    timers = _timers(owner, timeout_ns=1_000_000, watchdog=True)
    req = _request(driver)
    timers.add_phantom(req, "x", None)
    assert owner.fired.wait(10)
    timers._watchdog.join(10)
    assert not timers._watchdog.is_alive()
    assert isinstance(req.error, DeviceTimeoutError)


def test_timers_do_not_keep_their_owner_alive():
    import gc
    import weakref

    owner = _Owner()
    timers = _timers(owner)
    owner.timers = None       # the fake's back-reference, which Replica does not need
    ref = weakref.ref(owner)
    gc.disable()
    try:
        del owner
        assert ref() is None  # freed by reference counting alone
    finally:
        gc.enable()
    timers.fire(time.monotonic())   # an owner that is gone: nothing to do
