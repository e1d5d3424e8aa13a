"""Helpers of the unit tests that run on a loopback device (the plugin's ``loopback_device``;
the suite over both kinds of IPU is tests/devices/).

- ``model_path`` / ``model`` / ``weights``: the seeds' example model
  (``tensor_C = tensor_A * weights + tensor_B``, tests/_helpers.py) for the module's
  ``SHAPE``.
- ``offline()``: a context manager that fails if the block started a process or left
  objects of this process's tag in /dev/shm.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import psutil

from shm import naming
from tests._helpers import model, model_path, weights
from tools.pytest_plugin.machine import shm_entries

__all__ = ["model", "model_path", "weights", "offline", "children"]


def children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


@contextlib.contextmanager
def offline() -> Iterator[None]:
    """The block starts no process and leaves nothing in /dev/shm."""
    procs, shm = children(), shm_entries(naming.current_tag())
    yield
    assert children() - procs == set(), "a loopback device started a process"
    assert shm_entries(naming.current_tag()) - shm == set()
