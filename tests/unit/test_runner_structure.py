"""The runner's shape, measured from the outside (``ast``): classes a reader can hold in
mind, a ModelRunner with no execution logic, one description of a request's path.

- (sizes of classes, functions and modules: ``test_structure``, over every package);
- ``_model_runner`` (the seed's API) imports nothing of the request path: no ring,
  transfer, submission or completion; it checks arguments, keeps the config, chooses
  a replica;
- every ring call that lays an input or takes an output back is in ``_transfer``
  (the one description); submission and completion reach the rings only through it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import numpy as np
import pytest

from host_runtime.memory import SHARED_MIN_BYTES, empty_shared
from host_runtime.runner._batching import TensorSpec
from host_runtime.runner._transfer import READ_MAX, Lay, Take, lay_action, take_action

RUNNER = Path(__file__).resolve().parents[2] / "host_runtime" / "runner"


def _tree(name: str) -> ast.Module:
    return ast.parse((RUNNER / name).read_text(), name)


def _imports(tree: ast.Module) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_the_model_runner_has_no_execution_logic() -> None:
    imported = _imports(_tree("_model_runner.py"))
    path_modules = {"shm", "host_runtime.runner._transfer", "host_runtime.runner._submission",
                    "host_runtime.runner._completion", "host_runtime.runner._life"}
    assert not imported & path_modules, imported & path_modules


_RING_CALLS = {"write", "publish", "acquire_read", "read", "release", "try_acquire_write"}


def test_ring_transfers_are_laid_and_taken_in_one_module() -> None:
    """Outside ``_transfer``, no runner module writes, publishes or reads a ring slot
    (acquiring a free slot to make room is the submitter's: ``try_acquire_write`` /
    ``acquire_write`` in ``_submission``; the interrupted-read clean-up releases one)."""
    allowed = {"_transfer.py": _RING_CALLS,
               "_submission.py": {"try_acquire_write"},
               "_completion.py": {"release"}}
    offenders = []
    for path in sorted(RUNNER.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), path.name)):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in _RING_CALLS
                    and re.search(r"(^|[._])(ring|rings\[.*\])$", ast.unparse(node.func.value))
                    and node.func.attr not in allowed.get(path.name, set())):
                offenders.append(f"{path.name}:{node.lineno} {ast.unparse(node.func)}")
    assert not offenders, offenders


# -- the one description: what each input and output of a transfer does -----------------

def _spec(shape: tuple[int, ...], batch_dim: int | None = 0) -> TensorSpec:
    return TensorSpec("t", "h", shape, np.dtype(np.float32), True, batch_dim, False)


@pytest.mark.parametrize("case,expected", [
    ("missing", Lay.SKIP), ("frozen", Lay.FROZEN), ("small", Lay.WRITE),
    ("small, small_io off", Lay.COPY), ("large", Lay.COPY), ("shared", Lay.HOST),
    ("one of several transfers", Lay.SLICE), ("not contiguous", Lay.SLICE),
])
def test_how_an_input_is_laid(case: str, expected: Lay) -> None:
    small = _spec((4, 3))
    large = _spec((SHARED_MIN_BYTES // 4, 1))
    spec, src, frozen, whole, small_io = small, np.ones((4, 3), np.float32), False, True, True
    if case == "missing":
        src = None
    elif case == "frozen":
        src, frozen = None, True
    elif case == "small, small_io off":
        small_io = False
    elif case == "large":
        spec, src = large, np.ones(large.shape, np.float32)
    elif case == "shared":
        spec = large
        src = empty_shared(large.shape, np.float32)
    elif case == "one of several transfers":
        whole = False
    elif case == "not contiguous":
        src = np.ones((3, 4), np.float32).T
    assert lay_action(spec, src, frozen, whole, small_io) is expected


def test_how_an_output_is_taken_back() -> None:
    assert take_action(_spec((READ_MAX // 4,), None), True) is Take.READ
    assert take_action(_spec((READ_MAX // 4,), None), False) is Take.SLOT
    assert take_action(_spec((READ_MAX // 4 + 1,), None), True) is Take.SLOT
