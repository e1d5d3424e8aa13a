"""Raising a kept error once more.

A device that was lost, or a queue that failed, keeps its error and raises it on
every later call. Raising an exception object appends the raising frames to its
traceback: raised as it is, a kept error would grow by the frames of each call (and
keep their locals alive: the request's arrays) for as long as it is kept.
"""

from __future__ import annotations

from typing import TypeVar

__all__ = ["again"]

E = TypeVar("E", bound=BaseException)


def again(exc: E) -> E:
    """``exc`` with its traceback reset, to be raised (``raise again(kept)``): its traceback
    is then this raise's frames only."""
    return exc.with_traceback(None)
