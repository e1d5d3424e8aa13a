"""A session's stream rings: one SPSC ring per anchor, its depth, and its life.

Each input or output anchor gets one ring (slot = one transfer of
``sizeInBytes``), made the first time the session is bound: its depth is decided
when the session is made (``SessionConfig.ring_depth`` / ``max_look_ahead``), the
room it takes is asked of /dev/shm before any is made, and a constant input's ring
is left sparse (never touched while the input is constant). When the device (the
peer) changes, every ring is reset and told its new peer.
"""

from __future__ import annotations

import operator
from typing import Callable, Collection, Sequence

from shm import Ring
from shm.settings import ShmSettings

from host_runtime import popef
from host_runtime.devices import check_room, ring_bytes, translated
from host_runtime.errors import BadRequestError

__all__ = ["StreamRings"]

_MAX_RING_BYTES = 64 << 20       # cap on one anchor's ring (slots x transfer size)
_PREFAULT_BYTES = 4 << 20        # pre-fault rings up to this size
_PACK_MAX_BYTES = 64 << 10       # rings up to this size share one segment
_UNLIMITED_DEPTH = 8             # ring depth of Main anchors for max_look_ahead "unlimited"
_MAX_DEPTH = 1024                # cap on a SessionConfig.ring_depth answer


def ring_depth(anchor: popef.Anchor, nbytes: int, main: Collection[int],
               look_ahead: int | None, depth_of: Callable[[popef.Anchor], int] | None) -> int:
    """Slots of ``anchor``'s ring (``nbytes`` a transfer; ``main`` the Main programs)."""
    is_main = any(p in main for p in anchor.programs())
    n = max(1, nbytes)
    if depth_of is None:
        if not is_main:
            return 2
        want = _UNLIMITED_DEPTH if look_ahead is None else look_ahead + 1
        return max(1, min(want, _MAX_RING_BYTES // n))
    given = depth_of(anchor)
    try:
        want = -1 if isinstance(given, bool) else operator.index(given)
    except TypeError:
        want = -1
    if want < 1:
        raise BadRequestError(f"SessionConfig.ring_depth gave {given!r} for anchor "
                              f"{anchor.name()!r}; expected an int >= 1 (ring slots)")
    if is_main and look_ahead is not None:
        want = min(want, look_ahead + 1)
    return max(1, min(want, _MAX_DEPTH, _MAX_RING_BYTES // n))


class StreamRings:
    """The rings of one session's streams (see the module docstring); ``rings`` maps an
    anchor's handle to its ring once they are made."""

    def __init__(self, streams: list[popef.Anchor], nbytes: dict[str, int],
                 depths: dict[str, int], settings: ShmSettings | None) -> None:
        self._streams = streams
        self._nbytes = nbytes
        self._depths = depths
        self._settings = settings   # of the rings (None: ShmSettings.current() then)
        self._uncounted: set[str] = set()   # rings not counted in /dev/shm (ensure)
        self._peer: int | None = None
        self.rings: dict[str, Ring] = {}

    def depth(self, handle: str) -> int:
        return self._depths[handle]

    def ensure(self, peer_pid: int | None, constant: Collection[str],
               extra: Sequence[tuple[str, int]] = ()) -> None:
        """Create the rings once; when the device (peer) changes, reset them (``None``:
        no device yet, the rings are only made).

        ``constant``: the inputs fed now by a value that never changes (their rings are
        not counted, nor backed, until they carry values). ``extra`` ((what, bytes) each):
        the session's other regions, counted with the rings when /dev/shm is asked
        whether it can hold them all.

        A device that died mid-transfer leaves stale slots; the old device is
        unbound when this runs, so the rings are quiescent.
        """
        if not self.rings:
            self._create(constant, extra)
        else:
            now = {h for h in self._uncounted if h not in constant}
            if now:   # no longer constants: their rings will carry values
                self._back(now, extra)
        if peer_pid is not None and self._peer != peer_pid:
            for ring in self.rings.values():
                if self._peer is not None:   # a previous device's slots (fresh rings are clean)
                    ring.reset()
                ring.set_peer(peer_pid)
            self._peer = peer_pid

    def _create(self, constant: Collection[str], extra: Sequence[tuple[str, int]]) -> None:
        plan = [(a, max(1, self._nbytes[a.handle()]), self._depths[a.handle()])
                for a in self._streams]
        # a constant's ring is not counted: its pages are never touched while it is
        # one (the constants region holds its value); counted once it is not
        self._uncounted = {a.handle() for a in self._streams if a.handle() in constant}
        check_room("this model's rings and regions", [
            (f"ring of anchor {a.name()!r} ({depth} x {n})", ring_bytes(n, depth))
            for a, n, depth in plan if a.handle() not in self._uncounted] + list(extra))
        # the small rings share one segment (shm/_packed.py): one name, one mapping
        small = [(a, n, depth) for a, n, depth in plan
                 if ring_bytes(n, depth) <= _PACK_MAX_BYTES]
        made: dict[str, Ring] = {}
        if len(small) > 1:
            with translated(f"the rings of {len(small)} anchors",
                            sum(ring_bytes(n, depth) for _, n, depth in small)):
                packed = Ring.create_packed(
                    [(n, depth, a.handle() in constant) for a, n, depth in small],
                    settings=self._settings)
            made = {a.handle(): ring for (a, _, _), ring in zip(small, packed)}
        for a, n, depth in plan:
            ring = made.get(a.handle())
            if ring is not None:
                self.rings[a.handle()] = ring
                continue
            kind = "in" if a.type() is popef.TensorType.INPUT else "out"
            # a constant's ring is never written while it is constant: left untouched
            # (its slots not even backed in /dev/shm until it carries values)
            sparse = a.handle() in constant
            prefault = n * depth <= _PREFAULT_BYTES and not sparse
            with translated(f"the ring of anchor {a.name()!r} ({depth} slots of {n} "
                            "bytes)", ring_bytes(n, depth)):
                self.rings[a.handle()] = Ring.create(n, depth, kind=kind,
                                                     prefault=prefault,
                                                     settings=self._settings,
                                                     sparse=sparse)

    def _back(self, now: set[str], extra: Sequence[tuple[str, int]]) -> None:
        names = {a.handle(): a.name() for a in self._streams}
        check_room("this model's rings", [
            (f"ring of anchor {names[h]!r}", ring_bytes(
                max(1, self._nbytes[h]), self._depths[h]))
            for h in sorted(now)] + list(extra))
        for h in sorted(now):   # backed before anything writes a slot
            ring = self.rings[h]
            with translated(f"the ring of anchor {names[h]!r}",
                            ring_bytes(max(1, self._nbytes[h]), ring.num_slots)):
                ring.back()
        self._uncounted -= now

    def reset(self) -> None:
        for ring in self.rings.values():
            ring.reset()

    def invalidate(self) -> None:
        """Wake every waiter on the rings, on both sides, at once (stop: the device
        takes the STOP sent before this instead of waiting out a slice)."""
        for ring in self.rings.values():
            if not ring.closed:
                ring.invalidate()

    def close(self) -> None:
        """Close and unlink every ring (idempotent): each is forgotten only once it is both
        (each idempotent), so that a close an interrupt cut short is finished by the next."""
        for handle in list(self.rings):
            ring = self.rings[handle]
            ring.close()
            ring.unlink()
            del self.rings[handle]
