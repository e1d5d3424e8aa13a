"""SPSC rings of fixed-size slots in shared memory, between two processes.

Layout of the ring's region (all words little-endian int64, ``q``)::

    offset  word  field        written by     meaning
    ------  ----  -----------  -------------  ------------------------------------
       0      0   magic        creator        b"IPUEMURG"
       8      1   version      creator        layout version (2)
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
    ---- the free semaphore's cache line -----------------------------------------
     256          free         creator (init) process-shared sem_t: slots the producer
                               then both      may fill (starts at num_slots)
    ---- the full semaphore's cache line -----------------------------------------
     320          full         creator (init) process-shared sem_t: published slots the
                               then both      consumer may read (starts at 0)
    ---- slots: slot i at HEADER_SIZE + i * slot_stride (HEADER_SIZE = 384) -----
      +0          seq          producer       message number (published + 1)
      +8          nbytes       producer       bytes of payload that are valid
     +16          tag          producer       the caller's int64 tag (what it means is
                                          the caller's: a kind and a sequence number
                                          for ipu_emulator.ipu_protocol's streams)
     +24..63      reserved
     +64          payload      producer       slot_size bytes (stride is 64-aligned)

Message k (counting from 0) lives in slot ``k % num_slots``. Two POSIX
semaphores in the header do all the blocking: ``free`` counts slots the producer
may fill (starts at ``num_slots``), ``full`` counts published slots the consumer
may read (starts at 0). They are process-shared ``sem_t`` made by the creator with
``sem_init`` (``shm._semaphore``), so a ring is one /dev/shm object and neither end
creates, opens or unlinks a named semaphore.

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
``reset()``. The woken waiter's token stays banked with its end; after the
reset it is one too many, and is dropped rather than used: a banked ``full``
token beyond ``published - acquired`` (it would read an unpublished slot), a
``free`` token taken while every slot is in use (it would write over the
oldest unread message).

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
:class:`ShmClosedError`). The mapping (and the semaphores in it) goes only when
the Ring object is garbage-collected: the semaphores' handles hold an export of
it, and a thread inside a wait holds a reference to the Ring, so a semaphore is
never unmapped under a waiter (that would crash), and the hot path needs no
bookkeeping of who holds it.

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

Where each part is (``Ring`` is made of one class per concept, each in its module,
each declaring what it reads of the others; the hot methods stay single flat methods
of the class, found by one attribute lookup):

- this module: the layout above, making and opening a ring (:meth:`Ring.create`,
  :meth:`Ring.create_packed`, :meth:`Ring.attach`), and
  :func:`interrupt_all`/:func:`resume_all`;
- ``shm/_packed.py``: several rings in one segment, each named ``<segment>@<offset>``;
- ``shm/_ring_layout.py``: the drawing's words as indices, and the sizes;
- ``shm/_ring_life.py``: the mapping and semaphores in this process, what the header
  says (:meth:`Ring.counters`, :meth:`Ring.state`), close, unlink, invalidate, reset,
  fork disowning;
- ``shm/_ring_waits.py``: token waits, interrupts, the peer watch, the doorbell;
- ``shm/_ring_producer.py``, ``shm/_ring_consumer.py``: the two ends;
- ``shm/_ring_handoff.py``: the C core taking over the hot calls and handing them back.
"""

from __future__ import annotations

import logging
import mmap
import os
from typing import Sequence

from ._packed import RegionPart, Shared, segment_of
from ._ring_consumer import _RingConsumer
from ._ring_handoff import _RingHandOff
from ._ring_layout import (_CREATOR, _FREE_SEM, _FULL_SEM, _MAGIC, _MAX_SLOTS, _NUM_SLOTS,
                           _SLOT_SIZE, _STRIDE, _VERSION, HEADER_SIZE, MAGIC, VERSION, _stride)
from ._ring_life import _RingLife, _live, _live_rings
from ._ring_producer import _RingProducer
from ._ring_waits import PEER_CHECK, _RingWaits
from .errors import ShmError
from ._semaphore import SharedSemaphore
from .region import Region
from .settings import ShmSettings

try:
    import shm._ringcore as _ringcore
except ImportError:  # built without the C extension: the pure-Python path does it all
    _ringcore = None

