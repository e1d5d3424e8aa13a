"""shm.spin.PollEstimate: the one poll-or-block policy of the host and the IPU process."""

from __future__ import annotations

import pytest

from shm.spin import NEVER, PollEstimate


def test_polls_while_waits_are_short_and_stops_when_they_are_long() -> None:
    est = PollEstimate(1000)
    calls = []
    assert est.poll(lambda: calls.append(1) or True) is True and calls == [1]
    for _ in range(20):       # an idle peer: every wait long
        est.record(10**9)
    assert 3000 < est.est_ns <= 4000   # samples capped at 4 budgets
    assert not est.worth_polling()
    assert est.poll(lambda: calls.append(2) or True) is False and calls == [1]   # not polled
    for _ in range(20):       # quick answers again: polling comes back
        est.record(0)
    assert est.worth_polling() and est.poll(lambda: True) is True


def test_an_idle_spell_is_forgotten_after_a_few_quick_waits() -> None:
    est = PollEstimate(1000)
    for _ in range(100):
        est.record(10**12)
    n = 0
    while not est.worth_polling():
        est.record(0)
        n += 1
    assert n <= 3


def test_budget_zero_never_polls_and_an_unready_poll_gives_up() -> None:
    assert PollEstimate(0).poll(lambda: True) is False
    assert PollEstimate(20_000).poll(lambda: False) is False


def test_a_shared_cpu_skips_the_next_polls() -> None:
    est = PollEstimate(10**9, shared_ns=1, backoff=2)   # every yield counts as shared
    polled = []
    assert est.poll(lambda: polled.append(1) and False) is False
    polled.clear()
    assert est.poll(lambda: polled.append(1) or True) is False
    assert est.poll(lambda: polled.append(1) or True) is False
    assert polled == []            # two polls skipped
    est.shared_ns = NEVER
    assert est.poll(lambda: polled.append(1) or True) is True and polled == [1]


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match=r"budget_ns=-1.*expected budget_ns >= 0"):
        PollEstimate(-1)
