"""Dispatch ``python -m tools.bench <name> [args]`` to ``tools.bench.<name>:main(argv)``."""

from __future__ import annotations

import importlib
import sys

_BENCHES = {
    "ring": ("tools.bench.ring", "shm ring latency and bandwidth vs Pipe, semaphores, numpy"),
}


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print("usage: python -m tools.bench <benchmark> [args]\n\nbenchmarks:")
        for name, (_, text) in _BENCHES.items():
            print(f"  {name:10s} {text}")
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in _BENCHES:
        print(f"tools.bench: unknown benchmark {name!r}; expected one of "
              + ", ".join(sorted(_BENCHES)), file=sys.stderr)
        return 2
    return int(importlib.import_module(_BENCHES[name][0]).main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
