"""Settings: the one reader of ``IPU_EMULATOR_*`` variables, and the ring's own knobs.

Each layer declares its knobs in a frozen dataclass that extends the one below
it, so that one object carries every knob down the layers::

    shm.settings.ShmSettings                 the rings' knobs, the shared-memory tag
      ipu_emulator.settings.IpuSettings      the IPU process, its launch, the daemon, the machine
        host_runtime.settings.HostSettings   the host: runner, sessions, devices, daemon client

A knob is a field declared with :func:`knob`: its default, its variable, a
parser and a line of documentation. Nothing outside this module reads the
environment for them:

- ``Cls.current()`` is the object for now: ``os.environ`` (an unset or empty
  variable means the default), then the overrides of :func:`override` on top.
  It is cached by the variables' texts, so it costs one look-up per variable
  (about 10 us for all of them, no parsing); an object that needs knobs takes it
  once, when it is made (a ring, an IPU process, a device, a session, a runner,
  a daemon), and passes it to what it makes, so that a runner made under an
  override keeps it for its whole life.
  Nothing reads a knob per request, and no module keeps one in a constant.
- ``Cls.read(name)`` is one knob, now: for the knobs marked ``when=EACH_USE``,
  which select the machine (its home, its shared-memory tag, its daemon...) and
  which tests and the pytest plugin change at run time.
- ``settings.to_env()`` is how the knobs cross into a child process: the launcher
  puts them into an IPU process's environment, where ``current()`` reads them.

A value that does not parse, or lies outside its knob's range, raises
:class:`SettingsError` naming the variable, the value and what is allowed
(``IPU_EMULATOR_RING_SPIN_US='1e20': expected a number of microseconds in
0..10000``); ``from_env`` reports every bad one at once. Every number is bounded:
spin budgets by ``MAX_SPIN_US``, timeouts by ``MIN_TIMEOUT``..``MAX_TIMEOUT``,
integers by their knob's range; NaN and infinities are refused. An empty variable
means the knob's default, as an unset one does.

``python -m host_runtime.settings`` prints README.md's table of every knob
(:func:`readme_table`; tests/unit/test_settings.py checks that README.md holds it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import threading
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterator, Mapping, NamedTuple, TypeVar

from .errors import echo

__all__ = ["Settings", "ShmSettings", "SettingsError", "Knob", "knob", "override", "readme_table",
           "EACH_USE", "flag", "micros", "seconds", "level", "text", "integer", "choice",
           "accepted", "accepts", "is_digits", "MAX_SPIN_US", "MIN_TIMEOUT", "MAX_TIMEOUT"]

_S = TypeVar("_S", bound="Settings")

EACH_USE = "at once"
"""``when`` of a knob read at each use (:meth:`Settings.read`), never kept in an object."""


class SettingsError(ValueError):
    """An ``IPU_EMULATOR_*`` variable (or an override) holds a value its knob cannot take."""


# -- parsers: (variable, text) -> value; SettingsError names the variable ------------------

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


_ALLOWED: dict[Callable[[str, str], Any], str] = {}   # parser -> what it accepts (README)


def accepted(parse: Callable[[str, str], Any]) -> str:
    """What ``parse`` accepts, as README's table says it."""
    return _ALLOWED.get(parse, "")


def accepts(what: str) -> Callable[[Callable[[str, str], Any]], Callable[[str, str], Any]]:
    """Decorator of a parser: README's table says it accepts ``what``."""
    def register(parse: Callable[[str, str], Any]) -> Callable[[str, str], Any]:
        _ALLOWED[parse] = what
        return parse
    return register


def _bad(var: str, value: object, allowed: str) -> SettingsError:
    return SettingsError(f"{var}={echo(value)}: expected {allowed}")


@accepts("`0`/`1` (`true`/`false`, `yes`/`no`, `on`/`off`)")
def flag(var: str, text: str) -> bool:
    """``1``/``0`` (or true/false, yes/no, on/off)."""
    low = text.strip().lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise _bad(var, text, "0 or 1 (or true/false, yes/no, on/off)")


MAX_SPIN_US = 10_000.0
"""The longest spin or poll budget a knob takes: 10 ms (a spin burns a CPU)."""
MIN_TIMEOUT, MAX_TIMEOUT = 0.001, 86_400.0
"""The shortest and longest timeout a knob takes: 1 ms and a day."""


def is_digits(text: str) -> bool:
    """``text`` is one or more of 0-9: a number a user wrote (``str.isdigit`` takes '²',
    which ``int`` refuses, and ``int`` takes '٤' and '1_0', which no setting should)."""
    return text.isascii() and text.isdigit()


