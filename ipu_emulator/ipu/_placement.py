"""Keeping an IPU process off the CPU its host runs on.

A host and its IPU process hand each request back and forth. When the
scheduler puts both on one CPU they take turns on it while another CPU idles:
neither looks idle to the scheduler, ``sched_yield`` gives the CPU to the other
only when its virtual runtime is lower, and both are too cache-hot to be
migrated. Measured here with ``perf sched timehist``: a [1,4] request then takes
33-35 us instead of 17-18 us, for tens of milliseconds at a time.

So while the IPU process serves requests it looks, every ``PERIOD`` seconds,
at the CPU the host's thread that submits requests last ran on
(``/proc/<pid>/task/<tid>/stat``: the host writes that thread's id into the
user word of its input rings, read through ``hint``; the main thread's
``/proc/<pid>/stat`` when there is none). If that is its own CPU it narrows
its affinity to the other CPUs, which moves it at once; at the next look where
they differ it gets its whole affinity back.
``IPU_EMULATOR_KEEP_APART=0`` turns it off; it is off on one CPU.
"""

from __future__ import annotations

import os
import time
from typing import Callable

from ipu_emulator.settings import IpuSettings

__all__ = ["KeepApart", "PERIOD"]

PERIOD = 0.005
"""Seconds between looks."""


def _cpu_of(stat_path: str) -> int:
    """Field 39 of a /proc stat file: the CPU the task last ran on."""
    with open(stat_path, "rb") as f:
        data = f.read()
    # the command name (field 2) may hold spaces and parentheses: count after the last ')'
    return int(data[data.rindex(b")") + 2:].split()[36])


class KeepApart:
    """See the module docstring. ``check()`` is cheap when it is not time to look."""

    def __init__(self, host_pid: int) -> None:
        self._allowed = frozenset(os.sched_getaffinity(0))
        self._narrowed = False
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
            host_cpu = self._host_thread_cpu()
            mine = _cpu_of("/proc/thread-self/stat")
            if host_cpu == mine:
                others = self._allowed - {host_cpu}
                if others:
                    os.sched_setaffinity(0, others)
                    self._narrowed = True
            elif self._narrowed:
                os.sched_setaffinity(0, self._allowed)
                self._narrowed = False
        except (OSError, ValueError, IndexError):   # host gone, /proc hidden, refused
            self.enabled = False
            self.next_look = float("inf")

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
        """Give the whole affinity back (the IPU process goes idle)."""
        if self._narrowed:
            try:
                os.sched_setaffinity(0, self._allowed)
            except OSError:
                pass
            self._narrowed = False
