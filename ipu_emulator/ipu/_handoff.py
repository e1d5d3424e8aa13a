"""Pool mode: the daemon lends this IPU process to one host at a time.

HOST(value=pid) hands the process to a host (0: to none). In between, the process
also watches that host (the client); when it dies, or the daemon takes the IPU back
(a HOST during a program), the process drops the client: its executables and host
memory close, its queued requests are void, and, if it is dead, every object it
created is unlinked. The process stays warm for the next host.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Callable, Protocol

from shm import Ring, cleanup
from shm import ring as ring_waits

from ipu_emulator.ipu._control import ControlWire
from ipu_emulator.ipu._fault_injection import FaultInjector
from ipu_emulator.ipu._host_watch import HostWatch
from ipu_emulator.ipu._loading import Executables
from ipu_emulator.ipu._options import DeviceOptions
from ipu_emulator.ipu._placement import KeepApart
from ipu_emulator.ipu._stream_io import _RequestError
from ipu_emulator.ipu_protocol import ErrorKind

__all__ = ["ClientHandOff", "PoolDevice"]

_log = logging.getLogger("ipu_emulator.ipu.process")


class PoolDevice(Protocol):
    """What the hand-off changes of the IPU process besides its parts."""

    opts: DeviceOptions   # num_ipus and label are the client's
    later: list[Callable[[], None]]   # run once the request is answered

    def set_title(self) -> None: ...


class ClientHandOff:
    """HOST, and dropping a client, for one IPU process (``DeviceOptions.pool``)."""

    def __init__(self, dev: PoolDevice, control: Ring, events: Ring, watch: HostWatch,
                 wire: ControlWire, executables: Executables, faults: FaultInjector,
                 apart: KeepApart, known: set[str]) -> None:
        self._dev = dev
        self._control = control
        self._events = events
        self._watch = watch
        self._wire = wire
        self._executables = executables
        self._faults = faults
        self._apart = apart
        self._known = known
        self._own = {dev.opts.control, dev.opts.events}   # never the client's
        # True from a drop_client until the next host, or a request, uses this process: a
        # HOST(pid) right after a HOST(0) then has nothing to drop
        self.idle = False
        self._opts: dict[tuple[int, str], DeviceOptions] = {}   # by (num_ipus, label)

    def _options(self, num_ipus: int, label: str) -> DeviceOptions:
        """This process's options with the client's ``num_ipus`` and ``label`` (made once
        for each pair: the daemon's at HOST(0) and the hosts' alternate)."""
        opts = self._opts.get((num_ipus, label))
        if opts is None:
            if len(self._opts) >= 16:
                self._opts.clear()
            opts = self._opts[num_ipus, label] = replace(self._dev.opts, num_ipus=num_ipus,
                                                         label=label)
        return opts

    def hand_to(self, pid: int, body: Any) -> None:
        """HOST: forget the previous host, serve ``pid`` (0: none, and the control ring
        reset for the next).

        ``body`` may give ``num_ipus`` (the size of the device the host attached, which
        sets this process's memory capacity), ``label`` and the daemon's ``faults``. The
        daemon sends HOST 0 only while no host uses the rings and waits for its DONE, so
        this process is the only one touching the control ring then; HOST(pid) follows
        it (or a fresh start) and is not waited for (``ipu_protocol.HANDOVER_SEQ``).
        """
        dev = self._dev
        if not dev.opts.pool:
            raise _RequestError(ErrorKind.PROTOCOL, "HOST is only for IPU processes a "
                                "daemon owns (--pool)")
        body = body if isinstance(body, dict) else {}
        num_ipus, label = body.get("num_ipus", 1), body.get("label", "")
        if (pid < 0 or not isinstance(num_ipus, int) or not 1 <= num_ipus <= 64
                or not isinstance(label, str)):
            raise _RequestError(ErrorKind.PROTOCOL, f"HOST needs a pid >= 0, num_ipus in "
                                f"1..64 and a str label, got {pid}, {num_ipus!r}, {label!r}")
        if not self.idle:   # else HOST(0) dropped the last host and nothing came since
            self.drop_client(later=True)
        self._faults.set_daemon_tables(body.get("faults"))
        dev.opts = self._options(num_ipus, label)
        if not pid:
            # clean for the next host; HOST(pid) is not waited for: the host's first
            # requests may already follow it on the ring
            self._control.reset()
        host = dev.opts.host_pid
        self._apart.host_pid = pid or host
        if pid:   # (0: drop_client set all this)
            self._watch.set_client(pid)
            self._watch_events(pid)
            dev.later.append(dev.set_title)
            self.idle = False
            self._wire.expect_soon()   # its LOAD comes next
        _log.info("%s now serves host %s", dev.opts.describe(), pid or "(none)")

    def _watch_events(self, pid: int) -> None:
        """The events ring's own watch of its reader (``pid``), where no watch thread
        interrupts its waits when that process exits (``HostWatch.threaded``: the thread
        watches the client already, and a second watch per hand-over is a pidfd and two
        wake-ups of shm.liveness's thread for nothing)."""
        if not self._watch.threaded:
            self._events.set_peer(pid)

    def drop_client(self, later: bool = False) -> None:
        """Close every executable of the current host; unlink its objects if it is dead.

        ``later``: the mappings of its executables (rings, regions, sessions) are closed,
        and the title set, once the request is answered (``PoolDevice.later``): nothing
        the next host could reach is left of them meanwhile."""
        dev = self._dev
        old = self._watch.client
        gone = bool(old) and self._watch.client_gone()
        if old:
            self._watch.set_client(0)
        if gone:   # the waits its exit interrupted block again (a wait that raises
            ring_waits.resume_all()   # WaitInterrupted resumes them too: after_interrupt)
        self._wire.drop_client()
        # the host's input ring the placement reads its thread from: let go with the rest
        # (else its objects are freed inside the next host's first run)
        self._apart.hint = None
        close = self._executables.detach()
        if later:
            dev.later.append(close)
            if old:
                dev.later.append(dev.set_title)
        else:
            close()
            if old:
                dev.set_title()
        self._faults.drop_host_tables()
        self._watch_events(dev.opts.host_pid)
        stale = self._known - self._own
        self._known.intersection_update(self._own)
        if gone:
            removed = sum(cleanup.unlink_named(name) for name in stale)
            removed += cleanup.unlink_created_by((old,), all_tags=True)
            _log.info("host %d died: removed %d of its shared-memory objects", old, removed)
        self.idle = True

