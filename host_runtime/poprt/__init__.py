"""PopRT over the emulated IPU: ``from host_runtime import poprt`` replaces ``import poprt``.

The runtime (``poprt.runtime``: ``Runner``, ``RuntimeConfig``), the compile side
(``poprt.compiler``: ``Compiler``, ``CompilerOptions``, ``Executable``), the
converter (``Converter``, ``Sharder``, ``MFConverter``), the passes (``Pass``,
``PassManager``, ``get_pass``...) and the backends (``Backend``,
``backend.get_session``). Names are imported on first use so that importing the
package stays cheap.

``__version__`` says which PopRT API this matches: ``1.5.0+emulator``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "1.5.0+emulator"
"""PopRT 1.5.0's API, over the IPU emulator (a PEP 440 local version)."""

__all__ = ["Runner", "RuntimeConfig", "compile", "Converter", "Backend", "Pass",
           "PassManager", "get_registered_passes", "get_pass", "__version__"]

_LAZY = {
    "Runner": "host_runtime.poprt.runtime",
    "RuntimeConfig": "host_runtime.poprt.runtime",
    "compile": "host_runtime.poprt.compiler",
    "Converter": "host_runtime.poprt.converter",
    "Backend": "host_runtime.poprt.backends",
    "Pass": "host_runtime.poprt.passes",
    "PassManager": "host_runtime.poprt.passes",
    "get_registered_passes": "host_runtime.poprt.passes",
    "get_pass": "host_runtime.poprt.passes",
}
_MODULES = ("runtime", "compiler", "converter", "frontend", "backends", "backend", "quantizer",
            "passes", "profile", "utils", "optimizer", "cli_args")


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        if name in _MODULES:
            return importlib.import_module(f"{__name__}.{name}")
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | set(_MODULES))


if TYPE_CHECKING:  # pragma: no cover
    from host_runtime.poprt.backends import Backend
    from host_runtime.poprt.compiler import compile
    from host_runtime.poprt.converter import Converter
    from host_runtime.poprt.passes import Pass, PassManager, get_pass, get_registered_passes
    from host_runtime.poprt.runtime import Runner, RuntimeConfig
