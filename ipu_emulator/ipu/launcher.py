"""Start and stop IPU processes; tell whether one is alive and how it died.

``launch_ipu(spec)`` creates the process's control ring (host produces) and
event ring (host consumes), starts the IPU process and returns an
:class:`IpuProcess` handle. The process is forked by this host's template
process (:mod:`ipu_emulator.ipu.forkserver`: pre-started, numpy and onnxruntime
already imported), or, with the setting ``forkserver`` off, started as a fresh
``python -m ipu_emulator`` with ``subprocess``; the host itself never forks
(it is threaded). The launch's settings (``IpuSettings``, or the host's, which
extend them) go into the process's environment, where it reads them when it
starts. The host talks to the device only through the two rings; the handle
adds liveness (``alive()``, ``describe_exit()``) and a polite-then-forceful
``shutdown()``.

The rest of the host depends only on what :class:`IpuConnection` lists, so a
daemon that keeps IPU processes warm can later hand out connections to
processes it started, with the same interface.

The process writes its log (stderr) to ``<log_dir>/ipu<N>.log``; the tail of
it is included when the process dies unexpectedly.
"""

from __future__ import annotations

import logging
import os
import re
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

from shm import Ring, RingTimeoutError, limits, naming, process_state
from shm.settings import ShmSettings
from shm.tracebuf import TraceBuffer

from ipu_emulator import ipu_protocol, safe_files
from ipu_emulator.ipu import forkserver
from ipu_emulator.ipu._options import IpuShape
from ipu_emulator.ipu_protocol import Message, Op, Ready
from ipu_emulator.errors import IpuProcessError, describe_returncode
from ipu_emulator.settings import IpuSettings
from ipu_emulator.trace import new_ipu_buffer, recorder as trace_recorder

__all__ = ["IpuSpec", "IpuProcess", "IpuConnection", "IpuProcessError", "launch_ipu", "create_rings", "prestart",
           "shutdown_all", "kill_all",
           "describe_returncode", "read_log_tail"]

_log = logging.getLogger(__name__)

_LOG_TAG = re.compile(r" ipu-?\d+\[(\d+)\] ")

@dataclass(frozen=True)
class IpuSpec(IpuShape):
    """What one IPU process emulates.

    ``ipu_id`` is the machine's IPU number (-1 for a private IPU model);
    ``num_ipus`` is how many IPUs the device this process runs programs for has
    (its memory capacity is ``num_ipus * tiles_per_ipu * memory_per_tile``).
    """

    ipu_id: int
    compute_threads: int = 1
    label: str = ""

    def describe(self) -> str:
        return self.label or (f"ipu {self.ipu_id}" if self.ipu_id >= 0 else "IPU model")


class IpuConnection(Protocol):
    """What the host needs from a running IPU process, however it was started."""

    spec: IpuSpec
    control: Ring
    events: Ring

    @property
    def pid(self) -> int: ...

    def alive(self) -> bool: ...

    def returncode(self) -> int | None: ...

    def wait_exit(self, timeout: float) -> int | None: ...

    def describe_exit(self) -> str: ...

    def log_tail(self, nbytes: int = 2000) -> str: ...

    def kill(self) -> None: ...

    def wait_ready(self, timeout: float | None = None) -> Ready:
        """Block until the process is ready (``timeout`` s; None: its start timeout)."""

    def shutdown(self, timeout: float = 5.0) -> None: ...

    def close(self) -> None: ...


def read_log_tail(log_path: str | None, pid: int, nbytes: int = 2000) -> str:
    """The last lines process ``pid`` wrote to the IPU log ``log_path`` ("" if none)."""
    if not log_path:
        return ""
    try:
        with open(log_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - nbytes))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    # Lines of this process: those tagged "ipuN[pid]" and their continuation
    # lines (tracebacks), up to the next line tagged by another process.
    mine: list[str] = []
    keep = False
    for ln in text.splitlines():
        tagged = _LOG_TAG.search(ln)
        if tagged:
            keep = int(tagged.group(1)) == pid
        if keep:
            mine.append(ln)
    return "\n".join(mine[-20:])


