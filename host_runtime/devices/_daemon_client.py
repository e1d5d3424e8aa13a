"""The host's side of daemon mode: attach the daemon's warm IPU processes.

``DeviceManager`` uses a :class:`DaemonClient` when the setting ``daemon``
(``IPU_EMULATOR_DAEMON``, read when the manager is made) names the daemon's socket
(or ``DeviceManager(daemon=path)``):

- the machine (IPU count, version, tiles, memory) is the daemon's pool;
- ``try_attach(device_id, ipus)`` asks the daemon for the IPUs, all or none,
  on a connection of their own (the one this process's last release was answered
  on, kept for its next attach, else a new one): a :class:`DaemonAttachment` (which replaces
  the local lock files: the daemon's attach is the exclusive one), or
  ``{ipu: holder pid}`` when some are held;
- ``attachment.launcher(spec, log_dir=...)`` is the ``DeviceManager``
  launcher seam: it hands out a :class:`DaemonIpu`, an ``IpuConnection`` over
  the process the daemon keeps warm (its rings are attached, not created; its
  liveness is a pidfd, as it is not our child);
- ``attachment.release()`` gives the IPUs back: the daemon answers at once and
  resets them before it lends them to anyone again (an attach meanwhile waits
  for the reset; the home's lock files stay taken until then). A host that dies
  releases them too: the daemon sees its connection close (or its pid die).

Every wait on the daemon is bounded by the host sync timeout of the client's
settings (``host_sync_timeout``, taken when the client is made): a daemon that does not answer (stopped, stuck)
fails an attach with a DeviceTimeoutError naming its pid and state; a release
gives up the hold locally (closes the connection, which the daemon takes as a
release when it runs again) and returns.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import weakref
from typing import Any, Callable

from shm import ExitWatch, Ring, ShmError, describe_process
from shm.settings import is_digits

from host_runtime.errors import (DeviceTimeoutError, DeviceUnavailableError,
                                 PartitionNotFoundError)
from host_runtime.devices._first import FIRST_SEQ, take_first_request
from host_runtime.devices._wait import waiting_elsewhere
from host_runtime.settings import HostSettings
from ipu_emulator import trace
from ipu_emulator.daemon import socket_protocol as wire
from ipu_emulator.errors import DaemonVersionError
from ipu_emulator.ipu.launcher import IpuSpec, describe_returncode, read_log_tail
from ipu_emulator import ipu_protocol
from ipu_emulator.ipu_protocol import Message, Op, Ready
from ipu_emulator.system import SystemConfig

__all__ = ["DaemonClient", "DaemonAttachment", "DaemonIpu", "daemon_from_env"]

_log = logging.getLogger(__name__)

_TIMEOUT = 60.0
"""Seconds for an attach or release (the daemon resets IPUs on release); at most the host
sync timeout: a daemon that does not answer by then is stopped or stuck."""


def daemon_from_env() -> str | None:
    """The daemon's socket path (the setting ``daemon``, ``IPU_EMULATOR_DAEMON``, now), or
    None (embedded mode)."""
    path: str | None = HostSettings.read("daemon")
    return path or None


class DaemonClient:
    """Requests to one daemon; ``settings``: its host sync timeout's (default: now's)."""

    def __init__(self, path: str, settings: HostSettings | None = None,
                 partition: str | None = None, origin: str = wire.ENV_VAR) -> None:
        """``partition``: a V-IPU partition of the daemon (``IPUOF_VIPU_API_PARTITION_ID``):
        the machine is then its IPUs, numbered 0..size-1 (``ipu_map`` holds the pool's).
        ``origin``: what named ``path`` (for messages)."""
        self.path = os.path.abspath(path)
        self.origin = origin
        self._hello: dict[str, Any] | None = None
        self.partition = partition
        self.ipu_map: tuple[int, ...] | None = None   # partition IPU k is pool IPU ipu_map[k]
        self.reconfigurable = True
        s = settings if settings is not None else HostSettings.current()
        self.sync_timeout = s.host_sync_timeout   # bounds every wait on the daemon

    def bound(self, timeout: float) -> float:
        """``timeout``, at most the host sync timeout."""
        return min(timeout, self.sync_timeout)

    def _unreachable(self, exc: BaseException) -> DeviceUnavailableError:
        if isinstance(exc, DaemonVersionError):
            return DeviceUnavailableError(
                f"the IPU emulator daemon at {self.path} ({wire.ENV_VAR}) is another version "
                f"of the emulator: {exc}; restart it with this installation ('ipu-emulator "
                "daemon --socket PATH')")
        fix = {wire.ENV_VAR: "or unset the variable",
               "the default socket": f"or name its socket with {wire.ENV_VAR}"}.get(
                   self.origin, f"or change {self.origin}")
        return DeviceUnavailableError(
            f"cannot reach the IPU emulator daemon at {self.path} ({self.origin}): {exc}; "
            f"start it with 'ipu-emulator daemon --socket PATH' {fix}")

    def no_answer(self, op: str, conn: wire.LineConnection | None, timeout: float
                  ) -> DeviceTimeoutError:
        """The error for a daemon that did not answer ``op`` in time: its pid and state."""
        pid = conn.peer_pid if conn is not None else None
        who = describe_process(pid) if pid is not None else "pid unknown: it did not accept"
        return DeviceTimeoutError(
            f"the IPU emulator daemon at {self.path} ({who}) did not answer {op} within "
            f"{timeout:g} s (the host sync timeout is IPU_EMULATOR_HOST_SYNC_TIMEOUT); "
            "continue or restart it")

    def request(self, message: dict[str, Any], timeout: float = 10.0) -> dict[str, Any]:
        """One request on a fresh connection; bounded by ``timeout`` and the host sync
        timeout (DeviceTimeoutError naming the daemon's pid and state)."""
        timeout = self.bound(timeout)
        conn: wire.LineConnection | None = None
        try:
            conn = wire.LineConnection(self.path, timeout)
            return conn.call(message, timeout)
        except TimeoutError as exc:
            raise self.no_answer(str(message.get("op")), conn, timeout) from exc
        except (OSError, ValueError) as exc:
            raise self._unreachable(exc) from exc
        finally:
            if conn is not None:
                conn.close()

    def malformed(self, what: str, problem: str) -> DeviceUnavailableError:
        return DeviceUnavailableError(f"the IPU emulator daemon at {self.path} sent a malformed "
                                      f"{what} reply: {problem}")

    def system(self, home: str) -> SystemConfig:
        """The daemon's pool as the machine's configuration (``home`` stays this host's).

        Its hello is asked once per daemon: the answer is kept while the socket is the
        same file (a daemon that starts again makes a new one)."""
        if self._hello is None:
            ident = _socket_identity(self.path)
            kept = _hellos.get(self.path)
            if ident is not None and kept is not None and kept[0] == ident:
                self._hello = kept[1]
        if self._hello is None:
            hello = self.request({"op": "hello"})
            if hello.get("ok") is not True:
                raise DeviceUnavailableError(f"the IPU emulator daemon at {self.path} refused "
                                             f"hello: {hello.get('message')!r:.200}")
            _expect(self, "hello", hello, {"system": dict})
            _expect(self, "hello", hello["system"], {
                "num_ipus": int, "ipu_version": str, "tiles_per_ipu": int,
                "memory_per_tile": int, "compute_threads": int}, "system.")
            self._hello = hello
            if ident is not None:
                _hellos[self.path] = (ident, hello)
        s = self._hello["system"]
        num_ipus = s["num_ipus"] if self.partition is None else self._partition_size()
        return SystemConfig(num_ipus=num_ipus, ipu_version=s["ipu_version"],
                            tiles_per_ipu=s["tiles_per_ipu"],
                            memory_per_tile=s["memory_per_tile"],
                            compute_threads=s["compute_threads"], home=home)

    def not_found(self, message: Any) -> PartitionNotFoundError:
        return PartitionNotFoundError(
            f"V-IPU partition {self.partition!r} (IPUOF_VIPU_API_PARTITION_ID or IPUoF config) "
            f"is not available on the daemon at {self.path}: {message}; create it with "
            f"'ipu-emulator vipu create partition {self.partition} --size N'",
            partition=self.partition or "")

    def _reread_partition(self) -> bool:
        """The partition was removed and made again since it was read: its new IPUs are
        taken (True) if it is the same device (size, reconfigurable); else the named error
        (this process's devices and their numbering are of the old one)."""
        was = (len(self.ipu_map or ()), self.reconfigurable)
        size = self._partition_size()
        if (size, self.reconfigurable) == was:
            return True
        raise PartitionNotFoundError(
            f"V-IPU partition {self.partition!r} was removed and made again since this "
            f"process read it ({was[0]} IPU(s), {'' if was[1] else 'not '}reconfigurable; "
            f"now {size}, {'' if self.reconfigurable else 'not '}reconfigurable): make a "
            "new DeviceManager", partition=self.partition or "")

    def _partition_size(self) -> int:
        """Ask the daemon for the partition: its IPUs become ``ipu_map``; its size."""
        reply = self.request({"op": "partition_get", "name": self.partition})
        if reply.get("ok") is not True:
            raise self.not_found(reply.get("message"))
        _expect(self, "partition_get", reply.get("partition"),
                {"ipus": list, "size": int, "reconfigurable": bool}, "partition.")
        part = reply["partition"]
        if not all(_is_int(i) for i in part["ipus"]) or len(part["ipus"]) != part["size"]:
            raise self.malformed("partition_get", f"partition.ipus {part['ipus']!r:.100} are "
                                 f"not {part['size']} IPU numbers")
        self.ipu_map = tuple(part["ipus"])
        self.reconfigurable = part["reconfigurable"]
        return int(part["size"])

    def try_attach(self, device_id: int, ipus: tuple[int, ...], again: bool = True
                   ) -> "DaemonAttachment | dict[int, int | None]":
        """The IPUs (all or none), or ``{ipu: holder pid or None}`` of the busy ones
        (in a partition, ``ipus`` are the partition's numbers; the daemon gets the pool's,
        and a partition made again since it was read is read ``again``, once)."""
        pmap = self.ipu_map
        back = {} if pmap is None else {g: k for k, g in enumerate(pmap)}
        pool_ipus = list(ipus) if pmap is None else [pmap[i] for i in ipus]
        message: dict[str, Any] = {"op": "attach", "ipus": pool_ipus, "device_id": device_id}
        if self.partition is not None:
            message["partition"] = self.partition
            message["partition_ipus"] = list(pmap) if pmap is not None else []
        timeout = self.bound(_TIMEOUT)
        kept = _take_idle(self.path)   # this process's connection of its last release
        try:
            if kept is not None:
                reply = self._attach_on(kept, message, timeout)
                conn = kept
            if kept is None or reply is None:   # none, or its daemon went: a new one
                try:
                    conn = wire.LineConnection(self.path, timeout)
                except TimeoutError as exc:
                    raise self.no_answer("attach", None, timeout) from exc
                except (OSError, ValueError) as exc:   # ValueError: a peer of another uid
                    raise self._unreachable(exc) from exc
                reply = self._attach_on(conn, message, timeout, fresh=True)
                assert reply is not None
        except BaseException:
            if kept is not None:
                kept.close()
            raise
        if reply.get("ok") is True:
            try:
                _expect(self, "attach", reply, {"ipus": list})
                infos = reply["ipus"]
                for k, info in enumerate(infos):
                    _expect(self, "attach", info, {"ipu": int, "pid": int, "control": str,
                                                   "events": str}, f"ipus[{k}].")
                    _expect_optional(self, "attach", info, {"log": str, "ready": dict},
                                     f"ipus[{k}].")
                    if pmap is not None:
                        info["ipu"] = back.get(info["ipu"], -1 - info["ipu"])
                got = sorted(int(i["ipu"]) for i in infos)
                if got != sorted(ipus) or any(int(i["pid"]) <= 0 for i in infos):
                    raise self.malformed("attach", f"asked for ipus {sorted(ipus)}, got "
                                         f"{got} (pids {[i['pid'] for i in infos]})")
            except BaseException:
                conn.close()
                raise
            return DaemonAttachment(self, conn, ipus, infos)
        conn.close()
        if reply.get("error") == "busy":
            busy = reply.get("busy", {})
            if not isinstance(busy, dict) or not all(
                    isinstance(k, str) and is_digits(k) and (v is None or _is_int(v))
                    for k, v in busy.items()):
                raise self.malformed("attach", f"'busy' must map ipu numbers to holder pids, "
                                     f"got {busy!r:.200}")
            return {back.get(int(k), int(k)): v for k, v in busy.items()}
        if reply.get("error") == "partition_not_found":
            raise self.not_found(reply.get("message"))
        if reply.get("error") == "partition_changed" and again and self._reread_partition():
            return self.try_attach(device_id, ipus, again=False)
        raise DeviceUnavailableError(f"the daemon at {self.path} could not attach ipus "
                                     f"{list(ipus)}: {reply.get('message')}")

    def _attach_on(self, conn: wire.LineConnection, message: dict[str, Any], timeout: float,
                   fresh: bool = False) -> dict[str, Any] | None:
        """Send the attach request on ``conn`` and read the answer (the session's work
        runs while the daemon answers); None if ``conn``, not ``fresh``, was closed by its
        daemon (which has not seen the request: it is gone)."""
        try:
            conn.send(message, timeout)
            waiting_elsewhere()   # the session's work runs now (session._attach)
            return conn.receive(timeout)
        except TimeoutError as exc:
            conn.close()   # the daemon releases on EOF, should it answer later
            raise self.no_answer("attach", conn, timeout) from exc
        except (OSError, ValueError) as exc:
            conn.close()
            if not fresh and isinstance(exc, (BrokenPipeError, ConnectionError)):
                return None
            raise self._unreachable(exc) from exc
        except BaseException:
            conn.close()
            raise

    def exit_status(self, pid: int) -> int | None:
        """How the daemon's IPU process ``pid`` ended (None if unknown or running)."""
        try:
            reply = self.request({"op": "exit_status", "pid": pid}, timeout=5.0)
        except (DeviceUnavailableError, DeviceTimeoutError):
            return None
        rc = reply.get("returncode") if reply.get("ok") else None
        return rc if isinstance(rc, int) else None


# The hello of each daemon this process asked, by socket path, with the socket file's
# identity then (its device, inode and change time: a restarted daemon's socket is new).
_hellos: dict[str, tuple[tuple[int, int, int], dict[str, Any]]] = {}


def _socket_identity(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_ctime_ns


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _type_ok(v: Any, kind: type) -> bool:
    return _is_int(v) if kind is int else isinstance(v, kind)


def _expect(client: DaemonClient, what: str, obj: Any, fields: dict[str, type],
            prefix: str = "") -> None:
    """``obj`` is a dict whose ``fields`` have those types: else a clear error."""
    if not isinstance(obj, dict):
        raise client.malformed(what, f"{prefix or 'the reply'} must be an object, got "
                               f"{type(obj).__name__}")
    for key, kind in fields.items():
        if key not in obj:
            raise client.malformed(what, f"{prefix}{key} is missing")
        if not _type_ok(obj[key], kind):
            raise client.malformed(what, f"{prefix}{key} must be {kind.__name__}, got "
                                   f"{obj[key]!r:.100} ({type(obj[key]).__name__})")


def _expect_optional(client: DaemonClient, what: str, obj: dict[str, Any],
                     fields: dict[str, type], prefix: str = "") -> None:
    for key, kind in fields.items():
        v = obj.get(key)
        if v is not None and not _type_ok(v, kind):
            raise client.malformed(what, f"{prefix}{key} must be {kind.__name__} or null, got "
                                   f"{v!r:.100} ({type(v).__name__})")


# Attachments of this process, for the fork hook below.
_attachments: "weakref.WeakSet[DaemonAttachment]" = weakref.WeakSet()

# The connection of this process's last release to each daemon (by socket path), kept
# for its next attach: the daemon serves attaches one after another on a connection,
# and a new one costs it an accept and a reader task (0.15 ms of its CPU per runner
# made and closed) and this process a connect. One per daemon; closed at exit (or by
# the daemon's end: the next attach then connects anew).
_idle: dict[str, wire.LineConnection] = {}
_idle_lock = threading.Lock()


def _take_idle(path: str) -> wire.LineConnection | None:
    with _idle_lock:
        return _idle.pop(path, None)


def _keep_idle(path: str, conn: wire.LineConnection) -> None:
    with _idle_lock:
        if path not in _idle:
            _idle[path] = conn
            return
    conn.close()


def _after_fork_in_child() -> None:
    """A forked child drops its copies of the parent's hold connections at once: it must
    never talk on them (its requests and the parent's would cross), and its copy of the
    socket would keep the parent's hold open after the parent lets go."""
    global _idle_lock
    _idle_lock = threading.Lock()
    idle = list(_idle.values())
    _idle.clear()
    for conn in idle:
        conn.close()   # this process's descriptor only (no shutdown())
    for att in list(_attachments):
        att._forget_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


class DaemonAttachment:
    """IPUs this host holds through the daemon (the connection is the hold)."""

    def __init__(self, client: DaemonClient, conn: wire.LineConnection, ipus: tuple[int, ...],
                 infos: list[dict[str, Any]]) -> None:
        self.client = client
        self.ipus = ipus
        self._conn: wire.LineConnection | None = conn
        self._infos = {int(i["ipu"]): i for i in infos}
        self._pid = os.getpid()
        self._users = 1   # devices cut from it (share): the last one's release is the daemon's
        self._users_lock = threading.Lock()
        _attachments.add(self)

    def share(self, users: int) -> None:
        """The attachment is held by ``users`` devices (a partition's one device cut into its
        replicas' devices): :meth:`release` gives the IPUs back at the last of theirs."""
        self._users = users

    def _forget_in_child(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            try:
                conn.close()   # this process's descriptor only (no shutdown())
            except OSError:   # pragma: no cover
                pass

    def launcher(self, spec: IpuSpec, log_dir: str | None = None) -> "DaemonIpu":
        """The ``DeviceManager`` launcher seam: the warm process of ``spec.ipu_id``."""
        try:
            info = self._infos[spec.ipu_id]
        except KeyError:
            raise DeviceUnavailableError(f"ipu {spec.ipu_id} is not part of this attachment "
                                         f"(ipus {list(self.ipus)})") from None
        return DaemonIpu(spec, info, self.client)

    @property
    def held(self) -> bool:
        return self._conn is not None

    def release(self, meanwhile: Callable[[], None] | None = None) -> None:
        """Hand the IPUs back; returns once the daemon has taken them (it resets them
        before it lends them again), idempotent. ``meanwhile`` runs while the daemon
        answers (not in a forked child, nor if there is nothing to release).

        In a forked child it only drops its copy of the connection. Shared (:meth:`share`),
        only the last user's release gives the IPUs back (the others run ``meanwhile``)."""
        with self._users_lock:
            self._users -= 1
            last = self._users <= 0
        if not last and os.getpid() == self._pid:
            if meanwhile is not None:
                meanwhile()
            return
        conn, self._conn = self._conn, None
        if conn is None:
            return
        timeout = self.client.bound(_TIMEOUT)
        failed: list[BaseException] = []   # meanwhile's error: raised once released
        keep = False   # answered: the connection serves this process's next attach
        try:
            if os.getpid() == self._pid:
                try:
                    conn.send({"op": "release"}, timeout)
                finally:
                    if meanwhile is not None:
                        try:
                            meanwhile()
                        except BaseException as exc:
                            failed.append(exc)
                reply = conn.receive(timeout)
                keep = True
                if not reply.get("ok"):
                    _log.warning("the daemon at %s: release of ipus %s: %s", self.client.path,
                                 list(self.ipus), reply.get("message"))
        except TimeoutError:
            # stopped or stuck: give up the hold locally (closing the connection is a
            # release the daemon acts on once it runs again) and return
            _log.warning("%s; ipus %s released locally",
                         self.client.no_answer("release", conn, timeout), list(self.ipus))
        except (OSError, ValueError) as exc:   # daemon gone: nothing left to release
            _log.debug("release of ipus %s: %s", list(self.ipus), exc)
        finally:
            if keep:
                _keep_idle(self.client.path, conn)
            else:
                conn.close()
        if failed:
            try:
                raise failed[0]
            finally:
                failed.clear()   # no cycle: the traceback holds this frame

    def __del__(self) -> None:
        conn = getattr(self, "_conn", None)
        if conn is not None:
            conn.close()   # the daemon releases on EOF


class DaemonIpu:
    """An ``IpuConnection`` over an IPU process the daemon owns."""

    def __init__(self, spec: IpuSpec, info: dict[str, Any], client: DaemonClient) -> None:
        self.spec = spec
        self.log_path: str | None = info.get("log")
        self._pid = int(info["pid"])
        self._ready = Ready.decode(info.get("ready"))
        self._client = client
        self._rc: int | None = None
        self._closed = False
        self._owner_pid = os.getpid()   # a forked child never kills the daemon's process
        self._exit = ExitWatch([self._pid])   # liveness: a pidfd (not our child)
        self.control = Ring.attach(info["control"], prefault=False)   # a slot's pages fault in as written
        # a session's LOAD, ready while the daemon answered: sent before the rest is built
        # (host_runtime.devices._first); the daemon's HOST is ahead of it on the ring
        # (a device of several IPUs has none: launch_all)
        self.first: tuple[int, Op, Any] | None = None
        first = take_first_request()
        if first is not None:
            try:
                ipu_protocol.send(self.control, Message(first[0], seq=FIRST_SEQ, body=first[1]),
                                  timeout=0.0)
                self.first = (FIRST_SEQ, *first)
            except (ShmError, ipu_protocol.ProtocolError):   # (then the session sends it)
                pass
        try:
            self.events = Ring.attach(info["events"], prefault=False)
        except BaseException:
            self.control.close()
            raise
        self.control.set_peer(self._pid)
        if info.get("trace") and trace.recorder.ON:   # a daemon recording its IPUs
            trace.map_ipu_buffer(str(info["trace"]))

    @property
    def pid(self) -> int:
        return self._pid

    def alive(self) -> bool:
        return self._rc is None and self._exit.dead_pid() is None

    def returncode(self) -> int | None:
        """None while running; then how it ended, as its parent (the daemon) saw it."""
        if self._rc is None and not self.alive():
            rc = self._client.exit_status(self._pid)
            # None: the daemon is gone. A stopping daemon terminates the processes it owns
            # (a SIGKILLed one leaves them to exit by themselves): SIGTERM is the best guess.
            self._rc = rc if rc is not None else -int(signal.SIGTERM)
        return self._rc

    def wait_exit(self, timeout: float) -> int | None:
        if self._rc is None and timeout > 0:
            self._exit.wait(timeout)   # woken by the exit itself
        return None if self.alive() else self.returncode()

    def describe_exit(self) -> str:
        return (f"{self.spec.describe()} (daemon IPU process pid {self._pid}) "
                f"{describe_returncode(self.returncode())}")

    def log_tail(self, nbytes: int = 2000) -> str:
        return read_log_tail(self.log_path, self._pid, nbytes)

    def kill(self) -> None:
        """SIGKILL the process (tests; the daemon starts a new one once it is released).
        Not from a process forked from the host that attached it."""
        if os.getpid() == self._owner_pid and self.alive():
            os.kill(self._pid, signal.SIGKILL)
            self.wait_exit(5.0)

    def wait_ready(self, timeout: float | None = None) -> Ready:
        return self._ready   # the daemon waited for READY when it started the process

    def shutdown(self, timeout: float = 5.0) -> None:
        """Nothing to do: the process is the daemon's; releasing the attachment resets it."""

    def close(self) -> None:
        """Stop using the rings (they are the daemon's: not unlinked). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.control.close()
        self.events.close()

    def __repr__(self) -> str:
        return f"DaemonIpu({self.spec.describe()}, pid={self._pid})"
