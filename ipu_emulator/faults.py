"""Deterministic fault injection: what an emulated IPU does wrong on purpose, and when.

A *fault* is one object of a list (``IPU_EMULATOR_FAULTS``: JSON text, or the path
of a JSON or YAML file holding the list)::

    {"kind": "application_error", "ipu": 0, "after": 3, "times": 1}
    {"kind": "recoverable_error", "action": "LINK_RESET"}
    {"kind": "slow", "delay_ms": 50, "probability": 0.1, "seed": 7, "times": 5}

- ``kind`` (required): ``application_error``, ``recoverable_error``,
  ``unrecoverable_error``, ``hang``, ``slow``, ``crash``, ``link_down``;
- ``ipu``: the machine's IPU id (as messages name it: ``ipu 3``); omitted: every IPU;
- ``after``: Main program runs of the matching IPUs that complete before the
  fault (default 0); or, instead, ``probability`` (0 < p <= 1) with ``seed``: each
  run is affected with that probability, drawn from ``seed`` and the run's number;
- ``times``: runs affected (default 1), in all, however many resets and IPU
  process restarts happen in between;
- ``action`` (``recoverable_error`` only): ``IPU_RESET`` (default), ``LINK_RESET``,
  ``PARTITION_RESET``, ``FULL_RESET``;
- ``delay_ms`` (``slow`` only, required): how much longer each affected run takes.

Where the schedule lives::

    owner (host or daemon)                           IPU processes (readers)
    ----------------------                           -----------------------
    FaultTable.create(faults)  -- shm region -->     FaultTable.attach(name)
      header: magic, generation (odd while written), spec length
      spec:   the faults as JSON (rewritten by add() / clear(): live injection)
      counters: per fault, runs seen and runs fired (int64), updated under flock

The counters are the owner's, not an IPU process's: an IPU process restarted by
``auto_reset`` or by the daemon attaches the same table and goes on counting, so
a fault fires ``times`` times in all. Every Main run of a matching IPU counts
once for each fault (``after`` and the probability draws use that count), so a
schedule is replayed exactly whenever the runs come in the same order.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import struct
import threading
import weakref
from dataclasses import asdict, dataclass
from typing import Any, Iterable

from shm import Region
from shm.settings import SettingsError

from ipu_emulator.errors import IpuEmulatorError
from ipu_emulator.safe_files import open_regular

__all__ = ["Fault", "FaultSpecError", "FaultTable", "KINDS", "ACTIONS", "parse_faults",
           "dumps", "setting"]

KINDS = ("application_error", "recoverable_error", "unrecoverable_error", "hang", "slow",
         "crash", "link_down")
ACTIONS = ("IPU_RESET", "LINK_RESET", "PARTITION_RESET", "FULL_RESET")
_FIELDS = ("kind", "ipu", "after", "times", "action", "delay_ms", "probability", "seed")
_MAX_IPU = 1023
_MAX_COUNT = 1 << 40


class FaultSpecError(IpuEmulatorError, ValueError):
    """A fault list that cannot be used; the message names the fault, the field and the
    value, and what is allowed."""


@dataclass(frozen=True)
class Fault:
    """One fault of a schedule (see the module docstring)."""

    kind: str
    ipu: int | None = None
    after: int = 0
    times: int = 1
    action: str = "IPU_RESET"
    delay_ms: float = 0.0
    probability: float | None = None
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The fault as its spec (fields at their defaults left out)."""
        d = {k: v for k, v in asdict(self).items() if v != _DEFAULTS[k] or k == "kind"}
        return d

    def matches(self, ipu: int) -> bool:
        return self.ipu is None or self.ipu == ipu

    def describe(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))


_DEFAULTS = asdict(Fault("x"))


def _field_error(where: str, field: str, value: Any, allowed: str) -> FaultSpecError:
    return FaultSpecError(f"{where}: field {field!r} = {value!r}: expected {allowed}")


def _int(where: str, d: dict[str, Any], field: str, lo: int, hi: int) -> int:
    v = d[field]
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise _field_error(where, field, v, f"an integer in {lo}..{hi}")
    return v


