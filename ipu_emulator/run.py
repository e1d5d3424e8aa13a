"""Run a program written for Graphcore's Python modules, unchanged, on the emulator.

::

    ipu-emulator run [--force] [--quiet] PROGRAM [ARGS...]
    ipu-emulator run [--force] [--quiet] -m MODULE [ARGS...]
    python -m ipu_emulator.run ...                        (the same)

    import ipu_emulator.run; ipu_emulator.run.install()   (in an interpreter or a program)

The way ``coverage run`` or ``python -m cProfile`` run a script: before the program's
first import, a finder is put first on ``sys.meta_path`` that answers Graphcore's module
names with this project's modules, then the program runs through ``runpy`` as
``__main__`` with ``sys.argv`` and ``sys.path[0]`` as ``python PROGRAM ARGS`` gives them.
A program that starts processes with multiprocessing's ``spawn`` (not Linux's default
``fork``) needs ``install()`` in the child too: a spawned interpreter starts afresh.

    model_runtime[.x]  ->  host_runtime[.x]
    popef[.x]          ->  host_runtime.popef[.x]
    poprt[.x]          ->  host_runtime.poprt[.x]      (poprt.runtime, poprt.compiler, ...)

``import popef`` gives the very module object ``host_runtime.popef`` (no copy: classes,
``isinstance`` and module state are shared), under both names. The names are mapped as
strings; this module imports nothing of ``host_runtime`` (the program's imports do).

Opt-in and never silent: where Graphcore's real ``model_runtime``, ``popef`` or ``poprt`` is
importable by the ordinary path finders (an installed SDK, or a module of that name next
to the program), nothing is mapped and :class:`~ipu_emulator.errors.RealModulesError` says
where it is, unless ``force`` (``--force``, ``IPU_EMULATOR_FORCE_MODULES=1``) asks for the
emulator anyway. The command says on stderr which implementation answers (``--quiet``: not).

The program's exit status is the command's; an exception prints the program's traceback
(without this module's frames) and exits 1.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import runpy
import sys
import threading
import types
from typing import Sequence

from ipu_emulator.errors import RealModulesError
from ipu_emulator.settings import IpuSettings

__all__ = ["ALIASES", "install", "uninstall", "installed", "real_modules", "describe",
           "target_of", "main"]

ALIASES: dict[str, str] = {
    "model_runtime": "host_runtime",
    "popef": "host_runtime.popef",
    "poprt": "host_runtime.poprt",
}
"""Graphcore's top-level module names and the modules of this project that answer them."""

_lock = threading.Lock()
_log = logging.getLogger(__name__)


def target_of(fullname: str) -> str | None:
    """The module of this project that answers ``fullname`` (``poprt.runtime`` ->
    ``host_runtime.poprt.runtime``), or None for a name that is not Graphcore's."""
    head, dot, rest = fullname.partition(".")
    base = ALIASES.get(head)
    if base is None:
        return None
    return base + dot + rest


class _AliasLoader(importlib.abc.Loader):
    """Loads a Graphcore name as the module of this project it maps to: the same object.

    The import system stamps the alias's spec on the module it gets; the module keeps
    its own (so relative imports, ``reload`` and pickling see the real name)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.own_spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = importlib.import_module(self.target)
        self.own_spec = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        module.__spec__ = self.own_spec   # already executed under its own name


class AliasFinder(importlib.abc.MetaPathFinder):
    """The meta path finder :func:`install` puts first on ``sys.meta_path``."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: types.ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        name = target_of(fullname)
        if name is None:
            return None
        try:
            found = importlib.util.find_spec(name)
        except ModuleNotFoundError:
            found = None
        except ValueError:   # in sys.modules without a spec: made by code, not a file
            found = getattr(sys.modules.get(name), "__spec__", None)
            if found is None:
                return importlib.util.spec_from_loader(fullname, _AliasLoader(name))
        if found is None:
            return None   # "No module named 'poprt.xyz'", as for any missing module
        return importlib.util.spec_from_loader(
            fullname, _AliasLoader(name),
            is_package=found.submodule_search_locations is not None)

    def __repr__(self) -> str:
        return "<ipu_emulator.run.AliasFinder: " + ", ".join(
            f"{k} -> {v}" for k, v in ALIASES.items()) + ">"


def _finder() -> AliasFinder | None:
    for f in sys.meta_path:
        if type(f).__name__ == "AliasFinder" and type(f).__module__ in (__name__, "__main__"):
            return f   # type: ignore[return-value]
    return None


def installed() -> bool:
    """Whether the names are mapped in this interpreter."""
    return _finder() is not None


def real_modules() -> dict[str, str]:
    """Graphcore's modules importable here by the ordinary path finders (or already
    imported), each with where it is: what :func:`install` refuses to hide."""
    found: dict[str, str] = {}
    for name in ALIASES:
        module = sys.modules.get(name)
        if module is not None:
            if module is not sys.modules.get(ALIASES[name]):
                found[name] = str(getattr(module, "__file__", None) or "already imported")
            continue
        try:
            spec = importlib.machinery.PathFinder.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is not None:
            locations = list(spec.submodule_search_locations or [])
            found[name] = spec.origin or (locations[0] if locations else "a namespace package")
    return found


