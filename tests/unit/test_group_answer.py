"""The answer of a request to a device of several IPUs (``GroupLink``): it comes once every
IPU has answered and, when one failed, once the others were told to stop and the
IPU-Links invalidated, never before. The caller's next request follows the answer; had
it overtaken the stop, a late STOP would end the next run, and a late wake of the links
would disconnect them under it (its outputs dropped: a run that answered without them).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from host_runtime.devices._ipu_group import GroupLink
from host_runtime.devices._link import Answer
from host_runtime.errors import DeviceExecutionError, InvalidStateError
from ipu_emulator.ipu.launcher import IpuSpec
from ipu_emulator.ipu_protocol import Op


class _Connection:
    """What a GroupLink reads of an IPU process (made, lost, killed)."""

    def __init__(self, ipu_id: int) -> None:
        self.spec = IpuSpec(ipu_id=ipu_id)
        self.pid = 1_000_000 + ipu_id
        self.code: int | None = None
        self.on_kill: Any = None

    def alive(self) -> bool:
        return self.code is None

    def returncode(self) -> int | None:
        return self.code

    def wait_exit(self, timeout: float) -> int | None:
        return self.code

    def log_tail(self) -> str:
        return ""

    def kill(self) -> None:
        if self.on_kill is not None:
            self.on_kill()
        self.code = -9


class _Member:
    """A member link that records the requests sent to it."""

    def __init__(self, name: str, log: list[Any]) -> None:
        self.description = name
        self._log = log

    def request(self, op: Op, body: Any = None, value: int = 0, last: bool = False) -> Answer:
        self._log.append((self.description, op, value))
        return Answer()


def _group(wake: Any) -> GroupLink:
    link = GroupLink("device 0 (ipu 0,1)", [_Connection(0), _Connection(1)])  # type: ignore[list-item]
    link.wake_links = wake
    return link


def test_the_answer_waits_for_the_stop_of_the_others_when_a_part_fails_first():
    log: list[Any] = []
    in_wake, go_on = threading.Event(), threading.Event()

    def wake() -> None:
        log.append("wake")
        in_wake.set()
        assert go_on.wait(60)

    link = _group(wake)
    parts = [Answer(), Answer()]
    members = [_Member("IPU 0", log), _Member("IPU 1", log)]
    out = link._all(list(parts), list(members), Op.RUN)   # type: ignore[arg-type]
    failure = DeviceExecutionError("IPU 1: program 1 failed")
    # IPU 1's ERROR on its event thread; the stop it starts is held inside the wake
    failing = threading.Thread(target=parts[1].set_exception, args=(failure,))
    failing.start()
    assert in_wake.wait(60)
    parts[0].set_result(None)          # IPU 0's DONE on its own event thread meanwhile
    assert not out.done(), "answered before the IPU-Links were invalidated"
    go_on.set()
    failing.join(60)
    assert out.exception(timeout=60) is failure
    assert log == [("IPU 0", Op.STOP, 1), "wake"]


def test_a_part_that_fails_last_wakes_the_links_before_the_answer():
    log: list[Any] = []
    link = _group(lambda: log.append("wake"))
    parts = [Answer(), Answer()]
    members = [_Member("IPU 0", log), _Member("IPU 1", log)]
    out = link._all(list(parts), list(members), Op.RUN)   # type: ignore[arg-type]
    out.add_done_callback(lambda f: log.append("answer"))
    parts[0].set_result(None)
    assert not out.done()
    failure = DeviceExecutionError("IPU 1: program 1 failed")
    parts[1].set_exception(failure)
    assert out.exception(timeout=0) is failure
    assert log == ["wake", "answer"]   # IPU 0 had answered: no STOP for it


@pytest.mark.parametrize("op", [Op.RUN, Op.LOOP])
def test_the_first_failure_is_the_answer_and_the_stop_it_caused_follows(op):
    log: list[Any] = []
    link = _group(lambda: log.append("wake"))
    parts = [Answer(), Answer(), Answer()]
    members = [_Member(f"IPU {k}", log) for k in range(3)]
    out = link._all(list(parts), list(members), op)   # type: ignore[arg-type]
    failure = DeviceExecutionError("IPU 1: program 1 failed")
    parts[1].set_exception(failure)
    assert log == [("IPU 0", Op.STOP, 1), ("IPU 2", Op.STOP, 1), "wake"]
    parts[0].set_exception(InvalidStateError("IPU 0: stop() interrupted the running programs"))
    assert not out.done()
    parts[2].set_result(None)
    assert out.exception(timeout=0) is failure
    assert log.count("wake") == 1     # one stop per request


def test_parts_that_all_succeed_answer_once_all_have():
    link = _group(lambda: pytest.fail("nothing failed: no wake"))
    parts = [Answer(), Answer()]
    out = link._all(list(parts), [_Member("IPU 0", []), _Member("IPU 1", [])],  # type: ignore[list-item]
                    Op.RUN)
    parts[1].set_result(None)
    assert not out.done()
    parts[0].set_result(None)
    assert out.result(timeout=0) is None


def test_the_other_ipu_processes_are_killed_before_the_loss_is_heard_of():
    """A lost device's other IPU processes die before anyone can read the loss: a runner
    that reacts to it by closing (a daemon's IPUs released, reset and freed) never has
    them killed after, free (the next attach of them failed)."""
    procs = [_Connection(0), _Connection(1)]
    link = GroupLink("device 0 (ipu 0,1)", procs)   # type: ignore[arg-type]
    seen: list[Any] = []
    procs[1].on_kill = lambda: seen.append(link.lost)
    procs[0].code = -9                                # IPU 0 was killed
    err = link.mark_lost()
    assert seen == [None], "the loss was visible before IPU 1 was killed"
    assert link.lost is err and not procs[1].alive()
    assert "IPU process 1000000 was killed by signal SIGKILL" in str(err)