class IpuProcess:
    """Host-side handle of one IPU process started by this host (embedded mode)."""

    def __init__(self, spec: IpuSpec, popen: "subprocess.Popen[bytes] | forkserver.ForkedProcess",
                 control: Ring, events: Ring, log_path: str | None,
                 start_timeout: float = IpuSettings.start_timeout) -> None:
        self.spec = spec
        self.start_timeout = start_timeout   # seconds it may take to become ready
        self.control = control
        self.events = events
        self.log_path = log_path
        self._popen = popen
        self._ready: Ready | None = None
        self._closed = False
        # The process is this host's: a process forked from it (which inherits this handle)
        # never shuts it down or signals it (see _foreign).
        self._owner_pid = os.getpid()
        self._poll_lock = threading.Lock()
        # tracing (ipu_emulator.trace): the buffer the process records into; its name is
        # unlinked once the process attached it (READY) or, when hosts of a daemon map it
        # too (trace_named), once the process is closed
        self.trace: TraceBuffer | None = None
        self.trace_named = False

    @property
    def pid(self) -> int:
        return self._popen.pid

    def returncode(self) -> int | None:
        """The exit status once the process ended (reaps it), else None.

        Every thread goes through this lock: ``Popen.poll()`` answers "running" when
        another thread is inside poll()/wait() at the same moment.
        """
        with self._poll_lock:
            return self._popen.poll()

    def alive(self) -> bool:
        return self.returncode() is None

    def describe_exit(self) -> str:
        rc = self.returncode()
        text = f"{self.spec.describe()} (IPU process pid {self.pid}) {describe_returncode(rc)}"
        popen = self._popen
        if isinstance(popen, forkserver.ForkedProcess) and popen.status_lost:
            text = (f"{self.spec.describe()} (IPU process pid {self.pid}) exited after its "
                    f"template process (pid {popen.template_pid}) died; its exit status is "
                    "unknown")
        return text

    def wait_exit(self, timeout: float) -> int | None:
        """Wait up to ``timeout`` s for the process to end; its return code or None."""
        rc = self.returncode()
        if rc is not None or timeout <= 0:
            return rc
        popen = self._popen
        if isinstance(popen, forkserver.ForkedProcess):
            # the template reports the exit at once; no polling
            rc = popen.wait_exit(timeout)
            with self._poll_lock:
                return popen.poll() if rc is None else rc
        deadline = time.monotonic() + timeout
        try:
            pidfd = os.pidfd_open(popen.pid)
        except OSError:   # already reaped, or no pidfd_open: poll below
            pidfd = -1
        try:
            delay = 0.001
            while True:
                rc = self.returncode()
                left = deadline - time.monotonic()
                if rc is not None or left <= 0:
                    return rc
                if pidfd >= 0:
                    # readable once it exited (capped: another thread may reap it first)
                    select.select([pidfd], [], [], min(left, 1.0))
                else:
                    time.sleep(min(delay, left))   # only on shutdown and death paths
                    delay = min(delay * 2, 0.05)
        finally:
            if pidfd >= 0:
                os.close(pidfd)

    def log_tail(self, nbytes: int = 2000) -> str:
        return read_log_tail(self.log_path, self.pid, nbytes)

    def wait_ready(self, timeout: float | None = None) -> Ready:
        """Block until the process posts READY (``timeout`` s, None: its start timeout);
        raises IpuProcessError if it dies or is late."""
        if self._ready is not None:
            return self._ready
        if timeout is None:
            timeout = self.start_timeout
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = ipu_protocol.receive(self.events, timeout=0.1)
            except RingTimeoutError:
                msg = None
            except Exception as exc:  # PeerDiedError and friends
                raise self._died("while starting") from exc
            if msg is not None:
                if msg.op is Op.READY:
                    self._ready = Ready.decode(msg.body)
                    if self.trace is not None and not self.trace_named:
                        self.trace.unlink()
                    return self._ready
                _log.warning("%s: unexpected %s before READY", self.describe_exit(), msg.op.name)
                continue
            if self.returncode() is not None:
                raise self._died("while starting")
            if time.monotonic() > deadline:
                raise IpuProcessError(
                    f"{self.spec.describe()} (IPU process pid {self.pid}) did not become ready "
                    f"within {timeout:g} s", pid=self.pid)

    def _died(self, when: str) -> IpuProcessError:
        rc = self.wait_exit(2.0)
        tail = self.log_tail()
        msg = f"{self.describe_exit()} {when}"
        if tail:
            msg += f"; its log ends with:\n{tail}"
        return IpuProcessError(msg, pid=self.pid, returncode=rc)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Ask the process to exit; escalate to SIGTERM then SIGKILL (with a warning)."""
        shutdown_all([self], timeout)

    def _foreign(self) -> bool:
        """Whether this is a process forked from the host that started the IPU process."""
        return os.getpid() != self._owner_pid

    def send_shutdown(self, timeout: float = 5.0) -> None:
        """Send SHUTDOWN without waiting for the exit (see shutdown_all)."""
        if self._foreign() or self.returncode() is not None:
            return
        try:
            ipu_protocol.send(self.control, Message(Op.SHUTDOWN), timeout=min(timeout, 1.0))
        except Exception as exc:  # full ring, dead peer, closed: the caller escalates
            _log.debug("could not send SHUTDOWN to %s: %s", self.describe_exit(), exc)

    def send_terminate(self) -> None:
        """SIGTERM without waiting for the exit (see shutdown_all)."""
        if not self._foreign() and self.returncode() is None:
            self._popen.terminate()

    def send_kill(self) -> None:
        """SIGKILL without waiting for the exit (see kill_all)."""
        if not self._foreign() and self.returncode() is None:
            self._popen.kill()

    def kill(self) -> None:
        """SIGKILL the process (tests, and a host giving up on a hung device)."""
        kill_all([self])

    def close(self) -> None:
        """Shut the process down and destroy its rings (idempotent). In a process forked
        from the host only this process's copies of the rings are closed."""
        if self._closed:
            return
        self._closed = True
        if self._foreign():
            self.control.close()
            self.events.close()
            return
        try:
            self.shutdown()
        finally:
            for ring in (self.control, self.events):
                ring.close()
                ring.unlink()
            if self.trace is not None:
                self.trace.unlink()   # the tracing session keeps its mapping

    def __enter__(self) -> "IpuProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"IpuProcess({self.spec.describe()}, pid={self.pid})"