def _fault(obj: Any, where: str) -> Fault:
    if not isinstance(obj, dict):
        raise FaultSpecError(f"{where}: expected an object with a 'kind', got {obj!r}")
    unknown = sorted(set(obj) - set(_FIELDS), key=str)
    if unknown:
        raise _field_error(where, str(unknown[0]), obj[unknown[0]],
                           f"one of the fields {', '.join(_FIELDS)}")
    if "kind" not in obj:
        raise FaultSpecError(f"{where}: field 'kind' is missing: expected one of "
                             f"{', '.join(KINDS)}")
    kind = obj["kind"]
    if kind not in KINDS:
        raise _field_error(where, "kind", kind, f"one of {', '.join(KINDS)}")
    ipu = None if obj.get("ipu") is None else _int(where, obj, "ipu", 0, _MAX_IPU)
    after = _int(where, obj, "after", 0, _MAX_COUNT) if "after" in obj else 0
    times = _int(where, obj, "times", 1, _MAX_COUNT) if "times" in obj else 1
    action = obj.get("action", "IPU_RESET")
    if action not in ACTIONS:
        raise _field_error(where, "action", action, f"one of {', '.join(ACTIONS)}")
    if "action" in obj and kind != "recoverable_error":
        raise _field_error(where, "action", action, "no action: it is for kind "
                           f"'recoverable_error' only, not {kind!r}")
    delay = obj.get("delay_ms", 0.0)
    if kind == "slow" and "delay_ms" not in obj:
        raise FaultSpecError(f"{where}: field 'delay_ms' is missing: kind 'slow' needs it "
                             "(milliseconds, > 0)")
    if "delay_ms" in obj:
        if kind != "slow":
            raise _field_error(where, "delay_ms", delay, f"no delay_ms: it is for kind "
                               f"'slow' only, not {kind!r}")
        if (isinstance(delay, bool) or not isinstance(delay, (int, float))
                or not 0 < delay <= 3_600_000):
            raise _field_error(where, "delay_ms", delay, "a number of milliseconds in "
                               "(0, 3600000]")
    prob = obj.get("probability")
    if prob is not None:
        if isinstance(prob, bool) or not isinstance(prob, (int, float)) or not 0 < prob <= 1:
            raise _field_error(where, "probability", prob, "a number in (0, 1]")
        if "after" in obj:
            raise _field_error(where, "after", obj["after"], "no 'after' with 'probability' "
                               "(give one or the other)")
        if "seed" not in obj:
            raise FaultSpecError(f"{where}: field 'seed' is missing: 'probability' needs a "
                                 "seed (an integer) so that the faults are reproducible")
    if "seed" in obj:
        seed = _int(where, obj, "seed", -(1 << 62), 1 << 62)
        if prob is None:
            raise _field_error(where, "seed", seed, "no seed without 'probability'")
    else:
        seed = 0
    return Fault(kind, ipu, after, times, action, float(delay),
                 None if prob is None else float(prob), seed)


def parse_faults(value: Any, source: str = "IPU_EMULATOR_FAULTS") -> list[Fault]:
    """The faults of ``value``: a list of fault objects (or one object), JSON text of
    them, or the path of a JSON or YAML file holding them. ``FaultSpecError`` names
    ``source``, the fault's position, the field and the value."""
    if isinstance(value, Fault):
        return [value]
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return []
        if text[0] in "[{":
            try:
                value = json.loads(text)
            except ValueError as exc:
                raise FaultSpecError(f"{source}: not valid JSON ({exc}); expected a list of "
                                     "fault objects, or the path of a JSON or YAML file") from None
        else:
            value = _read_file(text, source)
            source = f"{source} ({text})"
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise FaultSpecError(f"{source}: expected a list of fault objects, got "
                             f"{type(value).__name__}")
    if len(value) > FaultTable.MAX_FAULTS:
        raise FaultSpecError(f"{source}: {len(value)} faults; at most "
                             f"{FaultTable.MAX_FAULTS} are allowed")
    return [f if isinstance(f, Fault) else _fault(f, f"{source}: fault {i}")
            for i, f in enumerate(value)]


