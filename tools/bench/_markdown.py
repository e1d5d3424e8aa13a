"""``--markdown``: a benchmark's figures as rows of the table in ``docs/benchmarks.md``.

With it on, the benchmark's usual report goes to stderr and stdout gets only the
table (header and rows), ready to paste::

    python -m tools.bench runner --markdown > rows.md
"""

from __future__ import annotations

import contextlib
import sys
from typing import TextIO

__all__ = ["MarkdownTable", "HEADER"]

HEADER = ("| measure | figure | baseline | ratio | target |\n"
          "|---|---|---|---|---|")


class MarkdownTable:
    """Rows of figures; while ``enabled``, ``print`` goes to stderr until :meth:`emit`."""

    def __init__(self, enabled: bool, out: TextIO | None = None) -> None:
        self.enabled = enabled
        self.rows: list[str] = []
        self._out = out if out is not None else sys.stdout
        self._redirect: contextlib.AbstractContextManager[object] | None = None
        if enabled:
            self._redirect = contextlib.redirect_stdout(sys.stderr)
            self._redirect.__enter__()

    def add(self, measure: str, figure: str, baseline: str = "", ratio: float | None = None,
            target: str = "") -> None:
        """One row; ``ratio`` (figure / baseline) with two decimals, three below 0.1."""
        shown = "" if ratio is None else f"{ratio:.3f}" if ratio < 0.1 else f"{ratio:.2f}"
        cells = [measure, figure, baseline, shown, target]
        self.rows.append("| " + " | ".join(cells) + " |")

    def emit(self) -> None:
        """Give stdout back and print the table there (nothing when not enabled)."""
        if not self.enabled:
            return
        if self._redirect is not None:
            self._redirect.__exit__(None, None, None)
            self._redirect = None
        print(HEADER, file=self._out)
        for row in self.rows:
            print(row, file=self._out)
