"""Where the suite is, and the PYTHONPATH of the child interpreters it starts.

A child that runs one of the suite's programs (``python -m tests....``) needs the suite
importable, and the packages under test: from the checkout in a source run, from
site-packages in CI's wheel leg (.ci/run sets IPU_EMULATOR_TEST_INSTALLED there, and a
PYTHONPATH that holds the suite alone), where the checkout must stay off the path."""

from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_pythonpath(*first: str) -> str:
    """PYTHONPATH for a child interpreter: ``first``, then the checkout (not in the
    wheel leg), then the inherited PYTHONPATH."""
    checkout = [] if os.environ.get("IPU_EMULATOR_TEST_INSTALLED") else [ROOT]
    return os.pathsep.join(p for p in (*first, *checkout, os.environ.get("PYTHONPATH", ""))
                           if p)
