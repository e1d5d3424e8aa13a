"""Closing at interpreter exit what the program left open."""

from __future__ import annotations

import logging
import os
from typing import Any, Iterable

__all__ = ["close_owned"]

_log = logging.getLogger(__name__)


def close_owned(objects: Iterable[Any]) -> None:
    """``close()`` each object this process made (``_owner_pid``), best effort.

    A child made by ``fork`` inherits the parent's objects but not their
    ownership: closing them would stop the parent's devices and runners.
    """
    me = os.getpid()
    for obj in list(objects):
        if obj._owner_pid != me:
            continue
        try:
            obj.close()
        except Exception:  # pragma: no cover - best effort at exit
            _log.exception("closing %r at exit", obj)
