"""PopRT's passes: ``Pass``, ``register``, ``PassManager`` and every documented pass.

``from host_runtime.poprt.passes import Pass, register`` replaces ``from poprt.passes
import ...``. Each documented pass lives in its documented module
(``host_runtime.poprt.passes.float_to_half.Float2Half``, registered as
``float_to_half``). Which passes change the model, which leave the emulated result
unchanged and which are refused: ``_catalog`` and docs/poprt_compile.md.
"""

from __future__ import annotations

import sys

from host_runtime.poprt.passes._base import (Pass, PassManager, UnknownPassError,
                                             get_pass, get_registered_passes, register)
from host_runtime.poprt.passes._catalog import PassNotSupportedError, install

__all__ = ["Pass", "PassManager", "register", "get_pass", "get_registered_passes",
           "UnknownPassError", "PassNotSupportedError", "onnx_helper", "base_pass",
           "pattern_helper", "get_dtype", "get_shape"]

install(sys.modules[__name__])

# after the catalog: these modules import the registered passes' modules
from host_runtime.poprt.passes import base_pass, onnx_helper, pattern_helper  # noqa: E402
from host_runtime.poprt.passes.onnx_helper import get_dtype, get_shape  # noqa: E402
