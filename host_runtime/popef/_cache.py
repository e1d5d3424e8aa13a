"""Models a ``ModelRunner`` read from files, kept while their files are unchanged.

Making runners of one file again and again (a test rig, a server that reloads) reads
and checks it once: a model is kept, after its checksums have passed, under its
files' identities (device, inode, size, modification and change times, each in
nanoseconds), and handed out again while every file still has that identity. A file
written again, replaced, renamed over or changed in mode has a new change time: it is
read again. Kept: the last ``MAX_MODELS`` models of files under ``MAX_FILE_BYTES``
together, which the reader copies whole (a model holds its payloads' bytes, no file
descriptor or mapping). A ``popef.Model`` is read-only to the runners, which share it
as they share one a program passes them; ``ModelRunner.model`` shows a program a copy
of its own. Should a kept model change all the same, it is not handed out again: only
while every object it is made of (its dataclasses' fields, their lists' items) is the
one it was read with.
"""

from __future__ import annotations

import collections
import dataclasses
import operator
import os
import stat
import threading
from typing import Any, Callable, Iterable

from host_runtime.popef.model import Model
from host_runtime.popef.reader import MAP_MIN_BYTES

__all__ = ["MAX_FILE_BYTES", "MAX_MODELS", "FilesKey", "files_key", "kept_model", "keep_model"]

MAX_MODELS = 8
MAX_FILE_BYTES = MAP_MIN_BYTES   # larger payloads are mapped views of a snapshot

FilesKey = tuple[tuple[int, int, int, int, int], ...]

_lock = threading.Lock()
_models: "collections.OrderedDict[FilesKey, tuple[Model, list[object]]]" = (
    collections.OrderedDict())
# per type: how to list the objects an object of it is made of (False: none, a leaf)
_children: "dict[type, Callable[[Any], Iterable[object]] | bool]" = {}


def _items_of(d: dict[Any, Any]) -> list[object]:
    return [x for kv in d.items() for x in kv]


def _children_of(obj: object) -> "Callable[[Any], Iterable[object]] | bool":
    """How to list what an object of ``obj``'s type is made of (False: nothing)."""
    kind = type(obj)
    if issubclass(kind, (list, tuple)):
        return tuple
    if issubclass(kind, dict):
        return _items_of
    if not dataclasses.is_dataclass(obj):
        return False
    names = tuple(f.name for f in dataclasses.fields(obj))
    if not names:
        return False
    get = operator.attrgetter(*names)
    return get if len(names) > 1 else (lambda o: (get(o),))


def _parts(model: Model) -> list[object]:
    """Every object ``model`` is made of, in order: the values of its dataclasses' fields,
    the items of its lists and tuples, the keys and values of its dicts (the list holds
    them: no id is reused while it lives)."""
    out: list[object] = []
    stack: list[object] = [model]
    pop, extend, keep = stack.pop, stack.extend, out.append
    children = _children
    while stack:
        obj = pop()
        keep(obj)
        get = children.get(type(obj))
        if get is None:
            get = children[type(obj)] = _children_of(obj)
        if get:
            extend(get(obj))   # type: ignore[operator]
    return out


def files_key(paths: list[str]) -> FilesKey | None:
    """The identity of the regular files at ``paths`` now; None if one cannot be
    stat'ed, is not a regular file, or they are too large to keep."""
    try:
        sts = [os.stat(p) for p in paths]
    except (OSError, ValueError):
        return None
    if (not all(stat.S_ISREG(st.st_mode) for st in sts)
            or sum(st.st_size for st in sts) >= MAX_FILE_BYTES):
        return None
    return tuple((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
                 for st in sts)


def kept_model(key: FilesKey | None) -> Model | None:
    """The model read from files of identity ``key``, if kept."""
    if key is None:
        return None
    with _lock:
        entry = _models.get(key)
        if entry is None:
            return None
        model, parts = entry
        now = _parts(model)
        if len(now) != len(parts) or any(a is not b for a, b in zip(now, parts)):
            del _models[key]   # changed by a program since: read the file again
            return None
        _models.move_to_end(key)
        return model


def keep_model(key: FilesKey | None, model: Model, paths: list[str]) -> None:
    """Keep ``model``, read (and its checksums passed) from ``paths`` whose identity was
    ``key`` before they were read: only if they still have it (not written meanwhile)."""
    if key is None or files_key(paths) != key:
        return
    parts = _parts(model)
    with _lock:
        _models[key] = (model, parts)
        _models.move_to_end(key)
        while len(_models) > MAX_MODELS:
            _models.popitem(last=False)


def _after_fork_in_child() -> None:
    """A forked child starts with a lock of its own: another thread of the parent may have
    held this one at the fork, and would never release it here. The kept models stay
    (bytes and objects, copied with the process)."""
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def forget_all() -> None:
    """Drop every kept model (tests)."""
    with _lock:
        _models.clear()
