"""RUN and LOOP: the programs of the active executable run in turns.

A RUN is one turn; a LOOP turns until a STOP (or a failure). :meth:`Scheduler.run`
reads as its steps:

1. ``_runnable`` / ``_programs``: an executable is loaded and not stopped; the
   program indices exist (a LOOP's programs are validated once, ``_check_loop``);
2. ``_place``: where this process runs while it serves (``_placement``: off the
   submitting host thread's CPU, unless this is one IPU of several);
3. each turn: with a fault schedule, Main runs one at a time and is checked
   (``_fault_injection``); a loop of one program runs it as many times as it can in
   C steps until the next check is due; else each program once;
4. between turns: a disconnected stream ends the loop; the host is checked and the
   control ring polled when due (a STOP ends the run: ``RunEnded``, answered by the
   serving loop through :meth:`Scheduler.stopped`); the placement looked at again.

Nothing is added per turn beyond those checks: the loop of a LOOP is the hot path.
"""

from __future__ import annotations

import time
import traceback
from typing import Any, Callable, Protocol

from shm import Ring

from ipu_emulator.ipu._control import ControlWire
from ipu_emulator.ipu._ending import PASSES
from ipu_emulator.ipu._fault_injection import FaultInjector, FaultyIO
from ipu_emulator.ipu._host_memory import HostMemory
from ipu_emulator.ipu._host_watch import HOST_CHECK, HostWatch
from ipu_emulator.ipu._loading import Executables, constant_handles
from ipu_emulator.ipu._placement import KeepApart
from ipu_emulator.ipu._stream_io import _Loaded, _RequestError, _RingIO
from ipu_emulator.ipu_protocol import ErrorKind, Message, Op
from ipu_emulator.trace import recorder

__all__ = ["Scheduler", "RunDevice"]

_monotonic = time.monotonic
_PROGRAM_KINDS = {"load": 1, "main": 2, "save": 3}   # program name -> recorder.PROGRAM_KINDS
_PASSES_RUN = PASSES + (_RequestError,)


class RunDevice(Protocol):
    """What a run needs of the IPU process (its stream I/O's host, ``_stream_io``)."""

    host_memory: HostMemory
    keeps_apart: bool          # True: this process keeps off the host's CPU (never yield)

    def post(self, msg: Message) -> None: ...

    def wait_on(self, fn: Callable[..., Any]) -> Any: ...


class _NeverApart:
    """A KeepApart that never looks (one IPU of several)."""

    next_look = float("inf")

    def check(self) -> None:
        pass


_NEVER_APART: Any = _NeverApart()


