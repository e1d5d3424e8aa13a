"""Where IPU processes run: one policy for the whole machine.

Two things decide how fast an IPU process serves its host:

- It should not share a CPU with the host thread that submits its requests. The
  two hand each request back and forth; when the scheduler puts both on one CPU
  they take turns on it while another CPU idles: neither looks idle to the
  scheduler, ``sched_yield`` gives the CPU to the other only when its virtual
  runtime is lower, and both are too cache-hot to be migrated. Measured with
  ``perf sched timehist``: a [1,4] request then takes 33-35 us instead of 17-18
  us, for tens of milliseconds at a time.
- It should not share a CPU with another busy IPU process: two replicas of a
  compute-bound model on one CPU run at the speed of one. A rule that only moves
  each process off its host's CPU puts every one of them on the same other CPU.

So every busy IPU process of the machine holds at most one CPU, and a CPU is held
by at most one: a hold is an abstract Unix socket named after the CPU
(``ipu-emulator.cpu.<n>``), which only one process can bind and which the kernel
releases when its process exits, however it ends (no file is left behind). While
it serves requests the process looks, every ``PERIOD`` seconds, at the CPU the
host's submitting thread last ran on (``/proc/<pid>/task/<tid>/stat``: the host
writes that thread's id into the user word of its input rings, read through
``hint``; the main thread's ``/proc/<pid>/stat`` when there is none):

- holding a CPU other than that one: it stays where it is;
- otherwise it takes a free CPU other than the host thread's (its own first, to
  stay cache-hot) and narrows its affinity to it, which moves it at once;
- if every other CPU is held, it holds the one it runs on (beside the host thread,
  which is not pinned and which the scheduler moves); if that is held too, it gives
  up any hold and lets the scheduler place it.

A process that stops serving, or whose wait for work lasted a whole slice
(``release()``), gives its CPU and its affinity back. A run that starts without a CPU
held first looks after ``PERIOD`` (``starting()``): a runner that lives a few
milliseconds (made, run once, closed) is served where it is, without a move there and
back (two ``sched_setaffinity`` and the /proc reads per life). ``IPU_EMULATOR_KEEP_APART=0``
turns the policy off; it is off on one CPU.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Callable

from ipu_emulator.settings import IpuSettings

__all__ = ["KeepApart", "CpuHold", "PERIOD", "NAMESPACE"]

PERIOD = 0.005
"""Seconds between looks."""

NAMESPACE = "ipu-emulator.cpu."
"""Prefix of the abstract socket names that hold CPUs (tests use their own)."""


def _cpu_of(stat_path: str) -> int:
    """Field 39 of a /proc stat file: the CPU the task last ran on."""
    with open(stat_path, "rb") as f:
        data = f.read()
    # the command name (field 2) may hold spaces and parentheses: count after the last ')'
    return int(data[data.rindex(b")") + 2:].split()[36])


class CpuHold:
    """This process's hold on at most one CPU of the machine (see the module docstring)."""

    def __init__(self, namespace: str = NAMESPACE) -> None:
        self.namespace = namespace
        self.cpu = -1                       # the CPU held, -1: none
        self._sock: socket.socket | None = None

    def take(self, cpu: int) -> bool:
        """Hold ``cpu`` instead of the CPU held now; False (and no change) if another
        process holds it."""
        if cpu == self.cpu:
            return True
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.bind(f"\0{self.namespace}{cpu}")
        except OSError:
            sock.close()
            return False
        self.drop()
        self._sock, self.cpu = sock, cpu
        return True

    def drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock, self.cpu = None, -1


class KeepApart:
    """See the module docstring. ``check()`` is cheap when it is not time to look."""

    def __init__(self, host_pid: int, namespace: str = NAMESPACE) -> None:
        self._allowed = frozenset(os.sched_getaffinity(0))
        self._pinned = -1                 # the CPU the affinity is narrowed to, -1: none
        self.hold = CpuHold(namespace)
        self.next_look = 0.0
        self.host_pid = host_pid
        self.hint: Callable[[], int] | None = None   # the host thread to keep off, or 0
        self.enabled = (len(self._allowed) > 1 and host_pid > 0
                        and IpuSettings.current().keep_apart)
        if not self.enabled:
            self.next_look = float("inf")   # callers compare before calling check()

    def check(self) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now < self.next_look:
            return
        self.next_look = now + PERIOD
        try:
            # pinned, this thread runs on that CPU: one /proc read less (each ~15 us)
            mine = self._pinned if self._pinned >= 0 else _cpu_of("/proc/thread-self/stat")
            self._look(self._host_thread_cpu(), mine)
        except (OSError, ValueError, IndexError):   # host gone, /proc hidden, refused
            self.release()
            self.enabled = False
            self.next_look = float("inf")

    def starting(self) -> None:
        """A run starts: without a CPU held, the first look is ``PERIOD`` from now."""
        if self.enabled and self.hold.cpu < 0:
            self.next_look = max(self.next_look, time.monotonic() + PERIOD)

    def _look(self, host_cpu: int, mine: int) -> None:
        hold = self.hold
        if hold.cpu >= 0 and hold.cpu != host_cpu:
            return
        others = sorted(self._allowed - {host_cpu, mine})
        for cpu in ([mine] if mine != host_cpu else []) + others:
            if hold.take(cpu):
                self._pin(cpu)
                return
        if hold.cpu >= 0 or hold.take(mine):   # every other CPU is held: stay here
            self._pin(hold.cpu)
            return
        self._unpin()

    def _pin(self, cpu: int) -> None:
        if self._pinned != cpu:
            os.sched_setaffinity(0, {cpu})
            self._pinned = cpu

    def _unpin(self) -> None:
        if self._pinned >= 0:
            self._pinned = -1
            os.sched_setaffinity(0, self._allowed)

    def _host_thread_cpu(self) -> int:
        """The CPU of the host thread ``hint`` names, else of the host's main thread."""
        tid = 0
        if self.hint is not None:
            try:
                tid = int(self.hint())
            except Exception:   # the ring is closed (its session went): no hint
                self.hint = None
        if tid > 0:
            try:
                return _cpu_of(f"/proc/{self.host_pid}/task/{tid}/stat")
            except (OSError, ValueError, IndexError):   # that thread has exited
                pass
        return _cpu_of(f"/proc/{self.host_pid}/stat")

    def release(self) -> None:
        """Give the CPU held and the whole affinity back (the IPU process goes idle)."""
        self.hold.drop()
        if self._pinned >= 0:
            try:
                self._unpin()
            except OSError:
                pass
            self._pinned = -1
        if self.enabled:
            self.next_look = 0.0
