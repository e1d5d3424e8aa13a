"""Who owns what, and closing at interpreter exit what the program left open.

Every OS resource (an IPU attachment, an IPU process, a shared-memory region
or ring, a lock file, a thread, a socket) has one owner object::

    ModelRunner --> Replica --> Session --> Device --> DeviceLink (event thread)
      (PopRT Runner)              |  |         |--> IPU processes (rings)
                                  |  |         `--> IpuLocks / DaemonAttachment
                                  |  `--> StreamTable (stream rings), regions
                                  `--> QueueManagers

Arrows are strong references, and they only point down. Everything that
points back up (the event thread, the device's active session, the loop
future's callbacks, a replica's callbacks into its runner, the exit hooks'
registries) is a weak reference. So dropping the last reference a program
holds to an owner frees it, and everything under it, by reference counting
alone: its ``__del__`` closes it at once, even with the cyclic garbage
collector off. ``close()`` does the same explicitly and is idempotent.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any, Callable, Iterable, Protocol, TypeVar

__all__ = ["close_owned", "weak_method"]

_log = logging.getLogger(__name__)


class _Closable(Protocol):
    def close(self) -> None: ...


_T = TypeVar("_T", bound=_Closable)


def close_owned(objects: Iterable[_T], owner_pid: Callable[[_T], int]) -> None:
    """``close()`` each object this process made (``owner_pid(obj)``), best effort.

    A child made by ``fork`` inherits the parent's objects but not their
    ownership: closing them would stop the parent's devices and runners.
    """
    me = os.getpid()
    for obj in list(objects):
        if owner_pid(obj) != me:
            continue
        try:
            obj.close()
        except Exception:  # pragma: no cover - best effort at exit
            _log.exception("closing %r at exit", obj)


def weak_method(method: Callable[..., Any],
                on_gone: Callable[[], Any] | None = None) -> Callable[..., Any]:
    """A callable that calls the bound ``method`` while its object lives, else returns
    ``on_gone()`` (None without it): a back-reference that does not keep the object alive."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any, **kwargs: Any) -> Any:
        fn = ref()
        if fn is None:
            return None if on_gone is None else on_gone()
        return fn(*args, **kwargs)
    return call