def _read_file(path: str, source: str) -> Any:
    try:
        with open_regular(path) as f:   # a FIFO there is refused, not waited on
            raw = f.read(1 << 20).decode("utf-8")
    except (OSError, ValueError, UnicodeDecodeError) as exc:   # ValueError: a NUL in the name
        why = exc.strerror if isinstance(exc, OSError) else str(exc)
        raise FaultSpecError(f"{source}={path!r}: neither JSON text (it starts with '[' or "
                             f"'{{') nor a readable file: {why}") from None
    if path.endswith((".yaml", ".yml")):
        from ipu_emulator.errors import ConfigYamlError
        from ipu_emulator.yaml_config import load_yaml_text

        try:
            return load_yaml_text(raw, f"{source}={path!r}")
        except ConfigYamlError as exc:
            raise FaultSpecError(str(exc)) from None
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise FaultSpecError(f"{source}={path!r}: not valid JSON ({exc})") from None


def dumps(faults: Iterable[Fault]) -> str:
    """The canonical JSON text of ``faults`` ("" for none)."""
    items = [f.to_dict() for f in faults]
    return json.dumps(items, separators=(",", ":"), sort_keys=True) if items else ""


_PLAN = "plan:"
"""The knob's text for a :class:`FaultPlan` of this process: ``plan:<its table's name>``."""


def setting(var: str, text: str) -> str:
    """The settings knob's parser: the canonical JSON of the faults ``text`` holds (read
    from the file it names, if it names one); ``SettingsError`` names the variable,
    the fault, the field and the value. ``plan:<name>`` (what a :class:`FaultPlan`'s
    block sets) is kept as it is."""
    if text.startswith(_PLAN):
        if not text[len(_PLAN):].startswith("/"):
            raise SettingsError(f"{var}={text!r}: expected plan:<a fault table's name>")
        return text
    try:
        return dumps(parse_faults(text, var))
    except FaultSpecError as exc:
        raise SettingsError(str(exc)) from None


# -- the shared schedule --------------------------------------------------------------------

_HEAD = struct.Struct("<QQQQ")      # magic, generation, spec length, faults
_MAGIC = 0x49505546_41554C54        # "IPUFAULT"
_SPEC_AT = 64
_SPEC_MAX = 60 * 1024
_COUNT = struct.Struct("<qq")       # runs seen, runs fired (per fault)


