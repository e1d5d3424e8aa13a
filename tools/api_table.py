"""``python -m tools.api_table [--check]``: docs/python_api.md, the three Python APIs name by name.

For every name of ``tests/reference/python_api.tsv`` (Graphcore's ``model_runtime``,
``popef`` and ``poprt``): whether it resolves as an unchanged program reaches it (through
``ipu_emulator.run``'s mapping) and what it does here: *implemented*, *emulated* (with the
difference stated), *raises* (a named error: it needs hardware or a feature the emulator
does not have) or *missing*. The text is the difference noted in NOTES, else the first line
of the object's docstring. ``--check`` exits 1 if the committed file differs
(tests/unit/test_api_table.py runs it).
"""

from __future__ import annotations

import argparse
import csv
import enum
import importlib
import inspect
import sys
from pathlib import Path
from typing import Any

from ipu_emulator import run

def _checkout() -> Path:
    """The project's checkout: where ``tools/`` lies when it is one (the reference table
    beside it), else the working directory (an installed ``tools`` has no table)."""
    here = Path(__file__).resolve().parents[1]
    return here if (here / "tests" / "reference").is_dir() else Path.cwd()


ROOT = _checkout()
TABLE = ROOT / "tests" / "reference" / "python_api.tsv"
DOC = ROOT / "docs" / "python_api.md"

MISSING = object()

_CONTAINER = ("this project's PopEF container: a tensor- or feed-data blob holds its anchor's "
              "name and bytes")
# (module, name) -> (status, what it does here); names not listed: implemented + docstring
NOTES: dict[tuple[str, str], tuple[str, str]] = {
    ("popef", "Reader"): ("emulated", "reads this project's PopEF files (its own container, "
                          "checked blob by blob); Graphcore's files hold Poplar executables "
                          "and are refused as not PopEF"),
    ("popef", "Writer"): ("emulated", "writes this project's PopEF container (its own byte "
                          "layout), whole or not at all"),
    ("popef", "ExecutableReader.executable"): ("emulated", "the emulator's executable (its "
                                               "program language and ONNX graphs), not Poplar's"),
    ("popef", "TensorReader.info"): ("emulated", f"{_CONTAINER}, so the tensor info is the "
                                     "metadata anchor's of that name (`U8 [bytes]` if none)"),
    ("popef", "FeedReader.info"): ("emulated", f"{_CONTAINER}, so the tensor info is the "
                                   "metadata anchor's of that name (`U8 [bytes]` if none)"),
    ("popef", "OpaqueReader.executable"): ("emulated", "not stored in the container: the "
                                           "executable of the reader's metadata ('' if none "
                                           "or several)"),
    ("popef", "Writer.createOpaqueBlob"): ("emulated", "the executable name is not stored "
                                           "(see OpaqueReader.executable)"),
    ("popef", "Writer.createTensorData"): ("emulated", "refuses a tensor info that the "
                                           "metadata's anchor contradicts, and a size that "
                                           "is not the tensor info's"),
    ("popef", "BlobWriter.write"): ("implemented", "appends; the blob is written when the "
                                    "blob writer closes (close(), the next create*, or the "
                                    "writer's close())"),
    ("popef", "Metadata.engineOptions"): ("emulated", "a dict {name: value} (Graphcore's: a "
                                          "list of Option); setEngineOptions takes either"),
    ("popef", "Metadata.deviceOptions"): ("emulated", "a dict {name: value} (Graphcore's: a "
                                          "list of Option); setDeviceOptions takes either"),
    ("popef", "Metadata.ipuVersion"): ("implemented", "2 or 21 (Mk2, Bow)"),
    ("popef", "DataType.F8"): ("raises", "exists; numpy conversion and models using it raise "
                               "BadRequestError (FP8 is not emulated)"),
    ("popef", "popefTypeToNumpyDType"): ("implemented", "numpy dtype of a DataType (FP8: "
                                         "BadRequestError)"),
    ("popef", "numpyDTypeToPopefType"): ("implemented", "DataType of a numpy dtype (a name "
                                         "seen only in the brief: unverified)"),
}


def rows(table: Path = TABLE) -> list[dict[str, str]]:
    with table.open(newline="") as f:
        return list(csv.DictReader(f, delimiter="\t"))


