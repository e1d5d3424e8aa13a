"""``ipu-emulator daemon``: a pool of warm emulated IPUs served to host processes.

The daemon starts one IPU process per IPU of its pool (``--pool`` mode, see
:mod:`ipu_emulator.ipu.process`) and keeps them running. Hosts connect to its
unix socket (mode 0600, default ``$IPU_EMULATOR_HOME/daemon.sock``) and speak
:mod:`ipu_emulator.daemon.socket_protocol`:

- ``attach`` takes a set of IPUs exclusively (all or none) for the connection
  and answers with each IPU's process pid and ring names; a busy IPU is
  reported with its holder's pid (the kernel's ``SO_PEERCRED``, not a claim);
- ``release``, closing the connection, or the death of the holder (checked
  every ``_MONITOR`` seconds, so a forked child keeping the socket open does not
  matter) hands the IPUs back: each process drops that host's executables and,
  if the host died, every shared-memory object it created; then it is free;
- a dead IPU process is restarted once nobody holds it.

An IPU is exclusive across everything on one ``IPU_EMULATOR_HOME`` (embedded
hosts, other daemons on other sockets, stress rigs): while a host holds IPUs
through the daemon, the daemon holds their lock files
(:class:`ipu_emulator.system.IpuLocks`, the ``flock`` embedded hosts take), from
attach until the IPUs are reset and free again. An attach whose IPUs are locked
by someone else is answered ``busy`` with the lock holder's pid, so the host
waits or is refused per its ``DeviceWaitConfig``. Per attach, not for the
daemon's life: a daemon that locked its whole pool at start would shut every
embedded host of the home out even while the daemon is idle (the pytest
plugin runs both on one home), and a second daemon could not even start.

Event loop: asyncio on one thread owns every state change; blocking steps on
IPU processes run on the default executor, at most one at a time per IPU.
``run()`` returns after SIGTERM/SIGINT, having stopped every IPU process and
removed the socket and every shared-memory object of the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import stat
import struct
from typing import Any

from shm import ExitWatch, pid_alive

from ipu_emulator import safe_files, titles, trace
from ipu_emulator.daemon import socket_protocol as wire
from ipu_emulator.daemon.daemon_metrics import DaemonMetrics
from ipu_emulator.daemon._pool import PoolError, PooledIpu, remove_objects_of
from ipu_emulator.ipu.launcher import IpuSpec
from ipu_emulator.system import IpuLocks, SystemConfig
from ipu_emulator.errors import DaemonError
from ipu_emulator.faults import FaultSpecError, FaultTable, dumps, parse_faults
from ipu_emulator.settings import IpuSettings

__all__ = ["Daemon", "DaemonError"]

_log = logging.getLogger("ipu_emulator.daemon.server")

_MONITOR = 0.2     # seconds between checks of holders and IPU processes
_RETRY = 5.0       # seconds between restarts of an IPU process that failed to start
_EXITS_KEPT = 256  # exit statuses of retired IPU processes kept for exit_status
MAX_CONNECTIONS = 512   # connections served at once; more are answered "busy" and closed
FIRST_MESSAGE_TIMEOUT = 10.0   # seconds a new connection may stay silent before its first
                               # message (later silence is a host holding its IPUs)
REPLY_TIMEOUT = 10.0    # seconds a reply may wait for a client that does not read



_EXIT_GRACE = 2.0
"""Seconds a host whose connection dropped is given to exit before it counts as alive."""


def _exits_within(pid: int, timeout: float) -> bool:
    """True if ``pid`` has exited, or exits within ``timeout`` seconds."""
    watch = ExitWatch([pid])
    try:
        return watch.wait(timeout) is not None or not pid_alive(pid)
    finally:
        watch.close()


class _Conn:
    """One client connection: its peer and what it holds."""

    def __init__(self, pid: int, writer: asyncio.StreamWriter) -> None:
        self.pid = pid
        self.writer = writer
        self.holding: list[PooledIpu] = []
        self.locks: IpuLocks | None = None   # the home's lock files of what it holds
        self.device_id = -1   # the host's device id of what it holds (-1: not given)


class Daemon:
    """The pool and its socket server. ``run()`` blocks until SIGTERM/SIGINT or ``stop()``."""

    def __init__(self, system: SystemConfig, socket_path: str | None = None,
                 metrics_port: int | None = None, metrics_address: str = "127.0.0.1",
                 settings: IpuSettings | None = None) -> None:
        """``settings``: the knobs of the pool's IPU processes and of its handovers
        (default: ``IpuSettings.current()``, when the daemon is made)."""
        self.system = system
        self.settings = settings if settings is not None else IpuSettings.current()
        self.socket_path = wire.check_socket_path(
            socket_path or os.path.join(system.home, wire.SOCKET_NAME))
        self.ipus = [PooledIpu(IpuSpec(ipu_id=i, ipu_version=system.ipu_version_number,
                                       tiles_per_ipu=system.tiles_per_ipu,
                                       memory_per_tile=system.memory_per_tile,
                                       compute_threads=system.compute_threads,
                                       label=f"ipu {i}"), system.log_dir, self.settings)
                     for i in range(system.num_ipus)]
        self._conns: set[_Conn] = set()
        self._exits: dict[int, int] = {}
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._busy: set[int] = set()     # IPUs with a blocking step under way
        self._retry_at: dict[int, float] = {}
        self._stopping = False   # no more attaches, resets or restarts
        # the schedule of faults its IPUs follow (IPU_EMULATOR_FAULTS, --faults; live:
        # the "faults" request): refused here when bad, naming the fault, field and value
        try:
            faults = parse_faults(self.settings.faults)
        except FaultSpecError as exc:
            raise DaemonError(f"bad faults: {exc}") from None
        self.fault_table = FaultTable.create(faults)
        for ipu in self.ipus:
            ipu.faults = [self.fault_table.name]
        self.metrics = DaemonMetrics(self, metrics_port, metrics_address)

    # -- lifecycle ------------------------------------------------------------------------

    def run(self) -> int:
        """Serve until stopped (the process is titled ``ipu-emulator: daemon`` meanwhile)."""
        title = titles.title()
        titles.set_title(titles.DAEMON)
        try:
            return asyncio.run(self._main())
        finally:
            titles.set_title(title)

    def stop(self) -> None:
        """Ask ``run()`` to end (thread-safe)."""
        loop, ev = self._loop, self._stop
        if loop is not None and ev is not None:
            loop.call_soon_threadsafe(ev.set)

    async def _main(self) -> int:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._loop.add_signal_handler(sig, self._stop.set)
        self._claim_socket_path()
        server = None
        monitor = None
        try:
            port = self.metrics.serve()   # first: a port in use fails before any IPU starts
            await asyncio.gather(*(self._start_ipu(ipu) for ipu in self.ipus))
            failed = [ipu.index for ipu in self.ipus if ipu.state != "free"]
            if failed:
                raise DaemonError(f"IPU processes of ipus {failed} did not start; see "
                                  f"{self.system.log_dir}")
            old = os.umask(0o177)
            try:
                server = await asyncio.start_unix_server(self._serve_client,
                                                         path=self.socket_path,
                                                         limit=wire.MAX_MESSAGE)
            finally:
                os.umask(old)
            st = os.lstat(self.socket_path)   # made 0600 by the umask; never chmod by name
            if not stat.S_ISSOCK(st.st_mode) or stat.S_IMODE(st.st_mode) & 0o077:
                raise DaemonError(f"{self.socket_path} was replaced while the daemon made it "
                                  "(not a private socket); refusing to serve")
            monitor = asyncio.create_task(self._monitor())
            if port is not None:
                _log.info("serving /metrics at http://%s:%d/metrics", self.metrics.address, port)
            s = self.system
            _log.info("serving %d x %s (%d tiles, %d bytes per tile) at %s; pids %s",
                      s.num_ipus, s.ipu_version, s.tiles_per_ipu, s.memory_per_tile,
                      self.socket_path, [ipu.pid for ipu in self.ipus])
            await self._stop.wait()
            _log.info("stopping")
        finally:
            self._stopping = True
            self.metrics.close()
            if monitor is not None:
                monitor.cancel()
            if server is not None:
                server.close()
            for conn in list(self._conns):
                conn.writer.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)
            await self._stop_ipus()
            self.fault_table.close()
        return 0

    def _claim_socket_path(self) -> None:
        path = self.socket_path
        folder = os.path.dirname(path)
        # the home (locks, logs, maybe the socket): ours, private, not a link; checked
        # before any IPU starts (a named UnsafePathError otherwise)
        os.close(safe_files.open_private_dir(self.system.home, what="emulator home"))
        if os.path.normpath(folder) != os.path.normpath(self.system.home):
            os.makedirs(folder, mode=0o700, exist_ok=True)
        if os.path.lexists(path):
            if not stat.S_ISSOCK(os.lstat(path).st_mode):
                raise DaemonError(f"{path} exists and is not a socket; choose another --socket")
            try:
                wire.request(path, {"op": "hello"}, timeout=2.0)
            except (OSError, ValueError):
                _log.info("removing the stale socket %s", path)
                os.unlink(path)
            else:
                raise DaemonError(f"another daemon is serving at {path}")

    async def _stop_ipus(self) -> None:
        loop = asyncio.get_running_loop()
        pids = {os.getpid()} | {ipu.pid for ipu in self.ipus if ipu.pid is not None}
        pids |= {ipu.holder for ipu in self.ipus   # holders that died: nobody else cleans up
                 if ipu.holder is not None and not pid_alive(ipu.holder)}

        def stop(ipu: PooledIpu) -> None:
            try:
                ipu.close_process(polite=ipu.state == "free")
            except Exception:
                _log.exception("stopping ipu %d", ipu.index)
        await asyncio.gather(*(loop.run_in_executor(None, stop, ipu) for ipu in self.ipus))
        removed = remove_objects_of(pids)
        if removed:
            _log.info("removed %d leftover shared-memory objects", len(removed))

    async def _start_ipu(self, ipu: PooledIpu) -> None:
        if self._stopping:
            return
        ipu.state, ipu.holder = "starting", None
        self._busy.add(ipu.index)
        try:
            await asyncio.get_running_loop().run_in_executor(None, ipu.start)
            ipu.state = "free"
            self._retry_at.pop(ipu.index, None)
        except Exception as exc:
            _log.error("ipu %d: cannot start its process: %s", ipu.index, exc)
            ipu.state = "failed"
            self._retry_at[ipu.index] = asyncio.get_running_loop().time() + _RETRY
        finally:
            self._busy.discard(ipu.index)

    # -- clients --------------------------------------------------------------------------

    async def _serve_client(self, reader: asyncio.StreamReader,
                            writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                          struct.calcsize("3i")))
        if uid != os.getuid():
            _log.warning("refusing a connection of uid %d (pid %d)", uid, pid)
            writer.close()
            return
        if len(self._conns) >= MAX_CONNECTIONS:
            _log.warning("refusing a connection of pid %d: %d connections open", pid,
                         len(self._conns))
            writer.write(wire.encode(_error("overloaded", f"the daemon serves {MAX_CONNECTIONS} "
                                            "connections at most; try again later")))
            writer.close()
            return
        conn = _Conn(pid, writer)
        self._conns.add(conn)
        first = True
        try:
            while True:
                try:
                    if first:   # a client that connects and says nothing is dropped
                        line = await asyncio.wait_for(reader.readline(), FIRST_MESSAGE_TIMEOUT)
                        first = False
                    else:
                        line = await reader.readline()
                except asyncio.TimeoutError:
                    _log.info("dropping pid %d's connection: silent for %.0f s", pid,
                              FIRST_MESSAGE_TIMEOUT)
                    break
                except (ValueError, asyncio.LimitOverrunError):
                    await self._reply(conn, _error("protocol", f"message longer than "
                                                   f"{wire.MAX_MESSAGE} bytes; closing"))
                    break
                if not line:
                    break
                try:
                    req = wire.decode(line)
                except wire.DaemonProtocolError as exc:
                    await self._reply(conn, _error("protocol", str(exc)))
                    continue
                try:
                    reply = await self._handle(conn, req)
                except Exception as exc:   # a bug: the client still gets an answer
                    _log.exception("%s request of pid %d failed", req.get("op"), conn.pid)
                    reply = _error("internal", f"{type(exc).__name__}: {exc}")
                await self._reply(conn, reply)
        except (ConnectionError, OSError):
            pass
        finally:
            self._conns.discard(conn)
            await self._release(conn, "disconnected")
            writer.close()

    async def _reply(self, conn: _Conn, reply: dict[str, Any]) -> None:
        conn.writer.write(wire.encode(reply))
        try:
            await asyncio.wait_for(conn.writer.drain(), REPLY_TIMEOUT)
        except asyncio.TimeoutError:
            raise ConnectionError(f"pid {conn.pid} did not read its reply for "
                                  f"{REPLY_TIMEOUT:.0f} s") from None

    async def _handle(self, conn: _Conn, req: dict[str, Any]) -> dict[str, Any]:
        op = req.get("op")
        if op == "hello":
            return {"ok": True, "daemon_pid": os.getpid(), "system": self._system_info()}
        if op == "status":
            return self._status()
        if op == "attach":
            return await self._attach(conn, req)
        if op == "release":
            await self._release(conn, "released")
            return {"ok": True}
        if op == "exit_status":
            return await self._exit_status(req.get("pid"))
        if op == "faults":
            return self._faults(req)
        return _error("protocol", f"unknown op {op!r}; expected hello, status, attach, "
                      "release, exit_status or faults")

    def faults_injected(self) -> dict[str, int]:
        """Main runs a fault of its schedule affected, by kind (for /metrics)."""
        counts: dict[str, int] = {}
        for fault, _, fired in self.fault_table.counts():
            counts[fault.kind] = counts.get(fault.kind, 0) + fired
        return counts

    def _faults(self, req: dict[str, Any]) -> dict[str, Any]:
        """Live injection: ``clear`` (bool) removes every fault, ``add`` (a list of fault
        objects) adds some; the IPUs see the change before their next Main run. The
        reply lists each fault with the Main runs it has seen and fired on."""
        try:
            new = parse_faults(req.get("add") or [], "faults request")
        except FaultSpecError as exc:
            return _error("bad_request", str(exc))
        if req.get("clear"):
            self.fault_table.clear()
        if new:
            self.fault_table.add(new)
            _log.info("faults added: %s", dumps(new))
        return {"ok": True, "faults": [{"fault": f.to_dict(), "seen": seen, "fired": fired}
                                       for f, seen, fired in self.fault_table.counts()]}

    def _status(self) -> dict[str, Any]:
        """The pool per IPU, and per attached device: its id, its IPUs and its holder."""
        devices = []
        device_of: dict[int, int] = {}
        for conn in sorted(self._conns, key=lambda c: [i.index for i in c.holding]):
            if not conn.holding:
                continue
            ipus = [ipu.index for ipu in conn.holding]
            devices.append({"device_id": conn.device_id, "ipus": ipus, "holder": conn.pid,
                            "states": sorted({ipu.state for ipu in conn.holding})})
            device_of.update((i, conn.device_id) for i in ipus)
        ipus_status = [dict(ipu.status(), device=device_of.get(ipu.index))
                       for ipu in self.ipus]
        return {"ok": True, "daemon_pid": os.getpid(), "socket": self.socket_path,
                "system": self._system_info(), "ipus": ipus_status, "devices": devices}

    def _system_info(self) -> dict[str, Any]:
        s = self.system
        return {"num_ipus": s.num_ipus, "ipu_version": s.ipu_version,
                "tiles_per_ipu": s.tiles_per_ipu, "memory_per_tile": s.memory_per_tile,
                "compute_threads": s.compute_threads}

    async def _attach(self, conn: _Conn, req: dict[str, Any]) -> dict[str, Any]:
        started = asyncio.get_running_loop().time()
        reply = await self._attach_ipus(conn, req)
        if reply.get("error") == "busy":
            self.metrics.attach_busy(conn.pid)
        else:
            self.metrics.attach_done(conn.pid, started, bool(reply.get("ok")),
                                     refused=reply.get("error") in ("request", "stopping"))
        return reply

    async def _attach_ipus(self, conn: _Conn, req: dict[str, Any]) -> dict[str, Any]:
        indices = req.get("ipus")
        device_id = req.get("device_id", -1)
        n = len(self.ipus)
        if (not isinstance(indices, list) or not indices
                or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n
                           for i in indices) or len(set(indices)) != len(indices)
                or not isinstance(device_id, int)):
            return _error("request", f"attach needs 'ipus': distinct IPU numbers in 0..{n - 1} "
                          f"and an int 'device_id', got {indices!r}, {device_id!r}")
        if self._stopping:
            return _error("stopping", "the daemon is stopping")
        if conn.holding:
            return _error("request", f"this connection already holds ipus "
                          f"{[i.index for i in conn.holding]}; one attachment per connection")
        wanted = [self.ipus[i] for i in indices]
        busy = {str(i.index): i.holder for i in wanted if i.state != "free"}
        if busy:
            text = ", ".join(f"ipu {k} " + (f"held by pid {v}" if v else
                                            f"{self.ipus[int(k)].state}")
                             for k, v in busy.items())
            return {"ok": False, "error": "busy", "busy": busy,
                    "message": f"ipus {indices} are not all free: {text}"}
        # the home's lock files: exclusive against embedded hosts and other daemons
        try:
            locks = IpuLocks.try_acquire(self.system.lock_dir, tuple(indices))
        except OSError as exc:
            return _error("failed", f"cannot lock ipus {indices} in {self.system.lock_dir}: "
                          f"{exc}")
        if isinstance(locks, dict):
            outside = {str(i): pid for i, pid in locks.items()}
            text = ", ".join(f"ipu {i} " + (f"by pid {pid}" if pid else "(holder unknown)")
                             for i, pid in sorted(locks.items()))
            return {"ok": False, "error": "busy", "busy": outside,
                    "message": f"ipus {indices} are held outside this daemon, on its home "
                               f"{self.system.home} (lock files in {self.system.lock_dir}): "
                               f"{text}"}
        conn.locks = locks
        for ipu in wanted:
            ipu.state, ipu.holder = "attaching", conn.pid
        label = (f"device {device_id} (ipu {{}})" if device_id >= 0 else "ipu {}")
        results = await asyncio.gather(*(
            self._blocking(ipu, ipu.hand_over, conn.pid, len(wanted) if k == 0 else 1,
                           label.format(ipu.index)) for k, ipu in enumerate(wanted)),
            return_exceptions=True)
        failed = [(ipu, r) for ipu, r in zip(wanted, results) if isinstance(r, BaseException)]
        if failed:
            for ipu, _ in failed:
                ipu.state = "dead"   # the release below restarts these, resets the others
            conn.holding = wanted
            await self._release(conn, "attach failed")
            return _error("failed", "; ".join(str(r) for _, r in failed))
        if conn.writer.is_closing() or not pid_alive(conn.pid):
            conn.holding = wanted
            await self._release(conn, "gone while attaching")
            return _error("failed", "the host went away while attaching")
        for ipu in wanted:
            ipu.state = "held"
            ipu.hosts_served += 1
        conn.holding = wanted
        conn.device_id = device_id
        _log.info("host %d attached ipus %s (pids %s)", conn.pid, indices,
                  [ipu.pid for ipu in wanted])
        trace.instant(f"host {conn.pid} attached ipus {indices}", host=conn.pid)
        return {"ok": True, "ipus": [ipu.info() for ipu in wanted]}

    async def _blocking(self, ipu: PooledIpu, fn: Any, *args: Any) -> Any:
        self._busy.add(ipu.index)
        try:
            return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
        finally:
            self._busy.discard(ipu.index)

    async def _release(self, conn: _Conn, why: str) -> None:
        """Take back what ``conn`` holds: reset each IPU (restart a dead one), then free it."""
        held, conn.holding = conn.holding, []
        try:
            await self._take_back_all(conn, held, why)
        finally:
            locks, conn.locks = conn.locks, None
            if locks is not None:   # reset (or restarted) and free: others may lock them
                locks.release()

    async def _take_back_all(self, conn: _Conn, held: list[PooledIpu], why: str) -> None:
        if not held or self._stopping:   # stopping: every IPU process is being stopped
            return
        dead = not pid_alive(conn.pid)
        _log.info("host %d %s ipus %s", conn.pid, "died; reclaiming" if dead else why,
                  [ipu.index for ipu in held])
        trace.instant(f"host {conn.pid} {'died' if dead else why}: ipus "
                      f"{[ipu.index for ipu in held]}", host=conn.pid)
        for ipu in held:
            if ipu.state != "dead":
                ipu.state = "resetting"
        results = await asyncio.gather(*(self._take_back(ipu) for ipu in held))
        if not dead and why == "disconnected":
            # a host killed by a signal closes its socket an instant before it exits
            dead = await asyncio.get_running_loop().run_in_executor(
                None, _exits_within, conn.pid, _EXIT_GRACE)
        if dead:
            removed = await asyncio.get_running_loop().run_in_executor(
                None, remove_objects_of, {conn.pid})
            if removed:
                _log.info("removed %d shared-memory objects of dead host %d", len(removed),
                          conn.pid)
        for ipu, ok in zip(held, results):
            if ok:
                ipu.state, ipu.holder = "free", None
            else:
                self._retire(ipu)
                await self._start_ipu(ipu)

    async def _take_back(self, ipu: PooledIpu) -> bool:
        if ipu.state == "dead" or not ipu.alive():
            return False
        try:
            await self._blocking(ipu, ipu.take_back)
            return True
        except PoolError as exc:
            _log.warning("%s; restarting the process", exc)
            return False

    def _retire(self, ipu: PooledIpu) -> None:
        """Log how the IPU's process ended and keep its exit status (for exit_status)."""
        proc = ipu.proc
        if proc is not None and proc.pid not in self._exits:
            rc = proc.returncode()
            _log.warning("ipu %d: %s", ipu.index, proc.describe_exit())
            if rc is not None:
                self.metrics.died(ipu)
                self._exits[proc.pid] = rc
                while len(self._exits) > _EXITS_KEPT:
                    self._exits.pop(next(iter(self._exits)))

    async def _exit_status(self, pid: Any) -> dict[str, Any]:
        if not isinstance(pid, int):
            return _error("request", f"exit_status needs an int 'pid', got {pid!r}")
        if pid in self._exits:
            return {"ok": True, "returncode": self._exits[pid]}
        for ipu in self.ipus:
            proc = ipu.proc
            if proc is not None and proc.pid == pid:
                rc = await asyncio.get_running_loop().run_in_executor(None, proc.wait_exit, 2.0)
                return {"ok": True, "returncode": rc}
        return _error("unknown", f"process {pid} is not an IPU process of this daemon")

    # -- monitor --------------------------------------------------------------------------

    async def _monitor(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(_MONITOR)
            for conn in list(self._conns):
                if conn.holding and not pid_alive(conn.pid):
                    loop.create_task(self._release(conn, "died"))
            for ipu in self.ipus:
                if ipu.index in self._busy:
                    continue
                if ipu.state in ("free", "held") and not ipu.alive():
                    self._retire(ipu)
                    if ipu.state == "free":
                        self._schedule_start(ipu)
                    else:
                        ipu.state = "dead"   # restarted when its holder releases it
                elif ipu.state == "failed" and loop.time() >= self._retry_at.get(ipu.index, 0):
                    self._schedule_start(ipu)

    def _schedule_start(self, ipu: PooledIpu) -> None:
        ipu.state, ipu.holder = "starting", None   # at once: no attach may take it meanwhile
        self._busy.add(ipu.index)
        asyncio.get_running_loop().create_task(self._start_ipu(ipu))


def _error(kind: str, message: str) -> dict[str, Any]:
    return {"ok": False, "error": kind, "message": message}
