"""A ring's life in this process: its mapping and semaphores, from open to close.

What this process has of a ring (the region's mapping, the header words, the slot
views, the two semaphores) is opened by ``Ring.create``/``Ring.attach`` (shm/ring.py)
and then lives here: what its header says (:meth:`counters`, :meth:`state`, the user
word), :meth:`close` (this process stops using it), :meth:`unlink` (the names go, once,
by the owner), :meth:`invalidate` and :meth:`reset` (the shared state, for both ends),
and the disowning of every ring in a forked child ("Closing" and "Fork" in
shm/ring.py). ``_live`` is every Ring of this process.

:class:`_RingLife` is one of the concept classes ``shm.ring.Ring`` is made of; what it
reads of the others is declared at the top of its body.
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Callable, Self

import posix_ipc

from ._ring_layout import (_ACQUIRED, _CONSUMER_PID, _CREATOR, _FREE_SEM, _FULL_SEM,
                           _GEN, _HELD, _INVALID, _NUM_SLOTS, _PRODUCER_PID, _PUBLISHED,
                           _READ_TAG, _RELEASED, _SLOT_SIZE, _STRIDE, _USER, HEADER_SIZE,
                           SLOT_HEADER_SIZE)
from .errors import RingInvalidatedError, ShmClosedError, ShmForkedError
from .liveness import PeerWatch
from ._semaphore import SharedSemaphore
from ._packed import RegionPart
from .region import Region

_CLOSE_WAKE_TIMEOUT = 5.0
"""Seconds close() waits for the threads it woke to leave their waits (they are awake)."""


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


# Every Ring of this process, for the fork hook below and shm.ring.interrupt_all.
_live: "weakref.WeakSet[_RingLife]" = weakref.WeakSet()


def _disown_after_fork() -> None:
    """In a forked child: no Ring made before the fork may be used here (see above)."""
    for ring in list(_live):
        ring._disown()


os.register_at_fork(after_in_child=_disown_after_fork)


def _live_rings() -> "list[_RingLife]":
    """A copy of ``_live`` that another thread making or dropping rings cannot break."""
    while True:
        try:
            return list(_live)
        except RuntimeError:   # the set changed size during the copy: copy again
            continue


class _RingLife:
    """This process's mapping of a ring and its semaphores, and their life.

    Owns (set by ``__init__``): the region and its views (``_words``, ``_w``,
    the slot views ``_payload`` and each slot's first word ``_slot_word``), the ring's
    shape, the semaphores, and whether this process closed, unlinked or disowned it.
    ``_w`` is the header view while the ring is open, a :class:`_ClosedWords` after:
    every call reads the words through it, so a closed ring needs no check of its own.
    """

    # -- what closing and resetting use of the others (the waits: shm._ring_waits;
    #    the C core: shm._ring_handoff) --------------------------------------------
    _core: Any
    interrupt: Callable[[], None]
    resume: Callable[[], None]      # (shm.ring.resume_all calls it on every live ring)
    _peer: PeerWatch | None         # (for state())
    _wait_unblocked: Callable[[float], None]
    _forget_tokens: Callable[[], None]
    _stop_peer_watch: Callable[[], None]
    _stop_core: Callable[[], None]

    def __init__(self, region: Region | RegionPart, owner: bool) -> None:
        self._region = region
        self._name = region.name
        # the semaphores' handles hold an export of the mapping: it goes with them
        self._free = SharedSemaphore(region.buf, _FREE_SEM, f"ring {region.name} (free)")
        self._full = SharedSemaphore(region.buf, _FULL_SEM, f"ring {region.name} (full)")
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
        self._pid = os.getpid()
        self._closed = False
        self._forked_from = 0   # the creator's pid once disowned in a forked child
        self._unlinked = False

    # -- properties ----------------------------------------------------------------

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

    def back(self) -> None:
        """Allocate the pages of a ring made ``sparse`` (``ShmFullError`` if /dev/shm
        cannot hold them); nothing for one made whole."""
        self._region.back()

    # -- usable? -------------------------------------------------------------------

    def _closed_error(self) -> ShmClosedError:
        return _closed_error(self._name, self._forked_from)

    def _raise_if_unusable(self) -> None:
        if self._closed:
            raise self._closed_error()
        who = self._w[_INVALID]
        if who:
            raise RingInvalidatedError(
                f"ring {self._name} was invalidated by process {who}; reset() it to reuse")

    # -- what the header says ------------------------------------------------------

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

    def __repr__(self) -> str:
        return (f"Ring({self._name!r}, slot_size={self._slot_size}, "
                f"num_slots={self._num_slots}, owner={self._owner})")

    # -- the shared state, for both ends -------------------------------------------

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
        for i in (_PUBLISHED, _HELD, _ACQUIRED, _RELEASED, _READ_TAG):
            w[i] = 0
        for base in self._slot_word:
            w[base] = w[base + 1] = w[base + 2] = 0
        w[_GEN] = w[_GEN] + 1
        w[_INVALID] = 0
        self._forget_tokens()   # the drain above took any token interrupt() posted
        for _ in range(self._num_slots):
            self._free.release()

    # -- closing -------------------------------------------------------------------

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
        self._stop_core()
        self._stop_peer_watch()
        if not self._forked_from:
            self.interrupt()   # this process's blocked threads wake and see the close
            # ... and take back the tokens interrupt() posted for them before close()
            # returns: left in the semaphores (shared with the peer), a consumer there
            # (the next owner of a daemon's ring) would take one for an unpublished slot
            self._wait_unblocked(_CLOSE_WAKE_TIMEOUT)

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

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        if self._owner:
            self.unlink()