def _number(var: str, text: str, what: str, lo: float, hi: float) -> float:
    try:   # ASCII and no '_' (float() takes '٤' and '1_0')
        value = float(text) if text.isascii() and "_" not in text else math.nan
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or not lo <= value <= hi:
        raise _bad(var, text, f"a number of {what} in {lo:g}..{hi:g}")
    return value


@accepts(f"0..{MAX_SPIN_US:g} µs")
def micros(var: str, text: str) -> float:
    """A number of microseconds in 0..``MAX_SPIN_US``."""
    return _number(var, text, "microseconds", 0.0, MAX_SPIN_US)


@accepts(f"{MIN_TIMEOUT:g}..{MAX_TIMEOUT:g} s")
def seconds(var: str, text: str) -> float:
    """A number of seconds in ``MIN_TIMEOUT``..``MAX_TIMEOUT``."""
    return _number(var, text, "seconds", MIN_TIMEOUT, MAX_TIMEOUT)


@accepts("`DEBUG`, `INFO`, `WARNING`, `ERROR`, `CRITICAL`")
def level(var: str, text: str) -> str:
    """A logging level name (any case)."""
    name = text.strip().upper()
    if name not in _LEVELS:
        raise _bad(var, text, f"a logging level, one of {', '.join(_LEVELS)}")
    return name


def text(pattern: str = "", allowed: str = "", shown: str = "") -> Callable[[str, str], str]:
    """A parser of text matching ``pattern`` (any text if empty), described as ``allowed``
    in errors and as ``shown`` (default ``allowed``) in README's table."""
    compiled = re.compile(pattern) if pattern else None

    def parse(var: str, value: str) -> str:
        if compiled is not None and not compiled.fullmatch(value):
            raise _bad(var, value, allowed)
        return value
    _ALLOWED[parse] = shown or allowed or "any text"
    return parse


_UNITS = {"kib": 1024, "k": 1024, "mib": 1024 ** 2, "m": 1024 ** 2}


def integer(lo: int, hi: int, units: bool = False) -> Callable[[str, str], int]:
    """A parser of an integer in ``lo..hi`` (with ``units``: a k/KiB/m/MiB suffix too)."""
    allowed = f"an integer in {lo}..{hi}" + (" (or with a suffix k, KiB, m, MiB)" if units else "")

    def parse(var: str, value: str) -> int:
        low = value.strip().lower()
        factor = 1
        if units:
            for suffix, f in _UNITS.items():
                if low.endswith(suffix):
                    low, factor = low[:-len(suffix)].strip(), f
                    break
        if not is_digits(low) or len(low) > 24 or not lo <= int(low) * factor <= hi:
            raise _bad(var, value, allowed)
        return int(low) * factor
    _ALLOWED[parse] = f"{lo}..{hi}"
    return parse


def choice(values: Mapping[str, str]) -> Callable[[str, str], str]:
    """A parser of one of ``values``' keys (any case), giving the key's value."""
    def parse(var: str, value: str) -> str:
        found = values.get(value.strip().lower())
        if found is None:
            raise _bad(var, value, f"one of {', '.join(values)}")
        return found
    _ALLOWED[parse] = ", ".join(f"`{v}`" for v in values)
    return parse


_SHOWN_UNITS: dict[Callable[[str, str], Any], str] = {micros: " µs", seconds: " s"}


# -- declaring knobs ----------------------------------------------------------------------

def knob(default: Any, env: str, parse: Callable[[str, str], Any], doc: str, *,
         when: str, shown: str = "") -> Any:
    """A field of a :class:`Settings` class: ``default``, read from ``env`` with ``parse``.

    ``when`` says when it acts, as README's table says it: when the object that takes
    the settings is made (``"a ring is made"``, ``"an IPU process starts"``, ...), or
    :data:`EACH_USE`. ``shown``: the default as the table shows it (when the value alone
    does not say it)."""
    return dataclasses.field(default=default, metadata={
        "env": env, "parse": parse, "doc": doc, "when": when, "shown": shown})


class Knob(NamedTuple):
    """One field of a :class:`Settings` class, described."""

    name: str           # the field
    env: str            # its variable
    default: Any
    doc: str
    when: str           # when it acts (see knob())
    parse: Callable[[str, str], Any]
    shown: str          # the default as README shows it, if not the value's own text
    layer: str          # the module of the class that declares it

    def default_text(self) -> str:
        """The default as the README shows it."""
        if self.shown:
            return self.shown
        if isinstance(self.default, bool):
            return f"`{int(self.default)}`"
        if isinstance(self.default, float):
            return f"{self.default:g}{_SHOWN_UNITS.get(self.parse, '')}"
        return f"`{self.default}`"

    def format(self, value: Any) -> str:
        """``value`` as the variable's text (``parse`` gives ``value`` back)."""
        if value is None:
            return ""
        if isinstance(value, bool):
            return "1" if value else "0"
        if isinstance(value, float):
            return repr(value)
        return str(value)


