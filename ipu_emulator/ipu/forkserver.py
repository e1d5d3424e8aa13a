"""A pre-started, pre-imported template process that forks IPU processes.

Starting ``python -m ipu_emulator`` costs a fresh interpreter plus the
imports of numpy and onnxruntime (~300 ms here) for every IPU process. As
``multiprocessing``'s forkserver does, a host starts one *template* process
(``python -m ipu_emulator.ipu.forkserver``) the first time it launches an IPU; the
template imports everything an IPU process needs (but creates no onnxruntime
session and no thread of its own) and then forks one child per IPU process::

    host process                 template process              IPU process
    ------------                 ----------------              -----------
    spawn(argv, env, log) --->   fork() ----------------------> process.main(argv)
                          <---   {"spawned", pid}               (fds 1, 2: its log)
    returncode(pid)       <---   {"exit", pid, code}  <-------- exits; reaped at once
                                 (SIGCHLD -> waitpid)

What an IPU process guarantees is kept:

- it is its own process (a fork of the template, never a thread), with its
  own log (stdout/stderr appended to ``<log_dir>/ipuN.log``) and the host's
  environment of that launch;
- the host learns its death at once: the template reaps it on SIGCHLD and
  sends its status (``os.waitstatus_to_exitcode``: a negative number is the
  signal), which is what ``describe_returncode`` turns into "was killed by
  signal SIGKILL (9)";
- it watches the host by pid (its parent is the template, not the host; the
  same check a daemon's IPU processes use) and, when the host dies, unlinks
  what it and the host created and exits;
- nothing is left behind: the template creates no shared memory; when its
  host exits (its socket closes, or ``getppid()`` changes) it waits for its
  children to finish (they notice the dead host and clean up), reaps them and
  exits; the host reaps it (``stop()``), or init does if the host died.

The setting ``forkserver`` off (``IPU_EMULATOR_FORKSERVER=0``) turns the template
off: the launcher then starts every IPU process as a fresh ``python -m
ipu_emulator``. A forked IPU process reads its settings after the fork, from the
environment of its launch (no module of an IPU process reads a setting when it
is imported), so one template serves every setting; launches whose environments
differ in a variable that the modules *do* read when imported
(:data:`IMPORT_TIME_ENV`: the import path and the math libraries' threads) get a
template each (up to four; past that they start fresh).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable, NoReturn

from shm.liveness import describe_process

from ipu_emulator import safe_files, titles
from ipu_emulator.errors import ForkserverError, describe_returncode

__all__ = ["spawn", "prestart", "stop", "ForkedProcess", "ForkserverError", "IMPORT_TIME_ENV",
           "SPAWN_TIMEOUT"]

_log = logging.getLogger("ipu_emulator.ipu.forkserver")

IMPORT_TIME_ENV = ("PYTHONPATH", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS")
"""Environment variables the IPU process's modules read when imported: a launch must
agree with the template on these to be forked from it. No setting of ours is one
(tests/unit/test_settings.py checks that no module reads a setting at import)."""

_START_TIMEOUT = 120.0
SPAWN_TIMEOUT = 30.0
"""Seconds a launch waits at most for the template to fork (the launcher bounds it by the
host sync timeout too); past it the IPU process is started fresh."""
STATUS_LOST = 255
"""The return code of an IPU process that exited after its template died (the status
went with the template); ``ForkedProcess.status_lost`` tells it apart."""
_HOST_CHECK = 0.25   # seconds between the template's checks that its host is alive (only
# without pidfds: else the host's pidfd wakes it)


def _env_key(env: dict[str, str]) -> tuple[str | None, ...]:
    return tuple(env.get(k) for k in IMPORT_TIME_ENV)


class _Template:
    """The host's side of its template process."""

    def __init__(self, log_path: str | None, env: dict[str, str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.env = dict(env)   # the launch's: its import-time settings are the template's
        self.key = _env_key(self.env)
        log: Any = subprocess.DEVNULL
        try:
            if log_path:
                log = safe_files.open_log(log_path)
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "ipu_emulator.ipu.forkserver", "--fd", str(theirs.fileno()),
                 "--host-pid", str(os.getpid())],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, pass_fds=(theirs.fileno(),),
                env=self.env)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
            if log is not subprocess.DEVNULL:
                os.close(log)
        self.sock = ours
        self._cv = threading.Condition()
        self._replies: dict[int, dict[str, Any]] = {}
        self.exits: dict[int, int] = {}
        self.children: set[int] = set()
        self.lost: set[int] = set()   # exited after the template died: status unknown
        # the spawn (its request id) of the process now known by each pid: its status is
        # forgotten once its ForkedProcess has taken it (forget()), so these hold only
        # what a ForkedProcess of this host has still to take
        self.spawned: dict[int, int] = {}
        self.gone = False
        self.stalled = False   # a spawn went unanswered: no more launches through it
        self._abandoned: set[int] = set()
        self._ids = 0
        self._send_lock = threading.Lock()
        # One thread reads what the template sends (replies, exits) and wakes the waiters:
        # nobody polls, and an exit is known the moment the template reports it.
        self._reader = threading.Thread(target=self._read, name="ipu-template-reader",
                                        daemon=True)
        self._reader.start()
        if self._wait_reply(0, _START_TIMEOUT) is None:
            self.stop()
            raise ForkserverError(f"the template process (pid {self.popen.pid}) did not become "
                                  f"ready within {_START_TIMEOUT:g} s")

    @property
    def pid(self) -> int:
        return self.popen.pid

    def _read(self) -> None:
        buf = b""
        while True:
            try:
                data = self.sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                break
            buf += data
            *lines, buf = buf.split(b"\n")
            if not lines:
                continue
            with self._cv:
                for line in lines:
                    self._take(json.loads(line))
                self._cv.notify_all()
        with self._cv:
            stopped = self.gone
            self.gone = True
            self._cv.notify_all()
        if not stopped:
            rc = self.popen.poll()
            _log.warning("the IPU template process (pid %d) %s; its IPU processes' exit "
                         "statuses are lost", self.popen.pid,
                         _describe(rc) if rc is not None else "closed its socket")

    def _take(self, msg: dict[str, Any]) -> None:
        """Note one message of the template (the lock held), in the order it sent them: a
        child's fork comes before its exit."""
        if msg["op"] == "exit":
            self.exits[msg["pid"]] = msg["code"]
            self.children.discard(msg["pid"])
            return
        if "pid" in msg:
            # A new process with this pid: what an earlier one of the same pid left (its
            # exit status, a lost status) is not this one's. The kernel reuses pids, so a
            # long-lived host meets them again; the new one must not count as exited.
            self.exits.pop(msg["pid"], None)
            self.lost.discard(msg["pid"])
            self.spawned[msg["pid"]] = msg["id"]
        if msg["id"] in self._abandoned:
            self._abandoned.discard(msg["id"])
            if "pid" in msg:   # forked as the deadline passed: not ours now
                _kill(int(msg["pid"]))
        else:
            self._replies[msg["id"]] = msg

    def _wait_reply(self, ident: int, timeout: float) -> dict[str, Any] | None:
        with self._cv:
            self._cv.wait_for(lambda: ident in self._replies or self.gone, timeout)
            return self._replies.pop(ident, None)

    def forget(self, pid: int, ident: int) -> None:
        """The ForkedProcess of spawn ``ident`` took its exit status: drop what is kept of
        it (nothing if ``pid`` now names a later spawn's process)."""
        with self._cv:
            if self.spawned.get(pid) == ident:
                del self.spawned[pid]
                self.exits.pop(pid, None)
                self.lost.discard(pid)
                self._cv.notify_all()   # a waiter of that process ends (its ``taken``)

    def spawn(self, argv: list[str], env: dict[str, str], log_path: str | None,
              wait: float) -> tuple[int, int]:
        """Fork ``argv``; the new process's pid and the spawn's id (for :meth:`forget`)."""
        with self._send_lock:
            self._ids += 1
            ident = self._ids
            # the template forks nothing past this (CLOCK_MONOTONIC is the machine's):
            # a request the host gave up on must never become a second IPU process on the
            # rings of the one started fresh in its place
            data = json.dumps({"op": "spawn", "id": ident, "argv": argv, "env": env,
                               "log": log_path, "cwd": os.getcwd(),
                               "deadline": time.monotonic() + wait}).encode() + b"\n"
            try:
                self.sock.sendall(data)
            except OSError as exc:
                raise ForkserverError(f"the template process (pid {self.pid}) is gone: "
                                      f"{exc}") from exc
        reply = self._wait_reply(ident, wait)
        if reply is None:
            with self._cv:
                reply = self._replies.pop(ident, None)
                if reply is None:
                    self._abandoned.add(ident)   # a late child is killed (_read)
                    self.stalled = True          # later launches start a new template
            if reply is None:
                raise ForkserverError(f"the template process ({describe_process(self.pid)}) "
                                      f"did not fork within {wait:g} s")
        if "pid" not in reply:
            raise ForkserverError(f"the template process could not fork: {reply.get('message')}")
        pid = int(reply["pid"])
        with self._cv:
            if pid not in self.exits:
                self.children.add(pid)
        return pid, ident

    def returncode(self, pid: int) -> int | None:
        with self._cv:
            code = self.exits.get(pid)
            if code is not None or not self.gone:
                return code
        # The template died before reporting it: the process is no child of ours, so only
        # whether it still runs is known.
        from shm import pid_alive
        if pid_alive(pid):
            return None
        with self._cv:
            self.lost.add(pid)
            return self.exits.setdefault(pid, STATUS_LOST)

    def wait(self, pid: int, timeout: float,
             taken: Callable[[], bool] | None = None) -> int | None:
        """``pid``'s exit status once reported, within ``timeout`` s (None: not yet).
        ``taken``: says the caller's process object took the status meanwhile (another of
        its threads, which made this forget it): the wait ends then, with None."""
        deadline = time.monotonic() + timeout
        done = taken if taken is not None else (lambda: False)
        with self._cv:
            self._cv.wait_for(lambda: pid in self.exits or self.gone or done(), timeout)
        while True:
            if done():
                return None
            rc = self.returncode(pid)
            left = deadline - time.monotonic()
            if rc is not None or left <= 0:
                return rc
            time.sleep(min(left, 0.01))   # template lost: only polling is left

    def stop(self, timeout: float = 0.0) -> None:
        """Close the template's socket; it exits once its children have. Reaps it if it
        exits within ``timeout`` s (an atexit hook must not wait for IPU processes)."""
        with self._cv:
            self.gone = True
            self._cv.notify_all()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)   # wakes the reader; the template sees EOF
        except OSError:
            pass
        self._reader.join(5)
        self.sock.close()
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass


