"""``ipu-emulator``: one command with subcommands (cleanup, demo, daemon, ...).

Each subcommand lives in its own module of ``tools`` with a ``main(argv)``
function; this file only dispatches, so importing it is cheap. An error a
subcommand does not report itself (the project's named errors, ``OSError``) is
printed as ``ipu-emulator NAME: error: ...`` without a traceback: exit status 2
for a bad input or setting (a ``ValueError``), 1 for anything else, 130 for Ctrl-C.
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
    "vipu": ("tools.vipu", "V-IPU partitions on the daemon: create, list, get (IPUoF config), remove"),
    "ray-node": ("tools.ray_node", "start or stop a Ray cluster node that offers its daemon's IPUs as the resource 'IPU'"),
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
    try:
        return int(module.main(rest) or 0)
    except KeyboardInterrupt:
        print(f"ipu-emulator {name}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if not _named(exc):
            raise   # a bug: its traceback is what helps
        print(f"ipu-emulator {name}: error: {describe(exc)}", file=sys.stderr)
        return 2 if isinstance(exc, ValueError) else 1


def vipu_main() -> int:
    """``vipu``: V-IPU's own command name for ``ipu-emulator vipu`` (job scripts and Slurm
    prologs that call ``vipu create partition ...`` run unchanged)."""
    return main(["vipu", *sys.argv[1:]])


def _named(exc: BaseException) -> bool:
    """An error the project raises on purpose (its message says what and how to fix it),
    or one of the operating system's."""
    from host_runtime.errors import ModelRuntimeError
    from ipu_emulator.errors import IpuEmulatorError
    from shm.errors import ShmError
    from shm.settings import SettingsError

    return isinstance(exc, (IpuEmulatorError, ModelRuntimeError, ShmError, SettingsError,
                            OSError))


def describe(exc: BaseException) -> str:
    """``exc`` in one line: an OSError as ``PATH: reason``, others as their message."""
    if isinstance(exc, OSError) and exc.strerror and exc.filename is not None:
        return f"{exc.filename}: {exc.strerror}"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
