"""LOAD: an executable made ready to run on this IPU, with the host's stream rings.

The host names a spec region (``ipu_protocol.decode_load_spec``: the spec, then the
executable). :meth:`Loader.load` reuses the cached copy of that session's executable
or builds it (:meth:`Loader.build`: decode, check it fits, map the shared constants,
weights and device memory, make the interpreter, check the body checksum), then
attaches the stream rings. Everything opened on the way is pushed on one
``ExitStack``: a failure at any step closes what was opened, in reverse, in one place.

A warm IPU process a daemon lends (``DeviceOptions.pool``) also keeps the last few
executables it decoded (:class:`Decoded`), by their bytes: a host that loads the same
executable as an earlier one (the same model, another process) gets a copy of the
decoded and checked one instead of decoding, checksumming and validating it again.
Only executables that carry their weights (no weights region or file, which are the
host's objects) and are small are kept; the key is the whole of their bytes, never a
name of the host's.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import mmap
import time
import traceback
import weakref
from typing import Any, Callable

import posix_ipc

from shm import Region, Ring, ShmError
from shm.settings import ShmSettings

from ipu_emulator import ipu_protocol, package_hash
from ipu_emulator.errors import ExecutableError
from ipu_emulator.executable import Executable, ExecutableHeader, body_crc32, read_header
from ipu_emulator.fit import misfit
from ipu_emulator.ipu._constants import memory_ranges
from ipu_emulator.ipu._fault_injection import FaultInjector
from ipu_emulator.ipu._host_memory import HostMemory
from ipu_emulator.ipu._kept import KEPT_BYTES, Kept, KeptBuilds, Span
from ipu_emulator.ipu._options import DeviceOptions
from ipu_emulator.ipu._stream_io import _Loaded, _RequestError, _Stream
from ipu_emulator.ipu._weights_file import (Checksum, drop_pages, map_weights_file,
                                            same_file, unmap)
from ipu_emulator.ipu_protocol import ErrorKind, LoadConstants, LoadSpec, LoadStream
from ipu_emulator.settings import IpuSettings

__all__ = ["Executables", "Loader", "constant_handles"]

_log = logging.getLogger("ipu_emulator.ipu.process")

CACHE = 4        # loaded executables kept per device (sessions sharing it)
_CRC_APART = 1 << 20   # weights sections this large are checksummed while sessions are made
_PREFAULT_MAX = 512 * 1024   # pre-fault stream rings with transfers up to this size
KEPT_DECODED = 4                  # decoded executables a pool IPU process keeps
KEPT_DECODED_BYTES = 4 << 20      # ... each at most this large


class Executables:
    """The executables loaded on this IPU (the last ``CACHE``, by load key), the active
    one, and the host memory their runs read in place."""

    def __init__(self, host_memory: HostMemory) -> None:
        self.cache: collections.OrderedDict[str, _Loaded] = collections.OrderedDict()
        self.active: _Loaded | None = None
        self.host_memory = host_memory

    def take(self, key: str, fresh: bool, spec_region: str) -> _Loaded | None:
        """The cached executable of ``key`` if it can serve this LOAD (else closed)."""
        loaded = self.cache.pop(key, None)
        if loaded is not None and (fresh or not loaded.regions
                                   or loaded.regions[0].name != spec_region):
            loaded.close()
            loaded = None
        return loaded

    def put(self, loaded: _Loaded) -> None:
        """``loaded`` is the active executable now (the oldest beyond CACHE closed)."""
        loaded.stopped = False
        self.cache[loaded.key] = loaded
        self.active = loaded
        while len(self.cache) > CACHE:
            _, old = self.cache.popitem(last=False)
            old.close()

    def unload(self, key: str) -> None:
        loaded = self.cache.pop(key, None)
        if loaded is not None:
            if self.active is loaded:
                self.active = None
            loaded.close()
        self.host_memory.sweep()

    def close(self) -> None:
        """Close every executable and the host memory views."""
        self.detach()()

    def detach(self) -> Callable[[], None]:
        """Forget every executable and the host memory views now; what closes them
        (their rings, regions and sessions), to call once (e.g. after the answer)."""
        loaded = list(self.cache.values())
        self.cache.clear()
        self.active = None
        regions = self.host_memory.detach()

        def close() -> None:
            for one in loaded:
                one.close()
            for region in regions:
                region.close()
        return close


class Decoded:
    """The last ``KEPT_DECODED`` executables decoded, by their bytes (see the module
    docstring): each decoded, checksummed and validated once."""

    def __init__(self) -> None:
        self._kept: collections.OrderedDict[bytes, Executable] = collections.OrderedDict()

    def get(self, data: bytes) -> Executable | None:
        """A copy of the executable ``data`` decodes to, if kept (the interpreter may
        change the copy's fields, not the kept one's)."""
        exe = self._kept.get(data) if len(data) <= KEPT_DECODED_BYTES else None
        if exe is None:
            return None
        self._kept.move_to_end(data)
        return dataclasses.replace(exe)

    def put(self, data: bytes, exe: Executable) -> Executable:
        """Keep ``exe`` (decoded from ``data`` alone); a copy of it to use."""
        if len(data) > KEPT_DECODED_BYTES:
            return exe
        self._kept[data] = exe
        while len(self._kept) > KEPT_DECODED:
            self._kept.popitem(last=False)
        return dataclasses.replace(exe)


def _attach(name: str, what: str, readonly: bool = False) -> Region:
    try:
        return Region.attach(name, prefault=False, readonly=readonly)
    except (ShmError, OSError, posix_ipc.Error) as exc:
        raise _RequestError(ErrorKind.PROTOCOL, f"cannot open {what} {name}: {exc}") from None


class Loader:
    """Serves LOAD for one IPU process."""

    def __init__(self, options: Callable[[], DeviceOptions], executables: Executables,
                 faults: FaultInjector, known: set[str],
                 settings: IpuSettings | None = None) -> None:
        self._options = options   # the current ones (pool mode changes them)
        self._settings = settings if settings is not None else IpuSettings.current()
        self._executables = executables
        self._faults = faults
        self._known = known       # every shared-memory object name seen (cleanup)
        self.interpreter_cls: Any = None
        pool = options().pool   # lent to host after host: what serves the next one is kept
        self._decoded = Decoded() if pool else None
        self._kept = KeptBuilds() if pool else None

    def close(self) -> None:
        """Close the built executables kept for later hosts (after every loaded one)."""
        kept, self._kept = self._kept, None
        if kept is not None:
            kept.close()

    def load(self, body: Any) -> None:
        body = body or {}
        name = body.get("spec_region")
        if not isinstance(name, str):
            raise _RequestError(ErrorKind.PROTOCOL, "LOAD needs a 'spec_region' name")
        self._faults.set_host_tables(body.get("faults"), self._known)
        self._known.add(name)
        with contextlib.ExitStack() as undo:
            region = _attach(name, "load spec")
            undo.callback(region.close)
            try:
                spec = ipu_protocol.decode_load_spec(region.buf)
            except ipu_protocol.ProtocolError as exc:
                raise _RequestError(ErrorKind.PROTOCOL, str(exc)) from None
            loaded = self._executables.take(spec.key, spec.fresh, name)
            if loaded is None:
                loaded = self.build(spec, region)
            else:
                loaded.close_streams()
            undo.callback(loaded.close)
            self._attach_streams(loaded, spec.streams)
            _check_streams(loaded)
            undo.pop_all()
        if loaded.regions[0] is not region:   # the cached copy has its own
            region.close()
        self._executables.put(loaded)

    def build(self, spec: LoadSpec, region: Region) -> _Loaded:
        """The executable the spec region holds, made ready to run (its interpreter)."""
        with contextlib.ExitStack() as undo:
            t0 = time.monotonic()
            off, size = spec.executable_offset, spec.executable_size
            data = bytes(region.buf[off:off + size])
            header = self._checked_header(spec, data)
            key = self._kept_key(spec, data, header)
            if key is not None:
                return self._build_kept(key, spec, region, data, header.name)
            regions = [region]
            constants = self._constants(spec.constants, regions, undo)
            weights, file_map, trusted = self._weights(spec, header.total_length - size,
                                                       regions, undo)
            # the checksum over large weights is computed while onnxruntime loads them
            crc = Checksum(data, weights) if weights is not None \
                and len(weights) >= _CRC_APART and not trusted else None
            if crc is not None:
                undo.callback(crc.wait)   # it reads the weights: done before they go
            exe = self._decode(data, weights, crc is None and not trusted)
            memory = self._memory(spec.memory_region, exe, constants, regions, undo)
            t1 = time.monotonic()
            try:
                interp = self._interpreter(spec, exe, memory, constants, file_map is not None)
            finally:
                got = crc.result() if crc is not None else header.body_crc32
            undo.callback(interp.close)
            if trusted and spec.weights_file is not None and not same_file(spec.weights_file):
                assert weights is not None   # changed while read: check it here
                got = body_crc32(data, weights)
            if file_map is not None:
                del exe   # its views of the file go with it, unless the interpreter's
                if getattr(interp, "uses_weights", False):
                    drop_pages(file_map)   # held by the interpreter's views (read again)
                else:
                    unmap(file_map, weights)
            if got != header.body_crc32:
                raise _RequestError(ErrorKind.EXECUTABLE, f"body checksum mismatch: computed "
                                    f"{got:#010x}, header says {header.body_crc32:#010x} "
                                    "(damaged)")
            _log.debug("executable %r: decoded in %.3f s, sessions made in %.3f s",
                       header.name, t1 - t0, time.monotonic() - t1)
            if spec.weights_region and not getattr(interp, "uses_weights", True):
                # onnxruntime took its own (prepacked) copy: the shared one is not needed
                del exe, weights
                regions.pop(-2 if spec.memory_region else -1).close()
            undo.pop_all()
        return _Loaded(spec.key, interp, regions)

    def _kept_key(self, spec: LoadSpec, data: bytes, header: ExecutableHeader) -> Any:
        """The key of this LOAD's build among the kept ones (``ipu_emulator.ipu._kept``), or
        None where it is not kept: not a pool process, weights apart (the host's region or
        file), no device memory region, too large."""
        if (self._kept is None or spec.weights_file is not None or spec.weights_region
                or not spec.memory_region or header.total_length != len(data)
                or len(data) > KEPT_BYTES):
            return None
        consts = spec.constants
        layout = tuple((c.handle, c.offset, c.nbytes) for c in consts.streams) if consts else None
        s = self._settings
        return (data, layout, self._options().threads, spec.prepack, s.prepack, s.zero_copy)

    def _build_kept(self, key: Any, spec: LoadSpec, region: Region, data: bytes,
                    name: str) -> _Loaded:
        """The executable of ``data`` built over ranges of this process onto which the
        host's device memory and constants regions are mapped: a kept build if there is
        one (else one built now), handed back to be kept when the host lets go."""
        kept_builds = self._kept
        assert kept_builds is not None and spec.memory_region
        consts = spec.constants
        self._known.add(spec.memory_region)
        if consts:
            self._known.add(consts.region)
        kept = kept_builds.take(key)
        try:
            if kept is None:
                kept = self._new_kept(key, spec, data)
                _log.debug("executable %r: built (kept for later hosts)", name)
            else:
                kept.bind(spec.memory_region, consts.region if consts else None)
                _log.debug("executable %r: a kept build reused", name)
        except BaseException:
            if kept is not None:
                kept.close()
            raise
        loaded = _Loaded(spec.key, kept.interp, [region])
        loaded.give_back = functools.partial(self._give_back, kept)
        return loaded

    def _new_kept(self, key: Any, spec: LoadSpec, data: bytes) -> Kept:
        """A build of ``data`` over new ranges, bound to this LOAD's regions."""
        assert spec.memory_region
        exe = self._decode(data, None, True)
        consts = spec.constants
        need = max((c.offset + c.nbytes for c in consts.streams), default=1) if consts else 0
        kept = Kept(key, Span(max(1, exe.memory_bytes), readonly=False),
                    Span(max(1, need), readonly=True) if consts else None)
        try:
            constants = None
            if consts and kept.constants is not None:
                view = kept.constants.view
                constants = {c.handle: view[c.offset:c.offset + c.nbytes]
                             for c in consts.streams}
            kept.ranges = memory_ranges(exe, constants)
            kept.bind(spec.memory_region, consts.region if consts else None)
            kept.interp = self._interpreter(spec, exe, kept.memory.view[:exe.memory_bytes],
                                            constants, False)
        except BaseException:
            kept.close()
            raise
        return kept

    def _give_back(self, kept: Kept) -> None:
        """A kept build's host let go of it (unloaded, closed, dropped)."""
        if self._kept is not None:
            self._kept.give_back(kept)
        else:
            kept.close()

    def _decode(self, data: bytes, weights: memoryview | None, checksum: bool) -> Executable:
        """The executable of ``data`` (and ``weights``), decoded and validated."""
        kept = self._decoded if weights is None else None
        exe = kept.get(data) if kept is not None else None
        if exe is not None:
            return exe
        try:
            exe = Executable.from_bytes(data, weights=weights, checksum=checksum)
        except ExecutableError as exc:
            raise _RequestError(ErrorKind.EXECUTABLE, str(exc)) from None
        return kept.put(data, exe) if kept is not None and checksum else exe

    def _checked_header(self, spec: LoadSpec, data: bytes) -> ExecutableHeader:
        """The executable's header, checked against this runtime and this device."""
        try:
            header = read_header(data)
        except ExecutableError as exc:
            raise _RequestError(ErrorKind.EXECUTABLE, str(exc)) from None
        runtime_hash = package_hash()
        if spec.check_package_hash and header.package_hash != runtime_hash:
            raise _RequestError(ErrorKind.PACKAGE_HASH,
                                f"package hash {header.package_hash} differs from runtime "
                                f"hash {runtime_hash}")
        o = self._options()
        wrong = misfit(header.name, header.ipu_version,
                       max(header.memory_bytes, header.required_bytes),
                       header.num_ipus, device=o.describe(), device_version=o.ipu_version,
                       device_ipus=o.num_ipus, tiles_per_ipu=o.tiles_per_ipu,
                       memory_per_tile=o.memory_per_tile)
        if wrong is not None:
            raise _RequestError(*wrong)
        return header

    def _constants(self, consts: LoadConstants | None, regions: list[Region],
                   undo: contextlib.ExitStack) -> dict[str, memoryview] | None:
        """Constant streams: one read-only region for every replica (_constants)."""
        if not consts:
            return None
        c_name = consts.region
        self._known.add(c_name)
        c_region = _attach(c_name, "the constants region", readonly=True)
        undo.callback(c_region.close)
        buf = c_region.buf
        if any(c.offset + c.nbytes > len(buf) for c in consts.streams):
            raise _RequestError(ErrorKind.PROTOCOL, f"constants region {c_name} of "
                                f"{len(buf)} bytes is shorter than its streams")
        regions.append(c_region)
        return {c.handle: buf[c.offset:c.offset + c.nbytes] for c in consts.streams}

    def _weights(self, spec: LoadSpec, length: int, regions: list[Region],
                 undo: contextlib.ExitStack
                 ) -> tuple[memoryview | None, mmap.mmap | None, bool]:
        """The weights section when it is not in the spec region: (view, the file mapping
        if it is read from the host's file, whether that file is the one the host read
        and checks: no second checksum here)."""
        w_file = spec.weights_file
        if w_file is not None:   # with prepacking: prepacked by onnxruntime from where it
            # lies (no copy first); the mapping stays while onnxruntime may read it, its
            # pages let go
            file_map, weights, trusted = map_weights_file(w_file, length)
            undo.callback(unmap, file_map, weights)
            return weights, file_map, trusted
        w_name = spec.weights_region
        if not w_name:
            return None, None, False
        # shared by every replica: mapped read-only, used where it lies
        self._known.add(w_name)
        w_region = _attach(w_name, "the weights region", readonly=True)
        undo.callback(w_region.close)
        regions.append(w_region)
        return w_region.buf[:max(0, length)], None, False

    def _memory(self, mem_name: str | None, exe: Executable,
                constants: dict[str, memoryview] | None, regions: list[Region],
                undo: contextlib.ExitStack) -> memoryview | None:
        """The device memory region, backed where the executable will touch it."""
        if not mem_name:
            return None
        self._known.add(mem_name)
        mem_region = _attach(mem_name, "device memory")
        undo.callback(mem_region.close)
        regions.append(mem_region)
        try:   # the pages it will touch, allocated now: /dev/shm full is named here
            mem_region.back(memory_ranges(exe, constants))
        except ShmError as exc:
            raise _RequestError(ErrorKind.SHM_FULL, f"device memory {mem_name}: {exc}"
                                ) from None
        return mem_region.buf[:exe.memory_bytes]

    def _interpreter(self, spec: LoadSpec, exe: Executable, memory: memoryview | None,
                     constants: dict[str, memoryview] | None, from_file: bool) -> Any:
        prepack = True if from_file else spec.prepack
        # decoded by Executable.from_bytes, which validates; the settings read once
        s = self._settings
        kwargs: dict[str, Any] = {"validated": True, "zero_copy": s.zero_copy,
                                  "prepack": s.prepack if prepack is None else prepack}
        if from_file:
            kwargs["weights_kept"] = True
        if constants is not None:
            kwargs["constants"] = constants
        try:
            return self.interpreter_cls(exe, device_memory=memory,
                                        num_threads=self._options().threads, **kwargs)
        except Exception as exc:
            raise _RequestError(ErrorKind.PROGRAM, f"cannot prepare the executable: {exc}",
                                traceback.format_exc()) from None

    def _attach_streams(self, loaded: _Loaded, streams: tuple[LoadStream, ...]) -> None:
        """Open the host's stream rings, checked against the executable's streams. A
        constant stream's ring is never read nor written (its values come in the
        constants region): it is not opened."""
        exe_streams = loaded.interp.executable.streams
        constant = constant_handles(loaded)
        loaded.steps.clear()
        settings = ShmSettings.current()   # once for every ring
        segments: dict[str, Any] = {}   # the packed segments mapped (shm/_packed.py)
        for i, s in enumerate(streams):
            self._known.add(s.ring)
            handle, direction, nbytes = s.handle, s.direction, s.nbytes
            want = exe_streams.get(handle)
            if want is not None and (want.direction != direction or want.nbytes != nbytes):
                raise _RequestError(
                    ErrorKind.PROTOCOL, f"stream {handle!r}: the host offers {direction} x "
                    f"{nbytes} bytes, the executable has {want.direction} x {want.nbytes} "
                    "bytes")
            ring = None if handle in constant else self._ring(s, settings, segments)
            st = _Stream(i, handle, direction, nbytes, ring, s.mode)
            loaded.streams.append(st)
            loaded.by_handle[st.handle] = st

    @staticmethod
    def _ring(s: LoadStream, settings: ShmSettings, segments: dict[str, Any]) -> Ring:
        """The ring of stream ``s``, opened and checked (its slots hold a transfer)."""
        try:
            ring = Ring.attach(s.ring, prefault=s.nbytes <= _PREFAULT_MAX, settings=settings,
                               segments=segments)
        except (ShmError, OSError, posix_ipc.Error) as exc:
            raise _RequestError(ErrorKind.PROTOCOL, f"cannot open the ring of stream "
                                f"{s.handle!r}: {exc}") from None
        if ring.slot_size < s.nbytes:
            ring.close()
            raise _RequestError(ErrorKind.PROTOCOL, f"stream {s.handle!r}: ring slots of "
                                f"{ring.slot_size} bytes, transfers of {s.nbytes}")
        return ring


