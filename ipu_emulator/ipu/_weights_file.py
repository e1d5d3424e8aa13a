"""The weights section of an executable, read where it lies: the host's PopEF file,
mapped read-only (with prepacking, onnxruntime prepacks from it with no copy first), and
the body checksum over large weights computed on a thread of its own meanwhile."""

from __future__ import annotations

import logging
import mmap
import os
import threading
from ipu_emulator.executable import body_crc32
from ipu_emulator.ipu._stream_io import _RequestError
from ipu_emulator.ipu_protocol import ErrorKind, WeightsFile

__all__ = ["Checksum", "map_weights_file", "same_file", "drop_pages", "unmap"]

_log = logging.getLogger("ipu_emulator.ipu.process")
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


class Checksum:
    """The body checksum of an executable, computed on a thread of its own (zlib lets go
    of the GIL, as onnxruntime does while it makes a session)."""

    def __init__(self, data: bytes, weights: memoryview) -> None:
        self._value = 0
        self._error: BaseException | None = None

        def run() -> None:
            try:
                self._value = body_crc32(data, weights)
            except BaseException as exc:   # reported by result()
                self._error = exc
        self._thread = threading.Thread(target=run, name="ipu-checksum", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Until it is done (it reads the weights: before they are unmapped)."""
        self._thread.join()

    def result(self) -> int:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


def same_file(spec: WeightsFile) -> bool:
    """The file at the spec's path is still the one the host read (its identity)."""
    try:
        return _identity(os.stat(spec.path)) == list(spec.identity or [None])
    except OSError:
        return False


def _identity(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]


def map_weights_file(spec: WeightsFile, expected: int
                     ) -> tuple[mmap.mmap, memoryview, bool]:
    """A read-only mapping of the weights section in the host's PopEF file, and whether
    the file is the one the host read (its identity: the host checks its checksum)."""
    path, offset, length = spec.path, spec.offset, spec.length
    if length != expected:
        raise _RequestError(ErrorKind.PROTOCOL, f"weights file span of {length} bytes; the "
                            f"executable's weights section has {expected}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise _RequestError(ErrorKind.PROTOCOL, f"cannot open the weights file {path}: {exc}"
                            ) from None
    try:
        st = os.fstat(fd)
        same = bool(spec.identity) and _identity(st) == list(spec.identity)
        if st.st_size < offset + length:
            raise _RequestError(ErrorKind.EXECUTABLE, f"the weights file {path} is shorter "
                                f"than [{offset}, +{length}): changed since the host read it")
        base = offset - offset % mmap.ALLOCATIONGRANULARITY
        # populated at once: the checksum and onnxruntime read every page of it
        mm = mmap.mmap(fd, offset + length - base, flags=mmap.MAP_SHARED | _MAP_POPULATE,
                       prot=mmap.PROT_READ, offset=base)
    except OSError as exc:
        raise _RequestError(ErrorKind.PROTOCOL, f"cannot map the weights file {path}: {exc}"
                            ) from None
    finally:
        os.close(fd)
    return mm, memoryview(mm)[offset - base:offset - base + length], same


def drop_pages(mm: mmap.mmap) -> None:
    """Let go of the pages of a read-only file mapping this process read (they are the
    page cache's: a later read maps them again), so that they count as this process's
    memory only where it reads them again."""
    try:
        mm.madvise(mmap.MADV_DONTNEED)
    except (OSError, AttributeError, ValueError):
        _log.debug("cannot drop the pages of the weights file mapping", exc_info=True)


def unmap(mm: mmap.mmap, view: memoryview | None) -> None:
    try:
        if view is not None:
            view.release()
        mm.close()
    except BufferError:   # a view still alive somewhere: unmapped when it dies
        _log.debug("weights file mapping still in use; unmapped when its views die")
