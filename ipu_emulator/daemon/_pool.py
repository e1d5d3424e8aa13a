"""One IPU of the daemon's pool: its warm process and the blocking steps on it.

The daemon's event loop keeps the state (free, held, ...); the methods here
block (process start, a HOST round trip, shutdown) and run on its executor,
one at a time per IPU. While a host holds the IPU only the host touches the
control and event rings; the daemon uses them only between hosts:

- ``hand_over_soon(host)`` (an attach): HOST(host) on the control ring, not
  waited for: the process is idle with clean rings and takes it before the
  host's first request, which follows it on the ring; its answer goes to the
  host, whose link ignores the seq no host uses (``HANDOVER_SEQ``);
- ``take_back()``: HOST(0): the process ends whatever program the previous
  host left running, closes its executables and (that host being dead)
  unlinks the host's objects, resets its control ring and answers DONE;
  events the previous host never read are skipped, then the event ring is
  reset: the next host gets clean rings and a warm, empty IPU.
"""

from __future__ import annotations

import itertools
import logging
import os
import signal
import time
from typing import Any

import posix_ipc

from shm import RingTimeoutError, ShmError, pid_alive
from shm.cleanup import list_objects

from ipu_emulator import ipu_protocol
from ipu_emulator.ipu.launcher import IpuProcess, IpuSpec, launch_ipu
from ipu_emulator.ipu_protocol import Message, Op, Ready
from ipu_emulator.errors import PoolError
from ipu_emulator.settings import IpuSettings

__all__ = ["PooledIpu", "PoolError", "remove_objects_of"]

_log = logging.getLogger("ipu_emulator.daemon.server")

