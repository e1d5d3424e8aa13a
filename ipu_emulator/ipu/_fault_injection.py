"""Injected faults on the IPU process (the schedules of ``ipu_emulator.faults``).

The daemon's fault tables come with HOST, the host's with LOAD. While any is
scheduled, Main runs one at a time through :class:`FaultyIO`, and each run is
checked (:meth:`FaultInjector.fire`) once its inputs are in, as it writes its first
output: a fault then slows it, hangs the IPU, kills the process, or fails the run
with one of Poplar's runtime errors (:class:`FaultError`).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any, Callable

from ipu_emulator.executable import is_link, is_sync
from ipu_emulator.faults import Fault, FaultTable
from ipu_emulator.ipu._control import ControlWire
from ipu_emulator.ipu._stream_io import _Loaded, _RequestError, _RingIO
from ipu_emulator.ipu_protocol import ErrorKind
from ipu_emulator.trace import recorder

__all__ = ["FaultError", "FaultInjector", "FaultyIO"]

_log = logging.getLogger("ipu_emulator.ipu.process")


class FaultError(_RequestError):
    """An injected fault's error: its ERROR body also has ``extra`` (action, ipu, program)."""

    def __init__(self, kind: ErrorKind, message: str, extra: dict[str, Any]) -> None:
        super().__init__(kind, message)
        self.extra = extra


class FaultInjector:
    """The fault tables of one IPU process and what a fault does when it fires."""

    def __init__(self, wire: ControlWire, ipu_id: int, own_process: bool,
                 describe: Callable[[], str]) -> None:
        self._wire = wire
        self._ipu_id = ipu_id
        self._own_process = own_process   # a crash may kill it (never a host's thread)
        self._describe = describe
        self._daemon: list[FaultTable] = []   # the daemon's (HOST)
        self._host: list[FaultTable] = []     # the host's (LOAD)

    def set_host_tables(self, names: Any, known: set[str]) -> None:
        """The host's tables (LOAD ``faults``); their names join ``known`` (unlinked with
        the host's other objects if it dies)."""
        self._host = _attach(names, self._host)
        known.update(t.name for t in self._host)

    def set_daemon_tables(self, names: Any) -> None:
        """The daemon's tables (HOST ``faults``): never unlinked here."""
        self._daemon = _attach(names, self._daemon)

    def drop_host_tables(self) -> None:
        for table in self._host:
            table.close()
        self._host = []

    def scheduled(self) -> bool:
        """Main runs are checked one by one: the host gave a fault table (its plan may
        change at any time, and a run already waiting for its inputs must see a change),
        or the daemon's lists a fault (checked at each turn of a loop: a fault the daemon
        adds applies from the run after the one waiting then)."""
        return bool(self._host) or any(t.faults() for t in self._daemon)

    def fire(self, loaded: _Loaded, program: int) -> None:
        """A Main run of ``program`` has its inputs: apply the fault that fires on it."""
        has_link = any(is_link(st.handle) and not is_sync(st.handle)
                       and st.direction == "out" for st in loaded.streams)
        hit: tuple[int, Fault] | None = None
        for table in self._daemon + self._host:
            found = table.fire(self._ipu_id, has_link)
            if found is not None and hit is None:
                hit = found
        if hit is None:
            return
        index, fault = hit
        what = (f"program {program} ({loaded.interp.executable.programs[program].name}) "
                f"(injected fault {index}: {fault.describe()})")
        _log.warning("%s: injecting %s", self._describe(), what)
        recorder.instant(f"fault {index}: {fault.kind}")   # (an IPU keeps 24 bytes of it)
        self._apply(fault, what, {"ipu": self._ipu_id, "program": program})

    def _apply(self, fault: Fault, what: str, extra: dict[str, Any]) -> None:
        kind = fault.kind
        if kind == "slow":
            self._sleep(fault.delay_ms / 1000.0)
            return
        if kind == "hang":
            self._wire.ignore_until_ending()
        if kind == "crash":
            if self._own_process:
                logging.shutdown()
                os.kill(os.getpid(), signal.SIGKILL)
            raise FaultError(ErrorKind.PROGRAM, f"a crash of {what} (a loopback device "
                             "cannot die)", extra)
        if kind == "application_error":
            raise FaultError(ErrorKind.APPLICATION, f"application runtime error in {what}",
                             extra)
        if kind == "unrecoverable_error":
            raise FaultError(ErrorKind.UNRECOVERABLE, f"unrecoverable runtime error in "
                             f"{what}", extra)
        action = "LINK_RESET" if kind == "link_down" else fault.action
        cause = ("the IPU-Link to the next IPU went down in " if kind == "link_down"
                 else "recoverable runtime error in ")
        raise FaultError(ErrorKind.RECOVERABLE, f"{cause}{what}; recovery action {action}",
                         dict(extra, action=action))

    def _sleep(self, seconds: float) -> None:
        """Slept in slices: a STOP or SHUTDOWN meanwhile is taken at once."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(left, 0.05))
            if self._wire.ring.readable():
                self._wire.poll()


def _attach(names: Any, old: list[FaultTable]) -> list[FaultTable]:
    """The fault tables ``names`` lists (attached; ``old`` ones reused, others closed)."""
    names = [n for n in names if isinstance(n, str)] if isinstance(names, list) else []
    keep = {t.name: t for t in old}
    tables = []
    for name in names:
        table = keep.pop(name, None)
        if table is None:
            try:
                table = FaultTable.attach(name)
            except Exception as exc:
                raise _RequestError(ErrorKind.PROTOCOL, f"cannot open the fault table "
                                    f"{name}: {exc}") from None
        tables.append(table)
    for table in keep.values():
        table.close()
    return tables


class FaultyIO:
    """The StreamIO of Main runs under a fault schedule: a run is checked against it
    (``FaultInjector.fire``) once its inputs are in, as it writes its first output;
    no C steps (each run is seen)."""

    def __init__(self, faults: FaultInjector, loaded: _Loaded, io: _RingIO) -> None:
        self._faults = faults
        self._loaded = loaded
        self._io = io
        self._program = -1     # armed: the run of this program has not been checked

    def scheduled(self) -> bool:
        return self._faults.scheduled()

    def arm(self, program: int) -> None:
        self._program = program

    def _check(self) -> None:
        program, self._program = self._program, -1
        if program >= 0:
            self._faults.fire(self._loaded, program)

    @property
    def disconnected(self) -> bool:
        return self._io.disconnected

    def run_began(self, t0: int) -> int | None:
        return self._io.run_began(t0)

    def read_input(self, handle: str, dest: memoryview) -> None:
        self._io.read_input(handle, dest)

    def write_output(self, handle: str, src: memoryview) -> None:
        self._check()
        self._io.write_output(handle, src)

    def acquire_input(self, handle: str, nbytes: int) -> memoryview:
        return self._io.acquire_input(handle, nbytes)

    def release_input(self, handle: str) -> None:
        self._io.release_input(handle)

    def acquire_output(self, handle: str, nbytes: int) -> memoryview:
        self._check()
        return self._io.acquire_output(handle, nbytes)

    def publish_output(self, handle: str) -> None:
        self._io.publish_output(handle)

    def forget_redirects(self) -> None:
        self._io.forget_redirects()
