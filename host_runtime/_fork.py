"""Objects that cannot cross ``fork()``: the owner's pid, and the error a child gets.

A runner, session, device, queue, future or shared array owns OS resources of the
process that created it: SPSC rings whose other end is an IPU process, IPU processes
(its children), lock files, daemon connections, threads. A process forked from the
owner inherits the objects but none of that ownership: calling ``execute`` there
would interleave its requests with the owner's on the same rings (each side gets the
other's answers), and closing or dropping them there would stop the owner's devices
and unlink its shared memory. So, as CUDA in a forked child does (and PyTorch's
DataLoader, which re-creates per worker what cannot cross), every such object records
its owner's pid when it is made:

- using it in another process raises :class:`~host_runtime.errors.ForkedProcessError`
  ("... created in process P, used in process C after fork(); ...") before it touches
  anything shared: :func:`check_owner` at each entry point;
- closing or dropping it in another process only forgets this process's copy:
  :func:`foreign` at each release path; nothing of the owner's is unlinked, stopped,
  killed, invalidated or released.

The current pid is kept here and renewed in the child by ``os.register_at_fork``, so
the check on a hot path is a comparison (``os.getpid()`` is a system call).
"""

from __future__ import annotations

import os

from host_runtime.errors import ForkedProcessError

__all__ = ["current_pid", "foreign", "check_owner", "forked_error"]

_pid = os.getpid()


def _after_fork_in_child() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_after_fork_in_child)


def current_pid() -> int:
    """This process's pid (renewed at fork; the value to record as an owner)."""
    return _pid


def foreign(owner_pid: int) -> bool:
    """Whether an object made by ``owner_pid`` is used in another (forked) process."""
    return owner_pid != _pid


def forked_error(what: str, owner_pid: int) -> ForkedProcessError:
    """The error for ``what`` (e.g. "ModelRunner") made by ``owner_pid``, used here."""
    return ForkedProcessError(
        f"{what} created in process {owner_pid}, used in process {_pid} after fork(): its "
        "rings, IPU processes and attachments belong to the creating process; create "
        "runners after fork (in the process that uses them), or use the 'spawn' start "
        "method (multiprocessing.get_context('spawn'))", owner_pid=owner_pid, pid=_pid)


def check_owner(owner_pid: int, what: str) -> None:
    """Raise ForkedProcessError unless this process made the object (``owner_pid``)."""
    if owner_pid != _pid:
        raise forked_error(what, owner_pid)