__all__ = ["Ring", "PEER_CHECK", "interrupt_all", "resume_all"]

_log = logging.getLogger(__name__)

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


class Ring(_RingProducer, _RingConsumer, _RingWaits, _RingHandOff, _RingLife):
    """One producer process, one consumer process, ``num_slots`` slots of ``slot_size`` bytes.

    Use :meth:`create` (owner) or :meth:`attach`. Either end may be the owner.
    A process uses a ring as producer or as consumer (or both, in tests).

    Made of one class per concept (see the list above): the producer's and the
    consumer's calls, the token waits, the C hand-off, and the mapping's life. Each
    sets its own state in its ``__init__``, which this one calls in turn.
    """

    def __init__(self, region: Region | RegionPart, owner: bool,
                 settings: ShmSettings | None = None,
                 ) -> None:
        s = settings if settings is not None else ShmSettings.current()
        # each part's own state (see its class)
        _RingLife.__init__(self, region, owner)
        _RingWaits.__init__(self, s)
        _RingProducer.__init__(self)
        _RingConsumer.__init__(self)
        # The C core's methods shadow the hot methods on this instance (see
        # shm/_ring_handoff.py); without it the Python path does everything.
        _RingHandOff.__init__(self, _ringcore if s.ring_c else None)
        _live.add(self)
        if _all_interrupted:
            self.interrupt()

    # -- construction --------------------------------------------------------------

    @classmethod
    def create(cls, slot_size: int, num_slots: int, kind: str = "ring",
               prefault: bool = True, settings: ShmSettings | None = None,
               sparse: bool = False) -> "Ring":
        """Create a ring (one region, its two semaphores inside), owned by this process;
        ``settings``: the knobs it takes (default: ``ShmSettings.current()``). ``sparse``: only its
        header is backed in /dev/shm (``shm.region``); :meth:`back` before the first
        write to a slot."""
        settings = settings if settings is not None else ShmSettings.current()
        _check_shape(slot_size, num_slots)
        region = Region.create(cls.region_size(slot_size, num_slots), kind=kind,
                               prefault=prefault, backed=HEADER_SIZE if sparse else None)
        try:
            _init_header(region.buf, slot_size, num_slots)
        except BaseException:
            region.close()
            region.unlink()
            raise
        _log.debug("created ring %s: %d slots x %d bytes", region.name, num_slots, slot_size)
        return cls(region, owner=True, settings=settings)

    @classmethod
    def create_packed(cls, shapes: Sequence[tuple[int, int, bool]], kind: str = "rings",
                      prefault: bool = True, settings: ShmSettings | None = None,
                      ) -> list["Ring"]:
        """Create one ring per ``(slot_size, num_slots, sparse)`` of ``shapes``, all in one
        segment (``shm/_packed.py``: one name, one mapping, one unlink), each on a page
        boundary and named ``<segment>@<offset>``. Prefaulted (``prefault``) unless one is
        ``sparse``: then only the others and the sparse ones' headers are backed now, and
        a sparse ring's :meth:`back` backs the rest of its pages. Unlinking one of them
        destroys the name of all: they are unlinked together."""
        settings = settings if settings is not None else ShmSettings.current()
        if not shapes:
            raise ValueError("create_packed needs at least one ring shape")
        offsets, sizes, total = [], [], 0
        for slot_size, num_slots, _ in shapes:
            _check_shape(slot_size, num_slots)
            offsets.append(total)
            sizes.append(cls.region_size(slot_size, num_slots))
            total += -(-sizes[-1] // _PAGE) * _PAGE
        sparse = any(s for _, _, s in shapes)
        region = Region.create(total, kind=kind, prefault=prefault, backed=[
            (off, HEADER_SIZE if s else size)
            for off, size, (_, _, s) in zip(offsets, sizes, shapes)] if sparse else None)
        try:
            shared = Shared(region)
            parts = [RegionPart(shared, off, size) for off, size in zip(offsets, sizes)]
            for part, (slot_size, num_slots, _) in zip(parts, shapes):
                _init_header(part.buf, slot_size, num_slots)
        except BaseException:
            region.close()
            region.unlink()
            raise
        _log.debug("created %d rings in %s", len(shapes), region.name)
        return [cls(part, owner=True, settings=settings) for part in parts]

    @staticmethod
    def region_size(slot_size: int, num_slots: int) -> int:
        """Bytes of /dev/shm a ring of ``num_slots`` slots of ``slot_size`` bytes takes."""
        return HEADER_SIZE + num_slots * _stride(slot_size)

    @classmethod
    def attach(cls, name: str, prefault: bool = True,
               settings: ShmSettings | None = None,
               segments: dict[str, Shared] | None = None) -> "Ring":
        """Open the ring ``name`` made by another process (or this one). ``segments``:
        the packed segments mapped so far (``create_packed``), for the next rings of one
        to share the mapping (the caller keeps the dict while it attaches them)."""
        settings = settings if settings is not None else ShmSettings.current()
        segment, offset = segment_of(name)
        if segment == name:
            region = Region.attach(name, prefault=prefault)
            try:
                _check_header(name, region.buf, region.size)
            except BaseException:
                region.close()
                raise
            return cls(region, owner=False, settings=settings)
        shared = segments.get(segment) if segments is not None else None
        if shared is None:   # (pre-faulted ring by ring: another may be sparse)
            shared = Shared(Region.attach(segment, prefault=False))
            if segments is not None:
                segments[segment] = shared
        region = shared.region
        try:
            if offset % _PAGE or offset + HEADER_SIZE > region.size:
                raise ShmError(f"ring {name}: no ring starts at offset {offset} of a "
                               f"segment of {region.size} bytes")
            size = _check_header(name, region.buf[offset:], region.size - offset)
            if prefault:
                region.populate([(offset, size)])
            part = RegionPart(shared, offset, size)
        except BaseException:
            if not shared.parts:
                region.close()
            raise
        return cls(part, owner=False, settings=settings)


_PAGE = mmap.PAGESIZE


def _check_shape(slot_size: int, num_slots: int) -> None:
    if not isinstance(slot_size, int) or isinstance(slot_size, bool) or slot_size <= 0:
        raise ValueError(f"slot_size must be a positive int of bytes, got {slot_size!r}")
    if (not isinstance(num_slots, int) or isinstance(num_slots, bool)
            or not 1 <= num_slots <= _MAX_SLOTS):
        raise ValueError(f"num_slots must be an int in 1..{_MAX_SLOTS}, got {num_slots!r}")


def _init_header(buf: memoryview, slot_size: int, num_slots: int) -> None:
    """Write a fresh ring's header and make its semaphores, at the start of ``buf``."""
    w = buf.cast("q")
    w[_MAGIC], w[_VERSION] = MAGIC, VERSION
    w[_SLOT_SIZE], w[_NUM_SLOTS], w[_STRIDE] = slot_size, num_slots, _stride(slot_size)
    w[_CREATOR] = os.getpid()
    w.release()
    SharedSemaphore(buf, _FREE_SEM, "").init(num_slots)
    SharedSemaphore(buf, _FULL_SEM, "").init(0)


def _check_header(name: str, buf: memoryview, room: int) -> int:
    """The bytes the ring whose header starts ``buf`` takes, checked against the layout
    and the ``room`` its segment has from there (ShmError)."""
    if room < HEADER_SIZE:   # (``buf`` spans ``room`` bytes)
        raise ShmError(f"{name} is not a ring: {room} bytes, less than a ring's header")
    w = buf[:HEADER_SIZE].cast("q")
    try:
        magic, version = w[_MAGIC], w[_VERSION]
        slot_size, num_slots, stride = w[_SLOT_SIZE], w[_NUM_SLOTS], w[_STRIDE]
    finally:
        w.release()
    if magic != MAGIC or version != VERSION:
        raise ShmError(f"{name} is not a ring of layout version {VERSION}: "
                       f"magic {magic:#x} version {version}")
    need: int = HEADER_SIZE + num_slots * stride
    if (slot_size <= 0 or not 1 <= num_slots <= _MAX_SLOTS
            or stride != _stride(slot_size) or need > room):
        raise ShmError(f"ring {name} has an inconsistent header: slot_size {slot_size}, "
                       f"num_slots {num_slots}, stride {stride}, region {room} B")
    return need
