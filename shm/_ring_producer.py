"""The producer end of a ring: take a free slot, fill it, publish it.

The producer writes ``published``, ``held`` and ``producer_pid`` and each slot's header
(the drawing in shm/ring.py); it waits on the ``free`` semaphore and posts ``full``.
A slot is filled in place (:meth:`acquire_write`, then :meth:`publish`) or copied
into (:meth:`write`). These are the Python path: the C core's methods of the same
names shadow them once this process has published once (shm/_ring_handoff.py), and
hand calls back through the ``_c_<method>`` methods at the end of this module.

:class:`_RingProducer` is one of the concept classes ``shm.ring.Ring`` is made of;
what it reads of the others is declared at the top of its body.
"""

from __future__ import annotations

from typing import Any, Callable

from ._semaphore import SharedSemaphore
from ._ring_handoff import _GENERAL, _NO_TOKEN
from ._ring_layout import _DOORBELL, _HELD, _INVALID, _PRODUCER_PID, _PUBLISHED, _RELEASED
from ._ring_life import _ClosedWords
from ._ring_waits import _ring_doorbell
from .errors import ShmError, WouldBlock


class _RingProducer:
    """The producer's calls. Owns ``_is_producer`` (this process took the role: the
    first slot it acquired stored its pid)."""

    # -- what the producer uses of the others (the mapping: shm._ring_life; the waits
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
    _spare_free: list[None]
    _raise_if_unusable: Callable[[], None]
    _occupancy: Callable[[], str]
    _wait: Callable[[SharedSemaphore, float | None, str], None]
    _try: Callable[[SharedSemaphore, str], None]
    _wait_slow: Callable[[SharedSemaphore, float | None, str, float], None]

    def __init__(self) -> None:
        self._is_producer = False

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
        _RingProducer.acquire_write(self, timeout)   # the same slot if one is held already
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

    def writable(self) -> int:
        """Slots the producer could acquire now."""
        w = self._w
        return self._num_slots - (w[_PUBLISHED] - w[_RELEASED]) - w[_HELD]

    def holding(self) -> bool:
        """Whether the producer holds an acquired, unpublished slot (the next
        ``acquire_write`` returns it)."""
        return bool(self._w[_HELD])

    def last_published_tag(self) -> int | None:
        """The tag of the last message published, None if none was since the ring was made
        or reset (the producer's view: for a producer interrupted around a write)."""
        w = self._w
        k = w[_PUBLISHED]
        if not k:
            return None
        base = self._slot_word[(k - 1) % self._num_slots]
        return int(w[base + 2]) if w[base] == k else None

    # -- where the C core hands over (codes: shm._ring_handoff) --------------------

    def _c_write(self, code: int, first: float, data: Any, tag: Any, timeout: Any) -> None:
        tag = 0 if tag is None else tag
        if code == _GENERAL:
            return _RingProducer.write(self, data, tag, timeout)
        if code == _NO_TOKEN:
            self._wait_slow(self._free, timeout, "free slot", first)
        self._finish_write(self._message(data), tag)
        return None

    def _c_acquire_write(self, code: int, first: float, timeout: Any) -> memoryview:
        if code == _GENERAL:
            return _RingProducer.acquire_write(self, timeout)
        if code == _NO_TOKEN:
            self._wait_slow(self._free, timeout, "free slot", first)
        return self._took_free_token()

    def _c_try_acquire_write(self, code: int, first: float) -> memoryview:
        if code == _GENERAL:
            return _RingProducer.try_acquire_write(self)
        if code == _NO_TOKEN:
            raise WouldBlock(f"ring {self._name}: no free slot ({self._occupancy()})")
        return self._took_free_token()

    def _c_publish(self, code: int, first: float, nbytes: Any, tag: Any) -> None:
        _RingProducer.publish(self, nbytes, 0 if tag is None else tag)

    def _c_writable(self, code: int, first: float) -> int:
        return _RingProducer.writable(self)
