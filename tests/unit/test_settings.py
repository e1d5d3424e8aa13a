"""Settings: one mechanism (shm.settings) reading every IPU_EMULATOR_* variable, each layer
declaring its own knobs, errors that name the variable, the value and what is allowed,
override() blocks, no knob frozen at import, and README's table being the knobs' own."""

from __future__ import annotations

import ast
import functools
import os
import re
import threading
import time
from pathlib import Path

import pytest

import host_runtime.settings as host_settings
from host_runtime.settings import HostSettings
from ipu_emulator.settings import IpuSettings
from shm import Ring, naming
from shm.settings import (EACH_USE, Settings, SettingsError, ShmSettings, override,
                          readme_table)
from shm.spin import NEVER, spin_until, us_to_ns

ROOT = Path(__file__).resolve().parents[2]
KNOBS = {k.name: k for k in HostSettings.knobs()}
ENV_NAMES = {k.env for k in HostSettings.knobs()}

TEST_ONLY = {
    "IPU_EMULATOR_CONFORMANCE": "the whole conformance run (tests/integration/test_conformance.py)",
    "IPU_EMULATOR_TEST_HANG_SECONDS": "a test's time limit (tests/conftest.py)",
    "IPU_EMULATOR_TEST_INSTALLED": "the wheel CI's wheel leg installed (.ci/run)",
    "IPU_EMULATOR_FIELD_MODELS": "a folder of production models of your own "
                                 "(tests/integration/test_field_models.py)",
}
"""Variables of the test suite, not of the package."""


@pytest.fixture
def clean_env(monkeypatch):
    """Every knob's variable unset while the test runs."""
    for k in HostSettings.knobs():
        monkeypatch.delenv(k.env, raising=False)
    return monkeypatch


# -- each layer declares its own ------------------------------------------------------------

def test_each_layer_declares_its_own_knobs_and_extends_the_one_below() -> None:
    layer = {k.name: k.layer for k in HostSettings.knobs()}
    assert {n for n, m in layer.items() if m == "shm.settings"} == {
        "ring_c", "ring_peer_thread", "ring_spin_us", "shm_tag"}
    assert {n for n, m in layer.items() if m == "host_runtime.settings"} == {
        "runner_spin_us", "runner_fused", "runner_plain", "runner_small_io", "load_timeout",
        "stop_timeout", "host_sync_timeout", "daemon"}
    assert all(m in ("shm.settings", "ipu_emulator.settings", "host_runtime.settings")
               for m in layer.values())
    assert issubclass(HostSettings, IpuSettings) and issubclass(IpuSettings, ShmSettings)
    assert [k.name for k in ShmSettings.knobs()] == [k.name for k in HostSettings.knobs()][:4]


def test_defaults_are_the_documented_ones() -> None:
    s = HostSettings.from_env({})
    assert s == HostSettings()
    assert {k.env: getattr(s, k.name) for k in HostSettings.knobs()} == {
        "IPU_EMULATOR_RING_C": True, "IPU_EMULATOR_RING_PEER_THREAD": True,
        "IPU_EMULATOR_RING_SPIN_US": 0.0, "IPU_EMULATOR_SHM_TAG": "g",
        "IPU_EMULATOR_DEVICE_SPIN_US": 50.0,
        "IPU_EMULATOR_RUNNER_SPIN_US": 100.0, "IPU_EMULATOR_YIELDED_US": 5.0,
        "IPU_EMULATOR_RUNNER_FUSED": True, "IPU_EMULATOR_RUNNER_PLAIN": True,
        "IPU_EMULATOR_RUNNER_SMALL_IO": True,
        "IPU_EMULATOR_ZERO_COPY": True, "IPU_EMULATOR_PREPACK": True,
        "IPU_EMULATOR_KEEP_APART": True, "IPU_EMULATOR_FORKSERVER": True, "IPU_EMULATOR_DEVICE_LOG_LEVEL": "WARNING",
        "IPU_EMULATOR_DAEMON_LOG_LEVEL": "INFO", "IPU_EMULATOR_START_TIMEOUT": 120.0,
        "IPU_EMULATOR_LOAD_TIMEOUT": 300.0, "IPU_EMULATOR_STOP_TIMEOUT": 30.0,
        "IPU_EMULATOR_HOST_SYNC_TIMEOUT": 60.0, "IPU_EMULATOR_DAEMON_HANDOVER_TIMEOUT": 30.0,
        "IPU_EMULATOR_HOME": None, "IPU_EMULATOR_CONFIG": None, "IPU_EMULATOR_NUM_IPUS": None,
        "IPU_EMULATOR_IPU_VERSION": None, "IPU_EMULATOR_TILES_PER_IPU": None,
        "IPU_EMULATOR_MEMORY_PER_TILE": None, "IPU_EMULATOR_COMPUTE_THREADS": None,
        "IPU_EMULATOR_DAEMON": None, "IPU_EMULATOR_FAULTS": "", "IPU_EMULATOR_TRACE": None,
        "IPU_EMULATOR_TRACE_EVENTS": 65536, "IPU_EMULATOR_FORCE_MODULES": False}
    with pytest.raises(AttributeError):
        s.ring_c = False   # type: ignore[misc]   # frozen


