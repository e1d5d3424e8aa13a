"""README.md's Python snippets run as written, in order, in one namespace (as a reader
pasting them into one session would), on this module's own emulated machine.

The pytest plugin's example is not among them: it is a test file of its own, run by
``tests/integration/test_pytest_plugin.py``.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.daemon_rig import shm_entries

ROOT = Path(__file__).resolve().parents[2]
PLUGIN_SECTION = "## Testing with the pytest plugin"

pytestmark = pytest.mark.usefixtures("private_machine")


def readme_snippets() -> list[tuple[str, str]]:
    """(section title, code) of every ```python block outside the plugin's section."""
    text = (ROOT / "README.md").read_text()
    snippets = []
    for section in re.split(r"^(?=## )", text, flags=re.M):
        if section.startswith(PLUGIN_SECTION):
            continue
        title = section.splitlines()[0] if section else ""
        snippets += [(title, code) for code in re.findall(r"```python\n(.*?)```", section, re.S)]
    return snippets


def test_readme_has_snippets_for_the_api_tour() -> None:
    titles = {title for title, _ in readme_snippets()}
    for wanted in ("## Run a model", "## Sessions and queues", "## Shared-memory inputs",
                   "## Metrics (Prometheus)"):
        assert wanted in titles, f"README: no python snippet under {wanted!r}"


def test_readme_snippets_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    tag = os.environ["IPU_EMULATOR_SHM_TAG"]      # this worker's own
    before = shm_entries(tag)
    namespace: dict[str, object] = {"__name__": "readme"}
    for title, code in readme_snippets():
        try:
            exec(compile(code, f"README.md {title}", "exec"), namespace)
        except Exception as exc:
            raise AssertionError(f"README snippet under {title!r} failed: {exc!r}") from exc
    namespace.clear()      # the last references: runners, shared arrays
    assert shm_entries(tag) - before == set(), "the snippets left shared memory behind"
