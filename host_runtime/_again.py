"""Raising a kept error once more.

A device that was lost keeps its error and raises it on every later call; a request's
answer (a future, or a runner's request) keeps its failure for whoever waits. Raising an exception object
appends the raising frames to its traceback, and those frames hold the device, the
session, the request's arrays: raised as it is, a kept error would grow by each call's
frames and keep them alive, and since its keeper is among what they hold, in a
reference cycle that only the collector breaks. So a kept error is raised as a copy:
same type, message, attributes and cause, with a traceback of its own.
"""

from __future__ import annotations

from typing import TypeVar

__all__ = ["again"]

E = TypeVar("E", bound=BaseException)


def again(exc: E) -> E:
    """A copy of ``exc`` to raise (``raise again(kept)``): its type, ``args``,
    attributes and ``__cause__``, no traceback, and the exception being handled, if any,
    not shown as its context. Where it cannot be copied, ``exc`` itself with its
    traceback reset."""
    cls = type(exc)
    try:
        new = cls.__new__(cls, *exc.args)
        new.args = exc.args
        new.__dict__.update(exc.__dict__)
        same = type(new) is cls and str(new) == str(exc)
    except Exception:   # an exception type that cannot be made this way
        same = False
    if not same:   # (or one whose state is not its args and attributes)
        return exc.with_traceback(None)
    new.__cause__ = exc.__cause__
    new.__suppress_context__ = True
    return new