_templates: dict[tuple[str | None, ...], _Template] = {}   # by import-time settings
_template_lock = threading.Lock()
_broken = False
_MAX_TEMPLATES = 4   # distinct import-time settings served by a template of their own


def _get_template(env: dict[str, str], log_dir: str | None) -> _Template | None:
    """The running template for ``env``'s import-time settings (started if need be), or
    None to start the process fresh."""
    global _broken
    key = _env_key(env)
    with _template_lock:
        if _broken:
            return None
        t = _templates.get(key)
        if t is not None and (t.gone or t.stalled or t.popen.poll() is not None):
            if not t.children:
                t.stop()
            del _templates[key]
            t = None
        if t is None:
            if len(_templates) >= _MAX_TEMPLATES:
                return None
            log_path = os.path.join(log_dir, "forkserver.log") if log_dir else None
            try:
                t = _templates[key] = _Template(log_path, env)
            except (OSError, ForkserverError):
                _broken = True   # do not pay for a failing start at every launch
                raise
        return t


def prestart(env: dict[str, str], log_dir: str | None) -> None:
    """Start the template for ``env``'s import-time settings in the background if none
    runs (the first launch then waits less, or not at all, for it); errors are left to
    that launch."""
    with _template_lock:
        if _broken or _env_key(env) in _templates:
            return

    def start() -> None:
        try:
            _get_template(env, log_dir)
        except Exception:   # the launch that needs it starts it again or goes without
            _log.debug("starting the template in the background failed", exc_info=True)
    threading.Thread(target=start, name="ipu-template-start", daemon=True).start()


