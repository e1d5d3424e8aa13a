"""Keeping the pool's IPU processes running, on the daemon's event loop.

Every blocking step on an IPU process (start, hand-over, take-back, stop) runs on
the loop's default executor, at most one at a time per IPU: ``busy`` names the
IPUs with a step under way, and the periodic :meth:`ProcessKeeper.check` leaves
those alone. A process that dies while its IPU is free is restarted at once; one
that dies while held is marked ``dead`` and restarted when its holder lets go;
one that fails to start is retried every ``_RETRY`` seconds. How each process
ended is kept (the last ``_EXITS_KEPT``) for the ``exit_status`` request.

An idle pool costs no CPU: each running IPU process's pidfd is a reader of the event
loop, which wakes the daemon's monitor (``look``) only when one exits. The monitor
polls (every 0.2 s) only while something cannot be watched that way: a process
without a pidfd, an exit seen while a step on its IPU was under way, an IPU whose
start failed and waits for its retry.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, Callable

from shm import pid_alive

from ipu_emulator.daemon._pool import PoolError, PooledIpu, remove_objects_of

__all__ = ["LoopExits", "ProcessKeeper"]

_log = logging.getLogger("ipu_emulator.daemon.server")

_RETRY = 5.0       # seconds between restarts of an IPU process that failed to start
_EXITS_KEPT = 256  # exit statuses of retired IPU processes kept for exit_status
_REPORT_WAIT = 1.0  # seconds the template's report of a reaped process's exit is waited for


class LoopExits:
    """Processes whose exit wakes the event loop: each one's pidfd is a reader of the
    loop, read once (it stays readable), which sets :attr:`look` and notes its key in
    :attr:`exited` (until unwatched)."""

    def __init__(self) -> None:
        self._look: asyncio.Event | None = None
        self._fds: dict[Any, int] = {}   # key -> pidfd
        self.exited: set[Any] = set()

    @property
    def look(self) -> asyncio.Event:
        if self._look is None:   # (made on the loop)
            self._look = asyncio.Event()
        return self._look

    def watch(self, key: Any, pid: int) -> bool:
        """Watch ``pid`` under ``key`` (the key's earlier process forgotten); False if it
        cannot be watched (no pidfds, or gone already): the caller polls it."""
        self.unwatch(key)
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            return False
        try:
            asyncio.get_running_loop().add_reader(fd, self._seen, key, fd)
        except BaseException:
            os.close(fd)
            raise
        self._fds[key] = fd
        return True

    def _seen(self, key: Any, fd: int) -> None:
        asyncio.get_running_loop().remove_reader(fd)
        self.exited.add(key)
        self.look.set()

    def unwatch(self, key: Any) -> None:
        self.exited.discard(key)
        fd = self._fds.pop(key, None)
        if fd is not None:
            asyncio.get_running_loop().remove_reader(fd)
            os.close(fd)


class ProcessKeeper:
    """The pool's IPU processes: started, restarted, stopped, their exits remembered."""

    def __init__(self, ipus: list[PooledIpu], died: Callable[[PooledIpu], None]) -> None:
        """``died``: told of each IPU process that ended with a status (for /metrics)."""
        self.ipus = ipus
        self._died = died
        self.busy: set[int] = set()     # IPUs with a blocking step under way
        self._retry_at: dict[int, float] = {}
        self._exits: dict[int, int] = {}
        self._resets: dict[int, "asyncio.Task[None]"] = {}   # take-backs under way, by IPU
        self._ready: dict[int, asyncio.Event] = {}   # ... set once their IPUs are free
        self.stopping = False   # no more attaches, resets or restarts
        self.exits = LoopExits()    # the pidfds of the IPU processes (and of holders)
        self._unwatched: set[int] = set()   # IPUs whose process has no pidfd: polled

    # -- exits: watched on the loop ---------------------------------------------------

    @property
    def look(self) -> asyncio.Event:
        """Set when a watched process exited: the monitor's cue for :meth:`check`."""
        return self.exits.look

    def polling(self) -> bool:
        """Whether :meth:`check` must run periodically: a process that cannot be watched
        by pidfd, an exit not handled yet (its IPU was busy), a start to retry."""
        return bool(self._unwatched or self.exits.exited or self._retry_at)

    def _watch(self, ipu: PooledIpu) -> None:
        """Have the loop tell of the exit of ``ipu``'s (new) process."""
        self._unwatch(ipu)
        pid = ipu.pid
        if pid is not None and not self.exits.watch(("ipu", ipu.index), pid):
            self._unwatched.add(ipu.index)   # no pidfd here, or gone already: polled
            self.look.set()     # the monitor starts polling

    def _unwatch(self, ipu: PooledIpu) -> None:
        self._unwatched.discard(ipu.index)
        self.exits.unwatch(("ipu", ipu.index))

    def resetting(self, ipus: list[PooledIpu], task: "asyncio.Task[None]") -> None:
        """``task`` takes ``ipus`` back (their reset, then forgetting their host);
        :meth:`settle` waits for it, or only until :meth:`usable`."""
        ready = asyncio.Event()
        for ipu in ipus:
            self._resets[ipu.index] = task
            self._ready[ipu.index] = ready

        def done(_: "asyncio.Task[None]") -> None:
            ready.set()
            for ipu in ipus:
                if self._resets.get(ipu.index) is task:
                    del self._resets[ipu.index]
                if self._ready.get(ipu.index) is ready:
                    del self._ready[ipu.index]
        task.add_done_callback(done)

    def usable(self, ipus: list[PooledIpu]) -> None:
        """The take-back of ``ipus`` has reset (or restarted) and freed them."""
        for ipu in ipus:
            ready = self._ready.pop(ipu.index, None)
            if ready is not None:
                ready.set()

    async def settle(self, ipus: list[PooledIpu], whole: bool = True) -> None:
        """Return once no take-back of ``ipus`` is under way (each is bounded by the
        hand-over timeout, or a restart); ``whole=False``: once each is reset and free,
        though forgetting its last host (a dead host's objects) may go on."""
        while True:
            if not whole:
                events = {self._ready[i.index] for i in ipus if i.index in self._ready}
                if not events:
                    return
                for event in events:
                    await event.wait()
                continue
            tasks = {self._resets[i.index] for i in ipus if i.index in self._resets}
            if not tasks:
                return
            await asyncio.wait(tasks)   # a cancelled caller leaves them running

    async def start(self, ipu: PooledIpu) -> None:
        """Start (or restart) ``ipu``'s process; ``failed`` and retried later if it cannot."""
        if self.stopping:
            return
        ipu.state, ipu.holder = "starting", None
        self.busy.add(ipu.index)
        try:
            await asyncio.get_running_loop().run_in_executor(None, ipu.start)
            ipu.state = "free"
            self._retry_at.pop(ipu.index, None)
            self._watch(ipu)
        except Exception as exc:
            _log.error("ipu %d: cannot start its process: %s", ipu.index, exc)
            ipu.state = "failed"
            self._retry_at[ipu.index] = asyncio.get_running_loop().time() + _RETRY
        finally:
            self.busy.discard(ipu.index)

    def _schedule_start(self, ipu: PooledIpu) -> None:
        ipu.state, ipu.holder = "starting", None   # at once: no attach may take it meanwhile
        self.busy.add(ipu.index)
        asyncio.get_running_loop().create_task(self.start(ipu))

    async def blocking(self, ipu: PooledIpu, fn: Any, *args: Any) -> Any:
        """Run the blocking step ``fn(*args)`` on ``ipu`` on the executor."""
        self.busy.add(ipu.index)
        try:
            return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
        finally:
            self.busy.discard(ipu.index)

    async def take_back(self, ipu: PooledIpu) -> bool:
        """Reset ``ipu``'s process for the next host; False if it must be restarted."""
        if ipu.state == "dead" or not ipu.alive():
            return False
        try:
            await self.blocking(ipu, ipu.take_back)
            return True
        except PoolError as exc:
            _log.warning("%s; restarting the process", exc)
            return False

    async def restart(self, ipu: PooledIpu) -> None:
        """Replace ``ipu``'s process (dead, or not reset) by a fresh one."""
        self.retire(ipu)
        await self.start(ipu)

    def retire(self, ipu: PooledIpu) -> None:
        """Log how the IPU's process ended and keep its exit status (for exit_status)."""
        self._unwatch(ipu)
        proc = ipu.proc
        if proc is not None and proc.pid not in self._exits:
            rc = proc.returncode()
            if rc is None and not pid_alive(proc.pid):
                # gone, its exit not reported yet: the template reports it a moment after
                # it reaped the process (at once if the template itself is gone)
                rc = proc.wait_exit(_REPORT_WAIT)
            _log.warning("ipu %d: %s", ipu.index, proc.describe_exit())
            if rc is not None:
                self._died(ipu)
                self._exits[proc.pid] = rc
                while len(self._exits) > _EXITS_KEPT:
                    self._exits.pop(next(iter(self._exits)))

    def check(self) -> None:
        """One look at every idle IPU: restart a dead free one, mark a dead held one,
        retry one that failed to start once its time has come."""
        now = asyncio.get_running_loop().time()
        for ipu in self.ipus:
            if ipu.index in self.busy:
                continue
            self.exits.exited.discard(("ipu", ipu.index))   # looked at (a busy one: later)
            if ipu.state in ("free", "held") and not ipu.alive():
                self.retire(ipu)
                if ipu.state == "free":
                    self._schedule_start(ipu)
                else:
                    ipu.state = "dead"   # restarted when its holder releases it
            elif ipu.state == "failed" and now >= self._retry_at.get(ipu.index, 0):
                self._schedule_start(ipu)

    async def exit_status(self, pid: int) -> int | None:
        """How the IPU process ``pid`` ended (waiting up to 2 s if it is ending);
        raises KeyError if ``pid`` is not an IPU process of this pool."""
        if pid in self._exits:
            return self._exits[pid]
        for ipu in self.ipus:
            proc = ipu.proc
            if proc is not None and proc.pid == pid:
                rc: int | None = await asyncio.get_running_loop().run_in_executor(
                    None, proc.wait_exit, 2.0)
                return rc
        raise KeyError(pid)

    async def stop_all(self) -> None:
        """Stop every IPU process, then remove what they and dead holders left in /dev/shm."""
        self.stopping = True
        loop = asyncio.get_running_loop()
        pids = {os.getpid()} | {ipu.pid for ipu in self.ipus if ipu.pid is not None}
        pids |= {ipu.holder for ipu in self.ipus   # holders that died: nobody else cleans up
                 if ipu.holder is not None and not pid_alive(ipu.holder)}

        def stop(ipu: PooledIpu) -> None:
            try:
                ipu.close_process(polite=ipu.state == "free")
            except Exception:
                _log.exception("stopping ipu %d", ipu.index)
        for ipu in self.ipus:
            self._unwatch(ipu)
        await asyncio.gather(*(loop.run_in_executor(None, stop, ipu) for ipu in self.ipus))
        removed = remove_objects_of(pids)
        if removed:
            _log.info("removed %d leftover shared-memory objects", len(removed))
