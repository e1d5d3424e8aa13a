"""The wire across fork(): a child never uses, invalidates, resets or unlinks the rings and
regions its parent made (ShmForkedError names the parent), and never keeps the parent's IPU
locks held. Each test forks this process; the child reports through a pipe and leaves with
``os._exit``."""

from __future__ import annotations

import json
import os
import select
from typing import Any, Callable

import pytest

import shm.ring as ring_module
from ipu_emulator.system import IpuLocks
from shm import Region, Ring, ShmClosedError, ShmForkedError


def in_child(body: Callable[[], Any], timeout: float = 30.0) -> Any:
    """Fork; the child runs ``body()`` and reports its JSON result (or its crash)."""
    rd, wr = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(rd)
            try:
                out = {"result": body()}
            except BaseException as exc:   # noqa: BLE001 - reported
                out = {"crash": f"{type(exc).__name__}: {exc}"}
            os.write(wr, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(wr)
    try:
        ready, _, _ = select.select([rd], [], [], timeout)
        assert ready, "the child did not report"
        data = b""
        while chunk := os.read(rd, 65536):
            data += chunk
    finally:
        os.close(rd)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    out = json.loads(data)
    assert "crash" not in out, out["crash"]
    return out["result"]


def raised(call: Callable[[], Any]) -> list[Any]:
    try:
        call()
    except ShmForkedError as exc:
        return ["ShmForkedError", str(exc), exc.owner_pid]
    except Exception as exc:   # noqa: BLE001 - reported
        return [type(exc).__name__, str(exc), None]
    return ["returned", "", None]


@pytest.fixture(params=["c", "python"])
def pair(request, monkeypatch):
    if request.param == "python":
        monkeypatch.setattr(ring_module, "_ringcore", None)
    elif ring_module._ringcore is None:
        pytest.skip("shm._ringcore is not built (IPU_EMULATOR_RING_C=0)")
    producer = Ring.create(64, 4)
    consumer = Ring.attach(producer.name)
    yield producer, consumer
    consumer.close()
    producer.close()
    producer.unlink()


def _entries(name: str) -> list[str]:
    base = name.lstrip("/")
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(base) or
                  n.startswith("sem." + base))


def test_a_forked_child_cannot_use_invalidate_reset_or_unlink_the_parents_ring(pair):
    producer, consumer = pair
    producer.write(b"before")             # one message waiting for the parent's consumer
    parent, names = os.getpid(), _entries(producer.name)
    assert len(names) == 1   # one segment: the semaphores are inside

    def child() -> dict[str, Any]:
        calls = {
            "write": lambda: producer.write(b"child"),
            "try_acquire_write": producer.try_acquire_write,
            "read": lambda: consumer.read(timeout=0.1),
            "try_acquire_read": consumer.try_acquire_read,
            "readable": consumer.readable,
            "invalidate": producer.invalidate,
            "reset": consumer.reset,
            "set_user_word": lambda: producer.set_user_word(5),
        }
        out = {k: raised(call) for k, call in calls.items()}
        out["closed"] = producer.closed and consumer.closed
        out["valid"] = producer.is_valid()
        producer.unlink()                 # the parent's names: nothing happens
        consumer.unlink()
        producer.close()                  # this process's mapping only
        consumer.close()
        out["names"] = _entries(producer.name)
        out["state"] = consumer.state()
        return out

    out = in_child(child)
    message = (f"ring {producer.name} belongs to process {parent}; this process "
               f"({{child}}) is a fork of it and may not use the ring")
    for what in ("write", "try_acquire_write", "read", "try_acquire_read", "readable",
                 "invalidate", "reset", "set_user_word"):
        kind, text, owner = out[what]
        assert (kind, owner) == ("ShmForkedError", parent), (what, out[what])
        child_pid = int(text.split("this process (")[1].split(")")[0])
        assert child_pid != parent and text == message.format(child=child_pid)
    assert out["closed"] is True and out["valid"] is False
    assert out["names"] == names
    assert out["state"].startswith(f"ring {producer.name}: ring {producer.name} belongs to")
    # the parent's ends are untouched: the message is still there, nothing else
    assert producer.is_valid() and consumer.is_valid() and producer.user_word() == 0
    assert consumer.read(timeout=5) == (b"before", 0)
    producer.write(b"after")
    assert consumer.read(timeout=5) == (b"after", 0)
    assert consumer.readable() == 0
    assert _entries(producer.name) == names


def test_shm_forked_error_is_a_closed_error():
    assert issubclass(ShmForkedError, ShmClosedError)


def test_a_forked_child_never_unlinks_the_parents_region():
    region = Region.create(4096)
    try:
        region.buf[:5] = b"hello"
        names = _entries(region.name)

        def child() -> list[str]:
            region.unlink()
            region.close()
            return _entries(region.name)

        assert in_child(child) == names
        attached = Region.attach(region.name)
        assert bytes(attached.buf[:5]) == b"hello"
        attached.close()
    finally:
        region.close()
        region.unlink()
    assert _entries(region.name) == []


def test_a_forked_child_does_not_keep_the_parents_ipu_locks(tmp_path):
    """flock belongs to the open file the child's copies share: the child drops its copies
    at fork, so the parent's release frees the IPU while the child lives on (and the child
    can never unlock it)."""
    locks = IpuLocks.try_acquire(str(tmp_path), (0, 1))
    assert isinstance(locks, IpuLocks)
    go_rd, go_wr = os.pipe()
    rd, wr = os.pipe()
    pid = os.fork()
    if pid == 0:   # lives until the parent says so, holding whatever it inherited
        try:
            os.close(go_wr)
            os.close(rd)
            held = locks.held
            other = IpuLocks.try_acquire(str(tmp_path), (0,))   # the parent still holds it
            os.write(wr, json.dumps([held, other if isinstance(other, dict) else "got"]).encode())
            os.close(wr)
            select.select([go_rd], [], [], 30)
        finally:
            os._exit(0)
    os.close(go_rd)
    os.close(wr)
    try:
        ready, _, _ = select.select([rd], [], [], 30)
        assert ready
        held, other = json.loads(os.read(rd, 4096))
        assert held is False                       # its copies are closed
        assert other == {"0": os.getpid()}          # the parent's lock stood in the child
        locks.release()
        again = IpuLocks.try_acquire(str(tmp_path), (0, 1))   # the child is still alive
        assert isinstance(again, IpuLocks), again
        again.release()
    finally:
        os.close(rd)
        os.close(go_wr)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
