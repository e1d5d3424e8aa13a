"""Handing IPUs to a host (``attach``) and taking them back (``release``, disconnect, death).

An attach takes its IPUs all or none: each must be free in the pool and its lock
file in the home must be free (embedded hosts and other daemons take the same
``flock``); then each IPU process is handed to the host (HOST(pid) on its control
ring, not waited for: the host's requests follow it there).
Taking back resets each IPU process (HOST(0)) or restarts one that is dead or does
not reset; a host that died has its shared-memory objects removed; the lock files
are let go last, once every IPU is free again. A ``release`` request is answered as
soon as the take-back has started (:func:`release_soon`): the IPUs are ``resetting``
meanwhile, and an attach that wants one waits for its reset instead of being told
it is busy, so a host's close() does not wait for the reset and no IPU is lent
before it is reset.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from shm import ExitWatch, pid_alive

from ipu_emulator import trace
from ipu_emulator.daemon._keeper import ProcessKeeper
from ipu_emulator.daemon._pool import PooledIpu, remove_objects_of
from ipu_emulator.errors import PoolError
from ipu_emulator.system import IpuLocks, SystemConfig

__all__ = ["Conn", "attach", "error", "release", "release_soon"]

_log = logging.getLogger("ipu_emulator.daemon.server")

_EXIT_GRACE = 2.0
"""Seconds a host whose connection dropped is given to exit before it counts as alive."""


class Conn:
    """One client connection: its peer and what it holds."""

    def __init__(self, pid: int, writer: asyncio.StreamWriter) -> None:
        self.pid = pid
        self.writer = writer
        self.holding: list[PooledIpu] = []
        self.locks: IpuLocks | None = None   # the home's lock files of what it holds
        self.device_id = -1   # the host's device id of what it holds (-1: not given)
        self.spoke = False    # it sent a request (a client's, not a silent connection)
        self.serving = False  # a request of it is being answered
        self.watched = False  # holding: its exit wakes the daemon's monitor (a pidfd)


def error(kind: str, message: str) -> dict[str, Any]:
    """A refusal on the wire: its kind and a message naming what was wrong."""
    return {"ok": False, "error": kind, "message": message}


def _exits_within(pid: int, timeout: float) -> bool:
    """True if ``pid`` has exited, or exits within ``timeout`` seconds."""
    watch = ExitWatch([pid])
    try:
        return watch.wait(timeout) is not None or not pid_alive(pid)
    finally:
        watch.close()


def _bad_request(req: dict[str, Any], n: int) -> dict[str, Any] | None:
    indices = req.get("ipus")
    device_id = req.get("device_id", -1)
    if (not isinstance(indices, list) or not indices
            or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n
                       for i in indices) or len(set(indices)) != len(indices)
            or not isinstance(device_id, int)):
        return error("request", f"attach needs 'ipus': distinct IPU numbers in 0..{n - 1} "
                     f"and an int 'device_id', got {indices!r}, {device_id!r}")
    return None


def _lock(system: SystemConfig, indices: list[int]) -> IpuLocks | dict[str, Any]:
    """The home's lock files of ``indices``, or the refusal (busy outside, cannot lock)."""
    try:
        locks = IpuLocks.try_acquire(system.lock_dir, tuple(indices))
    except OSError as exc:
        return error("failed", f"cannot lock ipus {indices} in {system.lock_dir}: {exc}")
    if isinstance(locks, dict):
        outside = {str(i): pid for i, pid in locks.items()}
        text = ", ".join(f"ipu {i} " + (f"by pid {pid}" if pid else "(holder unknown)")
                         for i, pid in sorted(locks.items()))
        return {"ok": False, "error": "busy", "busy": outside,
                "message": f"ipus {indices} are held outside this daemon, on its home "
                           f"{system.home} (lock files in {system.lock_dir}): {text}"}
    return locks