def test_values_parse_by_kind() -> None:
    s = HostSettings.from_env({
        "IPU_EMULATOR_RING_C": "0", "IPU_EMULATOR_ZERO_COPY": "off",
        "IPU_EMULATOR_KEEP_APART": "Yes", "IPU_EMULATOR_RING_SPIN_US": "2.5",
        "IPU_EMULATOR_YIELDED_US": "0", "IPU_EMULATOR_STOP_TIMEOUT": "0.5",
        "IPU_EMULATOR_DEVICE_LOG_LEVEL": "debug", "IPU_EMULATOR_FORKSERVER": "",   # empty: default
        "IPU_EMULATOR_IPU_VERSION": "2", "IPU_EMULATOR_MEMORY_PER_TILE": "64 KiB",
        "IPU_EMULATOR_NUM_IPUS": "8", "IPU_EMULATOR_" + "UNRELATED": "x"})   # not a knob: ignored
    assert (s.ring_c, s.zero_copy, s.keep_apart, s.forkserver) == (False, False, True, True)
    assert (s.ring_spin_us, s.yielded_us, s.stop_timeout) == (2.5, 0.0, 0.5)
    assert s.device_log_level == "DEBUG"
    assert (s.ipu_version, s.memory_per_tile, s.num_ipus) == ("ipu2", 65536, 8)


@pytest.mark.parametrize("var, text, expected", [
    ("IPU_EMULATOR_RING_SPIN_US", "abc", "expected a number of microseconds in 0..10000"),
    ("IPU_EMULATOR_DEVICE_SPIN_US", "-1", "expected a number of microseconds in 0..10000"),
    ("IPU_EMULATOR_YIELDED_US", "nan", "expected a number of microseconds in 0..10000"),
    ("IPU_EMULATOR_STOP_TIMEOUT", "0", "expected a number of seconds in 0.001..86400"),
    ("IPU_EMULATOR_LOAD_TIMEOUT", "inf", "expected a number of seconds in 0.001..86400"),
    ("IPU_EMULATOR_ZERO_COPY", "maybe", "expected 0 or 1 (or true/false, yes/no, on/off)"),
    ("IPU_EMULATOR_DEVICE_LOG_LEVEL", "LOUD",
     "expected a logging level, one of DEBUG, INFO, WARNING, ERROR, CRITICAL"),
    ("IPU_EMULATOR_SHM_TAG", "no-dashes", "expected 1-16 letters or digits"),
    ("IPU_EMULATOR_NUM_IPUS", "four", "expected an integer in 0..64"),
    ("IPU_EMULATOR_NUM_IPUS", "65", "expected an integer in 0..64"),
    ("IPU_EMULATOR_IPU_VERSION", "ipu3", "expected one of ipu2, ipu21, 2, 21"),
    ("IPU_EMULATOR_MEMORY_PER_TILE", "lots",
     "expected an integer in 1..4294967296 (or with a suffix k, KiB, m, MiB)"),
])
def test_a_bad_value_names_the_variable_what_was_expected_and_given(var, text, expected) -> None:
    with pytest.raises(SettingsError) as info:
        HostSettings.from_env({var: text})
    assert str(info.value) == f"{var}={text!r}: {expected}"
    assert isinstance(info.value, ValueError)


