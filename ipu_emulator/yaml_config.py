"""The one YAML loader of the project: every config file (the machine's
``IPU_EMULATOR_CONFIG``, poprt's ``--config_yaml``, ``--manual_sharding_config``)
is read here, and refused cheaply when it is hostile.

YAML's aliases make a "billion laughs" document possible: nine anchors of nine
aliases each are a 400-byte file whose value, once walked, is 9**9 strings.
PyYAML composes it in microseconds (an alias is a reference to the same node),
and everything that then walks the value (type checks, ``str()`` for an
error message) takes minutes or prints megabytes. Refusing aliases outright
would do, since no config of ours needs them (the fusion config's global keys
already share values between models), but a hand-written config may use an
anchor to repeat an ``input_shape``; so aliases are allowed and *counted*:

- before any value is built, the document's parse events are counted: each
  node's expanded size (itself plus its children, an alias counting as the
  whole node it names) is known as soon as the node is complete, and a
  document whose expansion passes ``MAX_NODES`` is refused at the node where
  it does, before anything walks it (libyaml's parser, when PyYAML has it,
  makes both the count and the load fast);
- an alias to a node that contains it (a recursive structure) is refused;
- nesting deeper than ``MAX_DEPTH`` is refused (deep brackets would otherwise
  end in a RecursionError inside the composer);
- the file is at most ``MAX_BYTES`` and must be UTF-8; a scalar the
  constructor cannot convert (an integer of more than 4300 digits, a bad
  date) is refused with the line it is on.

Every refusal is a ``ConfigYamlError`` naming the file and what was wrong; the
caller turns it into its own class (``SystemConfigError``, ``CompileError``,
``BadRequestError``).
"""

from __future__ import annotations

import os
from typing import Any

import yaml

from ipu_emulator.errors import ConfigYamlError
from ipu_emulator.safe_files import open_regular
from shm.errors import echo

__all__ = ["load_yaml_file", "load_yaml_text", "ConfigYamlError", "MAX_NODES", "MAX_DEPTH",
           "MAX_BYTES"]

MAX_NODES = 100_000
"""Nodes a document may expand to, aliases expanded (ours have tens to thousands)."""
MAX_DEPTH = 64
"""Levels of nesting (ours have three or four)."""
MAX_BYTES = 1 << 20
"""Bytes of a config file."""


class _Refused(yaml.YAMLError):
    """Raised by the count of events; becomes ConfigYamlError at the edge."""


def _where(mark: Any) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "?"


# libyaml's parser when PyYAML was built with it (a 1 MiB document: ~0.3 s instead of ~5 s)
_Parser: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def _count(text: str) -> None:
    """Refuse the document as soon as a node's expansion passes MAX_NODES, nesting passes
    MAX_DEPTH, or an alias names a node that contains it (``_count_events``).

    libyaml's scanner reads tokens ahead of the events it hands out, and newer releases
    refuse deep nesting there (at 1000 levels), before the events reach our bound; so
    when libyaml's parser fails, the count is made again with PyYAML's own parser, which
    hands out each event as it is read: our bound then speaks first, whatever libyaml's,
    and a document that is simply invalid fails the same way in both. (PyYAML's parser
    is ten times slower, so it is skipped where the document cannot nest that deep: each
    level opens with a bracket, a brace, an indicator or a new line.)"""
    try:
        _count_events(_Parser(text))
    except _Refused:
        raise
    except yaml.YAMLError:
        if _Parser is yaml.SafeLoader or _depth_bound(text) <= MAX_DEPTH:
            raise
        _count_events(yaml.SafeLoader(text))


def _depth_bound(text: str) -> int:
    """More levels than any YAML text can nest: every collection starts at a flow
    bracket, a block indicator (``-``, ``?``, ``:``) or a new line."""
    return 1 + text.count("\n") + sum(text.count(c) for c in "[{-?:")


