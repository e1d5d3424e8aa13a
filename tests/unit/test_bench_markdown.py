"""``python -m tools.bench <name> --markdown``: the report goes to stderr, the table to stdout."""

from __future__ import annotations

import pytest

from tools.bench._markdown import HEADER, MarkdownTable


def test_rows_go_to_stdout_and_the_report_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    table = MarkdownTable(True)
    print("report line")
    table.add("64-byte round trip", "2.5 µs", "semaphores 2.7 µs", 2.5 / 2.7, "≤ 1.2")
    table.add("same", "", "Pipe 68.0 µs", 2.5 / 68.0, "≤ 0.5")
    table.add("close()", "6.3 ms")
    table.emit()
    print("after")
    out, err = capsys.readouterr()
    assert err == "report line\n"
    assert out == (HEADER + "\n"
                   "| 64-byte round trip | 2.5 µs | semaphores 2.7 µs | 0.93 | ≤ 1.2 |\n"
                   "| same |  | Pipe 68.0 µs | 0.037 | ≤ 0.5 |\n"
                   "| close() | 6.3 ms |  |  |  |\n"
                   "after\n")


def test_off_it_prints_nothing_and_leaves_stdout_alone(
        capsys: pytest.CaptureFixture[str]) -> None:
    table = MarkdownTable(False)
    print("report line")
    table.add("x", "1 µs")
    table.emit()
    assert capsys.readouterr() == ("report line\n", "")
