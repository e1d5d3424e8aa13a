"""A tracing session of one host (or daemon) process: start, the IPU buffers, stop, write.

While a session is on, every IPU process this process starts gets a trace buffer
(``shm.tracebuf``) made here (:func:`new_ipu_buffer`, called by the launcher);
the process writes its events there and this process keeps the mapping, so the
events survive the IPU process (a crash loses at most the record being
written). :func:`stop` merges this process's events and every buffer's into one
Chrome trace (``_chrome.merge``) and writes it atomically (a temporary file
renamed over the path). A program that exits, normally or by an exception,
writes its file at exit (``atexit``).
"""

from __future__ import annotations

import atexit
import errno
import json
import logging
import os
import threading
import time
from typing import Any, Callable

from shm.errors import ShmError
from shm.liveness import pid_alive
from shm.tracebuf import TraceBuffer

from ipu_emulator import safe_files
from ipu_emulator.settings import IpuSettings
from ipu_emulator.trace import recorder as rec
from ipu_emulator.trace._chrome import IpuRecords, merge

__all__ = ["start", "stop", "active", "new_ipu_buffer", "snapshot", "start_from_settings"]

_log = logging.getLogger("ipu_emulator.trace")
_lock = threading.RLock()
_path: str | None = None
_role = "host"
_t_start = 0
_capacity = 1 << 16
_buffers: list[TraceBuffer] = []    # IPU processes' buffers this process made
_lent: dict[str, TraceBuffer] = {}  # buffers of a daemon's IPU processes, by name
_atexit = False
_owner = 0                          # pid of the process that started the session


def active() -> bool:
    """Whether this process has a tracing session on."""
    return rec.ON and _owner == os.getpid()


def expand(path: str) -> str:
    """``path`` with ``%p`` replaced by this process's pid (one file per process)."""
    return os.path.abspath(os.path.expanduser(path.replace("%p", str(os.getpid()))))


def start(path: str | None = None, role: str = "host", capacity: int | None = None) -> None:
    """Start recording this process (and the IPU processes it starts from now on).

    ``path``: where :func:`stop` (or the exit) writes the trace (None: only
    :func:`stop`'s return value). ``capacity``: events kept per process (the oldest
    are dropped past it; default the setting ``trace_events``)."""
    global _path, _role, _t_start, _capacity, _atexit, _owner
    with _lock:
        if active():
            raise RuntimeError(f"tracing is already on (writing {_path!r}); stop() it first")
        if rec.buffer() is not None:
            raise RuntimeError("an IPU process records into its host's buffer; it cannot "
                               "start a tracing session of its own")
        _capacity = capacity if capacity is not None else IpuSettings.current().trace_events
        if _capacity < 1:
            raise ValueError(f"capacity must be at least 1 event, got {_capacity}")
        _path = expand(path) if path else None
        _role = role
        _owner = os.getpid()
        _t_start = time.monotonic_ns()
        rec.start_host(_capacity)
        if not _atexit:
            _atexit = True
            atexit.register(_at_exit)
    for announce in list(_announcers):   # (outside the lock: they record events)
        try:
            announce()
        except Exception:   # pragma: no cover - a timeline without their names
            _log.debug("announcing to a new trace failed", exc_info=True)


_announcers: list[Callable[[], None]] = []


def on_start(announce: Callable[[], None]) -> None:
    """Call ``announce()`` whenever tracing starts in this process: what was made before
    it (a runner's replicas) records what names it on the timeline."""
    _announcers.append(announce)


def set_role(role: str) -> None:
    """Name this process's role in the trace (``host``, ``daemon``): ``<role> <pid>``."""
    global _role
    _role = role


def new_ipu_buffer() -> TraceBuffer | None:
    """A trace buffer for an IPU process about to start (None: not tracing). The caller
    passes its name to the process and :meth:`TraceBuffer.unlink` s it once the process
    has attached it (or failed)."""
    if not active():
        return None
    buf = TraceBuffer.create(_capacity)
    with _lock:
        _buffers.append(buf)
    return buf


