"""What this process created, so that it can be destroyed at exit.

Every segment and semaphore created through :mod:`shm` is recorded here until
its owner unlinks it. At interpreter exit whatever is still recorded is
unlinked (an owner that forgot to, or an exception path that skipped it). A
child made by ``fork`` inherits the set but not the ownership: the exit hook
only unlinks names recorded by the process that is exiting.

Processes killed by a signal never run the hook; their objects carry their pid
in the name, and :func:`shm.cleanup.remove_dead` removes them.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading

import posix_ipc

_log = logging.getLogger(__name__)

_lock = threading.Lock()
# name -> (kind "shm" or "sem", creating pid)
_created: dict[str, tuple[str, int]] = {}


def _after_fork_in_child() -> None:
    # another thread of the parent may have held the lock at the fork: it never returns here
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def register(name: str, what: str) -> None:
    """Record that this process created ``name`` (``what``: "shm" or "sem")."""
    with _lock:
        _created[name] = (what, os.getpid())


def forget(name: str) -> None:
    """Record that ``name`` was unlinked (by anyone)."""
    with _lock:
        _created.pop(name, None)


def created() -> list[str]:
    """Names created by this process and not yet unlinked."""
    pid = os.getpid()
    with _lock:
        return sorted(n for n, (_, p) in _created.items() if p == pid)


def unlink_name(name: str, what: str) -> bool:
    """Unlink a segment or semaphore by name; False if it did not exist."""
    try:
        if what == "sem":
            posix_ipc.unlink_semaphore(name)
        else:
            posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        forget(name)
        return False
    forget(name)
    return True


def unlink_all_created() -> list[str]:
    """Unlink everything this process created and still holds; return the names."""
    pid = os.getpid()
    with _lock:
        items = [(n, w) for n, (w, p) in _created.items() if p == pid]
    done = []
    for name, what in items:
        try:
            if unlink_name(name, what):
                done.append(name)
        except OSError as exc:  # pragma: no cover - permission trouble at exit
            _log.warning("could not unlink %s at exit: %s", name, exc)
    if done:
        _log.debug("unlinked at exit: %s", done)
    return done


atexit.register(unlink_all_created)
