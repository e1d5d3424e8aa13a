"""Every tuning knob of the project, read from the environment once per process.

:class:`Settings` holds one typed field per knob (its default, its variable, a
one-line doc); :func:`settings` returns the process's object, parsed from
``os.environ`` at its first call and kept. A value that does not parse raises
:class:`SettingsError` naming the variable, what was expected and what was
given (``IPU_EMULATOR_RING_SPIN_US='abc': expected a number of microseconds
(>= 0)``). An unset or empty variable means the default. ``python -m
shm.settings`` prints the README's table of the knobs (tests/unit/test_settings.py
checks that README.md holds it).

Why in ``shm``: it is the lowest layer (shm <- ipu_emulator <- host_runtime <-
tools) and ``shm.ring`` itself has knobs; every layer may import downwards, so
one module here serves them all without an upward import. It imports nothing
else of the project.

When a knob is read (the one rule):

- ``when="import"``: a module copies the value into a constant when it is
  imported (hot paths, defaults of arguments). Changing the variable later
  acts in processes started afterwards, not in this one. The knobs of that
  kind that an IPU process's modules read (``ipu=True``) are also the ones the
  fork server compares: a launch whose environment differs in one of them gets
  a template process of its own (``ipu_emulator.ipu.forkserver.IMPORT_TIME_ENV``
  is :data:`IPU_IMPORT_ENV` plus a few non-project variables).
- ``when="call"``: a decision taken per action (a launch, an IPU process's
  start), which applications and tests change at run time with the
  environment (``monkeypatch.setenv``): its user reads :func:`current`, which
  re-reads those knobs, and only those, from ``os.environ`` each time. A forked
  IPU process gets its launch's environment after the fork, so it reads these
  afresh too (its import-time knobs equal its template's by the rule above).

:func:`reload` re-reads everything into the cached object: for tests of this
module (module constants taken at import keep their values).

Not settings, read when used (they name *which* machine, not how it runs; the
pytest plugin and tests change them at run time): see :data:`NOT_SETTINGS`,
which lists each with its reader, so that every ``IPU_EMULATOR_*`` variable is
listed in this module.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Literal, Mapping, NamedTuple, TypeVar

__all__ = ["Settings", "SettingsError", "Knob", "settings", "current", "reload", "knobs",
           "IPU_IMPORT_ENV", "NOT_SETTINGS", "readme_table"]

_T = TypeVar("_T")


class SettingsError(ValueError):
    """An ``IPU_EMULATOR_*`` variable holds a value its knob cannot take."""


# -- parsers: (variable, text) -> value -------------------------------------------------

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _flag(var: str, text: str) -> bool:
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise SettingsError(f"{var}={text!r}: expected 0 or 1 (or true/false, yes/no, on/off)")


def _number(var: str, text: str, what: str, positive: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        raise SettingsError(f"{var}={text!r}: expected a number of {what} "
                            f"({'> 0' if positive else '>= 0'})")
    return value


def _micros(var: str, text: str) -> float:
    return _number(var, text, "microseconds", positive=False)


def _seconds(var: str, text: str) -> float:
    return _number(var, text, "seconds", positive=True)


def _level(var: str, text: str) -> str:
    level = text.strip().upper()
    if level not in _LEVELS:
        raise SettingsError(f"{var}={text!r}: expected a logging level, one of "
                            f"{', '.join(_LEVELS)}")
    return level


_UNITS: dict[Callable[[str, str], Any], str] = {_micros: " µs", _seconds: " s"}


def _knob(default: _T, env: str, parse: Callable[[str, str], Any], doc: str,
          when: Literal["import", "call"] = "import", ipu: bool = False,
          used_in: str = "") -> _T:
    return dataclasses.field(default=default, metadata={
        "env": env, "parse": parse, "doc": doc, "when": when, "ipu": ipu, "used_in": used_in})


@dataclass(frozen=True)
class Settings:
    """The tuning knobs (see the module docstring); build with :meth:`from_env`."""

    ring_c: bool = _knob(
        True, "IPU_EMULATOR_RING_C", _flag,
        "`0`: the rings' pure-Python path instead of their C hot paths (the C extension "
        "`pip install` builds)",
        ipu=True, used_in="shm/ring.py")
    ring_peer_thread: bool = _knob(
        True, "IPU_EMULATOR_RING_PEER_THREAD", _flag,
        "`0`: no thread watching the rings' peer processes; a wait on a ring with a peer "
        "then checks it every 50 ms, arming a kernel timer per wait (a 64-byte round trip "
        "about 10% slower)",
        ipu=True, used_in="shm/ring.py")
    ring_spin_us: float = _knob(
        0.0, "IPU_EMULATOR_RING_SPIN_US", _micros,
        "a ring waiter's spin budget before it blocks, adapting (doubled on success, halved "
        "on failure); both the C core and the Python path; 0: no spin",
        ipu=True, used_in="shm/ring.py (passed to shm/_ringcore.c)")
    device_spin_us: float = _knob(
        50.0, "IPU_EMULATOR_DEVICE_SPIN_US", _micros,
        "an IPU process's poll of an empty input ring before it blocks, while recent inputs "
        "came quickly; 0: never poll",
        ipu=True, used_in="ipu_emulator/ipu/_stream_io.py")
    runner_spin_us: float = _knob(
        100.0, "IPU_EMULATOR_RUNNER_SPIN_US", _micros,
        "the host's poll of an output ring before it blocks, while recent outputs came "
        "quickly; 0: never poll",
        used_in="host_runtime/runner/_replica.py")
    yielded_us: float = _knob(
        5.0, "IPU_EMULATOR_YIELDED_US", _micros,
        "a `sched_yield` between polls that took longer ran another task on this CPU: the "
        "poller blocks instead (IPU process unless it keeps apart, host on one CPU); "
        "0: never",
        ipu=True, used_in="ipu_emulator/ipu/_stream_io.py, host_runtime/runner/_replica.py")
    zero_copy: bool = _knob(
        True, "IPU_EMULATOR_ZERO_COPY", _flag,
        "`0`: the IPU process copies stream transfers instead of computing in ring slots "
        "(for measurements)",
        ipu=True, used_in="ipu_emulator/ipu/interpreter.py")
    keep_apart: bool = _knob(
        True, "IPU_EMULATOR_KEEP_APART", _flag,
        "`0`: the scheduler alone places IPU processes (else a busy one holds a CPU of its "
        "own, one per CPU machine-wide, off the CPU of the host thread that submits its "
        "requests)",
        when="call", ipu=True, used_in="ipu_emulator/ipu/_placement.py")
    forkserver: bool = _knob(
        True, "IPU_EMULATOR_FORKSERVER", _flag,
        "`0`: start every IPU process as a fresh `python -m ipu_emulator` instead of forking "
        "it from the host's template process (started once, with numpy and onnxruntime "
        "imported once; its log is `forkserver.log`)",
        when="call", used_in="ipu_emulator/ipu/forkserver.py")
    device_log_level: str = _knob(
        "WARNING", "IPU_EMULATOR_DEVICE_LOG_LEVEL", _level,
        "logging level of IPU processes (their `ipuN.log` files, under `$IPU_EMULATOR_HOME`)",
        when="call", ipu=True, used_in="ipu_emulator/ipu/process.py")
    daemon_log_level: str = _knob(
        "INFO", "IPU_EMULATOR_DAEMON_LOG_LEVEL", _level,
        "logging level of `ipu-emulator daemon` (its `--log-level` default)",
        when="call", used_in="tools/daemon.py")
    start_timeout: float = _knob(
        120.0, "IPU_EMULATOR_START_TIMEOUT", _seconds,
        "how long an IPU process may take to start (a fresh Python imports onnxruntime)",
        used_in="ipu_emulator/ipu/launcher.py")
    load_timeout: float = _knob(
        300.0, "IPU_EMULATOR_LOAD_TIMEOUT", _seconds,
        "how long loading an executable onto a device may take",
        used_in="host_runtime/session/_session.py")
    stop_timeout: float = _knob(
        30.0, "IPU_EMULATOR_STOP_TIMEOUT", _seconds,
        "how long a session's stop or close waits for its device's main loop",
        used_in="host_runtime/session/_session.py, host_runtime/session/_fastpath.py, "
                "host_runtime/runner/_replica.py")
    host_sync_timeout: float = _knob(
        60.0, "IPU_EMULATOR_HOST_SYNC_TIMEOUT", _seconds,
        "the longest any host call waits on a device or daemon that makes no progress (a "
        "stopped or stuck peer) before it fails with a named error (modelled on Poplar's "
        "`target.hostSyncTimeout`); read when a runner, session, device or queue is made",
        when="call", used_in="host_runtime/_deadline.py (its host_sync_timeout() bounds: "
                             "devices/_link.py links and their wait() (sessions; Device.close); "
                             "devices/_daemon_client.py requests to the daemon; "
                             "queues/_spsc.py a producer waiting for a free slot), "
                             "ipu_emulator/ipu/forkserver.py (the wait for the template to fork "
                             "an IPU process; past it the process starts fresh)")
    daemon_handover_timeout: float = _knob(
        30.0, "IPU_EMULATOR_DAEMON_HANDOVER_TIMEOUT", _seconds,
        "how long a daemon's reset of an IPU between hosts may take before it restarts the "
        "IPU process",
        used_in="ipu_emulator/daemon/_pool.py")

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> "Settings":
        """Parse every knob from ``environ``; SettingsError lists every bad one."""
        values: dict[str, Any] = {}
        errors: list[str] = []
        for k in knobs():
            text = environ.get(k.env, "")
            if text == "":
                continue
            try:
                values[k.name] = k.parse(k.env, text)
            except SettingsError as exc:
                errors.append(str(exc))
        if errors:
            raise SettingsError("; ".join(errors))
        return cls(**values)


class Knob(NamedTuple):
    """One field of :class:`Settings`, described."""

    name: str                # the field
    env: str                 # its variable
    default: Any
    doc: str
    when: str                # "import" or "call" (see the module docstring)
    ipu: bool                # read by an IPU process
    used_in: str             # the modules that read it
    parse: Callable[[str, str], Any]

    def default_text(self) -> str:
        """The default as the README shows it."""
        if isinstance(self.default, bool):
            return f"`{int(self.default)}`"
        if isinstance(self.default, float):
            return f"{self.default:g}{_UNITS.get(self.parse, '')}"
        return f"`{self.default}`"


_KNOBS = tuple(Knob(f.name, f.metadata["env"], f.default, f.metadata["doc"], f.metadata["when"],
                    f.metadata["ipu"], f.metadata["used_in"], f.metadata["parse"])
               for f in dataclasses.fields(Settings))


def knobs() -> tuple[Knob, ...]:
    """Every knob, in field order."""
    return _KNOBS


IPU_IMPORT_ENV = tuple(k.env for k in _KNOBS if k.ipu and k.when == "import")
"""The variables an IPU process's modules read when imported."""

