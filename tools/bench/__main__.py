"""Dispatch ``python -m tools.bench <name> [args]`` to ``tools.bench.<name>:main(argv)``.

Benchmarks are found by naming convention: every module of this package
(other than this one) with a ``main(argv)`` function is one. Its one-line
description is its ``DESCRIPTION`` or the first line of its docstring.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
from types import ModuleType

import tools.bench as _package


def _names() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(_package.__path__)
                  if not m.name.startswith("_"))


def _describe(module: ModuleType) -> str:
    text = getattr(module, "DESCRIPTION", None) or (module.__doc__ or "").strip()
    return text.splitlines()[0] if text else ""


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    names = _names()
    if not args or args[0] in ("-h", "--help"):
        print("usage: python -m tools.bench <benchmark> [args]\n\nbenchmarks:")
        for name in names:
            print(f"  {name:10s} {_describe(importlib.import_module(f'tools.bench.{name}'))}")
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in names:
        print(f"tools.bench: unknown benchmark {name!r}; expected one of " + ", ".join(names),
              file=sys.stderr)
        return 2
    return int(importlib.import_module(f"tools.bench.{name}").main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
