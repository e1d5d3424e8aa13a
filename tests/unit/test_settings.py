"""shm.settings: one object for every tuning knob, parsed once, with errors that name the
variable; every module reads its knobs through it; README's table is the knobs' own; one
spin helper (shm.spin)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shm import settings as settings_module
from shm.settings import (NOT_SETTINGS, Settings, SettingsError, current, knobs, readme_table,
                          reload, settings)
from shm.spin import NEVER, spin_until, us_to_ns

ROOT = Path(__file__).resolve().parents[2]
KNOBS = {k.name: k for k in knobs()}
ENV_NAMES = {k.env for k in knobs()}


@pytest.fixture
def fresh(monkeypatch):
    """Knobs unset while the test runs; the cached object restored after it."""
    saved = settings_module._cached
    for k in knobs():
        monkeypatch.delenv(k.env, raising=False)
    yield monkeypatch
    settings_module._cached = saved


def test_defaults_are_the_documented_ones() -> None:
    s = Settings.from_env({})
    assert s == Settings()
    assert {k.env: getattr(s, k.name) for k in knobs()} == {
        "IPU_EMULATOR_RING_C": True, "IPU_EMULATOR_RING_PEER_THREAD": True,
        "IPU_EMULATOR_RING_SPIN_US": 0.0, "IPU_EMULATOR_DEVICE_SPIN_US": 50.0,
        "IPU_EMULATOR_RUNNER_SPIN_US": 100.0, "IPU_EMULATOR_YIELDED_US": 5.0,
        "IPU_EMULATOR_ZERO_COPY": True, "IPU_EMULATOR_KEEP_APART": True,
        "IPU_EMULATOR_FORKSERVER": True, "IPU_EMULATOR_DEVICE_LOG_LEVEL": "WARNING",
        "IPU_EMULATOR_DAEMON_LOG_LEVEL": "INFO", "IPU_EMULATOR_START_TIMEOUT": 120.0,
        "IPU_EMULATOR_LOAD_TIMEOUT": 300.0, "IPU_EMULATOR_STOP_TIMEOUT": 30.0,
        "IPU_EMULATOR_HOST_SYNC_TIMEOUT": 60.0, "IPU_EMULATOR_DAEMON_HANDOVER_TIMEOUT": 30.0}
    with pytest.raises(AttributeError):
        s.ring_c = False   # type: ignore[misc]   # frozen


def test_values_parse_by_kind() -> None:
    s = Settings.from_env({
        "IPU_EMULATOR_RING_C": "0", "IPU_EMULATOR_ZERO_COPY": "off",
        "IPU_EMULATOR_KEEP_APART": "Yes", "IPU_EMULATOR_RING_SPIN_US": "2.5",
        "IPU_EMULATOR_YIELDED_US": "0", "IPU_EMULATOR_STOP_TIMEOUT": "0.5",
        "IPU_EMULATOR_DEVICE_LOG_LEVEL": "debug", "IPU_EMULATOR_FORKSERVER": "",   # empty: default
        "IPU_EMULATOR_" + "UNRELATED": "x"})   # not a knob: ignored
    assert (s.ring_c, s.zero_copy, s.keep_apart, s.forkserver) == (False, False, True, True)
    assert (s.ring_spin_us, s.yielded_us, s.stop_timeout) == (2.5, 0.0, 0.5)
    assert s.device_log_level == "DEBUG"


@pytest.mark.parametrize("var, text, expected", [
    ("IPU_EMULATOR_RING_SPIN_US", "abc", "expected a number of microseconds (>= 0)"),
    ("IPU_EMULATOR_DEVICE_SPIN_US", "-1", "expected a number of microseconds (>= 0)"),
    ("IPU_EMULATOR_YIELDED_US", "nan", "expected a number of microseconds (>= 0)"),
    ("IPU_EMULATOR_STOP_TIMEOUT", "0", "expected a number of seconds (> 0)"),
    ("IPU_EMULATOR_LOAD_TIMEOUT", "inf", "expected a number of seconds (> 0)"),
    ("IPU_EMULATOR_ZERO_COPY", "maybe", "expected 0 or 1 (or true/false, yes/no, on/off)"),
    ("IPU_EMULATOR_DEVICE_LOG_LEVEL", "LOUD",
     "expected a logging level, one of DEBUG, INFO, WARNING, ERROR, CRITICAL"),
])
def test_a_bad_value_names_the_variable_what_was_expected_and_given(var, text, expected) -> None:
    with pytest.raises(SettingsError) as info:
        Settings.from_env({var: text})
    assert str(info.value) == f"{var}={text!r}: {expected}"
    assert isinstance(info.value, ValueError)


def test_every_bad_value_is_reported_at_once() -> None:
    with pytest.raises(SettingsError, match=r"^IPU_EMULATOR_RING_C='2': expected 0 or 1 .*; "
                                            r"IPU_EMULATOR_START_TIMEOUT='soon': expected"):
        Settings.from_env({"IPU_EMULATOR_RING_C": "2", "IPU_EMULATOR_START_TIMEOUT": "soon"})


def test_a_bad_value_stops_the_import_with_that_message() -> None:
    env = dict(os.environ, IPU_EMULATOR_RING_SPIN_US="abc", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", "import shm"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[-1] == ("shm.settings.SettingsError: IPU_EMULATOR_RING_SPIN_US="
                                            "'abc': expected a number of microseconds (>= 0)")


def test_read_once_then_reload_and_current(fresh) -> None:
    first = settings()
    assert settings() is first                      # cached
    fresh.setenv("IPU_EMULATOR_RUNNER_SPIN_US", "7")
    fresh.setenv("IPU_EMULATOR_FORKSERVER", "0")
    fresh.setenv("IPU_EMULATOR_KEEP_APART", "0")
    assert settings() is first and settings().runner_spin_us == first.runner_spin_us
    now = current()                                 # call-time knobs only, re-read
    assert (now.forkserver, now.keep_apart) == (False, False)
    assert now.runner_spin_us == first.runner_spin_us and settings() is first
    fresh.delenv("IPU_EMULATOR_FORKSERVER")
    assert current().forkserver is True
    again = reload()
    assert settings() is again and again.runner_spin_us == 7.0 and again.keep_apart is False
    fresh.setenv("IPU_EMULATOR_KEEP_APART", "sometimes")
    with pytest.raises(SettingsError, match="IPU_EMULATOR_KEEP_APART='sometimes'"):
        current()


def test_the_call_time_knobs_are_the_ones_changed_at_run_time() -> None:
    assert {k.env for k in knobs() if k.when == "call"} == {
        "IPU_EMULATOR_FORKSERVER", "IPU_EMULATOR_KEEP_APART", "IPU_EMULATOR_DEVICE_LOG_LEVEL",
        "IPU_EMULATOR_DAEMON_LOG_LEVEL", "IPU_EMULATOR_HOST_SYNC_TIMEOUT"}


# -- every module reads its knobs through shm.settings --------------------------------------

def _py_files() -> list[Path]:
    return [p for pkg in ("shm", "ipu_emulator", "host_runtime", "tools")
            for p in (ROOT / pkg).rglob("*.py")]


def _env_reads(tree: ast.AST) -> set[str]:
    """Names in os.environ.get("X") / os.environ["X"] / os.getenv("X") / "X" in os.environ."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and ast.unparse(node.func) in ("os.environ.get", "os.getenv", "env.get",
                                                "environ.get"):
            found.add(str(node.args[0].value))
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) \
                and ast.unparse(node.value) in ("os.environ", "env", "environ"):
            found.add(str(node.slice.value))
    return found


