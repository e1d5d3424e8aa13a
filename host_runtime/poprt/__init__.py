"""The PopRT pieces of seed 004: the runtime ``Runner`` and the compiler front end.

``from host_runtime.poprt import Runner, RuntimeConfig`` replaces the seed's
``from poprt.runtime import Runner, RuntimeConfig``. Names are imported on
first use so that importing the package stays cheap.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["Runner", "RuntimeConfig", "compile"]

_LAZY = {
    "Runner": "host_runtime.poprt.runtime",
    "RuntimeConfig": "host_runtime.poprt.runtime",
    "compile": "host_runtime.poprt.compiler",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        if name in ("runtime", "compiler"):
            return importlib.import_module(f"{__name__}.{name}")
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # pragma: no cover
    from host_runtime.poprt.compiler import compile
    from host_runtime.poprt.runtime import Runner, RuntimeConfig
