"""Benchmarks: ``python -m tools.bench <name>`` (``ring``; more to come)."""

from __future__ import annotations

__all__: list[str] = []