def test_no_module_reads_a_knob_from_the_environment_itself() -> None:
    offenders = {}
    for path in _py_files():
        if path == ROOT / "shm" / "settings.py":
            continue
        read = _env_reads(ast.parse(path.read_text(), str(path))) & ENV_NAMES
        if read:
            offenders[str(path.relative_to(ROOT))] = read
    assert not offenders, f"read from os.environ instead of shm.settings: {offenders}"


def test_each_knob_is_read_where_its_field_says_and_the_right_way() -> None:
    where: dict[str, set[str]] = {name: set() for name in KNOBS}
    for path in _py_files():
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Call) \
                    and ast.unparse(node.value.func) in ("settings", "current"):
                knob = KNOBS[node.attr]
                how = ast.unparse(node.value.func)
                # call-time knobs through current(), others through the cached object
                assert how == ("current" if knob.when == "call" else "settings"), (rel, node.attr)
                where[node.attr].add(rel)
    for name, files in where.items():
        named = {m.split(" ")[0] for m in KNOBS[name].used_in.split(", ")}
        assert files == named, f"{name}: read in {sorted(files)}, its field names {sorted(named)}"


# -- README -------------------------------------------------------------------------------

def test_readme_table_lists_every_knob_as_settings_describes_it() -> None:
    readme = (ROOT / "README.md").read_text()
    missing = [row for row in readme_table().splitlines() if row not in readme.splitlines()]
    assert not missing, ("README.md's table differs from `python -m shm.settings`; "
                         f"rows not found: {missing}")