def test_every_bad_value_is_reported_at_once_and_a_huge_one_is_capped() -> None:
    with pytest.raises(SettingsError, match=r"^IPU_EMULATOR_RING_C='2': expected 0 or 1 .*; "
                                            r"IPU_EMULATOR_START_TIMEOUT='soon': expected"):
        IpuSettings.from_env({"IPU_EMULATOR_RING_C": "2", "IPU_EMULATOR_START_TIMEOUT": "soon"})
    with pytest.raises(SettingsError) as info:
        HostSettings.from_env({"IPU_EMULATOR_STOP_TIMEOUT": "x" * 1_000_000})
    assert len(str(info.value)) < 300 and "1000000 chars" in str(info.value)


def test_a_bad_value_fails_what_takes_the_settings_with_that_message(clean_env) -> None:
    clean_env.setenv("IPU_EMULATOR_RING_SPIN_US", "abc")
    with pytest.raises(SettingsError, match=r"^IPU_EMULATOR_RING_SPIN_US='abc': expected a "
                                            r"number of microseconds in 0\.\.10000$"):
        Ring.create(64, 2)
    clean_env.setenv("IPU_EMULATOR_SHM_TAG", "a/b")
    with pytest.raises(SettingsError, match=r"^IPU_EMULATOR_SHM_TAG='a/b': expected 1-16"):
        naming.new_name("ring")


# -- read when used: the environment, overrides ---------------------------------------------

def test_current_follows_the_environment_and_is_cached_while_it_stays(clean_env) -> None:
    first = HostSettings.current()
    assert HostSettings.current() is first          # cached: nothing changed
    clean_env.setenv("IPU_EMULATOR_RUNNER_SPIN_US", "7")
    now = HostSettings.current()
    assert now.runner_spin_us == 7.0 and first.runner_spin_us == 100.0   # a snapshot each
    assert host_settings.current() is now
    assert IpuSettings.current().device_spin_us == 50.0
    assert type(IpuSettings.current()) is IpuSettings


def test_override_changes_the_values_inside_the_block_only(clean_env) -> None:
    clean_env.setenv("IPU_EMULATOR_HOST_SYNC_TIMEOUT", "5")
    before = HostSettings.current()
    with override(host_sync_timeout=2, ring_spin_us="3.5", zero_copy=False, shm_tag="ovr1"):
        s = HostSettings.current()
        assert (s.host_sync_timeout, s.ring_spin_us, s.zero_copy) == (2.0, 3.5, False)
        assert ShmSettings.current().ring_spin_us == 3.5 and IpuSettings.current().zero_copy \
            is False                                  # every layer's view sees it
        assert naming.current_tag() == "ovr1"         # knobs read at each use too
        assert naming.new_name("ring").startswith("/ipuemu_ovr1_")
        with host_settings.override(host_sync_timeout=3):   # nested: the inner one wins
            assert HostSettings.current().host_sync_timeout == 3.0
            assert HostSettings.current().zero_copy is False
        assert HostSettings.current().host_sync_timeout == 2.0
        assert os.environ["IPU_EMULATOR_HOST_SYNC_TIMEOUT"] == "5"   # the environment unchanged
    assert HostSettings.current() == before and before.host_sync_timeout == 5.0
    assert naming.current_tag() == "g"


def test_override_ends_on_an_exception_and_other_threads_see_it(clean_env) -> None:
    seen: list[float] = []
    with pytest.raises(KeyError):
        with override(load_timeout=9):
            t = threading.Thread(target=lambda: seen.append(HostSettings.current().load_timeout))
            t.start()
            t.join()
            raise KeyError("boom")
    assert seen == [9.0] and HostSettings.current().load_timeout == 300.0