def _count_events(parser: Any) -> None:
    """Walk the document's events (no values built). A node's expanded size is 1 + its
    children's; an alias counts as the size of the node its anchor names, known once
    that node is complete."""
    stack: list[list[Any]] = []          # [size so far, anchor, start mark] per open node
    done: dict[str, int] = {}            # anchor -> expanded size of its (complete) node
    open_anchors: set[str] = set()

    aliases = 0

    def finish(size: int, anchor: str | None, mark: Any) -> None:
        if size > MAX_NODES:
            if not aliases:
                raise _Refused(f"holds more than {MAX_NODES} values (at {_where(mark)}); "
                               "expected a config (tens to thousands of values)")
            raise _Refused(f"its aliases expand past {MAX_NODES} values at {_where(mark)} "
                           "(a 'billion laughs' document?); expected a config of plain "
                           "values: write them out instead of repeating aliases")
        if anchor is not None:
            done[anchor] = size
            open_anchors.discard(anchor)
        if stack:
            stack[-1][0] += size

    try:
        while parser.check_event():
            ev = parser.get_event()
            if isinstance(ev, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
                if len(stack) >= MAX_DEPTH:
                    raise _Refused(f"nests too deeply: more than {MAX_DEPTH} levels at "
                                   f"{_where(ev.start_mark)}")
                if ev.anchor is not None:
                    done.pop(ev.anchor, None)
                    open_anchors.add(ev.anchor)
                stack.append([1, ev.anchor, ev.start_mark])
            elif isinstance(ev, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
                size, anchor, mark = stack.pop()
                finish(size, anchor, mark)
            elif isinstance(ev, yaml.ScalarEvent):
                finish(1, ev.anchor, ev.start_mark)
            elif isinstance(ev, yaml.AliasEvent):
                aliases += 1
                if ev.anchor in open_anchors:
                    raise _Refused(f"the alias *{echo(ev.anchor, 40, quote=False)} at "
                                   f"{_where(ev.start_mark)} refers to a node that contains "
                                   "it (a recursive structure); expected plain values")
                # an undefined alias is the composer's error, reported as invalid YAML
                finish(done.get(ev.anchor or "", 1), None, ev.start_mark)
    finally:
        parser.dispose()


def _problem(exc: yaml.YAMLError) -> str:
    """PyYAML's error on one line: the problem and where, then what it was parsing."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem:
        text = f"{exc.problem} at {_where(exc.problem_mark)}"
        if exc.context:
            text += f" ({exc.context} at {_where(exc.context_mark)})"
    else:
        text = str(exc)
    return echo(" ".join(text.split()), 300, quote=False)


class _Loader(_Parser):  # type: ignore[misc]
    """The safe loader, remembering which node it converts (for errors)."""

    last_mark: Any = None

    def construct_object(self, node: Any, deep: bool = False) -> Any:
        self.last_mark = node.start_mark
        return super().construct_object(node, deep)


def load_yaml_text(text: str, where: str) -> Any:
    """The value of the YAML document ``text``; ``where`` names it in errors."""
    loader: Any = None
    try:
        _count(text)
        loader = _Loader(text)
        return loader.get_single_data()
    except _Refused as exc:
        raise ConfigYamlError(f"{where}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigYamlError(f"{where} is not valid YAML: {_problem(exc)}") from None
    except (ValueError, OverflowError) as exc:   # a scalar the constructor cannot convert
        mark = loader.last_mark if loader is not None else None
        raise ConfigYamlError(f"{where} holds a value that cannot be read"
                              f"{' at ' + _where(mark) if mark is not None else ''}: "
                              f"{echo(str(exc), 200, quote=False)}") from None
    except RecursionError:   # pragma: no cover - MAX_DEPTH stops nesting long before
        raise ConfigYamlError(f"{where} nests too deeply to be a config") from None
    finally:
        if loader is not None:
            loader.dispose()


def load_yaml_file(path: str | os.PathLike[str], what: str = "config") -> Any:
    """Read and parse the YAML (or JSON) file ``path``; ``what`` names it in errors
    (``"config"``, ``"sharding config"``...). Raises ``ConfigYamlError``; an OS error
    (missing file, no permission) is one too, naming the file."""
    p = os.fspath(path)
    where = f"{what} {echo(p, 200)}"
    try:
        with open_regular(p) as f:   # a FIFO there is refused, not waited on
            size = os.fstat(f.fileno()).st_size
            if size > MAX_BYTES:
                raise ConfigYamlError(f"{where} is {size} bytes; the limit is {MAX_BYTES}")
            data = f.read(MAX_BYTES + 1)
    except OSError as exc:
        raise ConfigYamlError(f"cannot read {where}: {exc.strerror or exc}") from None
    if len(data) > MAX_BYTES:   # grew since the stat
        raise ConfigYamlError(f"{where} is more than {MAX_BYTES} bytes; the limit is "
                              f"{MAX_BYTES}")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigYamlError(f"{where} is not UTF-8 text: byte {exc.start} is "
                              f"{data[exc.start:exc.start + 1]!r}") from None
    return load_yaml_text(text, where)
