"""docs/python_api.md is what ``python -m tools.api_table`` generates (regenerate it when
names are added: the table says which resolve), and its notes name real rows."""

from __future__ import annotations

from pathlib import Path

from ipu_emulator import run
from tools import api_table

ROOT = Path(__file__).resolve().parents[2]     # the checkout's table and docs (not the
TABLE = ROOT / "tests" / "reference" / "python_api.tsv"   # installed tools' neighbours)
DOC = ROOT / "docs" / "python_api.md"


def test_the_committed_table_is_up_to_date() -> None:
    assert DOC.read_text() == api_table.generate(TABLE), (
        "docs/python_api.md is out of date: run python -m tools.api_table")


def test_the_notes_name_rows_of_the_reference_table() -> None:
    names = {(r["module"], r["name"]) for r in api_table.rows(TABLE)}
    stale = sorted(set(api_table.NOTES) - names)
    assert not stale, f"NOTES about names the table does not have: {stale}"
    assert {status for status, _ in api_table.NOTES.values()} <= {
        "implemented", "emulated", "raises"}


def test_a_row_of_each_status_reads_as_intended() -> None:
    text = DOC.read_text()
    assert "| `TensorReader.info` | property | emulated | this project's PopEF container" in text
    assert "| `DataType.F8` | constant | raises | exists; numpy conversion" in text
    assert "| `popef` | 109 | 109 |" in text and "| `model_runtime` | 183 | 183 |" in text
    # a name that does not resolve is shown as missing, not guessed
    run.install()
    try:
        assert api_table.resolve("popef", "NoSuchName")[1] == "popef has no 'NoSuchName'"
    finally:
        run.uninstall()