def test_override_checks_names_and_values_as_the_variables_are() -> None:
    with pytest.raises(TypeError, match=r"override\(\) got unknown settings \['ring_speed'\]; "
                                        r"the settings are \[.*'ring_c'"):
        with override(ring_speed=1):
            pass
    with pytest.raises(SettingsError, match=r"^IPU_EMULATOR_STOP_TIMEOUT='0': expected a "
                                            r"number of seconds in 0\.001\.\.86400$"):
        with override(stop_timeout=0):
            pass
    with pytest.raises(SettingsError, match=r"^IPU_EMULATOR_ZERO_COPY=1: expected True or False"):
        with override(zero_copy=1):
            pass
    with pytest.raises(SettingsError, match=r"^IPU_EMULATOR_NUM_IPUS=True: expected a value"):
        with override(num_ipus=True):
            pass
    with override(device_log_level="debug", num_ipus=None):   # None: a knob without default
        assert HostSettings.current().device_log_level == "DEBUG"
    assert HostSettings.current().device_log_level in ("WARNING", os.environ.get(
        "IPU_EMULATOR_DEVICE_LOG_LEVEL", "").upper())


def test_replace_and_to_env_carry_the_knobs_into_a_child_environment() -> None:
    s = HostSettings().replace(ring_c=False, device_spin_us=12.5, stop_timeout="2")
    assert (s.ring_c, s.device_spin_us, s.stop_timeout) == (False, 12.5, 2.0)
    with pytest.raises(TypeError, match=r"HostSettings has no settings \['nope'\]"):
        s.replace(nope=1)
    env = s.to_env()
    assert env["IPU_EMULATOR_RING_C"] == "0" and env["IPU_EMULATOR_DEVICE_SPIN_US"] == "12.5"
    # the knobs read at each use say which machine: never copied into a child
    assert not {k.env for k in HostSettings.knobs() if k.when == EACH_USE} & set(env)
    assert HostSettings.from_env(env) == s          # the child reads back the same values


def test_read_takes_one_knob_now_from_a_mapping_or_the_environment(clean_env) -> None:
    assert HostSettings.read("daemon") is None
    clean_env.setenv("IPU_EMULATOR_DAEMON", "/x.sock")
    assert HostSettings.read("daemon") == "/x.sock"
    assert HostSettings.read("daemon", {}) is None
    assert IpuSettings.read("num_ipus", {"IPU_EMULATOR_NUM_IPUS": "2"}) == 2
    with override(daemon="/y.sock"):
        assert HostSettings.read("daemon") == "/y.sock"
        assert HostSettings.read("daemon", {}) is None   # a mapping given: no overrides


def test_a_lookup_parses_nothing_while_nothing_changed(monkeypatch) -> None:
    """Objects take their settings once, when made; even so, current() parses the
    environment only when it (or an override) changed: the same object comes back."""
    first = HostSettings.current()
    parses = []
    real = HostSettings.from_env.__func__          # type: ignore[attr-defined]

    def counting(cls, env):
        parses.append(1)
        return real(cls, env)

    monkeypatch.setattr(HostSettings, "from_env", classmethod(counting))
    assert all(HostSettings.current() is first for _ in range(100)) and parses == []
    monkeypatch.setenv("IPU_EMULATOR_STOP_TIMEOUT", "7")
    changed = HostSettings.current()
    assert changed.stop_timeout == 7 and parses == [1]
    assert HostSettings.current() is changed and parses == [1]


# -- no module keeps a knob of its own ------------------------------------------------------

def _py_files() -> list[Path]:
    return [p for pkg in ("shm", "ipu_emulator", "host_runtime", "tools")
            for p in (ROOT / pkg).rglob("*.py")]


@functools.cache
def _tree(path: Path) -> ast.Module:
    """The module's syntax tree, parsed once for the scans below (they only read it)."""
    return ast.parse(path.read_text(), str(path))


