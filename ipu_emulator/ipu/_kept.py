"""Built executables a warm IPU process keeps between the hosts a daemon lends it to.

A LOAD builds an interpreter (``ipu_emulator.ipu.interpreter``): the executable decoded,
its onnxruntime sessions, its programs compiled into steps whose numpy views and
onnxruntime bindings point at the device memory region and at the constants region the
host made. A pool IPU process (``DeviceOptions.pool``) serves host after host, often of
the same model; :class:`KeptBuilds` lets the next host's LOAD of the same executable
take the built one instead of building it again.

What a built executable points at is the host's: so it is built over address ranges of
this process's own (:class:`Span`: an anonymous mapping, reserved for it), and each
host's regions are mapped over those ranges (``MAP_FIXED``) while that host has it
loaded: every view and binding then reads and writes that host's regions, and nothing
in the interpreter changes. When the host lets go (its session unloaded, closed, dropped,
dead) anonymous memory is mapped back over the ranges: no page of a host stays mapped
after it, and what the process keeps depends on no host.

Kept: executables that carry their weights (no weights region or file, which are the
host's), at most ``KEPT_BYTES`` long, keyed by their bytes, the constant streams' layout
in the constants region and the interpreter's options; the last ``KEPT`` unused ones
(the least recently used beyond that are closed). Not kept: one whose run was cut short
(a host gone mid-run: it may hold a transfer), one whose bind failed. The kept ones are
closed with the process's executables (:meth:`KeptBuilds.close`).
"""

from __future__ import annotations

import collections
import ctypes
import mmap
import os
from typing import Any, Hashable

import numpy as np
import posix_ipc

from shm import ShmError
from shm.region import back_segment

from ipu_emulator.ipu._stream_io import _RequestError
from ipu_emulator.ipu_protocol import ErrorKind

__all__ = ["KEPT", "KEPT_BYTES", "Kept", "KeptBuilds", "Span"]

KEPT = 2                  # unused built executables a pool IPU process keeps
KEPT_BYTES = 4 << 20      # ... each at most this large (its bytes, without weights)

_PAGE = mmap.PAGESIZE
_MAP_FIXED = 0x10         # <sys/mman.h>, Linux
_libc = ctypes.CDLL(None, use_errno=True)
_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                  ctypes.c_long]