def _attribute(obj: Any, part: str) -> Any:
    if hasattr(obj, part):
        return getattr(obj, part)
    if hasattr(obj, "__path__"):                       # a package: its submodule
        try:
            return importlib.import_module(f"{obj.__name__}.{part}")
        except ImportError:
            pass
    if isinstance(obj, type):
        fields = getattr(obj, "__dataclass_fields__", {})
        if part in fields:
            return fields[part]
        for klass in obj.__mro__:
            if part in getattr(klass, "__slots__", ()) or \
                    part in getattr(klass, "__annotations__", {}):
                return getattr(klass, part, None)
        try:
            instance = obj()
        except Exception:
            return MISSING
        return getattr(instance, part, MISSING)
    return MISSING


def resolve(module: str, dotted: str) -> tuple[Any, str | None]:
    """(the object, None) if ``module`` then ``dotted`` resolve as a program reaches them
    (call with the mapping installed); else (MISSING, what failed)."""
    try:
        obj: Any = importlib.import_module(module)
    except ImportError as exc:
        return MISSING, f"import {module}: {exc}"
    done = module
    for part in [p for p in dotted.split(".") if p]:
        obj = _attribute(obj, part)
        if obj is MISSING:
            return MISSING, f"{done} has no {part!r}"
        done += "." + part
    return obj, None


def _ours(obj: Any) -> bool:
    target = obj.fget if isinstance(obj, property) else obj
    module = getattr(target, "__module__", None) or ""
    return module.split(".")[0] in ("host_runtime", "ipu_emulator", "shm")


def first_line(obj: Any) -> str:
    """The first sentence of the docstring this project wrote for ``obj`` ('' if none)."""
    if not _ours(obj) or isinstance(obj, (int, str, float, bytes, enum.Enum)):
        return ""
    doc = (inspect.getdoc(obj) or "").strip()
    text = " ".join(doc.split("\n\n")[0].split()).replace("``", "`")
    if len(text) > 160 and ". " in text:
        text = text[:text.index(". ") + 1]
    return text


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def generate(table: Path = TABLE) -> str:
    was = run.installed()
    run.install(force=True)
    try:
        return _render(rows(table))
    finally:
        if not was:
            run.uninstall()


def _render(table: list[dict[str, str]]) -> str:
    out = ["# The Python APIs, name by name", "",
           "Generated by `python -m tools.api_table` from `tests/reference/python_api.tsv` "
           "(Graphcore's `model_runtime`, `popef` and `poprt`, with their public sources). "
           "Each name is looked up as an unchanged program reaches it under `ipu-emulator "
           "run` (README: Run a model). **here**: *implemented*; *emulated* (works, with the "
           "difference stated); *raises* (a named error: it needs hardware or a feature the "
           "emulator does not have); *missing* (not there yet).", ""]
    modules = sorted({r["module"] for r in table},
                     key=lambda m: (m.split(".")[0] != "model_runtime", m))
    counts = []
    sections: list[str] = []
    for module in modules:
        mine = [r for r in table if r["module"] == module]
        lines = [f"## `{module}`", "", "| name | kind | here | what it does here |",
                 "|---|---|---|---|"]
        found = 0
        for r in mine:
            obj, why = resolve(module, r["name"])
            status, text = NOTES.get((module, r["name"]), ("implemented", ""))
            if obj is MISSING:
                status, text = "missing", ""
            else:
                found += 1
                text = text or first_line(obj) or r["signature"]
            lines.append(f"| `{_cell(r['name'])}` | {r['kind']} | {status} | {_cell(text)} |")
        counts.append(f"| `{module}` | {len(mine)} | {found} |")
        sections += lines + [""]
    out += ["| module | names | resolve |", "|---|---|---|", *counts, "", *sections]
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.api_table", description=__doc__)
    parser.add_argument("--check", action="store_true",
                        help=f"exit 1 if {DOC.relative_to(ROOT)} is not what this generates")
    args = parser.parse_args(argv)
    text = generate()
    if args.check:
        if DOC.exists() and DOC.read_text() == text:
            return 0
        print(f"{DOC.relative_to(ROOT)} is out of date: run python -m tools.api_table",
              file=sys.stderr)
        return 1
    DOC.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
