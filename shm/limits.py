"""What the operating system refused, named: file descriptors, /dev/shm room, file size.

Creating a region, a ring or an IPU process can fail because a
limit was reached, and the raw error hides which: ``posix_ipc`` reports EMFILE
as ``OSError("This process already has the maximum number of files open")``
with no errno, EFBIG from ``ftruncate`` (a size above ``RLIMIT_FSIZE``) as
``ValueError("The size is too large")``, ENOMEM of a semaphore as a bare
``MemoryError``. This module is the one place such errors are recognised
(:func:`errno_of`) and turned into a named error (:func:`named_error`) that
says what happened with the numbers that matter:

=================  ==========================  =====================================
errno              class                       the message gives
=================  ==========================  =====================================
EMFILE, ENFILE     OutOfFileDescriptorsError   RLIMIT_NOFILE soft/hard, fds open
ENOSPC, ENOMEM     ShmFullError                bytes needed, bytes free in /dev/shm
EFBIG              FileSizeLimitError          bytes needed, RLIMIT_FSIZE soft/hard
=================  ==========================  =====================================

``with named_errors("a region of 4096 bytes", 4096): ...`` wraps the system
calls of one creation; ``Region``, ``Ring`` and the IPU process launcher use
it, and the host runtime maps the classes to its own at its boundary.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
from typing import Iterator

from . import naming
from .errors import FileSizeLimitError, OutOfFileDescriptorsError, ShmError, ShmFullError

__all__ = ["errno_of", "memory_available", "named_error", "named_errors", "open_fds",
           "shm_full", "shm_room"]

# posix_ipc's fixed texts for errnos it reports without one (posix_ipc 1.x)
_POSIX_IPC_TEXT = {
    "This process already has the maximum number of files open": errno.EMFILE,
    "The system limit on the total number of open files has been reached": errno.ENFILE,
    "The size is too large": errno.EFBIG,
    "Not enough memory": errno.ENOMEM,
}
_FD_PROBE_LIMIT = 1 << 16


def errno_of(exc: BaseException) -> int | None:
    """The errno behind ``exc``: its own, or the one a posix_ipc text stands for."""
    code = getattr(exc, "errno", None) if isinstance(exc, OSError) else None
    if isinstance(code, int) and code:
        return code
    if (isinstance(exc, (OSError, ValueError, MemoryError)) and len(exc.args) == 1
            and isinstance(exc.args[0], str)):
        return _POSIX_IPC_TEXT.get(exc.args[0])
    return None


def open_fds() -> int | None:
    """How many file descriptors this process has open (None if it cannot tell).

    Listing /proc/self/fd takes a descriptor itself; when none is left, the
    descriptor numbers below the soft limit are probed with ``fstat`` instead.
    """
    try:
        return len(os.listdir("/proc/self/fd")) - 1     # less the listing's own
    except OSError:
        pass
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY or soft > _FD_PROBE_LIMIT:
        return None
    n = 0
    for fd in range(soft):
        try:
            os.fstat(fd)
        except OSError:
            continue
        n += 1
    return n


def shm_room() -> tuple[int, int] | None:
    """(free, total) bytes of /dev/shm, or None when it cannot be asked."""
    try:
        st = os.statvfs(naming.SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def memory_available() -> int:
    """Bytes of memory available to new allocations without swapping (``MemAvailable`` of
    ``/proc/meminfo``, as ``psutil.virtual_memory().available`` says on Linux; read here
    so that a runner's start does not import psutil for it)."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    import psutil   # no /proc/meminfo, or a kernel without MemAvailable

    return int(psutil.virtual_memory().available)


def _limit(v: int) -> str:
    return "unlimited" if v == resource.RLIM_INFINITY else str(v)


def named_error(exc: BaseException, what: str, nbytes: int | None = None) -> ShmError | None:
    """``exc`` (raised while ``what``, e.g. "creating a region of 4096 bytes") as a named
    error, or None when it is not one of the limits above."""
    code = errno_of(exc)
    if code in (errno.EMFILE, errno.ENFILE):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        n = open_fds()
        has = f"this process has {n} open" if n is not None else "this process has all open"
        if code == errno.EMFILE:
            text = (f"out of file descriptors (EMFILE) {what}: {has} and its limit "
                    f"RLIMIT_NOFILE is {_limit(soft)} (hard {_limit(hard)}); close runners, "
                    "sessions or files it no longer uses, or raise the limit (ulimit -n, "
                    "resource.setrlimit)")
        else:
            text = (f"out of file descriptors (ENFILE) {what}: the system's table of open "
                    f"files is full (fs.file-max); {has}, its limit RLIMIT_NOFILE is "
                    f"{_limit(soft)} (hard {_limit(hard)}); close processes or files, or "
                    "raise fs.file-max")
        return OutOfFileDescriptorsError(text, errno=code, soft=soft, hard=hard, open_fds=n)
    if code in (errno.ENOSPC, errno.ENOMEM):
        return shm_full(what, nbytes, errno.errorcode.get(code, str(code)))
    if code == errno.EFBIG:
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        need = f"{nbytes} bytes" if nbytes is not None else "the size asked"
        text = (f"file size limit (EFBIG) {what}: {need} exceed RLIMIT_FSIZE of "
                f"{_limit(soft)} bytes (hard {_limit(hard)}), which bounds shared memory "
                "too; raise it (ulimit -f unlimited, resource.setrlimit)")
        return FileSizeLimitError(text, needed=nbytes, soft=soft, hard=hard)
    return None


def shm_full(what: str, nbytes: int | None, why: str | None = None) -> ShmFullError:
    """The error for /dev/shm too full for ``nbytes`` more (``why``: the errno's name)."""
    room = shm_room()
    need = f"{nbytes} bytes needed" if nbytes is not None else "more room needed"
    has = (f"{room[0]} bytes free of {room[1]}" if room is not None
           else "it cannot be asked how much it has")
    text = (f"{naming.SHM_DIR} full{f' ({why})' if why else ''} {what}: {need}, "
            f"{naming.SHM_DIR} has {has}; free it (ipu-emulator cleanup removes what dead "
            "processes left) or enlarge it (docker run --shm-size=...)")
    return ShmFullError(text, needed=nbytes, free=room[0] if room is not None else None)


@contextlib.contextmanager
def named_errors(what: str, nbytes: int | None = None) -> Iterator[None]:
    """Inside: an OS error of one of the limits above becomes its named ShmError
    (``__cause__`` keeps the original); anything else passes unchanged."""
    try:
        yield
    except ShmError:
        raise
    except (OSError, ValueError, MemoryError) as exc:
        named = named_error(exc, what, nbytes)
        if named is None:
            raise
        try:
            raise named from exc
        finally:   # this frame is in its traceback: holding it too would be a cycle
            del named