class Scheduler:
    """Runs RUN and LOOP requests for one IPU process."""

    def __init__(self, dev: RunDevice, control: Ring, wire: ControlWire, watch: HostWatch,
                 apart: KeepApart, executables: Executables, faults: FaultInjector,
                 describe: Callable[[], str]) -> None:
        self._dev = dev
        self._control = control
        self._wire = wire
        self._watch = watch
        self._apart = apart
        self._executables = executables
        self._faults = faults
        self._describe = describe
        self.program_runs = 0   # programs run; also published in the control ring's user word

    def run(self, msg: Message) -> None:
        """Run a RUN or a LOOP until it ends (a STOP ends it by ``RunEnded``)."""
        loaded = self._runnable()
        programs = self._programs(msg, loaded)
        loop = msg.op is Op.LOOP
        if loop:
            _check_loop(loaded, programs)
        io = _RingIO(self._dev, loaded)
        apart = self._place(loaded)
        # A loop of one program may run it many times per turn (C steps back to back, until
        # the next check below is due or a control message arrives).
        many = loop and len(programs) == 1 and not recorder.ON   # traced: each run a slice
        run_one = self._run_one_traced if recorder.ON else self._run_one
        main = [p for p in programs
                if loop or loaded.interp.executable.programs[p].name.lower() == "main"]
        faulty = FaultyIO(self._faults, loaded, io) if main else None
        watch, poll, control_readable = self._watch, self._wire.poll, self._control.readable
        while True:
            if faulty is not None and faulty.scheduled():
                self._faulty_turn(loaded, programs, main, faulty, io)
            elif many:
                due = min(watch.next_check, apart.next_look, _monotonic() + HOST_CHECK)
                run_one(loaded, programs[0], io, int(due * 1e9))
            else:
                for p in programs:
                    run_one(loaded, p, io)
            if io.disconnected:
                self._disconnected(loop)
            if not loop:
                return
            now = _monotonic()
            if now >= watch.next_check:
                watch.check()
                poll()     # also notices an invalidated control ring
            elif control_readable():
                poll()
            if now >= apart.next_look:
                apart.check()

    def _runnable(self) -> _Loaded:
        loaded = self._executables.active
        if loaded is None or loaded.interp is None:
            raise _RequestError(ErrorKind.STATE, f"{self._describe()} has no executable loaded")
        if loaded.stopped:
            raise _RequestError(ErrorKind.STATE,
                                f"{self._describe()} was stopped; reload the executable first")
        return loaded

    @staticmethod
    def _programs(msg: Message, loaded: _Loaded) -> list[int]:
        programs = msg.body
        n = loaded.interp.num_programs()
        if not isinstance(programs, list) or not all(isinstance(p, int) for p in programs):
            raise _RequestError(ErrorKind.PROTOCOL, "RUN needs a list of program indices")
        bad = [p for p in programs if not 0 <= p < n]
        if bad:
            raise _RequestError(ErrorKind.REQUEST, f"program indices {bad} do not exist; "
                                f"the executable has programs 0..{n - 1}")
        return programs

    def _place(self, loaded: _Loaded) -> Any:
        """Set up where this process runs while it serves the run; its KeepApart."""
        apart: Any = self._apart
        # the host writes the id of its thread that submits into its input rings
        constant = constant_handles(loaded)   # rings the host never writes
        hinted = [st.ring for st in loaded.streams if st.direction == "in" and st.ring is not None
                  and st.handle not in constant]
        apart.hint = hinted[0].user_word if hinted else None
        if loaded.interp.executable.attributes.get("keep_apart") == "0":
            # one IPU of several (compiler._sharding): the IPUs of a pipeline must spread
            # over the CPUs, not all leave the host's one
            apart.release()
            apart = _NEVER_APART
        else:
            apart.starting()
        # polls block at once when a yield ran another task, unless keeping apart
        self._dev.keeps_apart = apart is self._apart and self._apart.enabled
        return apart

    def _faulty_turn(self, loaded: _Loaded, programs: list[int], main: list[int],
                     faulty: FaultyIO, io: _RingIO) -> None:
        """A schedule of faults: Main runs one at a time, each checked once its inputs are
        in (at its first output: FaultyIO)."""
        run_one = self._run_one_traced if recorder.ON else self._run_one
        for p in programs:
            if p in main:
                faulty.arm(p)
                run_one(loaded, p, faulty)   # type: ignore[arg-type]
            else:
                run_one(loaded, p, io)

    def _disconnected(self, loop: bool) -> None:
        self._wire.poll()   # a STOP that came with the disconnection wins
        # Dummy data "until the run returns": a loop never returns, so it ends here instead
        # of spinning on disconnected streams. A run returns, but what it computed from
        # dummy inputs was dropped: never answered as done (its caller would take it for
        # a run that gave its outputs).
        if loop:
            raise _RequestError(ErrorKind.STATE, "the main loop ended: its streams were "
                                "disconnected (invalidated) by the host")
        raise _RequestError(ErrorKind.STATE, "the run's streams were disconnected "
                            "(invalidated) by the host while it ran: its outputs were "
                            "dropped")

    def stopped(self, msg: Message) -> None:
        """A STOP ended the run of ``msg``: answer STOPPED, and DONE to the STOP."""
        self._apart.release()
        wire = self._wire
        loaded = self._executables.active
        if loaded is not None:
            loaded.stopped = not wire.stop_soft
        self._dev.post(Message(Op.STOPPED, seq=msg.seq))
        self._dev.post(Message(Op.DONE, seq=wire.stop_seq or 0))
        wire.stop_seq = None

    def _run_one(self, loaded: _Loaded, index: int, io: _RingIO,
                 deadline_ns: int | None = None) -> None:
        """Run program ``index`` once; with ``deadline_ns``, as many times as it can be done
        without waiting before that time of the monotonic clock (at least once)."""
        try:
            try:
                runs = 0 if deadline_ns is None else loaded.interp.run_program_many(
                    index, io, deadline_ns)
                if not runs:
                    loaded.interp.run_program(index, io)
                    runs = 1
                # programs run, for whoever holds the control ring (the daemon's /metrics)
                self.program_runs += runs
                self._control.set_user_word(self.program_runs)
            finally:
                io.forget_redirects()   # left by a failed iteration: must not steer the next
        except _PASSES_RUN:
            raise
        except Exception as exc:
            inner = _unwrap(exc)
            if isinstance(inner, _PASSES_RUN):
                raise inner from None
            raise _RequestError(ErrorKind.PROGRAM,
                                f"program {index} failed: {type(exc).__name__}: {exc}",
                                traceback.format_exc()) from None

    def _run_one_traced(self, loaded: _Loaded, index: int, io: _RingIO,
                        deadline_ns: int | None = None) -> None:
        """``_run_one`` as a slice of the timeline (ipu_emulator.trace)."""
        t0 = time.monotonic_ns()
        before = self.program_runs
        programs = loaded.interp.executable.programs if loaded.interp is not None else []
        kind = _PROGRAM_KINDS.get(programs[index].name, 0) if index < len(programs) else 0
        try:
            self._run_one(loaded, index, io, deadline_ns)
        finally:
            # it began when its first transfer came (the wait before it is a gap: the IPU
            # was idle); one that ended still waiting never ran
            start = io.run_began(t0)
            if start is not None:
                recorder.ipu(recorder.I_PROGRAM, start, time.monotonic_ns() - start, index,
                             kind, self.program_runs - before)


def _check_loop(loaded: _Loaded, programs: list[int]) -> None:
    """A main loop of ``programs`` transfers something on every path of an iteration,
    streams out an output, and no stream twice (ipu_emulator.validate): else it would spin,
    or wait for what the host will not send, forever. Checked once per LOOP, so the
    iterations themselves (the C steps) pay nothing."""
    from ipu_emulator.validate import RuleError, check_loop

    checked = loaded.loops_checked
    key = tuple(programs)
    if key in checked:
        return
    try:
        check_loop(loaded.interp.executable, programs, loaded.by_handle)
    except RuleError as exc:
        raise _RequestError(ErrorKind.PROGRAM, f"DeviceProgramError: main loop of programs "
                            f"{programs} refused: {exc}") from None
    checked.add(key)


def _unwrap(exc: BaseException) -> BaseException:
    seen = 0
    while exc.__cause__ is not None and seen < 8:
        exc = exc.__cause__
        seen += 1
    return exc