class PooledIpu:
    """The daemon's handle on one IPU and its process."""

    def __init__(self, spec: IpuSpec, log_dir: str, settings: IpuSettings | None = None) -> None:
        self.spec = spec
        # the daemon's: its IPU processes run with them (default: IpuSettings.current())
        self.settings = settings if settings is not None else IpuSettings.current()
        # seconds a HOST round trip may take (a program the previous host left must
        # notice); past it the IPU process is restarted
        self.handover_timeout = self.settings.daemon_handover_timeout
        self.index = spec.ipu_id
        self.log_dir = log_dir
        self.proc: IpuProcess | None = None
        self.ready: Ready | None = None
        self.state = "starting"     # starting, free, attaching, held, resetting, dead, failed
        self.holder: int | None = None
        self.hosts_served = 0
        # for /metrics (ipu_emulator.daemon.daemon_metrics)
        self.starts = 0          # processes started
        self.resets = 0          # take_back()s that succeeded
        self.held_seconds = 0.0  # time held by hosts, past holds
        self._held_since: float | None = None
        self._runs_past = 0      # programs run by this IPU's earlier processes
        self.faults: list[str] = []   # the daemon's fault tables (ipu_emulator.faults)
        self._seq = itertools.count(1)

    # -- blocking steps (executor) ------------------------------------------------------

    def start(self) -> None:
        """Start a fresh process (after closing a dead one) and wait until it is ready."""
        self._end_hold()
        self.close_process(polite=False)
        self.starts += 1
        proc = launch_ipu(self.spec, log_dir=self.log_dir, pool=True, settings=self.settings)
        try:
            self.ready = proc.wait_ready()
        except BaseException:
            proc.kill()
            proc.close()
            raise
        self.proc = proc
        _log.info("ipu %d: process %d is ready", self.index, proc.pid)

    def hand_over_soon(self, host: int, num_ipus: int, label: str) -> None:
        """HOST(host) on the control ring, not waited for (on the event loop: it does not
        block). The process is idle with clean rings (started, or reset by take_back), so
        it takes HOST before the host's first request, which follows it on the same ring.
        Its answer goes to the host, whose link ignores it: its seq, ``HANDOVER_SEQ``, is
        one no host link uses. PoolError if the process is gone or the ring has no room."""
        proc = self._live_process()
        body = {"num_ipus": num_ipus, "label": label, "faults": self.faults}
        try:
            ipu_protocol.send(proc.control, Message(Op.HOST, seq=ipu_protocol.HANDOVER_SEQ,
                                                    value=host, body=body), timeout=0.0)
        except (ShmError, ipu_protocol.ProtocolError) as exc:
            raise PoolError(f"ipu {self.index} (process {proc.pid}): HOST {host} failed: "
                            f"{exc}") from exc
        self._held_since = time.monotonic()

    def take_back(self) -> None:
        self._end_hold()
        self._host_call(0, {"num_ipus": 1, "label": self.spec.label, "faults": self.faults})
        self.resets += 1

    def _end_hold(self) -> None:
        since, self._held_since = self._held_since, None
        if since is not None:
            self.held_seconds += time.monotonic() - since

    def held_seconds_at(self, now: float) -> float:
        """Time held by hosts up to ``now`` (``time.monotonic()``), the current hold too."""
        since = self._held_since
        return self.held_seconds + (now - since if since is not None else 0.0)

    def _host_call(self, host: int, body: dict[str, Any]) -> None:
        proc = self._live_process()
        seq = ipu_protocol.daemon_seq(next(self._seq))
        deadline = time.monotonic() + self.handover_timeout
        try:
            ipu_protocol.send(proc.control, Message(Op.HOST, seq=seq, value=host, body=body),
                          timeout=self.handover_timeout)
            skipped = 0
            while True:
                try:
                    msg = ipu_protocol.receive(proc.events, timeout=0.2)
                except RingTimeoutError:
                    if not proc.alive():
                        raise PoolError(f"{proc.describe_exit()} during HOST {host}") from None
                    if time.monotonic() > deadline:
                        raise PoolError(f"ipu {self.index} (process {proc.pid}) did not answer "
                                        f"HOST {host} within {self.handover_timeout:g} s") from None
                    continue
                if msg.seq == seq and msg.op in (Op.DONE, Op.ERROR):
                    break
                skipped += 1   # events the previous host never read
            if msg.op is Op.ERROR:
                raise PoolError(f"ipu {self.index} refused HOST {host}: {msg.body}")
            proc.events.reset()
        except (ShmError, ipu_protocol.ProtocolError) as exc:
            raise PoolError(f"ipu {self.index} (process {proc.pid}): HOST {host} failed: "
                            f"{exc}") from exc
        if skipped:
            _log.debug("ipu %d: skipped %d stale events", self.index, skipped)

    def _live_process(self) -> IpuProcess:
        proc = self.proc
        if proc is None or not proc.alive():
            raise PoolError(f"ipu {self.index}: " + (proc.describe_exit() if proc is not None
                                                       else "no process"))
        return proc

    def close_process(self, polite: bool, timeout: float = 5.0) -> None:
        """Stop the process and destroy its rings (idempotent).

        ``polite``: no host uses the rings, so ask with SHUTDOWN first; otherwise (a host
        holds them) SIGTERM. Escalates to SIGKILL with a warning naming the process.
        """
        proc, self.proc = self.proc, None
        if proc is None:
            return
        self._runs_past += _program_runs(proc)
        if not polite and proc.returncode() is None and pid_alive(proc.pid):
            # (a pid gone already, its exit not reported yet: no signal to a pid the
            # kernel may have handed to another process)
            os.kill(proc.pid, signal.SIGTERM)
            if proc.wait_exit(timeout) is None:
                _log.warning("%s ignored SIGTERM for %g s; killing it", proc.describe_exit(),
                             timeout)
                proc.kill()
        proc.close()   # SHUTDOWN (escalating, with warnings) if still running; unlinks rings

    # -- state (event loop) ----------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def program_runs(self) -> int:
        """Programs this IPU has run (a Main run serves one request of the model's batch
        per device iteration), over all its processes: each IPU process publishes its
        count in its control ring's user word."""
        proc = self.proc
        return self._runs_past + (_program_runs(proc) if proc is not None else 0)

    def alive(self) -> bool:
        """Its process runs. Not only what the template process reported: it reports an
        exit a moment after it reaped the process, and an attach meanwhile must not lend
        a dead one; the pid itself tells at once (this is the daemon's look before it
        lends an IPU, and its periodic one: not a hot path)."""
        proc = self.proc
        return proc is not None and proc.alive() and pid_alive(proc.pid)

    def info(self) -> dict[str, Any]:
        """What a host needs to use this IPU (attach reply)."""
        proc = self.proc
        assert proc is not None
        return {"ipu": self.index, "pid": proc.pid, "control": proc.control.name,
                "events": proc.events.name, "log": proc.log_path,
                "ready": self.ready.body() if self.ready is not None else None,
                "trace": proc.trace.name if proc.trace is not None else None}

    def status(self) -> dict[str, Any]:
        return {"ipu": self.index, "state": self.state, "holder": self.holder, "pid": self.pid,
                "ipu_version": self.spec.ipu_version, "tiles_per_ipu": self.spec.tiles_per_ipu,
                "memory_per_tile": self.spec.memory_per_tile, "hosts_served": self.hosts_served}


def remove_objects_of(pids: set[int]) -> list[str]:
    """Unlink every object (any tag) created by one of ``pids``; their /dev/shm entries."""
    removed = []
    for obj in list_objects(all_tags=True):
        if obj.pid not in pids:
            continue
        try:
            if obj.is_semaphore:
                posix_ipc.unlink_semaphore(obj.name)
            else:
                posix_ipc.unlink_shared_memory(obj.name)
            removed.append(obj.entry)
        except (posix_ipc.ExistentialError, OSError):
            pass
    return removed


def _program_runs(proc: IpuProcess) -> int:
    try:
        return max(0, proc.control.user_word())
    except Exception:   # the ring is closed: the process is gone with its count
        return 0
