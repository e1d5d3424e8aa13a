"""PopRT's ``poprt.passes.pattern_helper.PatternMatcher``: find a small sub-graph by the
op types of its nodes and the edges between them.

A pattern is a list of chains ``"s:0->Reshape:R->MatMul:M->e:1"``. Each link is
``OpType:label``; ``A->B`` says an output of ``A`` is an input of ``B``. ``s:…`` (start)
and ``e:…`` (end) mark the ends of a chain and match anything. A label used in two
chains is the same node (a node feeding two others, two paths meeting). Spaces are
ignored. ``next_pattern(graph)`` gives the first match (in node order) not given before
by this matcher (nodes known by op type and outputs, so editing a match's inputs does
not make it new): label -> ``MatchedNode`` (``.node``, the graph's NodeProto, and
``.index``, its position in ``graph.node``), or an empty dict when there is none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

import onnx

from host_runtime.errors import BadRequestError

__all__ = ["PatternMatcher", "MatchedNode"]

_ENDS = ("s", "e")
_MAX_STEPS = 2_000_000      # candidate checks per search: a bound, not a tuning knob


@dataclass
class MatchedNode:
    """One matched node: ``node`` is the graph's own NodeProto (edit it in place);
    ``index`` is its position in ``graph.node`` when matched."""
    node: onnx.NodeProto
    index: int


def _parse(pattern: Iterable[str]) -> tuple[dict[str, str], set[tuple[str, str]]]:
    if isinstance(pattern, str):
        pattern = [pattern]
    ops: dict[str, str] = {}
    edges: set[tuple[str, str]] = set()
    for chain in pattern:
        if not isinstance(chain, str):
            raise BadRequestError(f"PatternMatcher: a pattern is a list of str chains, got "
                                  f"{type(chain).__name__}")
        labels: list[Optional[str]] = []
        for link in "".join(chain.split()).split("->"):
            op, sep, label = link.partition(":")
            if not op or not sep or not label:
                raise BadRequestError(f"PatternMatcher: {link!r} in {chain!r} is not "
                                      "'OpType:label'")
            if op in _ENDS:
                labels.append(None)
                continue
            if ops.setdefault(label, op) != op:
                raise BadRequestError(f"PatternMatcher: label {label!r} is both "
                                      f"{ops[label]!r} and {op!r}")
            labels.append(label)
        for a, b in zip(labels, labels[1:]):
            if a is not None and b is not None:
                edges.add((a, b))
    if not ops:
        raise BadRequestError("PatternMatcher: the pattern names no node")
    return ops, edges


class PatternMatcher:
    """Finds the sub-graphs a pattern describes (module docstring)."""

    def __init__(self, pattern: Iterable[str]) -> None:
        self.ops, self.edges = _parse(pattern)
        self._order = self._search_order()
        self._given: set[tuple[tuple[str, ...], ...]] = set()

    def _search_order(self) -> list[str]:
        """Labels so that each (but the first of each connected part) has an edge to an
        earlier one: candidates then come from that neighbour's edges."""
        order: list[str] = []
        for start in self.ops:
            if start in order:
                continue
            order.append(start)
            grown = True
            while grown:
                grown = False
                for a, b in sorted(self.edges):
                    for new, old in ((b, a), (a, b)):
                        if old in order and new not in order:
                            order.append(new)
                            grown = True
        return order

    def next_pattern(self, graph: onnx.GraphProto) -> dict[str, MatchedNode]:
        """The next match in ``graph`` (label -> MatchedNode), or ``{}``."""
        nodes = list(graph.node)
        for found in self._matches(nodes):
            # a node is known by its type and outputs: rewrites edit inputs, not outputs
            key = tuple((nodes[i].op_type, *nodes[i].output) for i in found)
            if key in self._given:
                continue
            self._given.add(key)
            return {label: MatchedNode(nodes[i], i) for label, i in zip(self._order, found)}
        return {}

    def _matches(self, nodes: list[onnx.NodeProto]) -> Iterable[list[int]]:
        made: dict[str, list[int]] = {}
        used: dict[str, list[int]] = {}
        for i, n in enumerate(nodes):
            for o in n.output:
                made.setdefault(o, []).append(i)
            for t in n.input:
                used.setdefault(t, []).append(i)
        steps = 0

        def feeds(a: int, b: int) -> bool:
            return any(o and o in nodes[b].input for o in nodes[a].output)

        def candidates(label: str, got: dict[str, int]) -> Iterable[int]:
            for a, b in self.edges:
                if b == label and a in got:
                    return sorted({j for o in nodes[got[a]].output for j in used.get(o, [])})
                if a == label and b in got:
                    return sorted({j for t in nodes[got[b]].input for j in made.get(t, [])})
            return range(len(nodes))

        def grow(depth: int, got: dict[str, int]) -> Iterable[list[int]]:
            nonlocal steps
            if depth == len(self._order):
                yield [got[label] for label in self._order]
                return
            label = self._order[depth]
            for j in candidates(label, got):
                steps += 1
                if steps > _MAX_STEPS:
                    return
                if nodes[j].op_type != self.ops[label] or j in got.values():
                    continue
                if all(feeds(got[a], j) for a, b in self.edges if b == label and a in got) and \
                        all(feeds(j, got[b]) for a, b in self.edges if a == label and b in got):
                    got[label] = j
                    yield from grow(depth + 1, got)
                    del got[label]

        yield from grow(0, {})