_CALL = tuple(k for k in _KNOBS if k.when == "call")

NOT_SETTINGS: dict[str, str] = {
    "IPU_EMULATOR_HOME": "which machine: its locks, logs and daemon socket "
                         "(ipu_emulator/system.py emulator_home)",
    "IPU_EMULATOR_SHM_TAG": "namespace of shared-memory names (shm/naming.py current_tag)",
    "IPU_EMULATOR_DAEMON": "the daemon to attach through (host_runtime/devices/_daemon_client.py, "
                           "tools/daemon.py, tools/pytest_plugin)",
    "IPU_EMULATOR_CONFIG": "the machine's configuration file (ipu_emulator/system.py "
                           "load_system_config)",
    "IPU_EMULATOR_NUM_IPUS": "the machine's configuration (ipu_emulator/system.py)",
    "IPU_EMULATOR_IPU_VERSION": "the machine's configuration (ipu_emulator/system.py)",
    "IPU_EMULATOR_TILES_PER_IPU": "the machine's configuration (ipu_emulator/system.py)",
    "IPU_EMULATOR_MEMORY_PER_TILE": "the machine's configuration (ipu_emulator/system.py)",
    "IPU_EMULATOR_COMPUTE_THREADS": "the machine's configuration (ipu_emulator/system.py)",
    "IPU_EMULATOR_CONFORMANCE": "test suite only: the whole conformance run "
                                "(tests/integration/test_conformance.py)",
    "IPU_EMULATOR_TEST_HANG_SECONDS": "test suite only: a test's time limit (tests/conftest.py)",
}
"""Variables that are not settings, each with why and its reader: read when used (machine
selection changes at run time under tests and the pytest plugin), or by the test suite."""

_cached: Settings | None = None


def settings() -> Settings:
    """This process's settings, parsed from ``os.environ`` at the first call."""
    s = _cached
    return s if s is not None else reload()


def reload() -> Settings:
    """Parse ``os.environ`` again and keep the result (for tests; see the module docstring)."""
    global _cached
    _cached = s = Settings.from_env(os.environ)
    return s


def current() -> Settings:
    """:func:`settings` with the ``when="call"`` knobs re-read from ``os.environ`` now."""
    env = os.environ
    changes: dict[str, Any] = {}
    for k in _CALL:
        text = env.get(k.env, "")
        changes[k.name] = k.parse(k.env, text) if text else k.default
    return dataclasses.replace(settings(), **changes)


def readme_table() -> str:
    """The rows of README.md's table for the knobs (``python -m shm.settings`` prints them)."""
    return "\n".join(f"| `{k.env}` | {k.doc} | {k.default_text()} |" for k in _KNOBS)


if __name__ == "__main__":  # pragma: no cover
    sys.stdout.write(readme_table() + "\n")
