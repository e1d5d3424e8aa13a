"""``ipu-emulator stress --scenario faults`` honours ``--duration``: its host runs the
scenario until then (rounds of schedules), and only without one up to ``--max-seconds``."""

from __future__ import annotations

import time

import pytest

import tools._stress_faults as stress_faults
from tools._stress_host import _Host
from tools._stress_spec import HostSpec


@pytest.mark.parametrize("duration, requests, expected", [(3.0, None, 3.0), (None, 12, 600.0)])
def test_the_faults_scenario_runs_until_the_duration(monkeypatch, capfd, duration, requests,
                                                     expected):
    seen = {}

    def fake(spec, tally, check, deadline, budget):
        seen.update(deadline=deadline - time.time(), budget=budget, duration=spec.duration)
        return {"injected": 0}
    monkeypatch.setattr(stress_faults, "run_faults", fake)
    host = _Host(HostSpec(scenario="faults", seed=1, duration=duration, requests=requests,
                          max_seconds=600.0, hang_timeout=30.0))
    assert host._run_faults() is True
    assert expected - 1.0 < seen["deadline"] <= expected
    assert (seen["budget"], seen["duration"]) == (requests, duration)
    assert capfd.readouterr().out.startswith("READY ")
