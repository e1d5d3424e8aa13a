"""Whether the host (and, in pool mode, the host this IPU is lent to) still lives.

One object, :class:`HostWatch`, answers it for the serving loop, by one mechanism
chosen when it is made:

- **a watch thread** (an IPU process of its own, on its main thread, with pidfds): a
  thread blocks on the pidfds of the host and of the client and, when one exits,
  notes it and interrupts every ring wait of the process (``shm.ring.interrupt_all``).
  The loop's waits then block with no periodic wake (``threaded``); the same thread
  turns the control ring's doorbell (``DOORBELL``) into such an interrupt.
- **polling** (a loopback IPU on a thread of the host, whose liveness is
  ``ProcessHooks.host_alive``; or no pidfds): the waits wake every ``wait_slice``
  seconds and ask: the hook, else ``getppid()`` when the host is the parent, else a pid
  check; the client by a pid check.

Either way ``check()`` raises ``RunEnded(HOST_GONE)`` or ``RunEnded(CLIENT_GONE)``
(at most one real look per ``HOST_CHECK`` seconds: ``next_check``), and
``interrupted()`` is what a ``WaitInterrupted`` means.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import threading
import time
from typing import Callable

from shm import PeerDiedError, PeerWatch, pid_alive
from shm import ring as ring_waits

from ipu_emulator.ipu._ending import Ending, RunEnded

__all__ = ["HostWatch", "DOORBELL", "SLICE", "HOST_CHECK"]

_log = logging.getLogger("ipu_emulator.ipu.process")

SLICE = 0.1
"""Seconds between checks of the control ring and the host while a wait polls."""
HOST_CHECK = 0.25
"""Seconds between checks that the host is alive."""
DOORBELL = signal.SIGURG
"""Rung by the control ring while a program waits (``Ring.set_doorbell``); ignored by
default: a stale doorbell (this process died armed, its pid reused) harms none."""


class HostWatch:
    """The host's (and the client's) liveness, by a watch thread or by polling."""

    def __init__(self, host_pid: int, host_alive: Callable[[], bool] | None = None) -> None:
        self.host_pid = host_pid
        self.client = 0   # pool mode: the host this IPU is lent to (0: none)
        self.next_check = 0.0
        self._thread = (_PidfdThread.start(host_pid) if host_alive is None else None)
        self.threaded = self._thread is not None
        self.wait_slice: float | None = None if self.threaded else SLICE
        """Seconds a ring wait may block before it looks again (None: until woken)."""
        self.receive_timeout: float | None = None if self.threaded else HOST_CHECK
        """Seconds an idle wait for a control message blocks before it looks."""
        self._host_alive = host_alive or self._polled_host(host_pid)
        self._client_watch: PeerWatch | None = None

    def _polled_host(self, host_pid: int) -> Callable[[], bool]:
        if self._thread is not None:
            return self._thread.host_alive
        if host_pid <= 0:
            return lambda: True
        if os.getppid() == host_pid:   # its death re-parents this process
            return lambda: os.getppid() == host_pid
        return PeerWatch(host_pid).alive

    def gone(self) -> Ending | None:
        """HOST_GONE or CLIENT_GONE if the host or the client is gone (a real look)."""
        if not self._host_alive():
            return Ending.HOST_GONE
        if self.client and not self._client_alive():
            return Ending.CLIENT_GONE
        return None

    def check(self) -> None:
        """Raise RunEnded(HOST_GONE / CLIENT_GONE) if the host / client is gone (at most
        one real look per HOST_CHECK s)."""
        now = time.monotonic()
        if now < self.next_check:
            return
        self.next_check = now + HOST_CHECK
        ending = self.gone()
        if ending is not None:
            raise RunEnded(ending)

    def _client_alive(self) -> bool:
        if self._thread is not None:
            return self._thread.client_alive()
        return self._client_watch is None or self._client_watch.alive()

    def interrupted(self) -> None:
        """A ring wait was interrupted (the watch thread): raise RunEnded if the host or the
        client is gone; else (a doorbell, a stale wake) let the waits block again."""
        ending = self.after_interrupt()
        if ending is not None:
            raise RunEnded(ending)

    def after_interrupt(self) -> Ending | None:
        """``interrupted()``, answered instead of raised."""
        ring_waits.resume_all()   # first: an exit after the look below interrupts again
        self.next_check = time.monotonic() + HOST_CHECK
        return self.gone()

    def ending_of(self, exc: PeerDiedError) -> Ending:
        """What a ring's peer dying means: the client gone, or the host."""
        return Ending.CLIENT_GONE if self.client and exc.pid == self.client \
            else Ending.HOST_GONE

    def client_gone(self) -> bool:
        """Whether the client has exited by now (a zombie counts): asked of its pidfd (no
        wait for the watch thread to notice), else of /proc."""
        if self._thread is not None:
            return self._thread.client_gone()
        return self.client > 0 and not pid_alive(self.client)

    def set_client(self, pid: int) -> None:
        """Watch ``pid`` as the host this IPU is lent to (0: none) instead of the last."""
        self.client = pid
        if self._thread is not None:
            self._thread.set_client(pid)
        else:
            self._client_watch = PeerWatch(pid) if pid > 0 else None


