"""The pass abstraction of PopRT: ``Pass``, its registry, ``register`` and ``PassManager``.

A pass is a class whose ``run(onnx_model)`` returns the transformed model; calling
an instance runs it. ``@register('name')`` (or ``Pass.register_pass``) puts a class
in the registry under that name; ``Pass.get_pass(name, *args, **kwargs)`` makes an
instance. Constraints between passes (``depend``, ``before``, ``against``) order and
check what a ``PassManager`` runs.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, TypeVar

import onnx

from host_runtime.errors import BadRequestError

__all__ = ["Pass", "PassManager", "register", "get_registered_passes", "get_pass",
           "UnknownPassError"]

_log = logging.getLogger("poprt.passes")

_REGISTRY: dict[str, type["Pass"]] = {}
_CONSTRAINTS = ("against", "depend", "before")

P = TypeVar("P", bound=type)


class UnknownPassError(BadRequestError, KeyError):
    """A pass name that is not registered."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _unknown(name: str) -> UnknownPassError:
    return UnknownPassError(f"no pass is registered as {name!r}; registered passes are "
                            f"{', '.join(sorted(_REGISTRY))}")


class Pass:
    """Abstract base class for passes: subclasses override ``run(onnx_model)``.

    Class attributes set by the registry: ``name`` (the registered name) and
    ``properties`` (``property_register``/``constraint_passes``)."""

    name: str = ""
    properties: dict[str, Any] = {}
    effect: str = "changes the model"
    """What the pass does to the emulated result (shown by ``poprt --list_all_passes``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args
        self.kwargs = kwargs

    @property
    def logger(self) -> logging.Logger:
        """The pass's logger (``poprt.passes.<name>``), as PopRT's passes log."""
        return logging.getLogger(f"poprt.passes.{self.name or type(self).__name__}")

    def __call__(self, onnx_model: onnx.ModelProto) -> onnx.ModelProto:
        if not isinstance(onnx_model, onnx.ModelProto):
            raise BadRequestError(f"pass {self.name or type(self).__name__!r} expects an "
                                  f"onnx.ModelProto, got {type(onnx_model).__name__}")
        out = self.run(onnx_model)
        if not isinstance(out, onnx.ModelProto):
            raise BadRequestError(f"pass {self.name or type(self).__name__!r} returned "
                                  f"{type(out).__name__}, expected an onnx.ModelProto")
        return out

    def run(self, onnx_model: onnx.ModelProto) -> onnx.ModelProto:
        """Run the pass; subclasses override this."""
        raise NotImplementedError(f"{type(self).__name__}.run is not implemented")

    def traverse_graph(self, graph: onnx.GraphProto,
                       transform: Callable[[onnx.GraphProto, bool], onnx.GraphProto],
                       is_main_graph: bool = True) -> onnx.GraphProto:
        """Apply ``transform(graph, is_main_graph)`` to ``graph`` and to every sub-graph of
        its nodes (If branches, Loop and Scan bodies), innermost first."""
        for node in graph.node:
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    attr.g.CopyFrom(self.traverse_graph(attr.g, transform, False))
                elif attr.type == onnx.AttributeProto.GRAPHS:
                    for g in attr.graphs:
                        g.CopyFrom(self.traverse_graph(g, transform, False))
        return transform(graph, is_main_graph)

    # -- the registry ----------------------------------------------------------------------
    @staticmethod
    def register_pass(pass_name: str) -> Callable[[P], P]:
        """Register a pass under ``pass_name``; a name taken by another class is refused."""
        return _registrar(pass_name, override=False)

    @staticmethod
    def override_register_pass(pass_name: str) -> Callable[[P], P]:
        """Register a pass, replacing one registered under the same name."""
        return _registrar(pass_name, override=True)

    @staticmethod
    def property_register(k: str, v: Any) -> Callable[[P], P]:
        """Set the property ``k`` of a pass class to ``v``."""
        def deco(cls: P) -> P:
            props = dict(getattr(cls, "properties", {}))
            props[k] = v
            setattr(cls, "properties", props)
            return cls
        return deco

    @staticmethod
    def constraint_passes(constraint_name: str, pass_names: list[str]) -> Callable[[P], P]:
        """Constrain a pass: ``against`` (cannot run with), ``depend`` (runs after, added if
        missing) or ``before`` (runs before) the passes named."""
        if constraint_name not in _CONSTRAINTS:
            raise BadRequestError(f"constraint {constraint_name!r} is not one of "
                                  f"{', '.join(_CONSTRAINTS)}")
        return Pass.property_register(constraint_name, list(pass_names))

    @staticmethod
    def against_passes(pass_names: list[str]) -> Callable[[P], P]:
        """The pass cannot run together with ``pass_names``."""
        return Pass.constraint_passes("against", pass_names)

    @staticmethod
    def get_pass(name: str, *args: Any, **kwargs: Any) -> "Pass":
        """An instance of the pass registered as ``name``."""
        cls = _REGISTRY.get(name)
        if cls is None:
            raise _unknown(name)
        return cls(*args, **kwargs)

    @staticmethod
    def get_registered_passes() -> dict[str, type["Pass"]]:
        """Every registered pass: name -> class."""
        return dict(_REGISTRY)

    @staticmethod
    def get_typed_registered_passes(pass_type: Any) -> dict[str, type["Pass"]]:
        """The registered passes that are subclasses of ``pass_type``."""
        return {k: v for k, v in _REGISTRY.items()
                if isinstance(v, type) and issubclass(v, pass_type)}


def _registrar(pass_name: str, override: bool) -> Callable[[P], P]:
    if not isinstance(pass_name, str) or not pass_name:
        raise BadRequestError(f"a pass name must be a non-empty str, got {pass_name!r}")

    def deco(cls: P) -> P:
        if not (isinstance(cls, type) and issubclass(cls, Pass)):
            raise BadRequestError(f"@register({pass_name!r}) decorates a subclass of "
                                  f"poprt.Pass, got {cls!r}")
        old = _REGISTRY.get(pass_name)
        if old is not None and old is not cls and not override and \
                (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
            raise BadRequestError(f"a pass is already registered as {pass_name!r} "
                                  f"({old.__module__}.{old.__qualname__}); use "
                                  "Pass.override_register_pass to replace it")
        setattr(cls, "name", pass_name)
        _REGISTRY[pass_name] = cls
        return cls
    return deco


register = Pass.register_pass
get_registered_passes = Pass.get_registered_passes
get_pass = Pass.get_pass


class PassManager:
    """Runs passes in order (names or ``Pass`` instances), after solving their
    ``depend``/``before``/``against`` constraints."""

    def __init__(self, used_passes: Iterable["str | Pass"] = (),
                 gather_ir_passes: bool = False) -> None:
        self._passes: list[Pass] = []
        self.add_passes(used_passes, gather_ir_passes)

    def add_passes(self, used_passes: Iterable["str | Pass"] = (),
                   gather_ir_passes: bool = False) -> None:
        """Append passes. ``gather_ir_passes`` is accepted: the ONNX IR passes run one by
        one here, which gives the same model."""
        if isinstance(used_passes, (str, Pass)):
            used_passes = [used_passes]
        for p in used_passes:
            if isinstance(p, str):
                self._passes.append(Pass.get_pass(p))
            elif isinstance(p, Pass):
                self._passes.append(p)
            else:
                raise BadRequestError(f"PassManager takes pass names or Pass instances, got "
                                      f"{type(p).__name__}")
        self.sort_passes()

    def get_all_pass_names(self) -> list[str]:
        return [p.name or type(p).__name__ for p in self._passes]

    def get_passes(self) -> list[Pass]:
        return list(self._passes)

    def sort_passes(self) -> None:
        """Add missing dependencies, refuse ``against`` pairs, order ``depend``/``before``."""
        names = self.get_all_pass_names()
        for p in list(self._passes):
            for dep in p.properties.get("depend", []):
                if dep not in names:
                    self._passes.insert(self._passes.index(p), Pass.get_pass(dep))
                    names = self.get_all_pass_names()
            for other in p.properties.get("against", []):
                if other in names:
                    raise BadRequestError(f"pass {p.name!r} cannot run together with "
                                          f"{other!r}")
        order = list(self._passes)
        for _ in range(len(order) + 1):          # bounded: a cycle stops here
            moved = False
            for p in list(order):
                i = order.index(p)
                for dep in p.properties.get("depend", []):
                    j = next((k for k, q in enumerate(order) if q.name == dep), -1)
                    if j > i:
                        order.insert(j, order.pop(i))
                        moved = True
                        break
                for nxt in p.properties.get("before", []):
                    j = next((k for k, q in enumerate(order) if q.name == nxt), -1)
                    if 0 <= j < order.index(p):
                        order.insert(j, order.pop(order.index(p)))
                        moved = True
            if not moved:
                break
        self._passes = order

    def run(self, onnx_model: onnx.ModelProto) -> onnx.ModelProto:
        """Apply every pass in order and return the model."""
        for p in self._passes:
            _log.info("running pass %s", p.name or type(p).__name__)
            onnx_model = p(onnx_model)
        return onnx_model