def constant_handles(loaded: _Loaded) -> set[str]:
    """The constant streams of ``loaded`` (``ipu_emulator.ipu._constants``): their rings are
    never read, nor written by the host."""
    plan = getattr(loaded.interp, "constants", None)
    return set(plan.shared) | set(plan.copied) if plan is not None else set()


# per interpreter: (direction, handle) -> its programs that stream it (a kept build serves
# host after host: worked out once)
_streaming: "weakref.WeakKeyDictionary[Any, dict[tuple[str, str], set[int]]]" = (
    weakref.WeakKeyDictionary())


def _check_streams(loaded: _Loaded) -> None:
    """Every stream the host connected is one some program transfers (ipu_emulator.validate):
    else the host would wait on it forever."""
    from ipu_emulator.validate import RuleError, check_loaded_streams, programs_streaming

    interp = loaded.interp
    used = _streaming.get(interp)
    if used is None:
        used = _streaming[interp] = programs_streaming(interp.executable)
    try:
        check_loaded_streams(interp.executable,
                             [(s.handle, s.direction) for s in loaded.streams], used)
    except RuleError as exc:
        raise _RequestError(ErrorKind.PROGRAM, f"DeviceProgramError: executable "
                            f"{loaded.interp.executable.name!r} cannot serve this host: "
                            f"{exc}") from None
