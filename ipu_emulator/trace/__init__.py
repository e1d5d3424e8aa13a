"""Timeline traces: what the host and every IPU process serving it did, on one clock.

Record without changing a program: ``IPU_EMULATOR_TRACE=trace.json python app.py``
(the file is written when the program exits, normally or by an exception). Or
from Python::

    from ipu_emulator import trace

    with trace.tracing("trace.json"):      # or trace.start("trace.json") ... trace.stop()
        runner = ModelRunner("model.popef")
        runner.execute(inputs)

The file is Chrome Trace Event Format JSON: open it in Perfetto's UI
(ui.perfetto.dev) or chrome://tracing, or summarise it with ``ipu-emulator trace
FILE``. What it shows is in docs/tracing.md. Only IPU processes started while
tracing is on are recorded (start tracing before making runners).

:func:`instant` marks a named moment on this process's timeline (fault injection
calls it for each fault it injects).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

from ipu_emulator.trace import recorder
from ipu_emulator.trace._chrome import PHASES, combine, request_track
from ipu_emulator.trace._session import (active, map_ipu_buffer, new_ipu_buffer, on_start,
                                         set_role, snapshot, start, start_from_settings, stop,
                                         write)

_log = logging.getLogger(__name__)

__all__ = ["start", "stop", "tracing", "enabled", "active", "instant", "snapshot", "write",
           "start_from_settings", "set_role", "new_ipu_buffer", "map_ipu_buffer", "combine",
           "request_track", "PHASES", "recorder", "on_start"]


def enabled() -> bool:
    """Whether this process is recording now (a session, or an IPU process's buffer)."""
    return recorder.ON


@contextlib.contextmanager
def tracing(path: str | None = None, role: str = "host") -> Iterator[None]:
    """Record while the block runs; write ``path`` when it ends (also by an exception:
    then a failure to write the trace is logged, and the block's exception goes on)."""
    start(path, role=role)
    try:
        yield
    except BaseException:
        if active():
            try:
                stop()
            except Exception:   # the block's exception is the one to see
                _log.warning("could not write the trace of a block that raised",
                             exc_info=True)
        raise
    if active():
        stop()


def instant(name: str, **args: Any) -> None:
    """Mark ``name`` now on this process's timeline, with ``args`` (a host's; an IPU
    process keeps the first 24 bytes of the name). Does nothing when not tracing: a
    caller need not check."""
    if recorder.ON:
        recorder.instant(name, **args)
