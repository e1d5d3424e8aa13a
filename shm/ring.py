"""SPSC rings of fixed-size slots in shared memory, between two processes.

Layout of the ring's region (all words little-endian int64, ``q``)::

    offset  word  field        written by     meaning
    ------  ----  -----------  -------------  ------------------------------------
       0      0   magic        creator        b"IPUEMURG"
       8      1   version      creator        layout version (1)
      16      2   slot_size    creator        payload bytes per slot
      24      3   num_slots    creator        ring depth
      32      4   slot_stride  creator        bytes from one slot to the next
      40      5   invalid      anyone         0 = valid; else pid that invalidated
      48      6   generation   reset()        bumped by every reset
      56      7   creator_pid  creator
    ---- producer cache line -----------------------------------------------------
      64      8   published    producer       messages published so far
      72      9   held         producer       1 while a slot is acquired, unpublished
      80     10   producer_pid producer       last process that acquired for writing
    ---- consumer cache line -----------------------------------------------------
     128     16   acquired     consumer       messages acquired for reading so far
     136     17   released     consumer       messages released so far
     144     18   consumer_pid consumer       last process that acquired for reading
     152     19   read_tag     consumer       tag of the last message acquired (see
                                          last_read_tag(): was a message consumed?)
     192     24   user         either end     a word the ring never reads (a hint
                                          between the ends: user_word())
     200     25   doorbell     consumer       pid << 8 | signal: a publish also sends
                                          that signal (0: none; set_doorbell())
     208..255     reserved
    ---- slots: slot i at HEADER_SIZE + i * slot_stride ------------------------
      +0          seq          producer       message number (published + 1)
      +8          nbytes       producer       bytes of payload that are valid
     +16          tag          producer       the caller's int64 tag (what it means is
                                          the caller's: a kind and a sequence number
                                          for ipu_emulator.ipu_protocol's streams)
     +24..63      reserved
     +64          payload      producer       slot_size bytes (stride is 64-aligned)

Message k (counting from 0) lives in slot ``k % num_slots``. Two named POSIX
semaphores do all the blocking: ``<name>.free`` counts slots the producer may
fill (starts at ``num_slots``), ``<name>.full`` counts published slots the
consumer may read (starts at 0).

Why the ordering of stores is safe between processes. The producer writes the
payload, then the slot header (seq, nbytes, tag), then ``published``, and only
then posts ``full``; the consumer waits on ``full`` before it reads the slot
header and the payload. ``sem_post`` and ``sem_wait`` are atomic
read-modify-writes on the semaphore word (full memory barriers on x86 and
release/acquire in glibc everywhere), so every store the producer made before
its post is visible to the consumer after its wait. The same holds in the
other direction for ``release()`` (consumer done with the slot, posts
``free``) and the producer's next write into it. A producer killed mid-write
never posts, so its half-written slot is never read; the consumer also checks
that the slot's ``seq`` is the one it expects, which catches any protocol
violation (two producers, a reset under a live peer) instead of returning
stale bytes.

Interrupts: an exception a signal handler raises may end a call anywhere. A
token a wait took is never lost with it: the C core checks for a pending
signal after its wait and gives the token back before it raises; a token that
leaves a C call (the Python path's waits, with the C core or without) is
banked in the same C call that takes it and used up in the same step as the
ring's counter moves, so an exception raised after the call returns (a signal
handler's, an asynchronous one) leaves it to the next call, which uses it
before it waits. ``last_read_tag()`` says whether an interrupted read consumed its
message.

``invalidate()`` stores ``invalid`` and then posts both semaphores once, so a
waiter on either side wakes at once, sees the flag and raises
:class:`RingInvalidatedError`; every later call raises it too until
``reset()``.

Waiting: a wait sleeps until the earliest of its deadline (none for
``timeout=None``) and its token, never in slices. Whatever must end it early
posts the semaphore it sleeps on: the peer's token, ``invalidate()`` (either
process), ``close()`` and :meth:`Ring.interrupt` (another thread of this
process: it posts one token per thread blocked on this end, and each takes
its one back, so the semaphores still count slots). A process's death posts
nothing: a wait on a ring with ``set_peer`` checks the peer every
``PEER_CHECK`` seconds (a pidfd poll). A process that watches its peer with a
thread blocked on the peer's pidfd (the IPU process) sets no peer; the thread
calls :func:`interrupt_all`, and nothing wakes its waits in vain.

Closing: ``close()`` stops this process using the ring at once (a thread of
this process blocked in a wait wakes at once and raises
:class:`ShmClosedError`). The semaphores are ``sem_close``d only when the Ring
object is garbage-collected: a thread inside a wait holds a reference to the
Ring, so a semaphore is never unmapped under a waiter (that would crash), and
the hot path needs no bookkeeping of who holds it. For the same reason the
finalizer is not run at interpreter exit (``weakref.finalize`` would by
default, from an exit hook that runs before earlier-registered ones): exit
hooks and daemon threads may still use the ring, and exit frees the mappings.

Fork: a ring's ends are processes. A process forked from one end inherits the
Ring objects but is neither end: its calls would take the creator's slots and
answers. So in the child every Ring made before the fork is disowned at once
(``os.register_at_fork``): every call raises :class:`ShmForkedError` (a
ShmClosedError naming both pids), the C core hands everything to the Python
path, ``invalidate()``/``reset()`` refuse, and ``unlink()`` does nothing (the
names are the creator's). Only the child's own copy of the mapping goes when
the object does.

Hot paths in C: ``shm/_ringcore.c`` (built by setup.py when a compiler is
there) provides write, read, acquire_write, try_acquire_write, publish,
acquire_read, try_acquire_read, release, readable and writable with the same
layout, semaphores and ordering as above; they are set on each Ring instance
(bound methods of its Core, so a call is one C call: a class-level choice
would need the Core to be the Ring itself, tying the mapping's lifetime to the
Ring's instead of to the calls in flight). They act once the process has taken
its role through the Python path, and hand over to the Python path
(``_c_<method>``) at a point it can finish from, so both paths can serve one
ring, even one end each. A wait without deadline is an untimed ``sem_wait``
(no kernel timer to arm: ~0.25 us per side of a round trip); see the C file.
``IPU_EMULATOR_RING_C=0`` turns the core off. The 64-byte round trip of
``python -m tools.bench ring`` takes 2.6 us with it (about a bare semaphore
ping-pong) and 6.2-6.4 us without.

Other C extensions use a ring through :meth:`Ring.c_handle` and the C API
declared in ``shm/_ringcore.h`` (take, give back, consume and publish slots
without waiting); e.g. the IPU process's ``ipu_emulator.ipu._stepcore``.

Spinning: by default a waiter does not spin. ``python -m tools.bench ring``
on this project's 2-core VMs: the two processes of a ping-pong usually share
one vCPU, and a spin there only delays the peer (64-byte round trip 11.7 us
with a 20 us adaptive spin against 7.8 us without); when they land on two
vCPUs a spin wins (4.1 us). ``ring_spin_us`` (``shm.settings``, taken when the ring is made)
sets a spin budget that then adapts (doubles on success, halves on failure);
the loop is ``shm.spin.spin_until``, mirrored by ``spin`` in the C core.
"""