async def attach(keeper: ProcessKeeper, system: SystemConfig, conn: Conn,
                 req: dict[str, Any]) -> dict[str, Any]:
    """Give ``conn`` the IPUs ``req["ipus"]``, all or none; the reply for the host."""
    refused = _bad_request(req, len(keeper.ipus))
    if refused is not None:
        return refused
    indices: list[int] = req["ipus"]
    device_id: int = req.get("device_id", -1)
    await keeper.settle([keeper.ipus[i] for i in indices], whole=False)   # reset first
    for ipu in [keeper.ipus[i] for i in indices]:
        # a free IPU whose process died since the last look (check()) is restarted now,
        # not handed over dead
        if ipu.state == "free" and ipu.index not in keeper.busy and not ipu.alive():
            await keeper.restart(ipu)
    if keeper.stopping:
        return error("stopping", "the daemon is stopping")
    if conn.holding:
        return error("request", f"this connection already holds ipus "
                     f"{[i.index for i in conn.holding]}; one attachment per connection")
    wanted = [keeper.ipus[i] for i in indices]
    busy = {str(i.index): i.holder for i in wanted if i.state != "free"}
    if busy:
        text = ", ".join(f"ipu {k} " + (f"held by pid {v}" if v else
                                        f"{keeper.ipus[int(k)].state}")
                         for k, v in busy.items())
        return {"ok": False, "error": "busy", "busy": busy,
                "message": f"ipus {indices} are not all free: {text}"}
    locks = _lock(system, indices)   # exclusive against embedded hosts and other daemons
    if isinstance(locks, dict):
        return locks
    conn.locks = locks
    for ipu in wanted:
        ipu.state, ipu.holder = "attaching", conn.pid
    label = (f"device {device_id} (ipu {{}})" if device_id >= 0 else "ipu {}")
    failed: list[tuple[PooledIpu, PoolError]] = []
    for k, ipu in enumerate(wanted):   # HOST(pid), not waited for (PooledIpu.hand_over_soon)
        try:
            ipu.hand_over_soon(conn.pid, len(wanted) if k == 0 else 1,
                               label.format(ipu.index))
        except PoolError as exc:
            failed.append((ipu, exc))
    if failed:
        for ipu, _ in failed:
            ipu.state = "dead"   # the release below restarts these, resets the others
        conn.holding = wanted
        await release(keeper, conn, "attach failed")
        return error("failed", "; ".join(str(r) for _, r in failed))
    if conn.writer.is_closing() or not pid_alive(conn.pid):
        conn.holding = wanted
        await release(keeper, conn, "gone while attaching")
        return error("failed", "the host went away while attaching")
    for ipu in wanted:
        ipu.state = "held"
        ipu.hosts_served += 1
    conn.holding = wanted
    conn.device_id = device_id
    # its exit wakes the monitor (which otherwise polls it)
    conn.watched = keeper.exits.watch(("host", conn), conn.pid)
    if not conn.watched:
        keeper.look.set()
    _log.info("host %d attached ipus %s (pids %s)", conn.pid, indices,
              [ipu.pid for ipu in wanted])
    trace.instant(f"host {conn.pid} attached ipus {indices}", host=conn.pid)
    return {"ok": True, "ipus": [ipu.info() for ipu in wanted]}


def release_soon(keeper: ProcessKeeper, conn: Conn, why: str) -> "asyncio.Task[None] | None":
    """Start taking back what ``conn`` holds; returns at once (the task, or None).

    From now ``conn`` holds nothing and its IPUs are ``resetting``: no attach gets one
    before its reset is done (:meth:`ProcessKeeper.settle` waits for it), and the lock
    files are let go only then. The task resets each IPU (restarts a dead one)."""
    held, conn.holding = conn.holding, []
    locks, conn.locks = conn.locks, None
    keeper.exits.unwatch(("host", conn))
    conn.watched = False
    if not held or keeper.stopping:   # stopping: every IPU process is being stopped
        if locks is not None:
            locks.release()
        return None
    for ipu in held:
        if ipu.state != "dead":
            ipu.state = "resetting"
    task = asyncio.get_running_loop().create_task(
        _take_back(keeper, conn.pid, held, locks, why))
    keeper.resetting(held, task)
    return task


async def release(keeper: ProcessKeeper, conn: Conn, why: str) -> None:
    """Take back what ``conn`` holds: reset each IPU (restart a dead one), then free it;
    returns once that is done."""
    task = release_soon(keeper, conn, why)
    if task is not None:
        await asyncio.wait([task])   # a cancelled caller leaves the reset running


async def _take_back(keeper: ProcessKeeper, pid: int, held: list[PooledIpu],
                     locks: IpuLocks | None, why: str) -> None:
    try:
        dead = await _reset_all(keeper, pid, held, why)
    finally:
        if locks is not None:   # reset (or restarted) and free: others may lock them
            locks.release()
        keeper.usable(held)     # an attach waiting for them goes on now
    await _forget_host(pid, dead, why)


async def _reset_all(keeper: ProcessKeeper, pid: int, held: list[PooledIpu],
                     why: str) -> bool:
    """Reset each IPU ``pid`` held (restart one that does not reset) and free it; returns
    whether ``pid`` is known dead."""
    dead = not pid_alive(pid)
    _log.info("host %d %s ipus %s", pid, "died; reclaiming" if dead else why,
              [ipu.index for ipu in held])
    trace.instant(f"host {pid} {'died' if dead else why}: ipus "
                  f"{[ipu.index for ipu in held]}", host=pid)
    results = await asyncio.gather(*(keeper.take_back(ipu) for ipu in held))
    for ipu, ok in zip(held, results):
        if ok:
            ipu.state, ipu.holder = "free", None
        else:
            await keeper.restart(ipu)
    return dead


async def _forget_host(pid: int, dead: bool, why: str) -> None:
    """Remove a dead host's shared-memory objects; one whose connection dropped is given
    ``_EXIT_GRACE`` s to exit first (the IPUs are free meanwhile: this decides only what
    is removed)."""
    loop = asyncio.get_running_loop()
    if not dead and why == "disconnected":
        # a host killed by a signal closes its socket an instant before it exits
        dead = await loop.run_in_executor(None, _exits_within, pid, _EXIT_GRACE)
    if dead:
        removed = await loop.run_in_executor(None, remove_objects_of, {pid})
        if removed:
            _log.info("removed %d shared-memory objects of dead host %d", len(removed), pid)
