"""The recorder of one process: a module-level switch and where events go.

Every hook in the runtime reads :data:`ON` (a module attribute: one look-up) and
does nothing else when it is False: tracing off costs one test per request path
and no call. On, a hook calls :func:`host` (host processes: a tuple appended to a
bounded deque, thread-safe under the GIL, ~0.3 us) or :func:`ipu` (IPU processes:
one 48-byte record written into the process's shared-memory ring,
``shm.tracebuf``, ~1 us; the C step writes its own records there).

Time stamps are ``time.monotonic_ns()`` (CLOCK_MONOTONIC: one clock for every
process of the machine). The runner's request instants are
``time.perf_counter_ns()``, the same clock on Linux; :data:`PERF_OFFSET` converts
them elsewhere.

Event codes (what ``a``, ``b``, ``c`` of an IPU record mean) are the constants
below; ``ipu_emulator.trace._chrome`` turns them into Chrome trace events.
"""

from __future__ import annotations

import collections
import itertools
import os
import threading
import time
from typing import Any, Callable

from shm.tracebuf import TraceBuffer

__all__ = ["ON", "host", "ipu", "instant"]

ON = False
"""Whether this process records (read by every hook)."""


def _perf_offset() -> int:
    """monotonic - perf_counter: 0 where both are one clock (Linux: CLOCK_MONOTONIC), as
    the clocks say of themselves; elsewhere the tightest of a few paired reads (a single
    pair read on a busy machine can be a preemption apart)."""
    if time.get_clock_info("perf_counter").implementation == \
            time.get_clock_info("monotonic").implementation:
        return 0
    best: tuple[int, int] | None = None
    for _ in range(16):
        a = time.monotonic_ns()
        p = time.perf_counter_ns()
        b = time.monotonic_ns()
        if best is None or b - a < best[0]:
            best = (b - a, (a + b) // 2 - p)
    assert best is not None
    return best[1]


PERF_OFFSET = _perf_offset()
"""monotonic - perf_counter (0 on Linux, where both are CLOCK_MONOTONIC)."""

# -- host events: (code, thread ident, ts, dur, payload) --------------------------------
H_REQUEST = 1    # payload: RequestEvent fields (see _chrome.host_request)
H_LIFE = 2       # payload: (what, replica, pids, model)
H_WAIT = 3       # payload: (what,)
H_INSTANT = 4    # payload: (name, args)
H_FAILED = 5     # payload: (key, replica, request id, samples, error class name)

# -- IPU records (shm.tracebuf): a, b, c by code ---------------------------------------
I_OP = 10        # a control message served: a = ipu_protocol.Op value, b = message seq
I_PROGRAM = 11   # a program run: a = program index, b = PROGRAM_KINDS index, c = runs
I_STEP = 12      # a Main iteration in one C step: a = seq, b/c = ns from ts to inputs
                 # taken / compute done (written by _stepcore.c)
I_IN = 13        # an input transfer taken (copied): a = seq, b = stream index, c = 1: link
I_COMPUTE = 14   # an Execute (onnxruntime): a = graph index
I_OUT = 15       # an output transfer published: a = seq, b = stream index, c = 1: link
I_WAIT = 16      # a wait for an input transfer: a = stream index, b = 1: polled only
I_INSTANT = 17   # a named instant: its name in a, b, c (24 bytes of UTF-8)

PROGRAM_KINDS = ("program", "Load", "Main", "Save")

_events: collections.deque[tuple[Any, ...]] = collections.deque(maxlen=1)
_life: collections.deque[tuple[Any, ...]] = collections.deque(maxlen=4096)
"""H_LIFE events, kept apart: rare, and what a request's model and IPUs are found by."""
_appended = itertools.count()   # host events appended since start (dropped: the rest)
_threads: dict[int, tuple[int, str]] = {}    # thread ident -> (native id, name)
_buffer: TraceBuffer | None = None           # this IPU process's ring (None: a host)
_lock = threading.Lock()


def _append_host(code: int, ts: int, dur: int, payload: Any) -> None:
    ident = threading.get_ident()
    if ident not in _threads:
        t = threading.current_thread()
        _threads[ident] = (threading.get_native_id(), t.name)
    if code == H_LIFE:
        _life.append((code, ident, ts, dur, payload))
        return
    _events.append((code, ident, ts, dur, payload))
    next(_appended)


def _ipu_to_host(code: int, ts: int, dur: int, a: int = 0, b: int = 0, c: int = 0) -> None:
    """An IPU hook running in a host (a loopback device's thread): a host event."""
    _append_host(code, ts, dur, (a, b, c))


def _noop(*args: Any) -> None:
    pass


host: Callable[[int, int, int, Any], None] = _noop
"""``host(code, ts, dur, payload)``: record a host event (when ON)."""
ipu: Callable[..., None] = _noop
"""``ipu(code, ts, dur, a=0, b=0, c=0)``: record an IPU event (when ON)."""


def start_host(capacity: int) -> None:
    """Record this process's events as a host's, in a deque of ``capacity``."""
    global ON, host, ipu, _events, _appended
    with _lock:
        _events = collections.deque(maxlen=max(1, capacity))
        _life.clear()
        _appended = itertools.count()
        host = _append_host
        ipu = _ipu_to_host
        ON = True


def stop_host() -> tuple[list[tuple[Any, ...]], int, dict[int, tuple[int, str]]]:
    """Stop recording; (events, how many were dropped, thread names)."""
    global ON, host, ipu
    with _lock:
        ON = False
        host = ipu = _noop
        events = list(_life) + list(_events)
        dropped = max(0, next(_appended) - len(_events))
        _events.clear()
        _life.clear()
        return events, dropped, dict(_threads)


def peek_host() -> tuple[list[tuple[Any, ...]], int, dict[int, tuple[int, str]]]:
    """What stop_host returns, recording on."""
    with _lock:
        events = list(_life) + list(_events)
        dropped = max(0, next(_appended) - 1 - len(_events))
        return events, dropped, dict(_threads)


def _off_in_child() -> None:
    """A process forked from a recording one records nothing (its parent's session)."""
    global ON, host, ipu
    if _buffer is None:
        ON = False
        host = ipu = _noop


os.register_at_fork(after_in_child=_off_in_child)


def start_ipu(name: str, ipu_index: int) -> TraceBuffer:
    """This IPU process records into the trace buffer ``name`` its host made."""
    global ON, ipu, host, _buffer
    buf = TraceBuffer.attach(name)
    buf.set_writer(os.getpid(), ipu_index)
    _buffer = buf
    ipu = buf.write
    host = _noop
    ON = True
    return buf


def buffer() -> TraceBuffer | None:
    """This IPU process's trace buffer (None in a host, or not tracing)."""
    return _buffer


def pack_name(name: str) -> tuple[int, int, int]:
    """An instant's name as the three integers of an IPU record (24 bytes of UTF-8)."""
    raw = name.encode("utf-8")[:24].ljust(24, b"\0")
    return (int.from_bytes(raw[0:8], "little", signed=True),
            int.from_bytes(raw[8:16], "little", signed=True),
            int.from_bytes(raw[16:24], "little", signed=True))


def unpack_name(a: int, b: int, c: int) -> str:
    raw = b"".join(v.to_bytes(8, "little", signed=True) for v in (a, b, c))
    return raw.rstrip(b"\0").decode("utf-8", "replace")


def instant(name: str, **args: Any) -> None:
    """A named instant on this process's timeline (e.g. an injected fault): in a host
    with its arguments, in an IPU process with its name only. Nothing when not tracing."""
    if not ON:
        return
    ts = time.monotonic_ns()
    if _buffer is not None:
        _buffer.write(I_INSTANT, ts, 0, *pack_name(name))
    else:
        _append_host(H_INSTANT, ts, 0, (name, dict(args)))