# -- overrides ------------------------------------------------------------------------------

_lock = threading.Lock()
_frames: list[dict[str, Any]] = []     # the active override() blocks, oldest first
_state: tuple[int, dict[str, Any]] = (0, {})   # (generation, the frames' union, later ones
                                                #  winning): replaced whole at every change
_classes: list[type["Settings"]] = []  # every Settings class, for override()'s names


@contextlib.contextmanager
def override(**values: Any) -> Iterator[None]:
    """Use these knob values in this process while the block runs (any layer's knobs).

    ``with override(host_sync_timeout=2.0, device_spin_us=0): runner = ModelRunner(path)``:
    the runner (its devices, sessions, rings and IPU processes) is made with them and keeps
    them for its life; after the block, objects are made with the old values again. Values
    are checked as the variables are (``SettingsError`` naming the knob's variable) and may
    be given as Python values or as the variables' text. The overrides are the process's,
    seen by every thread, as the environment is; blocks nest. ``os.environ`` is not
    changed: a child process started by other means than this project's launchers does
    not see them."""
    known = {k.name: k for cls in _classes for k in cls.knobs()}
    unknown = sorted(set(values) - set(known))
    if unknown:
        raise TypeError(f"override() got unknown settings {unknown}; the settings are "
                        f"{sorted(known)}")
    frame = {name: _parse_value(known[name], value) for name, value in values.items()}
    with _lock:
        _frames.append(frame)
        _changed()
    try:
        yield
    finally:
        with _lock:
            for i in range(len(_frames) - 1, -1, -1):
                if _frames[i] is frame:
                    del _frames[i]
                    break
            _changed()


def _changed() -> None:
    global _state
    merged: dict[str, Any] = {}
    for frame in _frames:
        merged.update(frame)
    _state = (_state[0] + 1, merged)


def _parse_value(k: Knob, value: Any) -> Any:
    if isinstance(value, str):
        return k.parse(k.env, value) if value != "" else k.default
    if value is None:
        if k.default is not None:
            raise SettingsError(f"{k.env}=None: only knobs without a default may be unset")
        return None
    if isinstance(k.default, bool) and not isinstance(value, bool):
        raise _bad(k.env, value, "True or False (or the text 0 or 1)")
    if isinstance(value, bool) and not isinstance(k.default, bool):
        raise _bad(k.env, value, "a value of the knob's kind, not True or False")
    return k.parse(k.env, k.format(value))


# -- the settings classes -------------------------------------------------------------------

_FEW_KNOBS = 8   # current(): up to this many, a knob not set costs less than listing os.environ