def stop() -> None:
    """Stop this host's template processes (at exit; benchmarks).

    A template with no IPU process left exits at once and is reaped here; otherwise it
    exits (reaped by init) once they have, after this host is gone.
    """
    with _template_lock:
        templates = list(_templates.values())
        _templates.clear()
    for t in templates:
        t.stop(timeout=0.0 if t.children else 5.0)


def _after_fork_in_child() -> None:
    """A host that forks: the child must not share its parent's templates (their replies
    would cross); it starts its own if it launches IPU processes."""
    global _template_lock
    _template_lock = threading.Lock()
    templates = list(_templates.values())
    _templates.clear()
    for t in templates:   # (their reader threads are not in this process)
        try:
            t.sock.close()   # this process's copy; the parent's stays open
        except OSError:
            pass


os.register_at_fork(after_in_child=_after_fork_in_child)

# Registered when the launcher is first imported, before any exit hook of the runtime
# (those close runners and devices, shutting their IPU processes down): it runs last.
atexit.register(stop)


class ForkedProcess:
    """An IPU process forked by the template, with the parts of ``Popen`` the launcher
    uses: ``pid``, ``poll()``, ``wait()``, ``terminate()``, ``kill()``."""

    def __init__(self, template: _Template, pid: int, ident: int | None = None) -> None:
        """``ident``: the id of the spawn that made it (None: the template keeps its exit
        status for good)."""
        self._template = template
        self.pid = pid
        self._ident = ident
        self.returncode: int | None = None
        self._lost: bool | None = None   # status_lost, once the status was taken

    def _took(self, rc: int | None) -> int | None:
        """The exit status ``rc`` was taken (if not None): kept here, dropped there."""
        if rc is not None and self.returncode is None:
            self.returncode = rc
            self._lost = self.pid in self._template.lost
            if self._ident is not None:
                self._template.forget(self.pid, self._ident)
        return rc

    def _wait(self, timeout: float) -> int | None:
        """The template's report of the exit, within ``timeout`` s; or the status another
        thread took meanwhile (the template forgot it then: see :meth:`_took`)."""
        rc = self._template.wait(self.pid, timeout, lambda: self.returncode is not None)
        return self.returncode if self.returncode is not None else self._took(rc)

    def poll(self) -> int | None:
        if self.returncode is None:
            self._took(self._template.returncode(self.pid))
        return self.returncode

    @property
    def status_lost(self) -> bool:
        """It exited after the template died: its exit status is unknown."""
        if self._lost is not None:
            return self._lost
        return self.pid in self._template.lost

    @property
    def template_pid(self) -> int:
        return self._template.pid

    def wait_exit(self, timeout: float) -> int | None:
        """Wait up to ``timeout`` s for the template to report the exit (no polling)."""
        if self.returncode is not None:
            return self.returncode
        return self._wait(timeout)

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is not None:
            return self.returncode
        rc = self._wait(1e9 if timeout is None else timeout)
        if rc is None:
            raise subprocess.TimeoutExpired(f"IPU process {self.pid}", timeout or 0.0)
        return rc

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def spawn(argv: list[str], env: dict[str, str], log_path: str | None,
          log_dir: str | None, wait: float = SPAWN_TIMEOUT) -> ForkedProcess | None:
    """Fork ``python -m ipu_emulator <argv>`` from the template, waiting ``wait`` s at most
    (ForkserverError past it); None if it cannot be used for this launch (a template could
    not start, or too many import-time environments). The caller decides whether to use
    the template at all (the setting ``forkserver``)."""
    template = _get_template(env, log_dir)
    if template is None:
        return None
    pid, ident = template.spawn(argv, env, log_path, wait)
    return ForkedProcess(template, pid, ident)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _describe(rc: int | None) -> str:
    return describe_returncode(rc)


