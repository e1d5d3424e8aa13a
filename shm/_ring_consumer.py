"""The consumer end of a ring: take the next published slot, read it, release it.

The consumer writes ``acquired``, ``released``, ``consumer_pid`` and ``read_tag`` (the
drawing in shm/ring.py); it waits on the ``full`` semaphore and posts ``free``. A
message is read in place (:meth:`acquire_read`, then :meth:`release`, oldest first)
or copied out (:meth:`read`). These are the Python path: the C core's methods of the
same names shadow them once this process has acquired once (shm/_ring_handoff.py),
and hand calls back through the ``_c_<method>`` methods at the end of this module.

:class:`_RingConsumer` is one of the concept classes ``shm.ring.Ring`` is made of;
what it reads of the others is declared at the top of its body.
"""

from __future__ import annotations

from typing import Any, Callable

from ._semaphore import SharedSemaphore
from ._ring_handoff import _GENERAL, _NO_TOKEN
from ._ring_layout import _ACQUIRED, _CONSUMER_PID, _INVALID, _PUBLISHED, _READ_TAG, _RELEASED
from ._ring_life import _ClosedWords
from .errors import ShmError, WouldBlock


class _RingConsumer:
    """The consumer's calls. Owns ``_is_consumer`` (this process took the role: the
    first message it acquired stored its pid)."""

    # -- what the consumer uses of the others (the mapping: shm._ring_life; the waits
    #    and the token bank: shm._ring_waits; the C core: shm._ring_handoff) -------
    _name: str
    _w: memoryview | _ClosedWords
    _payload: list[memoryview]
    _slot_word: list[int]
    _slot_size: int
    _num_slots: int
    _free: SharedSemaphore
    _full: SharedSemaphore
    _pid: int
    _core: Any
    _spare_full: list[None]
    _raise_if_unusable: Callable[[], None]
    _occupancy: Callable[[], str]
    _wait: Callable[[SharedSemaphore, float | None, str], None]
    _try: Callable[[SharedSemaphore, str], None]
    _wait_slow: Callable[[SharedSemaphore, float | None, str, float], None]

    def __init__(self) -> None:
        self._is_consumer = False

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

    def unreleased(self) -> int:
        """Slots the consumer acquired and has not released yet."""
        w = self._w
        return int(w[_ACQUIRED] - w[_RELEASED])

    def last_read_tag(self) -> int | None:
        """The tag of the last message the consumer acquired (``read`` or ``acquire_read``),
        None if none was since the ring was made or reset.

        For a consumer interrupted around a read (an exception raised by a signal handler
        as the call returns): whether the message it was after was consumed."""
        w = self._w
        return int(w[_READ_TAG]) if w[_ACQUIRED] else None

    # -- where the C core hands over (codes: shm._ring_handoff) --------------------

    def _c_acquire_read(self, code: int, first: float, timeout: Any) -> tuple[memoryview, int]:
        if code == _GENERAL:
            return _RingConsumer.acquire_read(self, timeout)
        if code == _NO_TOKEN:
            self._wait_slow(self._full, timeout, "published slot", first)
        return self._took_full_token()

    def _c_try_acquire_read(self, code: int, first: float) -> tuple[memoryview, int]:
        if code == _GENERAL:
            return _RingConsumer.try_acquire_read(self)
        if code == _NO_TOKEN:
            raise WouldBlock(f"ring {self._name}: no published slot ({self._occupancy()})")
        return self._took_full_token()

    def _c_release(self, code: int, first: float) -> None:
        _RingConsumer.release(self)

    def _c_read(self, code: int, first: float, timeout: Any) -> tuple[bytes, int]:
        if code == _GENERAL:
            return _RingConsumer.read(self, timeout)
        if code == _NO_TOKEN:
            self._wait_slow(self._full, timeout, "published slot", first)
        return self._finish_read()

    def _c_readable(self, code: int, first: float) -> int:
        return _RingConsumer.readable(self)
