"""A loopback IPU: the IPU process's program on a thread of the host, no OS process.

``launch_loopback(spec)`` makes the same control and event rings as
:func:`~ipu_emulator.ipu.launcher.launch_ipu` and runs the same loop
(:class:`~ipu_emulator.ipu.process.DeviceProcess`: the interpreter, the
stream I/O over the session's stream rings, the host-memory views) on a daemon
thread of the calling process. It returns a :class:`LoopbackIpu`, which is an
:class:`~ipu_emulator.ipu.launcher.IpuConnection`: whatever takes one (the
host's device links, ``DeviceManager(launcher=...)``) runs unchanged over it.
The host and the "device" still talk only through the shared-memory rings;
only the process boundary is gone, so tests run in one process, quickly.

What an IPU process assumes about its own OS process is replaced
(:class:`~ipu_emulator.ipu.process.ProcessHooks`): READY reports the host's
pid (``pid`` is it too), the host is "alive" until :meth:`LoopbackIpu.kill`,
the thread never changes its CPU affinity, and a "dead host" (a kill) closes
the device side's mappings without unlinking anything (the host still owns
and unlinks its objects). ``main()``'s logging and signal set-up is not run:
the device side logs through the host's ``logging`` (so ``log_tail()`` is
empty, as for an IPU process started without a log folder).

Limits: ``kill()`` only emulates a SIGKILL. The thread notices it at its next
host check (every ~0.25 s, also while a program waits on a stream) and ends
without a BYE, and ``returncode()`` is then ``-SIGKILL``; a program busy in
one long computation runs it to the end first. A ring's peer watch names the
host's own pid, so losing the device is seen by the link's poll of
``alive()``, never by a ring's ``PeerDiedError``.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Any

from shm import Ring, RingTimeoutError

from ipu_emulator import ipu_protocol
from ipu_emulator.ipu.launcher import IpuSpec, create_rings, describe_returncode
from ipu_emulator.settings import IpuSettings
from ipu_emulator.errors import IpuProcessError
from ipu_emulator.ipu_protocol import Message, Op, Ready

__all__ = ["LoopbackIpu", "launch_loopback"]

_log = logging.getLogger(__name__)

class LoopbackIpu:
    """One emulated IPU served by a thread of this process (an ``IpuConnection``)."""

    def __init__(self, spec: IpuSpec, control: Ring, events: Ring) -> None:
        from ipu_emulator.ipu.process import DeviceOptions, ProcessHooks

        self.spec = spec
        self.control = control
        self.events = events
        self._ready: Ready | None = None
        self._closed = False
        self._killed = threading.Event()
        self._returncode: int | None = None
        self._opts = DeviceOptions(
            control=control.name, events=events.name, host_pid=os.getpid(),
            ipu_id=spec.ipu_id, ipu_version=spec.ipu_version, tiles_per_ipu=spec.tiles_per_ipu,
            memory_per_tile=spec.memory_per_tile, num_ipus=spec.num_ipus,
            threads=spec.compute_threads, label=spec.label)
        self._hooks = ProcessHooks(pid=os.getpid(), host_alive=self._host_alive,
                                   keep_apart=False, unlink_on_host_gone=False)
        self._thread = threading.Thread(target=self._main, daemon=True,
                                        name=f"ipu-loopback-{spec.describe()}")

    def _start(self) -> None:
        self._thread.start()

    # -- the device side (its thread) ---------------------------------------------------

    def _host_alive(self) -> bool:
        return not self._killed.is_set()

    def _main(self) -> None:
        """What ``process.main()`` does after its set-up: attach, serve, give an exit code."""
        from ipu_emulator.ipu.process import DeviceProcess

        code = 70
        try:
            try:
                dev = DeviceProcess(self._opts, self._hooks)
            except Exception as exc:
                _log.error("cannot attach the control and event rings: %s", exc)
                return
            try:
                code = dev.serve()
            except Exception:
                _log.exception("loopback IPU failed")
                dev.close()
        finally:
            self._returncode = -signal.SIGKILL if self._killed.is_set() else code

    # -- IpuConnection ------------------------------------------------------------------

    @property
    def pid(self) -> int:
        """This process's pid: the loopback IPU runs in it."""
        return os.getpid()

    @property
    def thread(self) -> threading.Thread:
        """The thread that serves this IPU."""
        return self._thread

    def returncode(self) -> int | None:
        """The "exit status" once the thread ended (``-SIGKILL`` after kill()), else None."""
        return None if self._thread.is_alive() else self._returncode

    def alive(self) -> bool:
        return self._thread.is_alive()

    def wait_exit(self, timeout: float) -> int | None:
        if timeout > 0 and self._thread.is_alive():
            self._thread.join(timeout)
        return self.returncode()

    def describe_exit(self) -> str:
        return (f"{self.spec.describe()} (loopback IPU in pid {self.pid}) "
                f"{describe_returncode(self.returncode())}")

    def log_tail(self, nbytes: int = 2000) -> str:
        return ""   # the device side logs through this process's logging

    def wait_ready(self, timeout: float | None = None) -> Ready:
        """Block until the device side posts READY; IpuProcessError if it ends first."""
        if self._ready is not None:
            return self._ready
        if timeout is None:
            timeout = IpuSettings.start_timeout   # the default: this IPU needs no imports
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = ipu_protocol.receive(self.events, timeout=0.05)
            except RingTimeoutError:
                msg = None
            if msg is not None:
                if msg.op is Op.READY:
                    self._ready = Ready.decode(msg.body)
                    return self._ready
                _log.warning("%s: unexpected %s before READY", self.describe_exit(), msg.op.name)
                continue
            if not self._thread.is_alive():
                raise IpuProcessError(f"{self.describe_exit()} while starting",
                                      pid=self.pid, returncode=self.returncode())
            if time.monotonic() > deadline:
                raise IpuProcessError(f"{self.spec.describe()} (loopback IPU) did not become "
                                      f"ready within {timeout:g} s", pid=self.pid)

    def shutdown(self, timeout: float = 5.0) -> None:
        """SHUTDOWN, then wait for the thread; one that ignores it is "killed"."""
        if not self._thread.is_alive():
            return
        try:
            ipu_protocol.send(self.control, Message(Op.SHUTDOWN), timeout=min(timeout, 1.0))
        except Exception as exc:  # full ring or closed: escalate below
            _log.debug("could not send SHUTDOWN to %s: %s", self.describe_exit(), exc)
        if self.wait_exit(timeout) is None:
            _log.warning("%s ignored SHUTDOWN for %g s; killing it", self.describe_exit(),
                         timeout)
            self.kill()

    def kill(self) -> None:
        """Emulate SIGKILL: the thread ends at its next host check, without a BYE."""
        if self._thread.is_alive():
            self._killed.set()
            self.wait_exit(5.0)

    def close(self) -> None:
        """Shut the device side down and destroy the rings (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.shutdown()
        finally:
            for ring in (self.control, self.events):
                ring.close()
                ring.unlink()

    def __enter__(self) -> "LoopbackIpu":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LoopbackIpu({self.spec.describe()}, {'alive' if self.alive() else 'ended'})"


def launch_loopback(spec: IpuSpec, *, log_dir: str | None = None, **_: Any) -> LoopbackIpu:
    """Create the rings and start serving ``spec`` on a thread of this process.

    The signature of :func:`~ipu_emulator.ipu.launcher.launch_ipu`, so it can be a
    ``DeviceManager``'s ``launcher``; ``log_dir`` and other options are ignored (the
    device side logs through this process's ``logging``). Does not wait for READY.
    """
    control, events = create_rings()
    try:
        ipu = LoopbackIpu(spec, control, events)
        ipu._start()
    except BaseException:
        for ring in (control, events):
            ring.close()
            ring.unlink()
        raise
    return ipu