from __future__ import annotations

import collections
import logging
import operator
import os
import struct
import threading
import time
import weakref
from typing import Any

import posix_ipc

from .errors import (PeerDiedError, RingInvalidatedError, RingTimeoutError, ShmClosedError,
                     ShmError, ShmForkedError, WaitInterrupted, WouldBlock)
from .liveness import PeerWatch, notify_on_exit
from .region import Region
from .settings import ShmSettings
from .spin import spin_until, us_to_ns
from . import _registry, limits, naming

try:
    import shm._ringcore as _ringcore
except ImportError:  # built without the C extension: the pure-Python path does it all
    _ringcore = None

__all__ = ["Ring", "PEER_CHECK", "interrupt_all", "resume_all"]

_log = logging.getLogger(__name__)

# -- layout -------------------------------------------------------------------

MAGIC = int.from_bytes(b"IPUEMURG", "little", signed=True)
VERSION = 1
HEADER_SIZE = 256
SLOT_HEADER_SIZE = 64
_ALIGN = 64

# Header: 32 int64 words (see the drawing above).
HEADER = struct.Struct("<8q 8q 8q 8q")
SLOT_HEADER = struct.Struct("<3q 5q")
assert HEADER.size == HEADER_SIZE and SLOT_HEADER.size == SLOT_HEADER_SIZE

# Word indices in the region viewed as int64.
_MAGIC, _VERSION, _SLOT_SIZE, _NUM_SLOTS, _STRIDE, _INVALID, _GEN, _CREATOR = range(8)
_PUBLISHED, _HELD, _PRODUCER_PID = 8, 9, 10
_ACQUIRED, _RELEASED, _CONSUMER_PID, _READ_TAG = 16, 17, 18, 19
_USER = 24
_DOORBELL = 25
# Within a slot header, relative to the slot's first word.
_SEQ, _NBYTES, _TAG = 0, 1, 2

PEER_CHECK = 0.05
"""Seconds between checks of the peer process (after ``set_peer``) during a wait: a
process's death posts no semaphore. Waits without a peer are never cut."""

_CLOSE_WAKE_TIMEOUT = 5.0
"""Seconds close() waits for the threads it woke to leave their waits (they are awake)."""

_SPIN_MIN_NS = 2000
"""Floor of an adapting spin budget (the ring's ``ring_spin_us`` if lower); see Ring._spin."""

_MAX_SLOTS = 1 << 20
# Return codes of the C core (see shm/_ringcore.c).
_GENERAL, _NO_TOKEN, _TOKEN = -1, -2, -3
_C_METHODS = ("write", "acquire_write", "try_acquire_write", "publish", "acquire_read",
              "try_acquire_read", "release", "read", "readable", "writable")
_consume: Any = collections.deque(maxlen=0).extend
"""Runs an iterator to its end in C (see Ring._acquire_token)."""
_FREE_SUFFIX, _FULL_SUFFIX = naming.RING_SEMAPHORES


class _ClosedWords:
    """Stands in for the header view after close() (or in a forked child): any access
    raises the ring's closed error."""

    __slots__ = ("_name", "_forked_from")

    def __init__(self, name: str, forked_from: int) -> None:
        self._name = name
        self._forked_from = forked_from

    def __getitem__(self, index: int) -> int:
        raise _closed_error(self._name, self._forked_from)

    def __setitem__(self, index: int, value: int) -> None:
        raise _closed_error(self._name, self._forked_from)


def _closed_error(name: str, forked_from: int) -> ShmClosedError:
    """ShmClosedError, or ShmForkedError in a fork of ``forked_from`` (the ring's maker)."""
    if forked_from:
        return ShmForkedError(
            f"ring {name} belongs to process {forked_from}; this process ({os.getpid()}) is "
            "a fork of it and may not use the ring", forked_from)
    return ShmClosedError(f"ring {name} is closed in this process")


# Every Ring of this process, for the fork hook below.
_live: "weakref.WeakSet[Ring]" = weakref.WeakSet()


def _disown_after_fork() -> None:
    """In a forked child: no Ring made before the fork may be used here (see above)."""
    for ring in list(_live):
        ring._disown()


os.register_at_fork(after_in_child=_disown_after_fork)

_all_interrupted = False


def interrupt_all() -> None:
    """:meth:`Ring.interrupt` every Ring of this process, and those made later, until
    :func:`resume_all`: for a thread that learns that the process must stop waiting
    (e.g. it saw the peer die, by a pidfd) while the main thread may be blocked on any
    ring."""
    global _all_interrupted
    _all_interrupted = True
    for ring in _live_rings():
        if not ring.closed:
            ring.interrupt()


def resume_all() -> None:
    """Undo :func:`interrupt_all`: waits on every Ring of this process block again."""
    global _all_interrupted
    _all_interrupted = False
    for ring in _live_rings():
        if not ring.closed:
            ring.resume()


def _live_rings() -> "list[Ring]":
    """A copy of ``_live`` that another thread making or dropping rings cannot break."""
    while True:
        try:
            return list(_live)
        except RuntimeError:   # the set changed size during the copy: copy again
            continue


def _stride(slot_size: int) -> int:
    return SLOT_HEADER_SIZE + (slot_size + _ALIGN - 1) // _ALIGN * _ALIGN


