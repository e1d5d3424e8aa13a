"""A device's first request, sent the moment its control ring is open.

A session that attaches a daemon's IPU makes its rings and its LOAD's spec region
while the daemon answers (:mod:`host_runtime.session._attach`), so its LOAD is ready
before the device exists. Within :func:`first_request`, the attach of a one-IPU device
sends that request as soon as the IPU's control ring is open (the daemon's HOST is
ahead of it there), before the host builds the rest of the device (its event ring,
link and binding): the IPU process loads while the host does that. The device's link
holds it as its request ``FIRST_SEQ`` (:meth:`ProcessLink.take_first`); the session
takes its answer as its LOAD's, or, when its LOAD would differ, waits for it and
sends its own.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

from ipu_emulator.ipu_protocol import Op

__all__ = ["FIRST_SEQ", "FirstRequest", "first_request", "take_first_request"]

FIRST_SEQ = 1
"""The seq of a first request: a link's own requests count from the next."""


class FirstRequest:
    """The request to send first, once it is known (:meth:`ready`)."""

    __slots__ = ("op", "body")

    def __init__(self) -> None:
        self.op: Op | None = None
        self.body: Any = None

    def ready(self, op: Op, body: Any) -> None:
        self.op, self.body = op, body


_first: contextvars.ContextVar[FirstRequest | None] = contextvars.ContextVar(
    "ipu_emulator_first_request", default=None)


@contextlib.contextmanager
def first_request(request: FirstRequest | None) -> Iterator[None]:
    """Within the block, an attach of a one-IPU device sends ``request`` first, if it is
    ready by then (None: no first request, e.g. for each IPU of a larger device)."""
    token = _first.set(request)
    try:
        yield
    finally:
        _first.reset(token)


def take_first_request() -> tuple[Op, Any] | None:
    """The first request to send (once: it is taken), if one is ready."""
    request = _first.get()
    if request is None or request.op is None:
        return None
    _first.set(None)
    return request.op, request.body