class _PidfdThread:
    """A thread blocked on the pidfds of the host and of the client; when one exits it
    notes it and interrupts every ring wait of the process."""

    def __init__(self, host_fd: int) -> None:
        self._host_fd = host_fd
        self._client_fd = -1
        self._host_exited = False
        self._client_exited = False
        self._lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        # the control ring's doorbell: the signal's number lands in the pipe (written by
        # the interpreter's own C handler, so it is never lost between a check and a wait)
        signal.signal(DOORBELL, lambda signum, frame: None)
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        threading.Thread(target=self._run, name="ipu-host-watch", daemon=True).start()

    @classmethod
    def start(cls, host_pid: int) -> "_PidfdThread | None":
        """The watch of ``host_pid``, or None where pidfds are missing or this is not the
        main thread (the waits then poll)."""
        if host_pid <= 0 or threading.current_thread() is not threading.main_thread():
            return None
        try:
            return cls(os.pidfd_open(host_pid))
        except (AttributeError, OSError):
            return None

    def host_alive(self) -> bool:
        return not self._host_exited

    def client_alive(self) -> bool:
        return not self._client_exited

    def client_gone(self) -> bool:
        with self._lock:
            fd, exited = self._client_fd, self._client_exited
        return exited or (fd >= 0 and _has_exited(fd))

    def set_client(self, pid: int) -> None:
        fd, exited = -1, False
        if pid > 0:
            try:
                fd = os.pidfd_open(pid)
            except OSError:   # gone already
                exited = True
        with self._lock:
            old, self._client_fd = self._client_fd, fd
            self._client_exited = exited
        if fd >= 0:   # the thread takes the new set; none: it may poll the old one meanwhile
            try:      # (an exit it reports then is checked against the set: _exited)
                os.write(self._wake_w, b"x")
            except BlockingIOError:   # full: it wakes anyway
                pass
        if old >= 0:
            os.close(old)

    def _watched(self) -> list[int]:
        with self._lock:
            return [fd for fd, gone in ((self._host_fd, self._host_exited),
                                        (self._client_fd, self._client_exited))
                    if fd >= 0 and not gone]

    def _exited(self, fd: int) -> bool:
        """Note the exit ``fd`` reported, if it is still a watched pidfd and its process
        has exited: set_client may have closed the one polled, and a new pidfd may have
        taken its number since. Whether one was noted."""
        with self._lock:
            if fd not in (self._host_fd, self._client_fd) or not _has_exited(fd):
                return False
            if fd == self._host_fd:
                self._host_exited = True
            else:
                self._client_exited = True
            return True

    def _run(self) -> None:
        while True:
            poller = select.poll()
            poller.register(self._wake_r, select.POLLIN)
            for fd in self._watched():
                poller.register(fd, select.POLLIN)
            try:
                ready = poller.poll()
            except OSError:   # a descriptor closed meanwhile by set_client: look again
                continue
            bell = False
            for fd, _ in ready:
                if fd == self._wake_r:
                    bell = bell or DOORBELL in os.read(self._wake_r, 512)
                elif self._exited(fd):
                    bell = True
            if bell:
                try:
                    ring_waits.interrupt_all()
                except Exception:   # pragma: no cover - never let this thread die
                    _log.exception("interrupting the ring waits failed")


def _has_exited(pidfd: int) -> bool:
    """Whether the process of ``pidfd`` has exited (readable; a zombie counts)."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return any(ev & select.POLLIN for _, ev in poller.poll(0))