class Ring:
    """One producer process, one consumer process, ``num_slots`` slots of ``slot_size`` bytes.

    Use :meth:`create` (owner) or :meth:`attach`. Either end may be the owner.
    A process uses a ring as producer or as consumer (or both, in tests).
    """

    def __init__(self, region: Region, free: posix_ipc.Semaphore, full: posix_ipc.Semaphore,
                 owner: bool, settings: ShmSettings | None = None) -> None:
        s = settings if settings is not None else ShmSettings.current()
        self._region = region
        self._name = region.name
        self._free = free
        self._full = full
        self._owner = owner
        self._words: memoryview | None = region.buf.cast("q")
        self._w: memoryview | _ClosedWords = self._words
        w = self._words
        self._slot_size: int = w[_SLOT_SIZE]
        self._num_slots: int = w[_NUM_SLOTS]
        stride = w[_STRIDE]
        self._stride = stride
        buf = region.buf
        # Precomputed per slot: first int64 word of its header, its payload view.
        # The payload views never leave this object (callers get slices of
        # them, which they may release() without harm).
        self._slot_word = [(HEADER_SIZE + i * stride) // 8 for i in range(self._num_slots)]
        self._payload = [buf[HEADER_SIZE + i * stride + SLOT_HEADER_SIZE:
                             HEADER_SIZE + i * stride + SLOT_HEADER_SIZE + self._slot_size]
                         for i in range(self._num_slots)]
        # longest spin before blocking (0 disables spinning) and its floor; see _spin
        self._spin_max_ns = self._spin_ns = spin_max = us_to_ns(s.ring_spin_us)
        self._spin_min_ns = spin_min = min(_SPIN_MIN_NS, spin_max)
        # Tokens the Python path took from a semaphore (itself, or through the C core's
        # wait_token/try_token and hand-overs) and has not used yet (see _acquire_token):
        # one is left when an exception interrupts a call between its wait and its use of
        # the slot, and the next call uses it instead of waiting. The C core holds these
        # lists: never rebind them.
        self._spare_full: list[None] = []
        self._spare_free: list[None] = []
        # The C core's methods shadow the hot methods on this instance (see the
        # module docstring); None: the Python path does everything.
        self._core: Any = None
        if _ringcore is not None and s.ring_c:
            core = self._core = _ringcore.Core(
                self, buf, self._payload, self._name + _FREE_SUFFIX, self._name + _FULL_SUFFIX,
                self._slot_size, self._num_slots, stride, spin_max, spin_min,
                self._spare_free, self._spare_full)
            for method in _C_METHODS:
                setattr(self, method, getattr(core, method))
        self._peer: PeerWatch | None = None
        # a thread of shm.liveness tells this ring that its peer exited (see set_peer)
        self._peer_thread = s.ring_peer_thread
        # interrupt(): this process's waits raise WaitInterrupted until resume(). The
        # pure-Python path's bookkeeping of it (the C core keeps its own): threads
        # blocked on [free, full] now, tokens interrupt() posted not yet taken back
        self._interrupted = False
        self._peer_gone = False          # the peer's exit was notified (see set_peer)
        self._peer_notified = False      # ... and will be: waits need no peer check
        self._unnotify: Any = None
        self._wlock = threading.Condition(threading.Lock())   # notified as a wait ends
        self._blocked = [0, 0]
        self._pending = [0, 0]
        self._pid = os.getpid()
        self._is_producer = False
        self._is_consumer = False
        self._closed = False
        self._forked_from = 0   # the creator's pid once disowned in a forked child
        self._unlinked = False
        _live.add(self)
        if _all_interrupted:
            self.interrupt()
        # Never at interpreter exit (weakref.finalize's default): its exit hook runs before
        # hooks registered earlier (atexit is LIFO), e.g. one that shuts devices down, while
        # a daemon thread may still wait on these semaphores; sem_close unmaps them and
        # the waiter segfaults when its wait slice ends. Process exit frees them anyway.
        weakref.finalize(self, _close_semaphores, free, full).atexit = False

    def c_handle(self) -> Any | None:
        """This process's end of the ring for C extensions, or None without the C core.

        An opaque object (the C core of this ``Ring``; None when ``shm._ringcore`` is
        not built or the ring was made with ``ring_c`` off). A C extension turns it into a
        ``ShmRingEnd *`` with the C API declared in ``shm/_ringcore.h`` (capsule
        ``shm._ringcore._C_API``) and holds a reference to it while it uses the end:
        the handle keeps the ring's mapping and semaphores alive. The C API never
        waits: it acts on an end whose role this process has taken through the Python
        methods (a first read or write) and that is open and valid, and otherwise does
        nothing, for the caller to use the Python methods.
        """
        return self._core

    # -- construction -------------------------------------------------------

    @classmethod
    def create(cls, slot_size: int, num_slots: int, kind: str = "ring",
               prefault: bool = True, settings: ShmSettings | None = None,
               sparse: bool = False) -> "Ring":
        """Create a ring (region + two semaphores), owned by this process; ``settings``:
        the knobs it takes (default: ``ShmSettings.current()``). ``sparse``: only its
        header is backed in /dev/shm (``shm.region``); :meth:`back` before the first
        write to a slot."""
        settings = settings if settings is not None else ShmSettings.current()
        if not isinstance(slot_size, int) or isinstance(slot_size, bool) or slot_size <= 0:
            raise ValueError(f"slot_size must be a positive int of bytes, got {slot_size!r}")
        if (not isinstance(num_slots, int) or isinstance(num_slots, bool)
                or not 1 <= num_slots <= _MAX_SLOTS):
            raise ValueError(f"num_slots must be an int in 1..{_MAX_SLOTS}, got {num_slots!r}")
        stride = _stride(slot_size)
        region = Region.create(HEADER_SIZE + num_slots * stride, kind=kind, prefault=prefault,
                               backed=HEADER_SIZE if sparse else None)
        name = region.name
        made: list[str] = []
        try:
            w = region.buf.cast("q")
            w[_MAGIC], w[_VERSION] = MAGIC, VERSION
            w[_SLOT_SIZE], w[_NUM_SLOTS], w[_STRIDE] = slot_size, num_slots, stride
            w[_CREATOR] = os.getpid()
            w.release()
            with limits.named_errors(f"creating the semaphores of ring {name}"):
                free = posix_ipc.Semaphore(name + _FREE_SUFFIX, posix_ipc.O_CREX, mode=0o600,
                                           initial_value=num_slots)
                _registry.register(name + _FREE_SUFFIX, "sem")
                made.append(name + _FREE_SUFFIX)
                full = posix_ipc.Semaphore(name + _FULL_SUFFIX, posix_ipc.O_CREX, mode=0o600,
                                           initial_value=0)
                _registry.register(name + _FULL_SUFFIX, "sem")
                made.append(name + _FULL_SUFFIX)
        except BaseException:
            for sem_name in made:
                _registry.unlink_name(sem_name, "sem")
            region.close()
            region.unlink()
            raise
        _log.debug("created ring %s: %d slots x %d bytes", name, num_slots, slot_size)
        return cls(region, free, full, owner=True, settings=settings)

    def back(self) -> None:
        """Allocate the pages of a ring made ``sparse`` (``ShmFullError`` if /dev/shm
        cannot hold them); nothing for one made whole."""
        self._region.back()

    @classmethod
    def attach(cls, name: str, prefault: bool = True,
               settings: ShmSettings | None = None) -> "Ring":
        """Open the ring ``name`` made by another process (or this one)."""
        settings = settings if settings is not None else ShmSettings.current()
        region = Region.attach(name, prefault=prefault)
        try:
            w = region.buf.cast("q")
            try:
                magic, version = w[_MAGIC], w[_VERSION]
                slot_size, num_slots, stride = w[_SLOT_SIZE], w[_NUM_SLOTS], w[_STRIDE]
            finally:
                w.release()
            if magic != MAGIC or version != VERSION:
                raise ShmError(f"{name} is not a ring of layout version {VERSION}: "
                               f"magic {magic:#x} version {version}")
            need = HEADER_SIZE + num_slots * stride
            if (slot_size <= 0 or not 1 <= num_slots <= _MAX_SLOTS
                    or stride != _stride(slot_size) or need > region.size):
                raise ShmError(f"ring {name} has an inconsistent header: slot_size {slot_size}, "
                               f"num_slots {num_slots}, stride {stride}, region {region.size} B")
            try:
                with limits.named_errors(f"opening the semaphores of ring {name}"):
                    free = posix_ipc.Semaphore(name + _FREE_SUFFIX)
                    full = posix_ipc.Semaphore(name + _FULL_SUFFIX)
            except posix_ipc.ExistentialError as exc:
                raise ShmError(f"ring {name}: its semaphores are gone ({exc})") from exc
        except BaseException:
            region.close()
            raise
        return cls(region, free, full, owner=False, settings=settings)

    # -- properties ---------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def slot_size(self) -> int:
        return self._slot_size

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def owner(self) -> bool:
        return self._owner

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def peer_pid(self) -> int | None:
        return None if self._peer is None else self._peer.pid

    def set_peer(self, pid: int | None) -> None:
        """Waits fail with PeerDiedError once process ``pid`` is gone (None: stop watching).

        A death posts no semaphore: a thread of ``shm.liveness`` blocked on the peer's
        pidfd (:func:`shm.liveness.notify_on_exit`) wakes this process's waiters when
        it exits, so their waits need no periodic wake. With
        ``IPU_EMULATOR_RING_PEER_THREAD=0`` (or without pidfds) a wait checks the peer
        every ``PEER_CHECK`` seconds instead."""
        peer = None if pid is None else PeerWatch(pid)
        if self._unnotify is not None:
            self._unnotify()
            self._unnotify = None
        self._peer = peer
        self._peer_notified = False
        if self._peer_gone:
            self._peer_gone = False
            if self._core is not None and not self._interrupted:
                self._core.resume()
        if peer is not None and self._peer_thread and peer.alive():
            ref = weakref.ref(self)
            self._unnotify = notify_on_exit(peer.pid, lambda: _peer_exited(ref, peer))
            self._peer_notified = self._unnotify is not None
        if self._core is not None:
            self._core.check_s = 0.0 if peer is None or self._peer_notified else PEER_CHECK

    def _wake_for_peer(self, peer: PeerWatch) -> None:
        """The peer exited (a notification): wake this process's waiters, which then
        raise PeerDiedError, and make later waits see it at once."""
        if peer is not self._peer:
            return   # set_peer changed it meanwhile
        with self._wlock:
            self._peer_gone = True
            self._wake_blocked()
        if self._core is not None:
            self._core.interrupt()

    def interrupt(self) -> None:
        """Wake every thread of this process blocked on this ring (either end); until
        :meth:`resume`, every wait of this process on it raises
        :class:`WaitInterrupted` (its checks of close, invalidation and the peer first).

        Thread-safe, for another thread of this process (the peer process is woken by
        :meth:`invalidate`). It posts a token for each blocked thread, which that
        thread takes back, so the semaphores count what they counted."""
        with self._wlock:
            self._interrupted = True
            self._wake_blocked()
        if self._core is not None:
            self._core.interrupt()

    def _wake_blocked(self) -> None:
        """Post a token for each thread of this process blocked in a Python-path wait
        (``_take``), counted as pending so that the woken thread takes it back. Under
        ``_wlock``; the C core's waiters are woken by ``Core.interrupt``."""
        for i, sem in enumerate((self._free, self._full)):
            for _ in range(self._blocked[i]):
                self._pending[i] += 1
                sem.release()

    def resume(self) -> None:
        """Waits block again after :meth:`interrupt`."""
        with self._wlock:
            self._interrupted = False
        if self._core is not None and not self._peer_gone:
            self._core.resume()

    # -- waiting ------------------------------------------------------------
    #
    # The Python path (the C core's methods shadow it once a role is taken, see
    # the module docstring). A wait (_wait, _wait_slow) loops: check the invalid
    # word and close (after close() the words are a stand-in that raises
    # ShmClosedError), interrupt() and the peer; then one wait for a token until
    # the deadline (none for timeout None), cut at PEER_CHECK only when a peer is
    # watched. Whatever ends it early posts the semaphore: a token, invalidate(),
    # interrupt() or close().

    def _closed_error(self) -> ShmClosedError:
        return _closed_error(self._name, self._forked_from)

    def _raise_if_unusable(self) -> None:
        if self._closed:
            raise self._closed_error()
        who = self._w[_INVALID]
        if who:
            raise RingInvalidatedError(
                f"ring {self._name} was invalidated by process {who}; reset() it to reuse")

    def _check_peer(self, what: str) -> None:
        peer = self._peer
        if peer is not None:
            reason = peer.dead_reason()
            if reason is not None:
                raise PeerDiedError(
                    f"ring {self._name}: peer process {peer.pid} {reason} "
                    f"while this process waited for {what}", peer.pid)

    def _spin(self, sem: posix_ipc.Semaphore) -> None:
        """Poll ``sem`` for up to the current spin budget; adapt the budget.

        A token that arrives while spinning saves the poster a futex wake and
        this process a sleep and a wake-up. A spin that runs out wasted its
        budget: halve it, down to a floor of _spin_min_ns (cheap next to a
        wake-up, and enough to notice when spinning starts to pay again).
        """
        budget = self._spin_ns
        if spin_until(lambda: sem.value, budget, yield_cpu=False):
            if budget < self._spin_max_ns:
                self._spin_ns = min(budget * 2, self._spin_max_ns)
        else:
            self._spin_ns = max(budget // 2, self._spin_min_ns)

    def _wait_slow(self, sem: posix_ipc.Semaphore, timeout: float | None, what: str,
                   waited: float) -> None:
        """Take a token of ``sem`` within ``timeout`` s (None: no deadline), of which
        ``waited`` s are spent already (by the C core's first wait)."""
        try:
            deadline = None if timeout is None else time.monotonic() - waited + timeout
            peer_check = PEER_CHECK
            tried = False
            while True:
                self._raise_if_unusable()
                self._check_peer(what)
                if self._peer_gone and self._peer is not None:   # notified: it is gone
                    raise PeerDiedError(
                        f"ring {self._name}: peer process {self._peer.pid} exited "
                        f"while this process waited for {what}", self._peer.pid)
                if self._interrupted:
                    raise WaitInterrupted(f"ring {self._name}: the wait for {what} was "
                                          "interrupted (Ring.interrupt) in this process")
                if deadline is None:
                    wait: float | None = None
                else:
                    wait = deadline - time.monotonic()
                    if wait <= 0:
                        if tried:
                            raise RingTimeoutError(f"ring {self._name}: no {what} within "
                                                   f"{timeout:g} s ({self._occupancy()})")
                        wait = 0.0
                tried = True
                if (self._peer is not None and not self._peer_notified
                        and (wait is None or wait > peer_check)):
                    wait = peer_check
                if self._take(sem, wait):
                    return
        except ShmError as exc:  # may be raised in an except clause: hide its context
            exc.__suppress_context__ = True
            raise

    def _take(self, sem: posix_ipc.Semaphore, wait: float | None) -> bool:
        """One wait of up to ``wait`` s (None: no deadline; 0: none) for a token of
        ``sem``, banked in the spare list (see _acquire_token); False if none came (time
        up, interrupted, or a signal: a handler that raises propagates)."""
        core = self._core
        if core is not None:
            return bool(core.wait_token(sem is self._full, wait))
        i = int(sem is self._full)
        with self._wlock:
            if self._interrupted or self._peer_gone:
                return False
            self._blocked[i] += 1
        got = False
        try:
            self._acquire_token(sem, wait)   # banked in the spare list (see there)
            got = True
        except (posix_ipc.BusyError, posix_ipc.SignalError):
            pass
        finally:
            with self._wlock:
                self._blocked[i] -= 1
                if got and self._pending[i]:   # a token interrupt() posted (see interrupt)
                    self._pending[i] -= 1
                    (self._spare_full if i else self._spare_free).pop()
                    got = False
                # interrupt() posted a token for each thread blocked then; one that left
                # without it (timed out as it came) would leave it in the semaphore, which
                # the peer shares: take back those no blocked thread is left to take
                while self._pending[i] > self._blocked[i]:
                    try:
                        sem.acquire(0)
                    except posix_ipc.BusyError:
                        break
                    self._pending[i] -= 1
                self._wlock.notify_all()
        return got

    def _try_token(self, sem: posix_ipc.Semaphore) -> bool:
        """Take a token of ``sem`` now if there is one (never one interrupt() posted),
        banked in the spare list (see _acquire_token)."""
        core = self._core
        if core is not None:
            return bool(core.try_token(sem is self._full))
        i = int(sem is self._full)
        while True:
            try:
                self._acquire_token(sem, 0)   # banked in the spare list (see there)
            except posix_ipc.BusyError:
                return False
            if not self._pending[i]:
                return True
            with self._wlock:
                if not self._pending[i]:
                    return True
                self._pending[i] -= 1
                (self._spare_full if i else self._spare_free).pop()

    def _acquire_token(self, sem: posix_ipc.Semaphore, timeout: float | None) -> None:
        """``sem.acquire(timeout)`` (the path without the C core); the token is banked in
        ``_spare_full``/``_spare_free`` within the same C call (``_consume`` of a ``map``),
        so that an exception raised as the wait returns (a signal handler's, checked at
        the end of each call) cannot lose it. Whoever uses the slot takes it from the bank
        in the same step (no call between) as it moves the ring's counter. The C core banks
        the tokens it takes for the Python path in the same lists (``wait_token``,
        ``try_token``, and a token handed over with code ``TOKEN``), and its fast paths
        leave a call to the Python path while a token is banked."""
        spare = self._spare_full if sem is self._full else self._spare_free
        _consume(map(spare.append, map(operator.call, (sem.acquire,), (timeout,))))

    def _wait(self, sem: posix_ipc.Semaphore, timeout: float | None, what: str) -> None:
        """Take one token of ``sem`` (the Python path's wait)."""
        if self._w[_INVALID]:
            self._raise_if_unusable()
        if (self._spare_full if sem is self._full else self._spare_free):
            return    # one taken by a call an exception interrupted before it used it
        if self._spin_ns and not sem.value:
            self._spin(sem)
        if not self._try_token(sem):
            self._wait_slow(sem, timeout, what, 0.0)
        if self._w[_INVALID]:
            self._raise_if_unusable()

    def _try(self, sem: posix_ipc.Semaphore, what: str) -> None:
        if self._w[_INVALID]:
            self._raise_if_unusable()
        if (self._spare_full if sem is self._full else self._spare_free):
            return    # one taken by a call an exception interrupted before it used it
        if not self._try_token(sem):
            raise WouldBlock(f"ring {self._name}: no {what} ({self._occupancy()})")
        if self._w[_INVALID]:
            self._raise_if_unusable()

    def _occupancy(self) -> str:
        w = self._w
        return (f"{w[_PUBLISHED] - w[_RELEASED]}/{self._num_slots} slots in use, "
                f"{w[_PUBLISHED] - w[_ACQUIRED]} readable")

    # -- producer -----------------------------------------------------------

    def acquire_write(self, timeout: float | None = None) -> memoryview:
        """Wait for a free slot and return its payload view (``slot_size`` bytes).

        Calling it again before :meth:`publish` returns the same slot.
        """
        w = self._w
        if w[_INVALID]:
            self._raise_if_unusable()
        if not w[_HELD]:
            self._wait(self._free, timeout, "free slot")
            self._took_write()
        return self._payload[w[_PUBLISHED] % self._num_slots][:]

    def _took_free_token(self) -> memoryview:
        w = self._w
        if w[_INVALID]:
            self._raise_if_unusable()
        spare = self._spare_free
        if spare:              # (no call from here to the store: see _acquire_token)
            del spare[-1]
        w[_HELD] = 1
        return self._payload[w[_PUBLISHED] % self._num_slots][:]

    def try_acquire_write(self) -> memoryview:
        """Like :meth:`acquire_write` but raise :class:`WouldBlock` if the ring is full."""
        w = self._w
        if w[_INVALID]:
            self._raise_if_unusable()
        if not w[_HELD]:
            self._try(self._free, "free slot")
            self._took_write()
        return self._payload[w[_PUBLISHED] % self._num_slots][:]

    def _took_write(self) -> None:
        w = self._w
        spare = self._spare_free
        if spare:              # (no call from here to the store: see _acquire_token)
            del spare[-1]
        w[_HELD] = 1
        if not self._is_producer:
            self._is_producer = True
            w[_PRODUCER_PID] = self._pid
            if self._core is not None:
                self._core.producer = 1

    def publish(self, nbytes: int, tag: int = 0) -> None:
        """Make the acquired slot's first ``nbytes`` bytes visible to the consumer."""
        w = self._w
        if not w[_HELD]:
            self._raise_if_unusable()
            raise ShmError(f"ring {self._name}: publish() without a slot from acquire_write()")
        if not 0 <= nbytes <= self._slot_size:
            raise ValueError(f"ring {self._name}: publish of {nbytes} bytes; expected "
                             f"0..{self._slot_size} (the slot size)")
        k = w[_PUBLISHED]
        base = self._slot_word[k % self._num_slots]
        w[base] = k + 1
        w[base + 1] = nbytes
        w[base + 2] = tag
        w[_PUBLISHED] = k + 1
        w[_HELD] = 0
        self._full.release()
        if w[_DOORBELL]:
            _ring_doorbell(w[_DOORBELL])

    def write(self, data: Any, tag: int = 0, timeout: float | None = None) -> None:
        """Acquire a slot, copy ``data`` (bytes-like, C-contiguous) into it, publish it."""
        data = self._message(data)
        Ring.acquire_write(self, timeout)   # the same slot if one is held already
        self._finish_write(data, tag)

    def _message(self, data: Any) -> Any:
        """``data`` as a flat byte sequence that fits a slot."""
        t = type(data)
        if t is not bytes and t is not bytearray and (
                t is not memoryview or data.ndim != 1 or data.format != "B"):
            data = memoryview(data).cast("B")
        if len(data) > self._slot_size:
            raise ValueError(f"ring {self._name}: message of {len(data)} bytes does not fit "
                             f"a slot of {self._slot_size} bytes")
        return data

    def _finish_write(self, data: Any, tag: int) -> None:
        """Copy and publish once a free-slot token is taken (held is 0 afterwards)."""
        w = self._w
        if w[_INVALID]:
            self._raise_if_unusable()
        n = len(data)
        k = w[_PUBLISHED]
        i = k % self._num_slots
        self._payload[i][:n] = data
        base = self._slot_word[i]
        spare = self._spare_free
        if spare:              # (no call from here to the store: see _acquire_token)
            del spare[-1]
        w[base] = k + 1
        w[base + 1] = n
        w[base + 2] = tag
        w[_PUBLISHED] = k + 1
        if w[_HELD]:
            w[_HELD] = 0
        self._full.release()
        if w[_DOORBELL]:
            _ring_doorbell(w[_DOORBELL])

    # -- consumer -----------------------------------------------------------

    def acquire_read(self, timeout: float | None = None) -> tuple[memoryview, int]:
        """Wait for the next published slot; return (view of its nbytes, tag).

        The view stays valid until the matching :meth:`release`; several
        slots may be acquired before releasing them (oldest first).
        """
        self._wait(self._full, timeout, "published slot")
        return self._took_full_token()

    def try_acquire_read(self) -> tuple[memoryview, int]:
        """Like :meth:`acquire_read` but raise :class:`WouldBlock` if nothing is published."""
        self._try(self._full, "published slot")
        return self._took_full_token()

    def _took_full_token(self) -> tuple[memoryview, int]:
        w = self._w
        if w[_INVALID]:
            self._raise_if_unusable()
        k = w[_ACQUIRED]
        i = k % self._num_slots
        return self._took_read_general(k, i, self._slot_word[i])

    def _take_consumer_role(self) -> None:
        self._is_consumer = True
        self._w[_CONSUMER_PID] = self._pid
        if self._core is not None:
            self._core.consumer = 1   # from now on the C core serves this end

    def _took_read_general(self, k: int, i: int, base: int) -> tuple[memoryview, int]:
        w = self._w
        if w[base] != k + 1:
            raise ShmError(f"ring {self._name}: slot {i} holds message {w[base]}, expected "
                           f"{k + 1} (two producers, or a reset under a live peer?)")
        if not self._is_consumer:
            self._take_consumer_role()
        nbytes = w[base + 1]
        if not 0 <= nbytes <= self._slot_size:
            raise ShmError(f"ring {self._name}: slot {i} claims {nbytes} bytes; "
                           f"slot size is {self._slot_size}")
        tag = w[_READ_TAG] = w[base + 2]
        spare = self._spare_full
        if spare:              # (no call from here to the store: see _acquire_token)
            del spare[-1]
        w[_ACQUIRED] = k + 1
        view = self._payload[i]
        return view[:nbytes], tag

    def release(self) -> None:
        """Give the oldest acquired read slot back to the producer."""
        w = self._w
        k = w[_RELEASED]
        if k >= w[_ACQUIRED]:
            self._raise_if_unusable()
            raise ShmError(f"ring {self._name}: release() without a slot from acquire_read()")
        w[_RELEASED] = k + 1
        self._free.release()

    def read(self, timeout: float | None = None) -> tuple[bytes, int]:
        """Acquire the next message, copy it out, release its slot.

        Refused while slots from :meth:`acquire_read` are still unreleased
        (releasing is oldest-first, so it would free one of those instead).
        """
        w = self._w
        k = w[_RELEASED]
        if k != w[_ACQUIRED]:
            raise ShmError(f"ring {self._name}: read() while {w[_ACQUIRED] - k} slot(s) from "
                           "acquire_read() are not released; release() them first")
        self._wait(self._full, timeout, "published slot")
        if not self._is_consumer:
            self._take_consumer_role()
        return self._finish_read()

    def _finish_read(self) -> tuple[bytes, int]:
        """Copy out and release the next message once a published-slot token is taken."""
        w = self._w
        if w[_INVALID]:
            self._raise_if_unusable()
        k = w[_RELEASED]
        i = k % self._num_slots
        base = self._slot_word[i]
        if w[base] != k + 1:
            self._took_read_general(k, i, base)  # raises the error
        nbytes = w[base + 1]
        if not 0 <= nbytes <= self._slot_size:
            self._took_read_general(k, i, base)  # raises the error
        data = self._payload[i][:nbytes].tobytes()
        tag = w[_READ_TAG] = w[base + 2]
        spare = self._spare_full
        if spare:              # (no call from here to the store: see _acquire_token)
            del spare[-1]
        w[_ACQUIRED] = w[_RELEASED] = k + 1
        self._free.release()
        return data, tag

    def readable(self) -> int:
        """Slots published and not yet acquired by the consumer."""
        w = self._w
        return w[_PUBLISHED] - w[_ACQUIRED]

    def writable(self) -> int:
        """Slots the producer could acquire now."""
        w = self._w
        return self._num_slots - (w[_PUBLISHED] - w[_RELEASED]) - w[_HELD]

    # -- where the C core hands over (see shm/_ringcore.c) -------------------

    def _c_write(self, code: int, first: float, data: Any, tag: Any, timeout: Any) -> None:
        tag = 0 if tag is None else tag
        if code == _GENERAL:
            return Ring.write(self, data, tag, timeout)
        if code == _NO_TOKEN:
            self._wait_slow(self._free, timeout, "free slot", first)
        self._finish_write(self._message(data), tag)
        return None

    def _c_acquire_write(self, code: int, first: float, timeout: Any) -> memoryview:
        if code == _GENERAL:
            return Ring.acquire_write(self, timeout)
        if code == _NO_TOKEN:
            self._wait_slow(self._free, timeout, "free slot", first)
        return self._took_free_token()

    def _c_try_acquire_write(self, code: int, first: float) -> memoryview:
        if code == _GENERAL:
            return Ring.try_acquire_write(self)
        if code == _NO_TOKEN:
            raise WouldBlock(f"ring {self._name}: no free slot ({self._occupancy()})")
        return self._took_free_token()

    def _c_publish(self, code: int, first: float, nbytes: Any, tag: Any) -> None:
        Ring.publish(self, nbytes, 0 if tag is None else tag)

    def _c_acquire_read(self, code: int, first: float, timeout: Any) -> tuple[memoryview, int]:
        if code == _GENERAL:
            return Ring.acquire_read(self, timeout)
        if code == _NO_TOKEN:
            self._wait_slow(self._full, timeout, "published slot", first)
        return self._took_full_token()

    def _c_try_acquire_read(self, code: int, first: float) -> tuple[memoryview, int]:
        if code == _GENERAL:
            return Ring.try_acquire_read(self)
        if code == _NO_TOKEN:
            raise WouldBlock(f"ring {self._name}: no published slot ({self._occupancy()})")
        return self._took_full_token()

    def _c_release(self, code: int, first: float) -> None:
        Ring.release(self)

    def _c_read(self, code: int, first: float, timeout: Any) -> tuple[bytes, int]:
        if code == _GENERAL:
            return Ring.read(self, timeout)
        if code == _NO_TOKEN:
            self._wait_slow(self._full, timeout, "published slot", first)
        return self._finish_read()

    def _c_readable(self, code: int, first: float) -> int:
        return Ring.readable(self)

    def _c_writable(self, code: int, first: float) -> int:
        return Ring.writable(self)

    # -- control ------------------------------------------------------------

    def invalidate(self) -> None:
        """Mark the ring unusable and wake a blocked waiter on either side at once."""
        if self._closed:
            raise self._closed_error()
        w = self._w
        if not w[_INVALID]:
            w[_INVALID] = self._pid
        self._full.release()
        self._free.release()

    def is_valid(self) -> bool:
        return not self._closed and not self._w[_INVALID]

    def reset(self) -> None:
        """Empty the ring and make it valid again.

        Both ends must be quiescent (no thread of either process inside a
        call on this ring); the peer's next call sees the fresh state.
        """
        if self._closed:
            raise self._closed_error()
        for sem in (self._full, self._free):
            while True:
                try:
                    sem.acquire(0)
                except posix_ipc.BusyError:
                    break
        w = self._w
        self._spare_full.clear()
        self._spare_free.clear()
        for i in (_PUBLISHED, _HELD, _ACQUIRED, _RELEASED, _READ_TAG):
            w[i] = 0
        for base in self._slot_word:
            w[base] = w[base + 1] = w[base + 2] = 0
        w[_GEN] = w[_GEN] + 1
        w[_INVALID] = 0
        with self._wlock:   # the drain above took any token interrupt() posted
            self._pending = [0, 0]
        if self._core is not None:
            self._core.forget_wakes()
        for _ in range(self._num_slots):
            self._free.release()

    def set_doorbell(self, signum: int) -> None:
        """While ``signum`` is set (0: off), every message published on this ring also
        sends that signal to this process: for a consumer that blocks on other rings for
        a while and must still hear this one at once (the IPU process, waiting for a
        stream while its control ring may bring STOP). The signal's handler is the
        consumer's business; arm it, then check :meth:`readable`, then block, so that
        no message falls between. Choose a signal ignored by default (``SIGURG``): a
        consumer that dies armed leaves the word set, and its pid may be reused."""
        if not isinstance(signum, int) or not 0 <= signum < 256:
            raise ValueError(f"signum must be an int in 0..255, got {signum!r}")
        self._w[_DOORBELL] = (self._pid << 8 | signum) if signum else 0

    def last_read_tag(self) -> int | None:
        """The tag of the last message the consumer acquired (``read`` or ``acquire_read``),
        None if none was since the ring was made or reset.

        For a consumer interrupted around a read (an exception raised by a signal handler
        as the call returns): whether the message it was after was consumed."""
        w = self._w
        return int(w[_READ_TAG]) if w[_ACQUIRED] else None

    def last_published_tag(self) -> int | None:
        """The tag of the last message published, None if none was since the ring was made
        or reset (the producer's view: for a producer interrupted around a write)."""
        w = self._w
        k = w[_PUBLISHED]
        if not k:
            return None
        base = self._slot_word[(k - 1) % self._num_slots]
        return int(w[base + 2]) if w[base] == k else None

    def unreleased(self) -> int:
        """Slots the consumer acquired and has not released yet."""
        w = self._w
        return int(w[_ACQUIRED] - w[_RELEASED])

    def holding(self) -> bool:
        """Whether the producer holds an acquired, unpublished slot (the next
        ``acquire_write`` returns it)."""
        return bool(self._w[_HELD])

    def user_word(self) -> int:
        """The header's user word (0 until an end sets it; see set_user_word)."""
        return int(self._w[_USER])

    def set_user_word(self, value: int) -> None:
        """Store an int64 in the header's user word, which the ring itself never reads:
        a hint from one end to the other (last store wins; reset() keeps it)."""
        self._w[_USER] = value

    def counters(self) -> dict[str, int]:
        """The header's fields and the semaphores' values, as numbers."""
        if self._closed:
            raise self._closed_error()
        w = self._w
        return {
            "slot_size": self._slot_size, "num_slots": self._num_slots,
            "invalid_by": w[_INVALID], "generation": w[_GEN], "creator_pid": w[_CREATOR],
            "published": w[_PUBLISHED], "held": w[_HELD], "producer_pid": w[_PRODUCER_PID],
            "acquired": w[_ACQUIRED], "released": w[_RELEASED],
            "consumer_pid": w[_CONSUMER_PID],
            "sem_full": self._full.value, "sem_free": self._free.value,
        }

    def state(self) -> str:
        """A readable dump of the ring's shared state (for logs and bug reports)."""
        if self._closed:
            if self._forked_from:
                return f"ring {self._name}: {self._closed_error()}"
            return f"ring {self._name}: closed in this process"
        c = self.counters()
        valid = "VALID" if not c["invalid_by"] else f"INVALIDATED by pid {c['invalid_by']}"
        peer = "none" if self._peer is None else str(self._peer.pid)
        return "\n".join([
            f"ring {self._name}: {c['num_slots']} slots x {c['slot_size']} B "
            f"(stride {self._stride}), {valid}, generation {c['generation']}, "
            f"creator pid {c['creator_pid']}",
            f"  producer pid {c['producer_pid'] or '-'}: published {c['published']}, "
            f"holding a slot: {'yes' if c['held'] else 'no'}",
            f"  consumer pid {c['consumer_pid'] or '-'}: acquired {c['acquired']}, "
            f"released {c['released']}",
            f"  readable {c['published'] - c['acquired']}, "
            f"in use {c['published'] - c['released']}/{c['num_slots']}; "
            f"semaphores: full={c['sem_full']} free={c['sem_free']}",
            f"  this process {self._pid}: owner={self._owner} watching peer {peer}",
        ])

    # -- lifetime -----------------------------------------------------------

    def close(self) -> None:
        """Stop using the ring in this process (idempotent).

        Every later call raises ShmClosedError; a thread of this process
        blocked in a wait raises it at once, and close() returns once those
        threads have left their waits (the wake tokens it posted are taken back:
        the semaphores are shared with the peer, whose consumer must never take
        one for a slot that was not published). Slot views handed out
        stay valid (the mapping goes when the last of them does). Use
        invalidate() first to wake the peer process too.
        """
        if self._closed:
            if self._forked_from and self._words is not None:
                self._forget_mapping()
            return
        self._shut()
        self._forget_mapping()

    def _shut(self) -> None:
        self._closed = True
        self._w = _ClosedWords(self._name, self._forked_from)
        # A thread inside a core call, or holding one of its methods, holds the core
        # (and so the mapping and the semaphores); closed sends it to the Python path.
        if self._core is not None:
            self._core.closed = 1
            for method in _C_METHODS:
                self.__dict__.pop(method, None)
        if self._unnotify is not None:
            self._unnotify()
            self._unnotify = None
        if not self._forked_from:
            self.interrupt()   # this process's blocked threads wake and see the close
            # ... and take back the tokens interrupt() posted for them before close()
            # returns: left in the semaphores (shared with the peer), a consumer there
            # (the next owner of a daemon's ring) would take one for an unpublished slot
            self._wait_unblocked(_CLOSE_WAKE_TIMEOUT)

    def _wait_unblocked(self, timeout: float) -> None:
        if self._core is not None:
            quiet = bool(self._core.wait_unblocked(timeout))
        else:
            with self._wlock:
                quiet = self._wlock.wait_for(lambda: not any(self._blocked), timeout)
        if not quiet:
            _log.warning("ring %s: closed while a thread of this process still waits on it "
                         "after %g s", self._name, timeout)

    def _forget_mapping(self) -> None:
        # Handed-out views (and numpy arrays over them, which hold no export)
        # keep the mapping alive: drop ours, never release them.
        self._words = None
        self._payload = []
        self._region.close()

    def _disown(self) -> None:
        """This process is a fork of the one that made this object: never use the ring."""
        if not self._forked_from:
            self._forked_from = self._pid
            if not self._closed:
                self._shut()
            else:
                self._w = _ClosedWords(self._name, self._forked_from)

    def unlink(self) -> None:
        """Destroy the ring's names (idempotent); open mappings stay usable.

        In a forked child (of the process that made this object) it does nothing."""
        if self._unlinked or self._forked_from:
            return
        self._unlinked = True
        self._region.unlink()
        _registry.unlink_name(self._name + _FREE_SUFFIX, "sem")
        _registry.unlink_name(self._name + _FULL_SUFFIX, "sem")

    def __enter__(self) -> "Ring":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        if self._owner:
            self.unlink()

    def __repr__(self) -> str:
        return (f"Ring({self._name!r}, slot_size={self._slot_size}, "
                f"num_slots={self._num_slots}, owner={self._owner})")


def _peer_exited(ref: "weakref.ref[Ring]", peer: PeerWatch) -> None:
    """From shm.liveness's thread: the peer of the Ring behind ``ref`` exited."""
    ring = ref()
    if ring is not None and not ring.closed:
        ring._wake_for_peer(peer)


def _ring_doorbell(word: int) -> None:
    """Send the consumer the signal its doorbell word asks for (see set_doorbell)."""
    try:
        os.kill(word >> 8, word & 0xFF)
    except (ProcessLookupError, PermissionError, ValueError):
        pass   # gone: its peer checks tell


def _close_semaphores(*sems: posix_ipc.Semaphore) -> None:
    """Finalizer of a Ring: no thread can be inside one of its waits any more."""
    for sem in sems:
        try:
            sem.close()
        except posix_ipc.Error:  # pragma: no cover - already closed
            pass
