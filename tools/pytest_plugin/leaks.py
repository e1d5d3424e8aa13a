"""The per-test leak check: what a test left attached, running or in /dev/shm.

While a test that uses the plugin runs, :class:`LeakGuard` records every
``ModelRunner`` and ``Device`` made (with a summary of where: the test's
frames, not the library's), the IPU processes of this host and this
process's /dev/shm objects. After the test's fixtures are torn down
(``model_runner`` closes its runners then), :meth:`LeakGuard.finish` names
what is still there:

- a runner still attached to its devices, with the IPU process pids and
  where it was made;
- a device (``DeviceManager.getDevice``) still attached, likewise;
- an IPU process of this host still running (titled ``ipu N (host <this pid>)``);
- shared-memory objects of this process's tag that were not there before;

then closes, stops and unlinks them, so that the next test starts clean, and
returns the report (the plugin fails the test with it).
"""

from __future__ import annotations

import gc
import os
import contextvars
import traceback
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import pytest

from ipu_emulator import titles
from tools.pytest_plugin.machine import remove_shm_entries, shm_entries

if TYPE_CHECKING:  # pragma: no cover
    import psutil

__all__ = ["LeakGuard", "creation_summary"]

# Frames of these folders are the library's, pytest's or the interpreter's, not the test's.
_SKIP = tuple(os.sep + p + os.sep for p in ("host_runtime", "ipu_emulator", "shm", "_pytest",
                                             "pytest", "pluggy", "pytest_plugin", "xdist",
                                             "execnet"))
_MAX_FRAMES = 3
_EXIT_GRACE = 5.0   # seconds an IPU process of a closed device may take to exit


def creation_summary(skip: int = 1) -> str:
    """Where the caller's caller was called from: up to three frames of the test's code,
    innermost first (``file:line in function (source)``)."""
    frames = traceback.extract_stack()[:-skip]
    mine = [f for f in frames if not f.filename.startswith("<")
            and not any(s in f.filename for s in _SKIP) and "runpy" not in f.filename]
    shown = []
    for f in reversed(mine or frames):   # innermost first, up to the test function
        shown.append(f)
        if len(shown) == _MAX_FRAMES or f.name.startswith("test"):
            break
    return " <- ".join(f"{_relpath(f.filename)}:{f.lineno} in {f.name}"
                       + (f" ({f.line.strip()})" if f.line else "") for f in shown)


def _relpath(path: str) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel.startswith(".." + os.sep + "..") else rel


@dataclass
class _Made:
    kind: str             # "runner" or "device"
    ref: "weakref.ref[Any]"
    where: str
    owner: "weakref.ref[Any] | None" = None   # the runner a device was made for


def _ipu_processes() -> dict[int, str]:
    """Running IPU processes started by this host: ``{pid: what it is}``.

    Titled ``ipu-emulator: ipu N (host <this pid>)`` (``ipu_emulator.titles``), or not
    titled yet: ``python -m ipu_emulator ... --host-pid <this pid>`` (its label from
    ``--label``), or a child forked by this host's template process that still carries
    the template's title; the template itself is not an IPU process.
    """
    import psutil

    me = os.getpid()
    found: dict[int, str] = {}
    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return found
    for child in children:
        try:
            argv = child.cmdline()
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            parent = child.ppid()
        except psutil.Error:
            continue
        title = " ".join(argv).rstrip()
        ipu = titles.parse_ipu(title)
        if ipu is not None:
            if ipu[1] == me and not ipu[2]:
                found[child.pid] = f"ipu {ipu[0]}"
            continue
        if title == titles.fork_server(me):
            if parent != me:
                found[child.pid] = f"forked by the template process {parent}"
            continue
        if "--host-pid" not in argv[:-1] or argv[argv.index("--host-pid") + 1] != str(me):
            continue
        if "ipu_emulator" in argv:
            found[child.pid] = (argv[argv.index("--label") + 1] if "--label" in argv[:-1]
                                else "IPU process")
        elif "ipu_emulator.ipu.forkserver" in argv and parent != me:
            found[child.pid] = f"forked by the template process {parent}"
    return found


