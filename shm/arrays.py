"""A request's arrays in one C call each (``shm/_ringcore.c``), for the hot path of a
host that sends small requests one after another: a Python loop over them costs about
0.3 us an array there, more than the C calls it makes.

- :func:`plain_arrays` ``(arrays, plan)``: whether ``arrays`` is a dict (exactly) of
  ``len(plan)`` items and, for each ``(key, type, format, shape)`` of the tuple
  ``plan``, ``arrays[key]`` is of ``type`` exactly (not a subclass) and exports a
  buffer of that struct ``format`` (bytes, as ``memoryview.format`` gives it) and
  ``shape`` (a tuple of ints), contiguous or not.
- :func:`write_arrays` ``(arrays, plan, tag)``: for each ``(key, core)`` of the tuple
  ``plan`` in turn (``core``: a ring's :meth:`Ring.c_handle`), ``ring.write(arrays[key],
  tag, 0.0)`` on the C core's fast path (a free slot there at once, the array one
  C-contiguous buffer); it stops at the first entry it cannot write so (a missing key,
  an array not contiguous, a ring full, closed or in a state of the Python path), which
  it leaves untouched, and returns the number of entries written. The caller writes
  the rest with ``Ring.write``, which waits and reports.

Without the C core (``IN_C`` False) both are Python: the same check, and no write (0).
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["IN_C", "plain_arrays", "write_arrays"]

try:
    import shm._ringcore as _ringcore
except ImportError:   # built without a compiler: the Python equivalents below
    _ringcore = None

IN_C: bool = _ringcore is not None
"""Whether the functions are the C core's."""


def _plain_arrays(arrays: Any, plan: tuple[Any, ...]) -> bool:
    if arrays.__class__ is not dict or len(arrays) != len(plan):
        return False
    for key, kind, fmt, shape in plan:
        value = arrays.get(key)
        if value is None or value.__class__ is not kind:
            return False
        try:
            view = memoryview(value)
        except (TypeError, ValueError, BufferError):
            return False
        with view:
            if view.format.encode() != fmt or view.shape != shape:
                return False
    return True


def _write_arrays(arrays: Any, plan: tuple[Any, ...], tag: int) -> int:
    return 0   # no C core: the caller writes every one


plain_arrays: Callable[[Any, tuple[Any, ...]], bool] = getattr(
    _ringcore, "plain_arrays", _plain_arrays)
write_arrays: Callable[[Any, tuple[Any, ...], int], int] = getattr(
    _ringcore, "write_arrays", _write_arrays)
