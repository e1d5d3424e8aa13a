"""``ipu-emulator``: one command with subcommands (cleanup, demo, daemon, ...).

Each subcommand lives in its own module of ``tools`` with a ``main(argv)``
function; this file only dispatches, so importing it is cheap.
"""

from __future__ import annotations

import importlib
import sys

_SUBCOMMANDS = {
    "cleanup": ("tools.cleanup", "remove shared-memory objects whose creating process is dead"),
    "demo": ("tools.demo", "write the seeds' example model and run every execution mode"),
    "daemon": ("tools.daemon", "serve a shared pool of warm emulated IPUs to host processes"),
    "trace": ("tools.trace_summary", "summarise a timeline trace: where each request's time went, how busy each IPU was"),
    "run": ("ipu_emulator.run", "run a program written for Graphcore's model_runtime, popef and poprt, unchanged"),
    "stress": ("tools.stress", "hammer the runtime with many hosts, threads, batch sizes and faults; check every result"),
}


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print("usage: ipu-emulator <command> [args]\n\ncommands:")
        for name, (_, text) in _SUBCOMMANDS.items():
            print(f"  {name:10s} {text}")
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in _SUBCOMMANDS:
        print(f"ipu-emulator: unknown command {name!r}; expected one of "
              + ", ".join(sorted(_SUBCOMMANDS)), file=sys.stderr)
        return 2
    module = importlib.import_module(_SUBCOMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
