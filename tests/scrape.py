"""Scraping a /metrics endpoint over real HTTP and reading its samples (metrics tests)."""

from __future__ import annotations

import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str) -> dict[str, list[Any]]:
    """metric family name -> its samples, parsed with prometheus_client's parser."""
    with urllib.request.urlopen(url, timeout=30) as resp:
        text = resp.read().decode()
    return {fam.name: fam.samples for fam in text_string_to_metric_families(text)}


def value(families: dict[str, list[Any]], sample: str, **labels: str) -> float:
    """The one sample named ``sample`` with these labels (fails unless exactly one)."""
    found = [s.value for samples in families.values() for s in samples
             if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, f"{sample}{labels}: expected one sample, found {found}"
    return float(found[0])