class FaultTable:
    """A fault schedule in shared memory with its counters (module docstring).

    The owner (``create``) writes the spec (``add``, ``clear``); IPU processes
    (``attach``) read it and count (``fire``). Closing the owner's object unlinks it."""

    MAX_FAULTS = 256
    SIZE = _SPEC_AT + _SPEC_MAX + MAX_FAULTS * _COUNT.size

    def __init__(self, region: Region) -> None:
        self._region = region
        self._buf = region.buf
        self._fd = -1
        self._gen = -1
        self._faults: list[Fault] = []
        self._lock = threading.Lock()   # writers of this process

    @classmethod
    def create(cls, faults: Iterable[Fault] = ()) -> "FaultTable":
        region = Region.create(cls.SIZE, kind="faults", prefault=False)
        table = cls(region)
        _HEAD.pack_into(table._buf, 0, _MAGIC, 0, 2, 0)
        table._buf[_SPEC_AT:_SPEC_AT + 2] = b"[]"
        table.add(faults)
        return table

    @classmethod
    def attach(cls, name: str) -> "FaultTable":
        region = Region.attach(name, prefault=False)
        if region.size < cls.SIZE or _HEAD.unpack_from(region.buf, 0)[0] != _MAGIC:
            region.close()
            raise FaultSpecError(f"{name} is not a fault table")
        return cls(region)

    @property
    def name(self) -> str:
        return self._region.name

    # -- the spec ------------------------------------------------------------------------
    def faults(self) -> list[Fault]:
        """The faults now (re-read when an owner changed them)."""
        for _ in range(1000):
            _, gen, n, _count = _HEAD.unpack_from(self._buf, 0)
            if gen == self._gen:
                return self._faults
            if gen & 1:
                continue    # being written
            raw = bytes(self._buf[_SPEC_AT:_SPEC_AT + min(n, _SPEC_MAX)])
            if _HEAD.unpack_from(self._buf, 0)[1] != gen:
                continue
            self._faults = parse_faults(json.loads(raw.decode()), "fault table")
            self._gen = gen
            return self._faults
        return self._faults

    def _write(self, faults: list[Fault], keep_counts: int) -> None:
        raw = json.dumps([f.to_dict() for f in faults], separators=(",", ":")).encode()
        if len(raw) > _SPEC_MAX or len(faults) > self.MAX_FAULTS:
            raise FaultSpecError(f"a fault table holds at most {self.MAX_FAULTS} faults and "
                                 f"{_SPEC_MAX} bytes of spec; these are {len(faults)} and "
                                 f"{len(raw)}")
        with self._lock, self._locked():
            _, gen, _, _ = _HEAD.unpack_from(self._buf, 0)
            _HEAD.pack_into(self._buf, 0, _MAGIC, gen + 1, len(raw), len(faults))
            self._buf[_SPEC_AT:_SPEC_AT + len(raw)] = raw
            at = _SPEC_AT + _SPEC_MAX
            for i in range(keep_counts, self.MAX_FAULTS):
                _COUNT.pack_into(self._buf, at + i * _COUNT.size, 0, 0)
            _HEAD.pack_into(self._buf, 0, _MAGIC, gen + 2, len(raw), len(faults))

    def add(self, faults: Iterable[Fault] | Any) -> None:
        """Append ``faults`` (live: IPU processes see them before their next Main run)."""
        new = parse_faults(list(faults) if not isinstance(faults, (str, dict)) else faults,
                           "faults")
        if not new:
            return
        old = self.faults()
        self._write(old + new, keep_counts=len(old))

    def clear(self) -> None:
        """Remove every fault (and its counts)."""
        self._write([], keep_counts=0)

    # -- counting --------------------------------------------------------------------------
    def counts(self) -> list[tuple[Fault, int, int]]:
        """Each fault with the runs it has seen and fired."""
        at = _SPEC_AT + _SPEC_MAX
        faults = self.faults()
        return [(f, *_COUNT.unpack_from(self._buf, at + i * _COUNT.size))
                for i, f in enumerate(faults)]

    def fire(self, ipu: int, has_link: bool) -> tuple[int, Fault] | None:
        """A Main run of ``ipu`` starts: count it for every fault that matches, and return
        the first one that fires on it (its index and the fault), if any."""
        faults = self.faults()
        if not faults:
            return None
        fired: tuple[int, Fault] | None = None
        at = _SPEC_AT + _SPEC_MAX
        with self._locked():
            for i, f in enumerate(faults):
                if not f.matches(ipu) or (f.kind == "link_down" and not has_link):
                    continue
                off = at + i * _COUNT.size
                seen, done = _COUNT.unpack_from(self._buf, off)
                hit = False
                if fired is None and done < f.times:
                    if f.probability is None:
                        hit = seen >= f.after
                    else:
                        hit = random.Random(f"{f.seed}/{seen}").random() < f.probability
                _COUNT.pack_into(self._buf, off, seen + 1, done + hit)
                if hit:
                    fired = (i, f)
        return fired

    def _locked(self) -> Any:
        """An exclusive flock of the table's file (released by the kernel if its holder
        dies): the counters are updated by several processes."""
        if self._fd < 0:
            self._fd = os.open("/dev/shm/" + self.name.lstrip("/"), os.O_RDWR | os.O_CLOEXEC)
        return _Flock(self._fd)

    def close(self) -> None:
        """Stop using it; the owner also unlinks it (idempotent)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        owner = self._region.owner
        self._region.close()
        if owner:
            self._region.unlink()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:   # pragma: no cover - interpreter exit
            pass

    def __repr__(self) -> str:
        return f"FaultTable({self.name}, {len(self._faults)} faults)"


class _Flock:
    def __init__(self, fd: int) -> None:
        self._fd = fd

    def __enter__(self) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)


# -- the public API: a schedule for the runners made while it is active -----------------------

_plans: "weakref.WeakValueDictionary[str, FaultTable]" = weakref.WeakValueDictionary()
_env_tables: dict[str, FaultTable] = {}   # the environment's schedule, by its text (kept)
_registry_lock = threading.Lock()


class FaultPlan:
    """A fault schedule for the runners, sessions and devices made while it is active.

    ::

        from ipu_emulator import faults

        with faults.inject([{"kind": "application_error", "after": 2}]) as plan:
            runner = ModelRunner("model.popef")     # keeps the schedule for its life
        plan.add({"kind": "slow", "delay_ms": 20})  # live: its IPUs see it at their next run
        plan.counts()                               # [(Fault, runs seen, runs fired), ...]

    Inside the block, ``IPU_EMULATOR_FAULTS`` is not used (the block overrides the
    setting with ``plan:<its name>``). The schedule's counters live as long as the
    plan or a runner made with it: a fault fires ``times`` times in
    all, across resets and restarted IPU processes. ``close()`` (or dropping every
    reference) removes it."""

    def __init__(self, faults: Any = ()) -> None:
        self.table = FaultTable.create(parse_faults(faults, "faults.inject"))
        with _registry_lock:
            _plans[self.table.name] = self.table
        self._blocks: list[Any] = []   # the settings overrides of open `with` blocks

    @property
    def faults(self) -> list[Fault]:
        return self.table.faults()

    def add(self, faults: Any = None, **fault: Any) -> "FaultPlan":
        """Add faults (a list, one object, JSON text or keyword fields of one fault)."""
        self.table.add(parse_faults(faults if faults is not None else dict(fault),
                                    "faults.add"))
        return self

    def clear(self) -> None:
        """Remove every fault."""
        self.table.clear()

    def counts(self) -> list[tuple[Fault, int, int]]:
        """Each fault with the Main runs it has seen and the runs it fired on."""
        return self.table.counts()

    def fired(self) -> int:
        """Runs affected by a fault so far, in all."""
        return sum(n for _, _, n in self.counts())

    def __enter__(self) -> "FaultPlan":
        from shm.settings import override

        block = override(faults=_PLAN + self.table.name)
        block.__enter__()
        self._blocks.append(block)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._blocks:
            self._blocks.pop().__exit__(None, None, None)

    def close(self) -> None:
        """End its blocks and remove the schedule (runners made with it inject no more)."""
        while self._blocks:
            self.__exit__()
        with _registry_lock:
            if _plans.get(self.table.name) is self.table:
                del _plans[self.table.name]
        self.table.close()


def inject(faults: Any = None, **fault: Any) -> FaultPlan:
    """A :class:`FaultPlan` of ``faults`` (a list of fault objects, one object, JSON text,
    a file's path, or keyword fields of one fault), to use as a context manager around
    the creation of runners (``with faults.inject(kind="hang"): ...``)."""
    return FaultPlan(faults if faults is not None else ([dict(fault)] if fault else []))


def table_for(text: str) -> FaultTable | None:
    """The schedule of the settings' ``faults`` text, for a runner, session or device made
    with them: a :class:`FaultPlan`'s (``plan:<name>``), or that of
    ``IPU_EMULATOR_FAULTS`` (one table per text, kept for the life of the process), or
    None (no faults)."""
    if not text:
        return None
    with _registry_lock:
        if text.startswith(_PLAN):
            table = _plans.get(text[len(_PLAN):])
            if table is None:
                raise FaultSpecError(f"IPU_EMULATOR_FAULTS={text!r}: no fault plan of that "
                                     "name in this process (it was closed)")
            return table
        table = _env_tables.get(text)
        if table is None:
            table = _env_tables[text] = FaultTable.create(parse_faults(text))
        return table


__all__ += ["FaultPlan", "inject", "table_for"]