# -- the template process -----------------------------------------------------------------

def _child(argv: list[str], env: dict[str, str], log_path: str | None,
           cwd: str | None) -> int:
    """In the forked child: become ``python -m ipu_emulator <argv>`` started by the host
    (its environment and working directory at the launch)."""
    os.environ.clear()
    os.environ.update(env)
    if cwd:
        try:
            os.chdir(cwd)
        except OSError:
            pass   # gone meanwhile: the IPU process uses absolute paths only
    try:
        fd = safe_files.open_log(log_path) if log_path else os.open(os.devnull, os.O_WRONLY)
    except OSError:   # checked by the host a moment ago: changed since, write nowhere
        fd = os.open(os.devnull, os.O_WRONLY)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.close(null)
    from ipu_emulator.ipu.process import main
    return main(argv)


def _serve(sock: socket.socket, host_pid: int) -> int:
    """The template's life: import what IPU processes run, then fork one per request of
    the host on ``sock`` until the host goes, then wait for the children."""
    _preload()
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the host decides when we stop
    titles.set_title(titles.fork_server(host_pid))
    server = _Server(sock, host_pid)
    server.send({"op": "ready", "id": 0, "pid": os.getpid()})
    server.serve()
    server.finish()
    return 0


def _preload() -> None:
    """Everything an IPU process imports, before any fork (no session, no thread of ours)."""
    import numpy  # noqa: F401
    import onnxruntime  # noqa: F401

    import ipu_emulator.ipu.interpreter  # noqa: F401
    import ipu_emulator.executable  # noqa: F401
    import ipu_emulator.ipu.process  # noqa: F401
    from ipu_emulator import package_hash

    # The hash of the sources imported here, which are the code every child runs (cached:
    # ~12 ms of reading files saved per IPU process).
    package_hash()


