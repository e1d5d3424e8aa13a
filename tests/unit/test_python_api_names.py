"""Every public name of Graphcore's Python modules resolves as a program imports it.

``tests/reference/python_api.tsv`` lists the names of ``model_runtime``, ``popef`` and
``poprt`` (module, dotted name, kind, signature, public source). Each is looked up the
way an unchanged program reaches it: through ipu_emulator.run's mapping (``import popef``;
``popef.Reader.parseFile``), as a module attribute, a submodule, a class attribute, a
dataclass field, a slot or, last, an attribute of an instance made with no arguments
(``tools.api_table.resolve``, which docs/python_api.md is generated with).

One test per module of the table (``-k popef``, ``-k "poprt and runtime"``), reporting
every name of it that does not resolve. PENDING lists the modules whose names other
work of issue 29 is adding (strict xfail: an entry whose names all resolve fails, so the
list only shrinks).
"""

from __future__ import annotations

from typing import Any, Iterator

import pytest

from pathlib import Path

from ipu_emulator import run
from tools import api_table
from tools.api_table import resolve

TABLE = Path(__file__).resolve().parents[1] / "reference" / "python_api.tsv"


def rows() -> list[dict[str, str]]:
    return api_table.rows(TABLE)


def modules() -> list[str]:
    return sorted({r["module"] for r in rows()})


# modules whose names are not all there yet (strict xfail: an entry whose names all
# resolve fails, so the list only shrinks); none today
PENDING: dict[str, str] = {}

@pytest.fixture(scope="module", autouse=True)
def mapped() -> Iterator[None]:
    was = run.installed()
    run.install()
    yield
    if not was:
        run.uninstall()


def _params() -> list[Any]:
    return [pytest.param(m, id=m, marks=pytest.mark.xfail(strict=True, reason=PENDING[m]))
            if m in PENDING else m for m in modules()]


@pytest.mark.parametrize("module", _params())
def test_every_name_resolves(module: str) -> None:
    missing = [f"{r['name']}: {why}" for r in rows() if r["module"] == module
               for _, why in [resolve(module, r["name"])] if why is not None]
    assert not missing, f"{len(missing)} names of {module} do not resolve:\n  " + \
        "\n  ".join(missing)


def test_the_table_is_whole() -> None:
    table = rows()
    assert len(table) == 609
    assert {r["module"].split(".")[0] for r in table} == {"model_runtime", "popef", "poprt"}
    assert all(r["name"] and r["kind"] for r in table)
    assert set(PENDING) <= set(modules())
