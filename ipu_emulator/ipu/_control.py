"""The control ring as the IPU process reads it: requests in order, endings at once.

``next()`` gives the next request (those taken off the ring early first). While a
program runs, ``poll()`` takes what arrived: STOP and SHUTDOWN (and, in pool mode,
HOST) end the run at once (``RunEnded``); MODES applies at once; anything else waits
in ``pending`` for its turn.

A pool process just lent to a host (HOST) polls the ring for that host's first request
(``expect_soon``) before it blocks: the host sends its LOAD a few hundred microseconds
later, and waking a blocked process costs 40-100 us on this project's VMs, on the path
of every runner made through the daemon.
"""

from __future__ import annotations

import collections
import logging
from typing import Callable

from shm import Ring, RingTimeoutError, WaitInterrupted, WouldBlock
from shm.spin import spin_until

from ipu_emulator import ipu_protocol
from ipu_emulator.ipu._ending import Ending, RunEnded
from ipu_emulator.ipu._host_watch import HostWatch
from ipu_emulator.ipu_protocol import Message, Op

__all__ = ["ControlWire", "FIRST_REQUEST_POLL_NS"]

FIRST_REQUEST_POLL_NS = 1_000_000
"""How long a pool process polls for a new host's first request (``expect_soon``) before
it blocks: a runner's LOAD follows the hand-over by 0.2-0.5 ms; a host that sends
nothing that soon costs this process no more than this once."""

_log = logging.getLogger("ipu_emulator.ipu.process")


class ControlWire:
    """The control ring of one IPU process and the requests taken off it early."""

    def __init__(self, ring: Ring, watch: HostWatch, pool: bool,
                 apply_modes: Callable[[Message], None]) -> None:
        self.ring = ring
        self._watch = watch
        self._pool = pool
        self._apply_modes = apply_modes
        self.pending: collections.deque[Message] = collections.deque()
        self.stop_seq: int | None = None   # the STOP that ended the run (answered DONE)
        self.stop_soft = False   # STOP with value 1: end the running loop, stay runnable
        self._poll_ns = 0        # next() polls this long before it blocks (once)

    def take_ending(self, msg: Message) -> None:
        """Raise RunEnded for a control message that ends what runs: STOP, SHUTDOWN, and
        HOST in pool mode (which then runs next)."""
        op = msg.op
        if op is Op.STOP:
            self.stop_seq = msg.seq
            self.stop_soft = bool(msg.value)
            raise RunEnded(Ending.STOPPED)
        if op is Op.SHUTDOWN:
            raise RunEnded(Ending.SHUTDOWN)
        if op is Op.HOST and self._pool:
            # what the previous host still had queued is void; HOST runs next
            self.pending.clear()
            self.pending.append(msg)
            raise RunEnded(Ending.CLIENT_GONE)

    def poll(self) -> None:
        """Take the control messages that arrived (RunEnded for one that ends the run)."""
        control = self.ring
        while True:
            if not control.readable() and control.is_valid():   # without WouldBlock's cost
                return
            try:
                view, tag = control.try_acquire_read()
            except WouldBlock:
                return
            try:
                msg = ipu_protocol.decode(view, tag)
            finally:
                control.release()
            self.take_ending(msg)
            if msg.op is Op.MODES:
                self._apply_modes(msg)
            else:
                self.pending.append(msg)

    def next(self) -> Message:
        """The next request: one taken off early, else the next on the ring (waited for)."""
        if self.pending:
            return self.pending.popleft()
        if self._poll_ns:
            budget, self._poll_ns = self._poll_ns, 0
            spin_until(self.ring.readable, budget)
        watch = self._watch
        while True:
            try:
                return ipu_protocol.receive(self.ring, timeout=watch.receive_timeout)
            except RingTimeoutError:
                watch.check()
            except WaitInterrupted:
                watch.interrupted()

    def expect_soon(self) -> None:
        """A request is due soon (a host was just handed this process): the next
        :meth:`next` polls for it up to ``FIRST_REQUEST_POLL_NS`` before it blocks, yielding
        the CPU between looks (it does not give up when a yield ran another task: giving up
        on the shared-CPU sign, it blocked before most LOADs came)."""
        self._poll_ns = FIRST_REQUEST_POLL_NS

    def ignore_until_ending(self) -> None:
        """Answer nothing until a message ends this (STOP, SHUTDOWN, HOST) or the host
        goes: an injected hang."""
        watch = self._watch
        while True:
            try:
                msg = ipu_protocol.receive(self.ring, timeout=watch.receive_timeout)
            except RingTimeoutError:
                watch.check()
                continue
            except WaitInterrupted:
                watch.interrupted()
                continue
            self.take_ending(msg)
            _log.info("hung: ignoring %s", msg.op.name)

    def drop_client(self) -> None:
        """Pool mode: what the previous host queued is void; a HOST taken off the ring
        early still runs."""
        self.pending = collections.deque(m for m in self.pending if m.op is Op.HOST)
        self.stop_seq = None