def map_ipu_buffer(name: str) -> None:
    """Read the trace buffer ``name`` of a daemon's IPU process lent to this host too
    (nothing if not tracing, already mapped, or gone)."""
    if not active() or name in _lent:
        return
    try:
        buf = TraceBuffer.attach(name)
    except (OSError, ValueError, ShmError) as exc:
        _log.debug("cannot map the trace buffer %s: %s", name, exc)
        return
    with _lock:
        _lent[name] = buf


def snapshot() -> dict[str, Any]:
    """The trace so far, as a Chrome trace object (recording goes on)."""
    if not active():
        raise RuntimeError("tracing is not on in this process")
    return _merge(*rec.peek_host(), time.monotonic_ns())


def _ipu_records(buffers: list[TraceBuffer]) -> list[IpuRecords]:
    out = []
    for buf in buffers:
        pid, index = buf.writer()
        if not pid:
            continue   # the process never attached it (it failed to start)
        records, dropped = buf.records()
        out.append(IpuRecords(pid, index, records, dropped))
    return out


def _merge(events: list[tuple[Any, ...]], dropped: int, threads: dict[int, tuple[int, str]],
           t_stop: int) -> dict[str, Any]:
    with _lock:
        buffers = list(_buffers) + list(_lent.values())
    return merge(os.getpid(), _role, events, dropped, threads, _ipu_records(buffers),
                 (_t_start, t_stop))


def stop() -> dict[str, Any]:
    """Stop recording; write the trace to the session's path (if it has one) and return
    it (a Chrome trace object)."""
    global _owner
    with _lock:
        if not active():
            raise RuntimeError("tracing is not on in this process")
        t_stop = time.monotonic_ns()
        events, dropped, threads = rec.stop_host()
        trace = _merge(events, dropped, threads, t_stop)
        _owner = 0
        # forget the buffers of IPU processes that are gone (their events are written)
        for buf in list(_buffers):
            pid, _ = buf.writer()
            if not pid or not pid_alive(pid):
                _buffers.remove(buf)
                buf.unlink()
                buf.close()
        for name, buf in list(_lent.items()):   # the daemon's: never unlinked here
            del _lent[name]
            buf.close()
        if _path:
            write(trace, _path)
        return trace


def write(trace: dict[str, Any], path: str) -> None:
    """Write ``trace`` to ``path`` atomically, never through a link (``safe_files.AtomicFile``:
    a new ``O_EXCL`` temporary file renamed over it). Text is UTF-8, not ``\\uXXXX``
    escapes: Perfetto's JSON reader keeps those as they are (a name's ``·`` would show
    as ``\\u00b7``); what cannot be encoded (a lone surrogate) becomes ``?``."""
    folder = os.path.dirname(path) or "."
    try:
        os.makedirs(folder, exist_ok=True)
    except FileExistsError:   # a file where a folder of the path is: say so
        raise NotADirectoryError(errno.ENOTDIR, "a folder of the trace's path is a file",
                                 folder) from None
    with safe_files.AtomicFile(path) as f:
        f.write(json.dumps(trace, separators=(",", ":"), ensure_ascii=False)
                .encode("utf-8", "replace"))
    _log.info("trace written to %s (%d events)", path, len(trace["traceEvents"]))


def _at_exit() -> None:
    if not active():
        return
    path = _path
    try:
        stop()
    except OSError as exc:   # a folder not writable, a link refused: named, one line
        _log.error("cannot write the trace to %s: %s", path, exc.strerror or exc)
    except Exception:   # pragma: no cover - never fail a program's exit
        _log.exception("writing the trace at exit failed")


def start_from_settings(role: str = "host") -> bool:
    """Start a session if the setting ``trace`` (``IPU_EMULATOR_TRACE=FILE``) names a
    file and none is on; True if one was started. IPU processes never do (they record
    into their host's buffer)."""
    path = IpuSettings.current().trace
    if not path or active() or rec.buffer() is not None:
        return False
    start(path, role=role)
    return True
