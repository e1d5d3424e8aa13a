"""Every setting is bounded: each knob swept with negative, huge, non-numeric, NaN/inf and
empty values either takes the value or refuses it with ``SettingsError`` naming the
variable, the value and the range README's table gives; an empty value is the default."""

from __future__ import annotations

import os
import re

import pytest

from host_runtime.settings import HostSettings
from ipu_emulator.system import SystemConfigError, emulator_home
from shm import Ring
from shm.settings import MAX_SPIN_US, MAX_TIMEOUT, MIN_TIMEOUT, SettingsError, accepted

KNOBS = HostSettings.knobs()
NUMERIC = [k for k in KNOBS if re.fullmatch(r"[\d.]+\.\.[\d.]+( µs| s)?", accepted(k.parse))]
SWEEP = ["-1", "-0.5", "1e20", "1e12", "99999999999999999999999", "abc", "nan", "NaN", "inf",
         "-inf", "1e309", "0x10", " ", "\x00", "9" * 5000, "²", "٤", "1_0", "５"]


def _range(k) -> str:
    return accepted(k.parse).split()[0]


def _bounds(k):
    lo, hi = _range(k).split("..")
    return float(lo), float(hi)


def test_the_numeric_knobs_are_the_spins_timeouts_and_counts() -> None:
    names = {k.name for k in NUMERIC}
    assert {"ring_spin_us", "device_spin_us", "yielded_us", "runner_spin_us", "start_timeout",
            "daemon_handover_timeout", "load_timeout", "stop_timeout", "host_sync_timeout",
            "trace_events", "num_ipus", "tiles_per_ipu", "memory_per_tile",
            "compute_threads"} <= names
    assert accepted(HostSettings.knob("ring_spin_us").parse) == f"0..{MAX_SPIN_US:g} µs"
    assert accepted(HostSettings.knob("host_sync_timeout").parse) == \
        f"{MIN_TIMEOUT:g}..{MAX_TIMEOUT:g} s"


@pytest.mark.parametrize("k", KNOBS, ids=lambda k: k.env)
def test_an_empty_value_is_the_default(k) -> None:
    assert getattr(HostSettings.from_env({k.env: ""}), k.name) == k.default


@pytest.mark.parametrize("k", KNOBS, ids=lambda k: k.env)
def test_every_knob_takes_a_value_or_names_variable_value_and_range(k) -> None:
    for value in SWEEP:
        try:
            s = HostSettings.from_env({k.env: value})
        except SettingsError as exc:
            assert str(exc).startswith(f"{k.env}="), str(exc)
            assert f"={value!r}:" in str(exc) or "chars" in str(exc), str(exc)
            if k in NUMERIC:
                assert f"expected a number of" in str(exc) or "expected an integer" in str(exc)
                assert f" in {_range(k)}" in str(exc), str(exc)
        else:
            assert k not in NUMERIC or value == "1e12" and _bounds(k)[1] >= 1e12, (k.env, value)
            assert getattr(s, k.name) is not None


@pytest.mark.parametrize("k", NUMERIC, ids=lambda k: k.env)
def test_a_numeric_knob_takes_its_bounds_and_nothing_past_them(k) -> None:
    lo, hi = _bounds(k)
    as_text = (lambda v: str(int(v))) if accepted(k.parse)[-1].isdigit() else repr
    assert getattr(HostSettings.from_env({k.env: as_text(lo)}), k.name) == lo
    assert getattr(HostSettings.from_env({k.env: as_text(hi)}), k.name) == hi
    for past in (hi * 2 + 1, lo - 1):
        with pytest.raises(SettingsError) as info:
            HostSettings.from_env({k.env: as_text(past)})
        assert str(info.value) .startswith(f"{k.env}={as_text(past)!r}: expected ")
        assert f" in {_range(k)}" in str(info.value)


def test_a_huge_ring_spin_is_refused_before_any_shared_memory_is_made(monkeypatch) -> None:
    def ours() -> set[str]:   # this process's objects (other workers make their own)
        return {n for n in os.listdir("/dev/shm") if f"_{os.getpid()}_" in n}
    before = ours()
    for value in ("1e20", "1e12"):
        monkeypatch.setenv("IPU_EMULATOR_RING_SPIN_US", value)
        with pytest.raises(SettingsError, match=rf"^IPU_EMULATOR_RING_SPIN_US='{value}': "
                                                r"expected a number of microseconds in "
                                                r"0\.\.10000$"):
            Ring.create(64, 2)
    monkeypatch.delenv("IPU_EMULATOR_RING_SPIN_US")
    monkeypatch.setenv("IPU_EMULATOR_DEVICE_SPIN_US", "1e20")
    with pytest.raises(SettingsError, match=r"^IPU_EMULATOR_DEVICE_SPIN_US='1e20'"):
        HostSettings.current()
    assert ours() - before == set()


@pytest.mark.parametrize("home", ["relative/home", "./h", "~/h", "h"])
def test_a_relative_home_is_refused_by_name(home) -> None:
    with pytest.raises(SystemConfigError, match=rf"^IPU_EMULATOR_HOME={re.escape(repr(home))}: "
                                                r"expected an absolute path \(starting with /\)$"):
        emulator_home({"IPU_EMULATOR_HOME": home})
    assert emulator_home({"IPU_EMULATOR_HOME": "/x//y/"}) == "/x/y"
    assert emulator_home({"IPU_EMULATOR_HOME": ""}) == emulator_home({})