def _launch_env(s: IpuSettings, extra_env: dict[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(s.to_env())   # the process reads its settings from its environment
    env[ShmSettings.knob("shm_tag").env] = naming.current_tag()
    if extra_env:
        env.update(extra_env)
    return env


def prestart(*, log_dir: str | None = None, settings: IpuSettings | None = None) -> None:
    """Start what ``launch_ipu`` with these settings forks IPU processes from (the fork
    server's template, which imports numpy and onnxruntime once) in the background, so
    that a host that will launch soon does not wait for it then. Nothing when the setting
    ``forkserver`` is off."""
    s = settings if settings is not None else IpuSettings.current()
    if not s.forkserver:
        return
    if log_dir:
        try:
            os.close(safe_files.open_private_dir(log_dir, what="log folder", check_parent=True))
        except OSError:   # the launch names the problem
            return
    forkserver.prestart(_launch_env(s, None), log_dir)


def create_rings(settings: IpuSettings | None = None) -> tuple[Ring, Ring]:
    """The control and event rings of one IPU (``ipu_protocol``), owned by this process;
    neither is left behind if the second cannot be made."""
    control = Ring.create(ipu_protocol.CONTROL_SLOT_SIZE, ipu_protocol.CONTROL_SLOTS, kind="ctl",
                          settings=settings)
    try:
        events = Ring.create(ipu_protocol.EVENT_SLOT_SIZE, ipu_protocol.EVENT_SLOTS, kind="evt",
                             prefault=False, settings=settings)
    except BaseException:
        control.close()
        control.unlink()
        raise
    return control, events


def launch_ipu(spec: IpuSpec, *, log_dir: str | None = None,
               extra_env: dict[str, str] | None = None, pool: bool = False,
               settings: IpuSettings | None = None,
               spawn_wait: float = forkserver.SPAWN_TIMEOUT) -> IpuProcess:
    """Create the rings and start one IPU process; does not wait for it to be ready.

    ``pool``: the caller is a daemon that hands the process to hosts (``HOST`` messages).
    ``settings``: the knobs the process runs with (default ``IpuSettings.current()``).
    ``spawn_wait``: seconds to wait for the fork server to fork it (a host passes its host
    sync timeout, if lower); past it the process is started fresh.
    """
    s = settings if settings is not None else IpuSettings.current()
    control, events = create_rings(s)
    log_path = None
    trace: TraceBuffer | None = None
    log_file: Any = subprocess.DEVNULL
    try:
        if log_dir:
            name = f"ipu{spec.ipu_id}.log" if spec.ipu_id >= 0 else "ipumodel.log"
            log_path = os.path.join(log_dir, name)
            # checked here (named error in the host), rotated past 4 MiB, never a link
            log_file = safe_files.open_log(log_path)
        env = _launch_env(s, extra_env)
        argv = ["--ipu-id", str(spec.ipu_id), "--ipu-version", str(spec.ipu_version),
                "--tiles", str(spec.tiles_per_ipu), "--memory-per-tile", str(spec.memory_per_tile),
                "--num-ipus", str(spec.num_ipus), "--threads", str(spec.compute_threads),
                "--control", control.name, "--events", events.name,
                "--host-pid", str(os.getpid())]
        if spec.label:
            argv += ["--label", spec.label]
        if pool:
            argv.append("--pool")
        trace = new_ipu_buffer() if trace_recorder.ON else None
        if trace is not None:
            argv += ["--trace-buffer", trace.name]
        popen: Any = None
        if s.forkserver:
            try:
                popen = forkserver.spawn(argv, env, log_path, log_dir, spawn_wait)
            except (forkserver.ForkserverError, OSError) as exc:
                _log.warning("%s; starting IPU processes without the template", exc)
        if popen is None:
            # out of descriptors or processes here is named (shm.limits), not a raw OSError
            with limits.named_errors(f"starting the IPU process of {spec.describe()}"):
                popen = subprocess.Popen([sys.executable, "-m", "ipu_emulator", *argv],
                                         stdin=subprocess.DEVNULL, stdout=log_file,
                                         stderr=log_file, env=env, close_fds=True)
    except BaseException:
        for ring in (control, events):
            ring.close()
            ring.unlink()
        if trace is not None:
            trace.unlink()
        raise
    finally:
        if log_file is not subprocess.DEVNULL:
            os.close(log_file)
    # The control ring watches the process (a full ring must not block forever on a dead
    # device); the event ring's reader sets its own watch (devices._link._watch_exit).
    control.set_peer(popen.pid)
    _log.debug("started %s as pid %d", spec.describe(), popen.pid)
    proc = IpuProcess(spec, popen, control, events, log_path, s.start_timeout)
    proc.trace = trace
    proc.trace_named = pool    # a daemon's: the hosts it lends the IPU to map it by name
    return proc


def shutdown_all(processes: "list[Any]", timeout: float = 5.0) -> None:
    """Shut several IPU processes down together (the IPUs of one device).

    SHUTDOWN goes to every process first, then their exits are waited for against one
    deadline, so the device's close costs its slowest IPU, not the sum of them. A
    process still running then gets SIGTERM, then SIGKILL (all at once, each step), with
    a warning. Connections that are not IpuProcess (a daemon's) get their own shutdown().
    """
    ours = [p for p in processes if isinstance(p, IpuProcess)]
    for p in processes:
        if not isinstance(p, IpuProcess):
            shutdown = getattr(p, "shutdown", None)
            if shutdown is not None:
                shutdown()
    for p in ours:
        p.send_shutdown(timeout)
    late = _wait_all(ours, timeout)
    if not late:
        return
    # a stopped process (SIGSTOP: state T) takes no SIGTERM until continued: kill it now
    stopped = [p for p in late if process_state(p.pid) in ("T", "t")]
    for p in stopped:
        _log.warning("%s (IPU process pid %d) is stopped (state T) and ignored SHUTDOWN for "
                     "%g s; killing it", p.spec.describe(), p.pid, timeout)
    late = [p for p in late if p not in stopped]
    kill_all(stopped)
    for p in late:
        _log.warning("%s ignored SHUTDOWN for %g s; terminating it", p.describe_exit(), timeout)
        p.send_terminate()
    late = _wait_all(late, min(2.0, timeout))
    for p in late:
        _log.warning("%s ignored SIGTERM; killing it", p.describe_exit())
    kill_all(late)


def kill_all(processes: "list[Any]", timeout: float = 5.0) -> None:
    """SIGKILL every process of ``processes`` first, then wait for their exits together."""
    ours = [p for p in processes if isinstance(p, IpuProcess)]
    for p in processes:
        try:
            if isinstance(p, IpuProcess):
                p.send_kill()
            else:
                p.kill()
        except Exception:  # pragma: no cover - best effort, the others still go
            _log.debug("killing %r", p, exc_info=True)
    _wait_all(ours, timeout)


def _wait_all(processes: "list[IpuProcess]", timeout: float) -> "list[IpuProcess]":
    """Wait until every process exited or ``timeout`` s passed; those still running.
    (They end in parallel: waiting for each in turn costs the slowest one.)"""
    deadline = time.monotonic() + timeout
    for p in processes:
        p.wait_exit(max(0.0, deadline - time.monotonic()))
    return [p for p in processes if p.returncode() is None]