def test_every_variable_named_anywhere_is_a_knob_or_listed_as_not_a_setting() -> None:
    named: dict[str, set[str]] = {}
    files = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *_py_files(),
             *(ROOT / "tests").rglob("*.py")]
    for path in files:
        for var in re.findall(r"IPU_EMULATOR_[A-Z][A-Z0-9_]*[A-Z0-9]", path.read_text()):
            named.setdefault(var, set()).add(str(path.relative_to(ROOT)))
    unknown = {v: sorted(f) for v, f in named.items()
               if v not in ENV_NAMES and v not in NOT_SETTINGS}
    assert not unknown, f"not in shm.settings (neither a knob nor NOT_SETTINGS): {unknown}"
    assert not ENV_NAMES & set(NOT_SETTINGS)
    assert set(NOT_SETTINGS) <= set(named)            # the list names no stale variable


# -- the spin helper ------------------------------------------------------------------------

def test_spin_until_returns_when_ready() -> None:
    calls = iter([False, False, True])
    assert spin_until(lambda: next(calls), 10**9) is True
    assert spin_until(lambda: True, 0) is True


@pytest.mark.parametrize("yield_cpu", [True, False])
def test_spin_until_gives_up_after_its_budget(yield_cpu: bool) -> None:
    t0 = time.perf_counter_ns()
    assert spin_until(lambda: False, 2_000_000, yield_cpu=yield_cpu) is False
    assert time.perf_counter_ns() - t0 >= 2_000_000


def test_spin_until_gives_up_when_a_yield_shows_a_shared_cpu(monkeypatch) -> None:
    yields: list[int] = []
    real = os.sched_yield
    monkeypatch.setattr(os, "sched_yield", lambda: (yields.append(1), real())[1])
    t0 = time.perf_counter_ns()
    assert spin_until(lambda: False, 10**10, shared_ns=0) is False
    assert yields == [1]       # the first yield took longer than 0 ns: stop at once
    assert time.perf_counter_ns() - t0 < 10**9


def test_spin_until_does_not_yield_for_its_first_microseconds(monkeypatch) -> None:
    """Polls within HOT_NS make no system call between them; past it they yield."""
    import shm.spin

    yields: list[int] = []
    monkeypatch.setattr(os, "sched_yield", lambda: yields.append(1))
    monkeypatch.setattr(shm.spin, "HOT_NS", 10**12)       # all of the poll is "hot"
    calls = iter([False] * 5 + [True])
    assert spin_until(lambda: next(calls), 10**13) is True
    assert yields == []
    monkeypatch.setattr(shm.spin, "HOT_NS", 1000)         # past 1 us it yields
    assert spin_until(lambda: len(yields) >= 3, 10**10) is True
    assert len(yields) == 3


def test_spin_until_says_when_it_gave_up_for_a_shared_cpu() -> None:
    told: list[int] = []
    assert spin_until(lambda: False, 10**10, shared_ns=0, on_shared=lambda: told.append(1)) \
        is False
    assert told == [1]
    assert spin_until(lambda: False, 1_000_000, on_shared=lambda: told.append(2)) is False
    assert told == [1]         # ended by its budget: not told


def test_microseconds_to_nanoseconds() -> None:
    assert us_to_ns(50.0) == 50_000 and us_to_ns(0.0) == 0 and us_to_ns(0.0, NEVER) == NEVER
    assert us_to_ns(2.5) == 2500
