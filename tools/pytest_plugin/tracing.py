"""``--ipu-trace-dir DIR``: a timeline of each failing test (``ipu_emulator.trace``).

Each test runs with tracing on (the host process, and every IPU process started
during the test); when any phase of the test fails, its timeline is written to
``DIR/<test id>.json`` (the evidence a CI run keeps), else it is dropped. IPU
processes started before the test (a module's runner) are not in it.
"""

from __future__ import annotations

import os
import re

import pytest

__all__ = ["TracedTest", "file_for"]

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def file_for(folder: str, nodeid: str) -> str:
    """The trace file of test ``nodeid`` in ``folder``."""
    name = _UNSAFE.sub("_", nodeid).strip("_")[:180] or "test"
    return os.path.join(folder, f"{name}.json")


class TracedTest:
    """Tracing around one test: ``failed()`` by its reports, ``finish()`` at its end."""

    def __init__(self, folder: str) -> None:
        from ipu_emulator import trace

        self.folder = folder
        self.started = not trace.active()   # a test that traces itself is left alone
        if self.started:
            trace.start(None)
        self.failed = False

    def report(self, report: pytest.TestReport) -> None:
        if report.failed:
            self.failed = True

    def finish(self, nodeid: str) -> str | None:
        """Stop tracing; the file written (failed), or None."""
        from ipu_emulator import trace

        if not self.started or not trace.active():
            return None
        timeline = trace.stop()
        if not self.failed:
            return None
        path = file_for(self.folder, nodeid)
        trace.write(timeline, path)
        return path