class LeakGuard:
    """One test's leak check: ``start(tag)`` once its fixtures are set up, ``finish()`` once
    they are torn down (returns the report, '' when clean)."""

    def __init__(self) -> None:
        self._made: list[_Made] = []
        self._runners: contextvars.ContextVar[tuple[Any, ...]] = contextvars.ContextVar(
            "ipu_emulator_runners_being_made", default=())
        self._patches: pytest.MonkeyPatch | None = None
        self._tag: str | None = None
        self._shm_before: set[str] = set()
        self._procs_before: set[int] = set()

    # -- recording -------------------------------------------------------------------------
    def start(self, tag: str | None) -> None:
        """Record runners and devices made from now on (patches their constructors), and
        the IPU processes and /dev/shm objects of ``tag`` there are now."""
        from host_runtime.devices import Device
        from host_runtime.runner import ModelRunner

        self._procs_before = set(_ipu_processes())
        self._tag = tag
        self._shm_before = set() if tag is None else shm_entries(tag)
        mp = self._patches = pytest.MonkeyPatch()
        mp.setattr(ModelRunner, "__init__", self._wrap(ModelRunner.__init__, "runner"))
        mp.setattr(Device, "__init__", self._wrap(Device.__init__, "device"))

    def _wrap(self, init: Callable[..., None], kind: str) -> Callable[..., None]:
        guard = self

        def __init__(obj: Any, *args: Any, **kwargs: Any) -> None:
            # the runners being made in this context (a thread's, or copied into a thread
            # the runner starts)
            stack = guard._runners.get()
            token = guard._runners.set(stack + (obj,)) if kind == "runner" else None
            try:
                init(obj, *args, **kwargs)
            finally:
                if token is not None:
                    guard._runners.reset(token)
            owner = weakref.ref(stack[-1]) if kind == "device" and stack else None
            guard._made.append(_Made(kind, weakref.ref(obj), creation_summary(2), owner))

        __init__.__wrapped__ = init  # type: ignore[attr-defined]
        return __init__

    def note_where(self, obj: Any, where: str) -> None:
        """``obj`` was made by a fixture: report ``where`` (the test's call) for it."""
        for m in self._made:
            if m.ref() is obj:
                m.where = where

    # -- the check ---------------------------------------------------------------------------
    def finish(self) -> str:
        """Undo the patches; name what the test left and clean it up; '' when nothing."""
        if self._patches is not None:
            self._patches.undo()
            self._patches = None
        lines: list[str] = []
        leaked_devices: list[tuple[_Made, Any]] = []
        for m in self._made:
            dev = m.ref() if m.kind == "device" else None
            if dev is not None and dev.isAttached():
                leaked_devices.append((m, dev))
        by_owner: dict[int, list[Any]] = {}
        runners: dict[int, Any] = {}
        where_runner = {id(obj): m.where for m in self._made
                        if m.kind == "runner" and (obj := m.ref()) is not None}
        bare = []
        for m, dev in leaked_devices:
            owner = m.owner() if m.owner is not None else None
            if owner is None:
                bare.append((m, dev))
                continue
            runners[id(owner)] = owner
            by_owner.setdefault(id(owner), []).append(dev)
        for key, runner in runners.items():
            devs = by_owner[key]
            lines.append(f"ModelRunner {_short(runner)} still attached to "
                         + "; ".join(f"{d.describe()} (IPU process pid "
                                     f"{', '.join(map(str, d.pids()))})" for d in devs)
                         + f"; made at {where_runner.get(key, '?')}")
        for m, dev in bare:
            lines.append(f"{dev.describe()} still attached (IPU process pid "
                         f"{', '.join(map(str, dev.pids()))}); attached at {m.where}")
        for runner in runners.values():
            _quietly(runner.close)
        for _, dev in leaked_devices:
            _quietly(dev.close)
        procs = {p: label for p, label in _ipu_processes().items() if p not in self._procs_before}
        for m in self._made:   # name an IPU process by the device it served, where known
            dev = m.ref() if m.kind == "device" else None
            if dev is not None:
                for pid in dev.pids():
                    if pid in procs:
                        procs[pid] = dev.describe()
        if procs:   # a closed device's IPU process may still be on its way out
            procs = {p: procs[p] for p in _still_running(list(procs), _EXIT_GRACE)}
        if procs:
            lines.append("IPU process(es) still running: " + ", ".join(
                f"pid {p} ({label})" for p, label in sorted(procs.items())))
            _stop_processes(list(procs))
        self._made.clear()
        if self._tag is not None:
            left = shm_entries(self._tag) - self._shm_before
            if left:
                gc.collect()   # arrays of empty_shared free their regions when collected
                left = shm_entries(self._tag) - self._shm_before
            if left:
                lines.append(f"{len(left)} object(s) in /dev/shm: " + ", ".join(sorted(left)))
                remove_shm_entries(left)
        if not lines:
            return ""
        return ("the test left emulated IPU resources behind (the ipu_emulator plugin has "
                "cleaned them up):\n" + "\n".join(f"  - {line}" for line in lines))


def _short(runner: Any) -> str:
    try:
        text = repr(runner)
    except Exception:
        return object.__repr__(runner)
    return text if len(text) <= 160 else text[:157] + "..."


def _quietly(fn: Callable[[], Any]) -> None:
    try:
        fn()
    except Exception:
        pass


def _processes(pids: list[int]) -> "list[psutil.Process]":
    """The processes of ``pids`` that still exist."""
    import psutil

    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.Error:
            pass
    return procs


def _still_running(pids: list[int], timeout: float) -> list[int]:
    import psutil

    _, alive = psutil.wait_procs(_processes(pids), timeout=timeout)
    running = []
    for p in alive:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                running.append(p.pid)
        except psutil.Error:
            pass
    return running


def _stop_processes(pids: list[int]) -> None:
    import psutil

    procs = _processes(pids)
    for p in procs:
        _quietly(p.terminate)
    _, alive = psutil.wait_procs(procs, timeout=5)
    for p in alive:
        _quietly(p.kill)
    psutil.wait_procs(alive, timeout=5)
