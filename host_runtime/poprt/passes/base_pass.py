"""PopRT's ``poprt.passes.base_pass``: the pass base classes that pass authors subclass.

``Pass`` is the registry's base class (``host_runtime.poprt.passes._base``);
``ImmutablePass`` is a pass that leaves the model it is given untouched (its ``run``
gets a copy); ``get_all_named_subclasses(cls)`` maps each named subclass to its class,
as programs that look passes up (or patch that lookup) expect.
"""

from __future__ import annotations

from typing import Any

import onnx

from host_runtime.poprt._onnx_util import copy_model
from host_runtime.poprt.passes._base import Pass

__all__ = ["Pass", "ImmutablePass", "get_all_named_subclasses"]


class ImmutablePass(Pass):
    """A pass that does not change the caller's model: calling it runs ``run`` on a
    copy (a check such as ``final_check``, or a pass that builds a new model)."""

    def __call__(self, onnx_model: onnx.ModelProto) -> onnx.ModelProto:
        if isinstance(onnx_model, onnx.ModelProto):
            onnx_model = copy_model(onnx_model)
        return super().__call__(onnx_model)


def get_all_named_subclasses(cls: type) -> dict[str, Any]:
    """Every subclass of ``cls`` (at any depth) that has a non-empty ``name``:
    name -> class; a later subclass with the same name wins."""
    out: dict[str, Any] = {}
    seen: set[type] = set()
    todo: list[type] = list(cls.__subclasses__())
    while todo:
        sub = todo.pop(0)
        if sub in seen:
            continue
        seen.add(sub)
        name = getattr(sub, "name", "")
        if isinstance(name, str) and name:
            out[name] = sub
        todo.extend(sub.__subclasses__())
    return out
