"""Named POSIX shared-memory regions mapped into this process.

``Region.create`` makes a new segment (mode 0600, name from :mod:`shm.naming`)
and owns it; ``Region.attach`` maps an existing one by name. ``close()`` means
"this process stops using it"; ``unlink()`` destroys the name (normally once,
by its owner; a survivor may unlink after the owner died). Both are idempotent.
A process forked from the one that made a Region object never unlinks through
it: the name belongs to its parent.

Numpy arrays from :meth:`Region.ndarray` reference a memoryview that holds a
buffer export of the mapping, so the mapping stays valid for as long as any
such array (or any memoryview from :attr:`Region.buf`) lives: ``close()``
with views alive drops this object's references and the unmapping happens
when the last view dies. Nothing ever unmaps memory that a live view points
into. (numpy does not hold an export itself: ``np.frombuffer(mv)`` keeps
``mv`` alive but ``mv.release()`` would still succeed, which is why no view
that was handed out is ever released here.)

Pre-faulting: a first touch of a fresh shared page costs a page fault that
makes a first copy 8-10x slower than a warm one. With ``prefault=True`` (the
default) the mapping is populated writable when it is made
(``MADV_POPULATE_WRITE``; on older kernels the creator touches every page and
an attacher uses ``MAP_POPULATE``), in the creator and in each attacher, since
page tables are per process.

Backing: every page of a new segment is allocated in ``/dev/shm`` when it is made
(``posix_fallocate``), pre-faulted or not, so that a ``/dev/shm`` too full for it is a
:class:`~shm.errors.ShmFullError` at creation. Without that, a page first touched after
another process (another user) filled ``/dev/shm`` cannot be backed and the process
touching it, creator or attacher, is killed with SIGBUS. A segment cannot shrink under
its users: only its owner (mode 0600) could truncate it, and nothing here does.
A creator that knows most of a segment stays untouched for a while (a ring of a
constant input) backs only its first ``backed`` bytes and the rest with
:meth:`Region.back` before anything writes there.
"""

from __future__ import annotations

import errno
import logging
import math
import mmap
import os
from typing import Any

import numpy as np
import posix_ipc

from . import _registry, limits, naming
from .errors import ShmClosedError, ShmError, ShmFullError

__all__ = ["Region", "back_segment"]

_log = logging.getLogger(__name__)
_PAGE = mmap.PAGESIZE
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; not yet named by Python 3.11's mmap


def _map(fd: int, size: int, prefault: bool, fresh: bool, name: str,
         readonly: bool = False) -> mmap.mmap:
    """Map ``fd``; with ``prefault``, fault every page in writable now.

    Measured here on 64 MiB: first copy into an unfaulted mapping 1.5 GB/s,
    after MAP_POPULATE 4.0 GB/s (it maps pages for reading, so writes still
    fault), after MADV_POPULATE_WRITE 6.3 GB/s (= a warm copy). Populating a
    mapping never changes its bytes, so attachers may do it too.
    """
    prot = mmap.PROT_READ | (0 if readonly else mmap.PROT_WRITE)
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)
    if not prefault or readonly:
        return mm
    try:
        if _populate_range(mm, 0, size, name):
            return mm
    except BaseException:
        mm.close()
        raise
    # An older kernel.
    if fresh:  # nobody else sees it yet: writing zeros is harmless
        view = np.frombuffer(mm, dtype=np.uint8)
        view[::_PAGE] = 0
        del view
        return mm
    mm.close()
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _MAP_POPULATE, prot=prot)


def _populate_range(mm: mmap.mmap, offset: int, length: int, name: str) -> bool:
    """``MADV_POPULATE_WRITE`` of the pages of ``[offset, offset + length)``: False on a
    kernel without it (EINVAL); ``ShmFullError`` when /dev/shm cannot back them."""
    start = offset - offset % _PAGE
    try:
        mm.madvise(_MADV_POPULATE_WRITE, start, min(length + offset - start, len(mm) - start))
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise limits.shm_full(f"faulting in the pages of {name}", length,   # ENOMEM, EFAULT
                              errno.errorcode.get(exc.errno or 0, str(exc.errno))) from exc
    return True


def _populate(mm: mmap.mmap, spans: list[tuple[int, int]], name: str) -> None:
    """Fault in the pages of ``spans`` writable now (``_map``'s pre-fault, for a segment
    backed in ranges); nothing on a kernel without ``MADV_POPULATE_WRITE`` (faulted in as
    touched)."""
    for offset, length in spans:
        if not _populate_range(mm, offset, length, name):
            return


_MEMORY_CHECK_BYTES = 1 << 20
"""Regions pre-faulted from this size up are checked against the memory available (a
smaller one cannot bring in the OOM killer; reading /proc/meminfo costs more than it)."""


