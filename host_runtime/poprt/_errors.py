"""Errors of PopRT's compile side."""

from __future__ import annotations

from host_runtime.errors import BadRequestError

__all__ = ["NotSupportedError", "PoplarRequiredError"]


class NotSupportedError(BadRequestError, NotImplementedError):
    """A documented PopRT feature the IPU emulator cannot honour; the message names it."""


class PoplarRequiredError(NotSupportedError):
    """The feature needs Poplar's compiler or profiler (a real IPU software stack)."""