def install(force: bool | None = None) -> None:
    """Map ``model_runtime``, ``popef`` and ``poprt`` (and their submodules) onto this
    project in this interpreter, before they are imported. Idempotent.

    ``force``: map them even where Graphcore's real modules are importable (default:
    ``IPU_EMULATOR_FORCE_MODULES``); else :class:`RealModulesError` names them."""
    with _lock:
        if _finder() is not None:
            return
        if force is None:
            force = bool(IpuSettings.read("force_modules"))
        real = real_modules()
        if real and not force:
            where = "; ".join(f"{name} at {path}" for name, path in sorted(real.items()))
            raise RealModulesError(
                f"Graphcore's own modules are importable here ({where}): mapping "
                f"{', '.join(ALIASES)} onto the IPU emulator would hide them. To use the "
                "emulator anyway pass --force (install(force=True), "
                "IPU_EMULATOR_FORCE_MODULES=1); to use the real SDK, run the program "
                "without the emulator")
        for name in [n for n in sys.modules if n.split(".")[0] in real]:
            del sys.modules[name]    # forced: a real module imported already gives way
        sys.meta_path.insert(0, AliasFinder())
        _log.info("%s", describe())


def uninstall() -> None:
    """Undo :func:`install`: the finder goes, and the names it answered are forgotten
    (``host_runtime`` and its modules stay imported under their own names)."""
    with _lock:
        finder = _finder()
        if finder is None:
            return
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if target_of(n) is not None]:
            if sys.modules[name] is sys.modules.get(target_of(name) or ""):
                del sys.modules[name]


def describe() -> str:
    """One line saying which implementation answers the names (the command prints it)."""
    spec = importlib.util.find_spec("host_runtime")
    where = os.path.dirname(spec.origin) if spec is not None and spec.origin else "?"
    return f"{', '.join(ALIASES)} are the IPU emulator's (host_runtime at {where})"


# -- the command ---------------------------------------------------------------------------

_USAGE = ("usage: ipu-emulator run [--force] [--quiet] PROGRAM [ARGS...]\n"
          "       ipu-emulator run [--force] [--quiet] -m MODULE [ARGS...]\n\n"
          "Run a program written for Graphcore's model_runtime, popef and poprt, unchanged,\n"
          "on the IPU emulator (those names resolve to host_runtime's modules).\n\n"
          "  --force   map the names even where Graphcore's real modules are installed\n"
          "            (also IPU_EMULATOR_FORCE_MODULES=1)\n"
          "  --quiet   do not say on stderr which implementation answers\n")


def _parse(argv: list[str]) -> tuple[bool, bool, str | None, list[str]]:
    """(force, quiet, module or None, [program or module, args...])."""
    force, quiet = False, False
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--force":
            force = True
        elif arg in ("-q", "--quiet"):
            quiet = True
        elif arg == "-m":
            if i + 1 >= len(argv):
                raise ValueError("-m needs a module name")
            return force, quiet, argv[i + 1], argv[i + 1:]
        elif arg == "--":
            i += 1
            break
        elif arg.startswith("-"):
            raise ValueError(f"unknown option {arg!r}")
        else:
            break
        i += 1
    if i >= len(argv):
        raise ValueError("no program given")
    return force, quiet, None, argv[i:]


def _strip_own_frames(exc: BaseException) -> None:
    """The traceback from the program's first frame on (as ``python PROGRAM`` prints it)."""
    tb = exc.__traceback__
    ours = {__file__, runpy.__file__, "<frozen runpy>"}
    while tb is not None and tb.tb_frame.f_code.co_filename in ours:
        tb = tb.tb_next
    exc.__traceback__ = tb


def main(argv: list[str] | None = None) -> int:
    """``ipu-emulator run``; returns the exit status (a program's ``sys.exit`` passes
    through as ``SystemExit``)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        sys.stdout.write(_USAGE)
        return 0 if args else 2
    try:
        force, quiet, module, rest = _parse(args)
    except ValueError as exc:
        sys.stderr.write(f"ipu-emulator run: {exc}\n{_USAGE}")
        return 2
    if module is None:
        program = rest[0]
        if not os.path.exists(program):
            sys.stderr.write(f"ipu-emulator run: can't open file {program!r}: no such file\n")
            return 2
        first = os.path.dirname(os.path.abspath(program))
    else:
        first = os.getcwd()
    # as `python PROGRAM` / `python -m` give it; what was first stays (this project may
    # be importable only from there, a checkout run with `python -m ipu_emulator.run`)
    sys.path.insert(0, first)
    try:
        install(force=force or None)
    except RealModulesError as exc:
        sys.stderr.write(f"ipu-emulator run: {exc}\n")
        return 2
    if not quiet:
        sys.stderr.write(f"ipu-emulator run: {describe()}\n")
        sys.stderr.flush()
    sys.argv = list(rest)
    try:
        if module is None:
            runpy.run_path(rest[0], run_name="__main__")
        else:
            # (a mapped name runs as the module it maps to: the alias has no code of its own)
            runpy.run_module(target_of(module) or module, run_name="__main__",
                             alter_sys=True)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:
        _strip_own_frames(exc)
        sys.excepthook(type(exc), exc, exc.__traceback__)
        return 1
    return 0


if __name__ == "__main__":
    from ipu_emulator.run import main as _main   # the module proper, not this __main__ copy

    sys.exit(_main())