@dataclass(frozen=True)
class Settings:
    """Base of each layer's settings class (no knobs of its own); see the module docstring."""

    _knobs: ClassVar[dict[type, tuple[Knob, ...]]] = {}
    _cache: ClassVar[dict[type, tuple[Any, Any]]] = {}
    _by_name: ClassVar[dict[type, dict[str, Knob]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _classes.append(cls)

    @classmethod
    def knobs(cls) -> tuple[Knob, ...]:
        """Every knob of this class (its layer's and those below), in field order."""
        found = Settings._knobs.get(cls)
        if found is None:
            found = Settings._knobs[cls] = tuple(
                Knob(f.name, f.metadata["env"], f.default, f.metadata["doc"],
                     f.metadata["when"], f.metadata["parse"], f.metadata["shown"],
                     _declared_in(cls, f.name))
                for f in dataclasses.fields(cls))
        return found

    @classmethod
    def knob(cls, name: str) -> Knob:
        """The knob of field ``name`` (KeyError if none)."""
        by_name = Settings._by_name.get(cls)
        if by_name is None:
            by_name = Settings._by_name[cls] = {k.name: k for k in cls.knobs()}
        return by_name[name]

    @classmethod
    def from_env(cls: type[_S], environ: Mapping[str, str]) -> _S:
        """Every knob parsed from ``environ`` (no overrides); SettingsError lists every bad one."""
        values: dict[str, Any] = {}
        errors: list[str] = []
        for k in cls.knobs():
            raw = environ.get(k.env, "")
            if raw == "":
                continue
            try:
                values[k.name] = k.parse(k.env, raw)
            except SettingsError as exc:
                errors.append(str(exc))
        if errors:
            raise SettingsError("; ".join(errors))
        return cls(**values)

    @classmethod
    def current(cls: type[_S]) -> _S:
        """The settings now: ``os.environ``, then the active :func:`override` blocks."""
        env = os.environ
        knobs = cls.knobs()
        generation, over = _state
        if len(knobs) <= _FEW_KNOBS:
            key = (generation, tuple([env.get(k.env) for k in knobs]))
        else:   # the names set now: a knob not set costs a set lookup, not a KeyError
            named = set(env)   # raised in os.environ.get (the host's 33: 33 -> 9 us)
            key = (generation, tuple([env.get(k.env) if k.env in named else None
                                      for k in knobs]))
        cached = Settings._cache.get(cls)
        if cached is not None and cached[0] == key:
            return cached[1]   # type: ignore[no-any-return]
        s = cls.from_env(env)
        changes = {k.name: over[k.name] for k in knobs if k.name in over}
        if changes:
            s = dataclasses.replace(s, **changes)
        Settings._cache[cls] = (key, s)
        return s

    @classmethod
    def read(cls, name: str, environ: Mapping[str, str] | None = None) -> Any:
        """Knob ``name`` now: an override, else ``environ`` (default ``os.environ``), else
        its default. For the knobs read at each use (``when=EACH_USE``)."""
        k = cls.knob(name)
        if environ is None:
            over = _state[1]
            if name in over:
                return over[name]
            environ = os.environ
        raw = environ.get(k.env, "")
        return k.parse(k.env, raw) if raw != "" else k.default

    def replace(self: _S, **values: Any) -> _S:
        """A copy with these knobs changed (checked as :func:`override` checks them)."""
        unknown = sorted(set(values) - {k.name for k in self.knobs()})
        if unknown:
            raise TypeError(f"{type(self).__name__} has no settings {unknown}")
        return dataclasses.replace(self, **{n: _parse_value(self.knob(n), v)
                                            for n, v in values.items()})

    def to_env(self) -> dict[str, str]:
        """The variables that give a child process these settings (the knobs kept in an
        object, not those read at each use)."""
        return {k.env: k.format(getattr(self, k.name)) for k in self.knobs()
                if k.when != EACH_USE and getattr(self, k.name) is not None}


def _declared_in(cls: type, name: str) -> str:
    for base in reversed(cls.__mro__):
        if name in getattr(base, "__annotations__", {}):
            return base.__module__
    return cls.__module__


# -- this layer's knobs -----------------------------------------------------------------

_RING = "a ring is made"


@dataclass(frozen=True)
class ShmSettings(Settings):
    """The wire's knobs (``shm``): rings, and the namespace of shared-memory names."""

    ring_c: bool = knob(
        True, "IPU_EMULATOR_RING_C", flag,
        "`0`: the rings' pure-Python path instead of their C hot paths (the C extension "
        "`pip install` builds)", when=_RING)
    ring_peer_thread: bool = knob(
        True, "IPU_EMULATOR_RING_PEER_THREAD", flag,
        "`0`: no thread watching the rings' peer processes and the devices' IPU processes; "
        "a wait on a ring with a peer then checks it every 50 ms, arming a kernel timer per "
        "wait (a 64-byte round trip about 10% slower), and an idle device's event thread "
        "looks at its IPU processes every 0.25 s", when=_RING)
    ring_spin_us: float = knob(
        0.0, "IPU_EMULATOR_RING_SPIN_US", micros,
        "a ring waiter's spin budget before it blocks, adapting (doubled on success, halved "
        "on failure); both the C core and the Python path; 0: no spin", when=_RING)
    shm_tag: str = knob(
        "g", "IPU_EMULATOR_SHM_TAG", text(r"[A-Za-z0-9]{1,16}", "1-16 letters or digits"),
        "namespace of shared-memory names `/ipuemu_<tag>_<pid>_<token>_<kind>` (tests give "
        "each worker its own)", when=EACH_USE)


def readme_table(cls: type[Settings]) -> str:
    """The rows of README.md's table of ``cls``'s knobs (``python -m host_runtime.settings``
    prints the host's, which are all of them)."""
    ordered = sorted(cls.knobs(), key=lambda k: k.when != EACH_USE)   # "at once" ones first
    return "\n".join(f"| `{k.env}` | {k.doc} | {k.default_text()} | {accepted(k.parse)} "
                     f"| {k.when} |" for k in ordered)