def _env_reads(tree: ast.AST) -> set[str]:
    """Names in os.environ.get("X") / os.environ["X"] / os.getenv("X") / env.get("X")."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.func, ast.Attribute) \
                and ast.unparse(node.func) in ("os.environ.get", "os.getenv", "env.get",
                                                "environ.get"):
            found.add(str(node.args[0].value))
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) \
                and isinstance(node.ctx, ast.Load) \
                and isinstance(node.value, (ast.Name, ast.Attribute)) \
                and ast.unparse(node.value) in ("os.environ", "env", "environ"):
            found.add(str(node.slice.value))
    return found


def test_no_module_reads_a_knob_from_the_environment_itself() -> None:
    offenders = {}
    for path in _py_files():
        if path == ROOT / "shm" / "settings.py":
            continue
        read = _env_reads(_tree(path)) & ENV_NAMES
        if read:
            offenders[str(path.relative_to(ROOT))] = read
    assert not offenders, f"read from os.environ instead of the settings: {offenders}"


def _import_time_reads(tree: ast.Module) -> list[str]:
    """Calls of ``X.current()`` / ``X.read(...)`` / ``settings()`` outside any function."""
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return
        if isinstance(node, ast.Call):
            func = ast.unparse(node.func)
            if func.endswith((".current", ".read")) and "Settings" in func \
                    or func in ("settings", "current", "host_sync_timeout"):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def test_no_module_reads_a_setting_when_it_is_imported() -> None:
    """No module-level copy: a test changes any knob without a new process, and the
    fork server's template (imported once) serves every setting."""
    offenders = {}
    for path in _py_files():
        if path.parts[-2:] == ("host_runtime", "settings.py"):
            continue   # its __main__ block prints the table
        found = _import_time_reads(_tree(path))
        if found:
            offenders[str(path.relative_to(ROOT))] = found
    assert not offenders, f"settings read at import: {offenders}"
    # the scan does see such a read
    assert _import_time_reads(ast.parse("X = HostSettings.current().ring_c\n"
                                        "def f():\n    return HostSettings.current()\n"))


def test_the_fork_server_compares_no_setting() -> None:
    from ipu_emulator.ipu.forkserver import IMPORT_TIME_ENV

    assert not set(IMPORT_TIME_ENV) & ENV_NAMES
    assert "PYTHONPATH" in IMPORT_TIME_ENV


def test_only_settings_modules_declare_knobs() -> None:
    declared = {}
    for path in _py_files():
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id == "knob":
                declared.setdefault(str(path.relative_to(ROOT)), 0)
                declared[str(path.relative_to(ROOT))] += 1
    assert set(declared) == {"shm/settings.py", "ipu_emulator/settings.py",
                             "host_runtime/settings.py"}
    assert sum(declared.values()) == len(KNOBS)


# -- README -------------------------------------------------------------------------------

def test_readme_table_lists_every_knob_as_the_settings_describe_it() -> None:
    readme = (ROOT / "README.md").read_text().splitlines()
    rows = host_settings.table().splitlines()
    assert rows == readme_table(HostSettings).splitlines() and len(rows) == len(KNOBS)
    missing = [row for row in rows if row not in readme]
    assert not missing, ("README.md's table differs from `python -m host_runtime.settings`; "
                         f"rows not found: {missing}")
    # one table: its rows stand together, and no other row names a knob
    at = readme.index(rows[0])
    assert readme[at:at + len(rows)] == rows
    others = [ln for ln in readme[:at] + readme[at + len(rows):]
              if ln.startswith("| `IPU_EMULATOR_")]
    assert not others, others


def test_every_variable_named_anywhere_is_a_knob_or_the_test_suites() -> None:
    named: dict[str, set[str]] = {}
    files = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *_py_files(),
             *(ROOT / "tests").rglob("*.py")]
    for path in files:
        for var in re.findall(r"IPU_EMULATOR_[A-Z][A-Z0-9_]*[A-Z0-9]", path.read_text()):
            named.setdefault(var, set()).add(str(path.relative_to(ROOT)))
    unknown = {v: sorted(f) for v, f in named.items() if v not in ENV_NAMES and v not in TEST_ONLY}
    assert not unknown, f"neither a knob nor a variable of the test suite: {unknown}"
    assert set(TEST_ONLY) <= set(named)             # the list names no stale variable
    for var in TEST_ONLY:                           # and the package never reads them
        assert not any(f.split("/")[0] in ("shm", "ipu_emulator", "host_runtime")
                       for f in named[var]), var


def test_settings_classes_are_the_three_layers() -> None:
    assert Settings.knobs() == ()
    assert {c.__module__ for c in (ShmSettings, IpuSettings, HostSettings)} == {
        "shm.settings", "ipu_emulator.settings", "host_runtime.settings"}


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