def _check_room(size: int, prefault: bool) -> None:
    """Refuse a region that /dev/shm (or, to fault it in now, memory) cannot hold.

    Otherwise the failure comes later and worse: SIGBUS on first touch of a
    page tmpfs cannot back, or the OOM killer while pre-faulting.
    """
    room = limits.shm_room()
    if room is None:  # pragma: no cover - no /dev/shm to ask
        return
    if size > room[0]:
        raise limits.shm_full(f"creating a shared-memory region of {size} bytes", size)
    if prefault and size >= _MEMORY_CHECK_BYTES:
        available = limits.memory_available()
        if size > available:
            raise ShmFullError(f"cannot create a shared-memory region of {size} bytes: "
                               f"only {available} bytes of memory are available to back it",
                               needed=size, free=room[0])


def _back(fd: int, offset: int, length: int, name: str) -> None:
    """Allocate the pages of ``[offset, offset + length)`` of segment ``fd`` now (see the
    module docstring): a full ``/dev/shm`` raises ``ShmFullError`` here, never SIGBUS at
    a later first touch."""
    if length <= 0:
        return
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):   # pragma: no cover - not tmpfs
            return
        raise limits.shm_full(f"allocating the pages of {name}", length,
                              errno.errorcode.get(exc.errno or 0, str(exc.errno))) from exc


def back_segment(name: str, size: int, ranges: list[tuple[int, int]] | None = None) -> None:
    """Allocate the pages of ``ranges`` (``(offset, length)`` each, cut at ``size``;
    default: ``[0, size)``) of the segment ``name`` now: ``ShmFullError`` if ``/dev/shm``
    cannot hold them (:meth:`Region.back`, and a process that maps the segment by other
    means)."""
    spans = [(0, size)] if ranges is None else ranges
    with limits.named_errors(f"backing the shared-memory region {name}",
                             sum(n for _, n in spans)):
        shm = posix_ipc.SharedMemory(name)
        try:
            for offset, length in spans:
                _back(shm.fd, offset, min(length, size - offset), name)
        finally:
            shm.close_fd()


