"""An asynchronous exception (KeyboardInterrupt, as a signal handler raises it) at every place
CPython 3.11 checks for one, in chosen code of the host: the machinery of
tests/unit/test_interrupt_anywhere.py and tests/devices/test_interrupt_session.py.

A signal's handler runs (and raises KeyboardInterrupt) only where CPython 3.11 checks
for pending work: at a function's entry, after a call returns and at a loop's backward
jump (a conditional one only when it jumps). :class:`Interrupts` counts those places in
the main thread's frames of the chosen directories (``RUNNER_DIR`` by default; also
``SESSION_DIRS``: the session layer and the device link) and of the standard library's
``threading.Condition`` and ``concurrent.futures.Future`` called from there, with a trace
function (every function entry, every ``CALL`` and backward-jump instruction) and, at the
chosen counts, schedules a KeyboardInterrupt with ``PyThreadState_SetAsyncExc``: CPython
raises it at its next check, exactly where a signal's handler would run. (The trace
function's own entry is a check too: an interrupt is scheduled so that it never comes
there first; for a call of a Python function, at that function's entry.)

:func:`sweep_places` runs a scenario interrupted at every place (once, and twice in a
row: an interrupt that lands while the first one is being handled) and checks what
follows in another thread (:func:`elsewhere`): a lock the interrupted thread left held
shows, and a hang is bounded.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import dis
import functools
import os
import sys
import threading
import traceback
import types
from typing import Any, Callable, Iterable

import host_runtime.devices._link as link_module
import host_runtime.runner as runner_package
import host_runtime.session as session_package

__all__ = ["RUNNER_DIR", "SESSION_DIRS", "Interrupts", "elsewhere", "sweep_places"]

RUNNER_DIR = os.path.dirname(os.path.abspath(runner_package.__file__)) + os.sep
SESSION_DIRS = (RUNNER_DIR, os.path.dirname(os.path.abspath(session_package.__file__)) + os.sep,
                os.path.abspath(link_module.__file__))
"""The runner, the session layer and the device link (its ``wait``, its answers)."""

_ALWAYS: Callable[[Any], bool] = lambda top: True   # noqa: E731
_CALL: Callable[[Any], bool] = lambda top: True   # noqa: E731
_CHECKS: dict[str, Callable[[Any], bool]] = {
    # instruction -> whether, given the value on top of the stack, it checks
    "CALL": _CALL, "JUMP_BACKWARD": _ALWAYS,
    # a conditional backward jump checks only when it jumps
    "POP_JUMP_BACKWARD_IF_TRUE": bool, "POP_JUMP_BACKWARD_IF_FALSE": lambda top: not top,
    "POP_JUMP_BACKWARD_IF_NONE": lambda top: top is None,
    "POP_JUMP_BACKWARD_IF_NOT_NONE": lambda top: top is not None}
_ALSO = frozenset(
    [getattr(threading.Condition, name).__code__ for name in (
        "wait", "notify", "notify_all", "_release_save", "_acquire_restore", "_is_owned",
        "__enter__", "__exit__")]
    + [getattr(cf.Future, name).__code__ for name in (
        "result", "exception", "done", "add_done_callback", "_Future__get_result")])
"""Code of the standard library whose places count too when counted code calls it
(``Condition`` is not safe from an interrupt: ``__enter__`` may return the lock held
by raising; the host has its own, ``runner._sleepers``, ``devices._link.Answer``)."""
_SET_ASYNC_EXC = ctypes.pythonapi.PyThreadState_SetAsyncExc


@functools.lru_cache(maxsize=None)
def _places(code: types.CodeType) -> dict[int, Callable[[Any], bool]]:
    """Offsets of the instructions of ``code`` after which CPython may check for a signal:
    whether it does, given the value on top of the stack."""
    return {i.offset: _CHECKS[i.opname] for i in dis.get_instructions(code)
            if i.opname in _CHECKS}


@functools.lru_cache(maxsize=None)
def _argc(code: types.CodeType, offset: int) -> int:
    return next(i.arg for i in dis.get_instructions(code) if i.offset == offset)


def _peek(frame: types.FrameType, k: int = 1) -> Any:
    """The ``k``-th value from the top of the stack of ``frame`` (stopped at an opcode
    event; None for a NULL).

    CPython 3.11's layout: ``PyFrameObject.f_frame`` (after the object's head and
    ``f_back``) points to the ``_PyInterpreterFrame``, whose ``stacktop`` (after 8
    pointers) counts the values of ``localsplus`` (after it, aligned) up to the top."""
    data = ctypes.c_void_p.from_address(id(frame) + 24).value
    assert data is not None
    depth = ctypes.c_int.from_address(data + 64).value
    assert depth >= k, (depth, k)
    value = ctypes.c_void_p.from_address(data + 72 + 8 * (depth - k)).value
    return None if value is None else ctypes.cast(value, ctypes.py_object).value


def _enters_python(frame: types.FrameType, argc: int) -> bool:
    """Whether the ``CALL argc`` ``frame`` is stopped at calls a Python function (whose
    entry is then the place: the trace function's own entry, a check, must not get the
    interrupt first, or the trace ends with it)."""
    method = _peek(frame, argc + 2)      # (a NULL unless a method is called on an object)
    func = method if method is not None else _peek(frame, argc + 1)
    if isinstance(func, types.MethodType):
        func = func.__func__
    return isinstance(func, types.FunctionType)


def _arming(tid: int) -> Any:
    """An object whose attribute assignment schedules KeyboardInterrupt in thread ``tid``.

    A trace function that called ``PyThreadState_SetAsyncExc`` itself would get the
    interrupt at once (a call's return is a check); a STORE_ATTR through a C callable
    ``__setattr__`` is none, so the trace function returns first."""
    arm = functools.partial(_SET_ASYNC_EXC, ctypes.c_ulong(tid),
                            ctypes.py_object(KeyboardInterrupt))
    return type("Arm", (), {"__slots__": (), "__setattr__": arm})()


def _nothing() -> None:
    pass


class Interrupts:
    """``with Interrupts(at):`` KeyboardInterrupt at the places numbered ``at`` (1, 2, ...)
    of the code of ``dirs`` (paths of directories, ending with a separator, or of files)
    run by this thread; ``count``: the places passed, ``where``: the functions and lines
    the interrupts were scheduled at."""

    def __init__(self, at: Iterable[int] = (), entry: str = "",
                 names: list[str] | None = None, dirs: tuple[str, ...] = (RUNNER_DIR,)) -> None:
        self.at = frozenset(at)
        self.entry = entry     # also: at the entry of the first call of the function so named
        self.names = names     # given: the name of each place's function is appended
        self.dirs = dirs
        self.count = 0
        self.where: list[str] = []
        self._at_entry = False   # the interrupt is due at the next function's entry
        self._arm = _arming(threading.get_ident())

    def _counted(self, frame: types.FrameType | None) -> bool:
        """Whether the places of ``frame`` count: code of ``dirs``, or of ``_ALSO`` called
        (through ``_ALSO`` code) from code of ``dirs``."""
        while frame is not None:
            code = frame.f_code
            if code.co_filename.startswith(self.dirs):
                return True
            if code not in _ALSO:
                return False
            frame = frame.f_back
        return False

    def _call(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        runner = self._counted(frame)
        due, self._at_entry = self._at_entry, False
        if runner:
            frame.f_trace_opcodes = True
            frame.f_trace_lines = False
            self.count += 1
            if self.names is not None:
                self.names.append(frame.f_code.co_name)
            if self.count in self.at or frame.f_code.co_name == self.entry:
                self.entry = ""
                self.where.append(f"{frame.f_code.co_name}:{frame.f_lineno} (entry)")
                due = True
        if due:
            self._arm.go = True   # last: nothing after it checks (the function's entry does)
        return self._opcode if runner else None

    def _opcode(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        if event != "opcode":
            return self._opcode
        checks = _places(frame.f_code).get(frame.f_lasti)
        # a place only if the instruction checks (else an interrupt scheduled here would be
        # raised by the next call of this trace function, where CPython never raises it:
        # e.g. after a loop's last test, before the ``with`` around it releases its lock)
        if self._at_entry:   # the call entered no Python function (it failed first)
            self._at_entry = False
            self._arm.go = True
            return self._opcode
        if checks is not None and (checks is _ALWAYS or checks is _CALL or checks(_peek(frame))):
            self.count += 1
            if self.names is not None:
                self.names.append(frame.f_code.co_name)
            if self.count in self.at:
                self.where.append(f"{frame.f_code.co_name}:{frame.f_lineno}")
                if checks is _CALL and _enters_python(frame, _argc(frame.f_code,
                                                                  frame.f_lasti)):
                    self._at_entry = True
                    return self._opcode
                self._arm.go = True   # last: nothing after it checks
        return self._opcode

    def __enter__(self) -> "Interrupts":
        sys.settrace(self._call)
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            sys.settrace(None)
            _nothing()    # an interrupt scheduled but not yet raised is raised here
        except KeyboardInterrupt:
            pass


def elsewhere(check: Callable[[], list[str]], limit: float = 30.0) -> list[str]:
    """``check()`` run by another thread: a lock the interrupted thread left held shows, and
    a hang is reported (after ``limit`` s) instead of stopping the sweep."""
    found = [f"the checks hung for {limit:g} s"]

    def run() -> None:
        try:
            found[:] = check()
        except BaseException as exc:   # noqa: B036 (reported, not raised)
            found[:] = [f"the checks raised {type(exc).__name__}: {exc}"]
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit)
    return found


def _unraisable(found: list[str], finalizers: bool, u: Any) -> None:
    """``sys.unraisablehook`` while sweeping: an exception a finalizer could not raise goes
    to ``found``, except an interrupt the trace function itself raised (a generator closed
    as a call returned runs it: CPython would raise the interrupt after the call), and
    with ``finalizers`` false, an interrupt that landed in a finalizer (CPython swallows
    it: what the finalizer had left to do is the sweep's own check)."""
    last = traceback.extract_tb(u.exc_traceback)[-1:] if u.exc_traceback else []
    if (isinstance(u.exc_value, KeyboardInterrupt) and last
            and last[0].filename == __file__ and last[0].name in ("_call", "_opcode")):
        return
    if not finalizers and isinstance(u.exc_value, KeyboardInterrupt):
        return
    found.append(f"unraisable {u.exc_type.__name__}: {u.exc_value} in {u.object!r}")


def sweep_places(run: Callable[[int], None], check: Callable[[], list[str]],
                 gaps: Iterable[int], every: int = 1, focus: Iterable[str] = (),
                 dirs: tuple[str, ...] = (RUNNER_DIR,),
                 replace: Callable[[], None] | None = None,
                 finalizers: bool = True) -> list[str]:
    """Run ``run(n)`` interrupted at every place of ``dirs`` (``gaps``: 0, once; d, a
    second interrupt d places after the first), then ``check()`` in another thread (what
    is wrong: nothing, []); what went wrong, by place. ``every``: only every k-th place,
    and every place in the functions named in ``focus`` (as a first run counted them).
    ``replace()``: after a failure, what the next runs use is made afresh (if that fails,
    the sweep ends). ``finalizers`` false: an interrupt a finalizer swallowed is no failure
    by itself."""
    names: list[str] = []
    with Interrupts(names=names, dirs=dirs) as counting:
        run(0)
    assert counting.count > 20, counting.count   # the trace saw the host's code
    bad = elsewhere(check)
    assert bad == [], bad
    focus = frozenset(focus)
    places = [n for n, name in enumerate(names, 1) if n % every == 0 or name in focus]
    assert not focus or len(places) > len(names) // every, "no place in the focus"
    failures = []
    unraisable: list[str] = []
    hook, sys.unraisablehook = sys.unraisablehook, functools.partial(_unraisable, unraisable, finalizers)
    try:
        for gap in gaps:
            for n in places:
                at = {n} if gap == 0 else {n, n + gap}
                bad = []
                interrupts = Interrupts(at, dirs=dirs)
                try:   # (a late one may come as the block ends, before __exit__ runs)
                    with interrupts:
                        try:
                            run(n)
                        except KeyboardInterrupt:
                            pass
                        except BaseException as exc:   # noqa: B036 (reported, not raised)
                            bad.append(f"raised {type(exc).__name__}: {exc}")
                except KeyboardInterrupt:
                    pass
                bad += elsewhere(check)
                bad += unraisable
                unraisable.clear()
                if bad:
                    failures.append(f"{sorted(at)} at {interrupts.where}: {bad}")
                    if any(b.startswith("the checks hung") for b in bad):
                        return failures   # (its thread still waits: nothing to go on with)
                    if replace is not None:
                        try:
                            replace()
                        except Exception as exc:   # nothing to sweep on any more
                            failures.append(f"after {sorted(at)}, making afresh raised "
                                            f"{type(exc).__name__}: {exc}")
                            return failures
    finally:
        sys.unraisablehook = hook
    return failures