class Span:
    """An address range of this process (``need`` bytes, whole pages) over which a
    host's region is mapped (:meth:`map`) and anonymous memory again (:meth:`clear`).
    ``view``: its first ``need`` bytes (read-only for a ``readonly`` span)."""

    def __init__(self, need: int, readonly: bool) -> None:
        self.need = need
        self.size = max(_PAGE, -(-need // _PAGE) * _PAGE)
        self.readonly = readonly
        self._mm: mmap.mmap | None = mmap.mmap(-1, self.size)
        self.addr = int(np.frombuffer(self._mm, dtype=np.uint8).ctypes.data)
        view = memoryview(self._mm)[:need]
        self.view = view.toreadonly() if readonly else view
        self.bound: str | None = None   # the region mapped over it now

    def map(self, name: str, what: str) -> None:
        """Map region ``name`` over the range (the host's ``what``); _RequestError if it
        cannot be opened or is shorter than the range needs."""
        try:
            shm = posix_ipc.SharedMemory(name, read_only=self.readonly)
        except (posix_ipc.Error, OSError) as exc:
            raise _RequestError(ErrorKind.PROTOCOL, f"cannot open {what} {name}: {exc}"
                                ) from None
        try:
            if shm.size < self.need:
                raise _RequestError(ErrorKind.PROTOCOL, f"{what} {name} of {shm.size} bytes "
                                    f"is shorter than the {self.need} bytes it holds")
            prot = mmap.PROT_READ | (0 if self.readonly else mmap.PROT_WRITE)
            self._fixed(prot, mmap.MAP_SHARED, shm.fd, f"mapping {what} {name}")
            self.bound = name
        finally:
            shm.close_fd()

    def back(self, ranges: list[tuple[int, int]], what: str) -> None:
        """Allocate the pages of ``ranges`` of the region mapped now (``/dev/shm`` full:
        an SHM_FULL error naming it, not SIGBUS at a first touch)."""
        name = self.bound
        if name is None or not ranges:
            return
        try:
            back_segment(name, self.need, ranges)
        except ShmError as exc:
            raise _RequestError(ErrorKind.SHM_FULL, f"{what} {name}: {exc}") from None

    def clear(self) -> None:
        """Anonymous memory over the range again: the host's region is no longer mapped."""
        if self.bound is not None and self._mm is not None:
            self._fixed(mmap.PROT_READ | mmap.PROT_WRITE,
                        mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, "clearing a kept range")
        self.bound = None

    def _fixed(self, prot: int, flags: int, fd: int, what: str) -> None:
        got = _mmap(self.addr, self.size, prot, flags | _MAP_FIXED, fd, 0)
        if got != self.addr:
            err = ctypes.get_errno()
            raise _RequestError(ErrorKind.PROTOCOL, f"{what}: mmap failed: "
                                f"{os.strerror(err)}")

    def close(self) -> None:
        """Unmap the range (once nothing views it: the interpreter was closed first)."""
        mm, self._mm = self._mm, None
        self.bound = None
        if mm is not None:
            try:
                self.view.release()
                mm.close()
            except BufferError:   # a view still alive (a failed build's traceback): the
                pass              # range, anonymous now, is unmapped when it dies


class Kept:
    """One built executable over its own ranges: ``interp`` computes in ``memory`` (the
    host's device memory region) and reads its constants in ``constants``."""

    def __init__(self, key: Hashable, memory: Span, constants: Span | None) -> None:
        self.key = key
        self.memory = memory
        self.constants = constants
        self.interp: Any = None
        self.ranges: list[tuple[int, int]] = []   # device memory backed for each host

    def bind(self, memory: str, constants: str | None) -> None:
        """Map a host's regions over the ranges, its device memory backed."""
        self.memory.map(memory, "device memory")
        if self.constants is not None:
            if constants is None:
                raise _RequestError(ErrorKind.PROTOCOL, "LOAD names constant streams but no "
                                    "constants region")
            self.constants.map(constants, "the constants region")
        self.memory.back(self.ranges, "device memory")

    def unbind(self) -> None:
        self.memory.clear()
        if self.constants is not None:
            self.constants.clear()

    def reusable(self) -> bool:
        """Whether nothing of the last host is left in it (no transfer held by a run
        that was cut short)."""
        interp = self.interp
        return interp is not None and not interp.closed and not interp.holds_transfers()

    def close(self) -> None:
        interp, self.interp = self.interp, None
        if interp is not None:
            interp.close()
        self.unbind()
        self.memory.close()
        if self.constants is not None:
            self.constants.close()


class KeptBuilds:
    """The unused built executables of this process, the least recently used first."""

    def __init__(self) -> None:
        self._kept: collections.OrderedDict[Hashable, Kept] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def take(self, key: Hashable) -> Kept | None:
        return self._kept.pop(key, None)

    def give_back(self, kept: Kept) -> None:
        """``kept``'s host let go: its ranges cleared, it is kept if it can serve another
        (else closed), the least recently used beyond ``KEPT`` closed."""
        try:
            kept.unbind()
        except Exception:   # pragma: no cover - mmap over our own range failed
            kept.close()
            raise
        if not kept.reusable():
            kept.close()
            return
        old = self._kept.pop(kept.key, None)
        if old is not None:
            old.close()
        self._kept[kept.key] = kept
        while len(self._kept) > KEPT:
            self._kept.popitem(last=False)[1].close()

    def close(self) -> None:
        kept, self._kept = list(self._kept.values()), collections.OrderedDict()
        for one in kept:
            one.close()
