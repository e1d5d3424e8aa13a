"""``ipu-emulator daemon``: a pool of warm emulated IPUs served to host processes.

The daemon starts one IPU process per IPU of its pool (``--pool`` mode, see
:mod:`ipu_emulator.ipu.process`) and keeps them running. Hosts connect to its
unix socket (mode 0600, default ``$IPU_EMULATOR_HOME/daemon.sock``) and speak
:mod:`ipu_emulator.daemon.socket_protocol`:

- ``attach`` takes a set of IPUs exclusively (all or none) for the connection
  and answers with each IPU's process pid and ring names; a busy IPU is
  reported with its holder's pid (the kernel's ``SO_PEERCRED``, not a claim);
- ``release``, closing the connection, or the death of the holder (its pidfd,
  read by the event loop, or where there is none a check every ``_MONITOR``
  seconds, so a forked child keeping the socket open does not matter) hands the
  IPUs back: each process drops that host's executables and, if the host died,
  every shared-memory object it created; then it is free.
  ``release`` is answered before the reset is done: an attach of a ``resetting``
  IPU waits for its reset, and ``status`` answers once resets under way are done;
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
This module serves connections and answers requests; attaching and taking back
are :mod:`._attach`, keeping the IPU processes running is :mod:`._keeper`.
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

from shm import pid_alive

from ipu_emulator import safe_files, titles
from ipu_emulator.daemon import socket_protocol as wire
from ipu_emulator.daemon.daemon_metrics import DaemonMetrics
from ipu_emulator.daemon._attach import Conn, attach, error, release, release_soon
from ipu_emulator.daemon._keeper import ProcessKeeper
from ipu_emulator.daemon.partitions import FILE_NAME as PARTITIONS_FILE
from ipu_emulator.daemon.partitions import PARTITION_OPS, PartitionTable
from ipu_emulator.daemon._pool import PooledIpu
from ipu_emulator.ipu.launcher import IpuSpec
from ipu_emulator.system import SystemConfig
from ipu_emulator.errors import DaemonError
from ipu_emulator.faults import FaultSpecError, FaultTable, dumps, parse_faults
from ipu_emulator.settings import IpuSettings

__all__ = ["Daemon", "DaemonError"]

_log = logging.getLogger("ipu_emulator.daemon.server")

_MONITOR = 0.2     # seconds between checks of holders and IPU processes
MAX_CONNECTIONS = 512   # connections served at once: past it an idle one is closed, else the
                        # new one is answered "overloaded" and closed
FIRST_MESSAGE_TIMEOUT = 10.0   # seconds a new connection may stay silent before its first
                               # message (later silence is a host holding its IPUs)
REPLY_TIMEOUT = 10.0    # seconds a reply may wait for a client that does not read


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
        self._conns: set[Conn] = set()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
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
        self.keeper = ProcessKeeper(self.ipus, self.metrics.died)
        # V-IPU partitions (ipu-emulator vipu), kept in the home across daemons
        self.partitions = PartitionTable(self.ipus, os.path.join(system.home, PARTITIONS_FILE))

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
            await asyncio.gather(*(self.keeper.start(ipu) for ipu in self.ipus))
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
            self.keeper.stopping = True
            self.metrics.close()
            if monitor is not None:
                monitor.cancel()
            if server is not None:
                server.close()
            for conn in list(self._conns):
                conn.writer.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)
            await self.keeper.settle(self.ipus)   # resets under way end (bounded) first
            await self.keeper.stop_all()
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
        if len(self._conns) >= MAX_CONNECTIONS and not self._drop_an_idle_connection():
            _log.warning("refusing a connection of pid %d: %d connections open", pid,
                         len(self._conns))
            writer.write(wire.encode(error("overloaded", f"the daemon serves {MAX_CONNECTIONS} "
                                            "connections at most; try again later")))
            writer.close()
            return
        conn = Conn(pid, writer)
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
                    await self._reply(conn, error("protocol", f"message longer than "
                                                   f"{wire.MAX_MESSAGE} bytes; closing"))
                    break
                if not line:
                    break
                conn.spoke = conn.serving = True
                try:
                    req = wire.decode(line)
                except wire.DaemonProtocolError as exc:
                    await self._reply(conn, error("protocol", str(exc)))
                    conn.serving = False
                    continue
                try:
                    reply = await self._handle(conn, req)
                except Exception as exc:   # a bug: the client still gets an answer
                    _log.exception("%s request of pid %d failed", req.get("op"), conn.pid)
                    reply = error("internal", f"{type(exc).__name__}: {exc}")
                await self._reply(conn, reply)
                conn.serving = False
        except (ConnectionError, OSError):
            pass
        finally:
            self._conns.discard(conn)
            await self._release(conn, "disconnected")
            writer.close()

    def _drop_an_idle_connection(self) -> bool:
        """At the cap: close a connection that holds nothing and waits for no answer (a
        host keeps the one of its last release for its next attach, which connects anew
        once it finds it closed); False if there is none."""
        for conn in self._conns:
            if conn.spoke and not conn.serving and not conn.holding \
                    and not conn.writer.is_closing():
                _log.info("closing an idle connection of pid %d: %d connections open",
                          conn.pid, len(self._conns))
                conn.writer.close()
                return True
        return False

    async def _reply(self, conn: Conn, reply: dict[str, Any]) -> None:
        conn.writer.write(wire.encode(reply))
        try:
            await asyncio.wait_for(conn.writer.drain(), REPLY_TIMEOUT)
        except asyncio.TimeoutError:
            raise ConnectionError(f"pid {conn.pid} did not read its reply for "
                                  f"{REPLY_TIMEOUT:.0f} s") from None

    async def _handle(self, conn: Conn, req: dict[str, Any]) -> dict[str, Any]:
        op = req.get("op")
        if op == "hello":
            return {"ok": True, "daemon_pid": os.getpid(), "system": self._system_info()}
        if op == "status":
            await self.keeper.settle(self.ipus)   # states as the resets under way leave them
            return self._status()
        if op == "attach":
            return await self._attach(conn, req)
        if op == "release":   # answered at once; the IPUs are lent again once reset
            release_soon(self.keeper, conn, "released")
            return {"ok": True}
        if op == "exit_status":
            return await self._exit_status(req.get("pid"))
        if op == "faults":
            return self._faults(req)
        if op in PARTITION_OPS:
            # as status: a host's release just answered is done (its IPUs free) first
            await self.keeper.settle(self.ipus)
            return self.partitions.handle(str(op), req, conn.pid)
        return error("protocol", f"unknown op {op!r}; expected hello, status, attach, "
                      "release, exit_status, faults or " + ", ".join(PARTITION_OPS))

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
            return error("bad_request", str(exc))
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

    async def _attach(self, conn: Conn, req: dict[str, Any]) -> dict[str, Any]:
        started = asyncio.get_running_loop().time()
        ipus = req.get("ipus")
        refused = (self.partitions.check_attach(req, ipus) if isinstance(ipus, list)
                   and all(isinstance(i, int) for i in ipus) else None)
        reply = (refused if refused is not None
                 else await attach(self.keeper, self.system, conn, req))
        if reply.get("error") == "busy":
            self.metrics.attach_busy(conn.pid)
        else:
            self.metrics.attach_done(conn.pid, started, bool(reply.get("ok")),
                                     refused=reply.get("error") in ("request", "stopping",
                                                                    "partition_not_found"))
        return reply

    async def _release(self, conn: Conn, why: str) -> None:
        await release(self.keeper, conn, why)

    async def _exit_status(self, pid: Any) -> dict[str, Any]:
        if not isinstance(pid, int):
            return error("request", f"exit_status needs an int 'pid', got {pid!r}")
        try:
            return {"ok": True, "returncode": await self.keeper.exit_status(pid)}
        except KeyError:
            return error("unknown", f"process {pid} is not an IPU process of this daemon")

    # -- monitor --------------------------------------------------------------------------

    async def _monitor(self) -> None:
        """Look at holders and IPU processes when one of them exits (their pidfds are
        read by the loop: the keeper's ``look``), and every ``_MONITOR`` seconds while
        something must be polled (a process without a pidfd, see ``polling``). An idle
        daemon, or one whose hosts hold their IPUs idle, sleeps until an exit."""
        loop = asyncio.get_running_loop()
        look = self.keeper.look
        while True:
            if (any(conn.holding and not conn.watched for conn in self._conns)
                    or self.keeper.polling()):
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(look.wait(), _MONITOR)
            else:
                await look.wait()
            look.clear()
            for conn in list(self._conns):
                if conn.holding and not pid_alive(conn.pid):
                    loop.create_task(self._release(conn, "died"))
            self.keeper.check()
