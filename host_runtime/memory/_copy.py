"""Copies of large transfers, split across two threads.

While the host copies a large input into its ring slot (or an output out of
one) the IPU process waits for it, so its core is idle: a helper thread copies
half of the bytes meanwhile (numpy releases the GIL while it copies). Below
``PARALLEL_MIN_BYTES`` a single copy is faster than the hand-over.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
from typing import Any, Optional

import numpy as np

__all__ = ["copy_bytes", "PARALLEL_MIN_BYTES"]

PARALLEL_MIN_BYTES = 4 << 20
_U8 = np.dtype(np.uint8)
_lock = threading.Lock()
_pool: Optional[cf.ThreadPoolExecutor] = None
_ONE = (os.cpu_count() or 1) < 2


_pool_pid = 0


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()   # a thread of the parent may have held it at the fork


os.register_at_fork(after_in_child=_after_fork_in_child)


def _helper() -> cf.ThreadPoolExecutor:
    global _pool, _pool_pid
    with _lock:
        # a forked child inherits the executor but not its thread: make its own
        if _pool is None or _pool_pid != os.getpid():
            _pool = cf.ThreadPoolExecutor(1, thread_name_prefix="ipu-emulator-copy")
            _pool_pid = os.getpid()
        return _pool


def copy_bytes(dst: Any, src: Any) -> None:
    """``dst[:] = src`` for two byte buffers of the same length (memoryviews or arrays)."""
    n = len(dst)
    if n < PARALLEL_MIN_BYTES or _ONE:
        dst[:] = src
        return
    d = np.frombuffer(dst, _U8)
    s = np.frombuffer(src, _U8)
    half = (n // 2) & ~4095
    later = _helper().submit(np.copyto, d[half:], s[half:])
    np.copyto(d[:half], s[:half])
    later.result()