class Region:
    """A mapped shared-memory segment. Use :meth:`create` or :meth:`attach`."""

    __slots__ = ("_name", "_size", "_mmap", "_buf", "_owner", "_unlinked", "_pid", "__weakref__")

    def __init__(self, name: str, mm: mmap.mmap, size: int, owner: bool) -> None:
        self._name = name
        self._size = size
        self._mmap: mmap.mmap | None = mm
        self._buf: memoryview | None = memoryview(mm)
        self._owner = owner
        self._unlinked = False
        self._pid = os.getpid()   # a forked child never unlinks (see unlink)

    def __del__(self) -> None:
        """An owner that lets go of the region without unlinking it (a program that drops
        it, an exception between its creation and its first use) unlinks its name then,
        in the process that made it: reference counting alone gives the name back, not
        only the exit hook of ``shm._registry``. Views of the mapping stay valid."""
        try:
            if self._owner and not self._unlinked and self._pid == os.getpid():
                self.unlink()
        except Exception:  # pragma: no cover - interpreter teardown, name gone already
            pass

    # -- construction -------------------------------------------------------

    @classmethod
    def create(cls, size: int, kind: str = "region", prefault: bool = True,
               backed: int | list[tuple[int, int]] | None = None) -> "Region":
        """Create a new segment of ``size`` bytes (zero-filled), owned by this process.

        ``backed``: only the first ``backed`` bytes, or the ``(offset, length)`` ranges,
        are allocated now (default: all; see the module docstring); nothing may touch the
        rest before :meth:`back` did. Pre-faulted (``prefault``): the whole segment, or
        the ranges given (nothing of a first ``backed`` bytes)."""
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise ValueError(f"region size must be a positive int of bytes, got {size!r}")
        with limits.named_errors(f"creating a shared-memory region of {size} bytes", size):
            _check_room(size, prefault)
            name = naming.new_name(kind)
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=size)
            _registry.register(name, "shm")
            try:
                os.fchmod(shm.fd, 0o600)  # whatever the umask said
                whole = backed is None or (isinstance(backed, int) and backed >= size)
                spans = ([(0, size)] if backed is None or whole   # (None: for mypy)
                         else [(0, max(0, backed))] if isinstance(backed, int) else backed)
                for offset, length in spans:
                    _back(shm.fd, offset, min(length, size - offset), name)
                mm = _map(shm.fd, size, prefault and whole, fresh=True, name=name)
                if prefault and isinstance(backed, list):
                    _populate(mm, spans, name)
            except BaseException:
                _registry.unlink_name(name, "shm")
                raise
            finally:
                shm.close_fd()
        _log.debug("created region %s (%d bytes)", name, size)
        return cls(name, mm, size, owner=True)

    @classmethod
    def attach(cls, name: str, prefault: bool = True, readonly: bool = False) -> "Region":
        """Map the existing segment ``name`` (as returned by :attr:`name`).

        ``readonly``: mapped for reading only (``buf`` is a read-only memoryview; a write
        through a pointer into it faults), never pre-faulted."""
        with limits.named_errors(f"opening the shared-memory region {name}"):
            try:
                shm = posix_ipc.SharedMemory(name, read_only=readonly)
            except posix_ipc.ExistentialError as exc:
                raise ShmError(f"no shared-memory region named {name!r}: {exc}") from exc
            try:
                size = shm.size
                if size <= 0:
                    raise ShmError(f"shared-memory region {name!r} has size {size}; "
                                   "expected a positive size (not yet sized by its creator?)")
                mm = _map(shm.fd, size, prefault, fresh=False, name=name, readonly=readonly)
            finally:
                shm.close_fd()
        return cls(name, mm, size, owner=False)

    def populate(self, ranges: list[tuple[int, int]]) -> None:
        """Fault in the pages of ``ranges`` (``(offset, length)`` each) writable now, as a
        pre-faulted mapping has them; pages that are backed only (see :meth:`back`)."""
        mm = self._mmap
        if mm is None:
            raise ShmClosedError(f"region {self._name} is closed in this process")
        _populate(mm, ranges, self._name)

    def back(self, ranges: list[tuple[int, int]] | None = None) -> None:
        """Allocate the pages of ``ranges`` (``(offset, length)`` each; default: the whole
        segment) now, in a segment made with ``backed``: raises ``ShmFullError`` if
        ``/dev/shm`` cannot hold them. Idempotent; in its owner, or in a process that
        attached it writable and is about to write those ranges."""
        if self._mmap is None:
            raise ShmClosedError(f"region {self._name} is closed in this process")
        back_segment(self._name, self._size, ranges)

    # -- properties ---------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def size(self) -> int:
        return self._size

    @property
    def owner(self) -> bool:
        """True in the process that created the region."""
        return self._owner

    @property
    def closed(self) -> bool:
        return self._mmap is None

    @property
    def buf(self) -> memoryview:
        """A memoryview of the whole mapping (writable unless attached ``readonly``)."""
        buf = self._buf
        if buf is None:
            raise ShmClosedError(f"region {self._name} is closed in this process")
        return buf

    def ndarray(self, dtype: Any, shape: Any, offset: int = 0) -> np.ndarray:
        """A numpy view of ``shape``/``dtype`` at byte ``offset``; keeps the mapping alive."""
        mm = self._mmap
        if mm is None:
            raise ShmClosedError(f"region {self._name} is closed in this process")
        dt = np.dtype(dtype)
        shp: tuple[int, ...] = ((int(shape),) if isinstance(shape, (int, np.integer))
                                else tuple(int(s) for s in shape))
        if any(s < 0 for s in shp):
            raise ValueError(f"shape must be non-negative, got {shp}")
        nbytes = dt.itemsize * math.prod(shp)
        if offset < 0 or offset + nbytes > self._size:
            raise ValueError(
                f"view of {nbytes} bytes ({dt}{list(shp)}) at offset {offset} does not fit "
                f"region {self._name} of {self._size} bytes")
        # numpy keeps a reference to the memoryview but not a buffer export;
        # the memoryview's export is what keeps mm from being unmapped, so it
        # must be a fresh one that nobody ever releases.
        return np.ndarray(shp, dtype=dt, buffer=memoryview(mm)[offset:offset + nbytes])

    # -- lifetime -----------------------------------------------------------

    def close(self) -> None:
        """Stop using the region in this process (idempotent).

        Views handed out earlier stay valid: the unmapping happens when the
        last of them is garbage-collected.
        """
        mm = self._mmap
        # .buf may be held by callers (numpy arrays over it hold a reference
        # but no buffer export), so it is dropped, never released: while
        # anyone holds it, it keeps the mapping alive and mm.close() refuses.
        self._mmap = self._buf = None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                _log.debug("region %s: views still alive; unmapping when they die", self._name)

    def unlink(self) -> None:
        """Destroy the name (idempotent). Mappings stay valid until closed.

        Only in the process that made this object: in a process forked from it, the
        name is the parent's (or its peer's) and this does nothing."""
        if self._unlinked:
            return
        if self._pid != os.getpid():
            _log.debug("region %s: not unlinked by process %d, a fork of its user %d",
                       self._name, os.getpid(), self._pid)
            return
        self._unlinked = True
        _registry.unlink_name(self._name, "shm")

    def __enter__(self) -> "Region":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        if self._owner:
            self.unlink()

    def __repr__(self) -> str:
        state = "closed" if self._mmap is None else "open"
        return f"Region({self._name!r}, size={self._size}, owner={self._owner}, {state})"