class _Server:
    """The template's loop over its host's socket: requests in, a fork for each, the
    children's exits out (reaped on SIGCHLD, which wakes the loop through a pipe)."""

    def __init__(self, sock: socket.socket, host_pid: int) -> None:
        self.sock = sock
        self.host_pid = host_pid
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.children: set[int] = set()
        # the host's exit wakes the select below (no periodic check) where pidfds exist
        try:
            host_fd = os.pidfd_open(host_pid)
        except (AttributeError, OSError):
            host_fd = -1
        self.watched = [host_fd] if host_fd >= 0 else []
        self.check = None if host_fd >= 0 else _HOST_CHECK

    def send(self, msg: dict[str, Any]) -> None:
        try:
            self.sock.sendall(json.dumps(msg).encode() + b"\n")
        except OSError:
            pass   # the host is gone; its children find out themselves

    def reap(self, block: bool) -> None:
        """Report the exit of each child that has exited (``block``: wait for one first)."""
        children = self.children
        while children:
            try:
                pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
            except ChildProcessError:
                children.clear()
                return
            if pid == 0:
                return
            children.discard(pid)
            self.send({"op": "exit", "pid": pid, "code": os.waitstatus_to_exitcode(status)})
            block = False

    def serve(self) -> None:
        """Fork a child for each request until the host closes the socket or dies."""
        buf = b""
        while True:
            sock_fd = self.sock.fileno()
            ready, _, _ = select.select([sock_fd, self.wake_r, *self.watched], [], [],
                                        self.check)
            if self.wake_r in ready:
                self._drain_wakeups()
            self.reap(block=False)
            if os.getppid() != self.host_pid:
                return
            if sock_fd not in ready:
                continue
            try:
                data = self.sock.recv(65536)
            except OSError:
                data = b""
            if not data:
                return
            buf += data
            *lines, buf = buf.split(b"\n")
            for line in lines:
                self._spawn(json.loads(line))

    def _drain_wakeups(self) -> None:
        try:
            while os.read(self.wake_r, 512):
                pass
        except BlockingIOError:
            pass

    def _spawn(self, req: dict[str, Any]) -> None:
        """Fork the IPU process ``req`` asks for and tell the host its pid (or why not)."""
        if time.monotonic() > req.get("deadline", float("inf")):
            self.send({"op": "error", "id": req["id"], "message": "the host gave up waiting"})
            return
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            pid = os.fork()
        except OSError as exc:
            self.send({"op": "error", "id": req["id"], "message": str(exc)})
            return
        if pid == 0:   # the IPU process
            self._become_child(req)
        self.children.add(pid)
        self.send({"op": "spawned", "id": req["id"], "pid": pid})

    def _become_child(self, req: dict[str, Any]) -> NoReturn:
        """In the forked child: drop the template's fds and signals, run the IPU process,
        exit with its code (never returns)."""
        code = 70
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.close(self.wake_r)
            os.close(self.wake_w)
            for fd in self.watched:
                os.close(fd)
            self.sock.close()
            code = _child(req["argv"], req["env"], req.get("log"), req.get("cwd"))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            import traceback
            traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)

    def finish(self) -> None:
        """The host closed us or died: our children watch it themselves; wait for them
        all."""
        self.sock.close()
        while self.children:
            self.reap(block=True)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m ipu_emulator.ipu.forkserver",
                                     description="template process forking IPU processes")
    parser.add_argument("--fd", type=int, required=True, help="socket to the host")
    parser.add_argument("--host-pid", type=int, required=True)
    a = parser.parse_args(argv)
    sock = socket.socket(fileno=a.fd)
    sock.setblocking(True)
    return _serve(sock, a.host_pid)


if __name__ == "__main__":
    sys.exit(main())
