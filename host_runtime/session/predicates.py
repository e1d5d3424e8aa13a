"""Anchor predicates: which anchors get user callbacks, which use PopEF data.

Seed 002, section 10.2.1. A predicate is a callable ``pred(anchor) -> policy``:

- an *anchor-callback predicate* returns an :class:`AnchorCallbackPolicy` and
  steers ``Session.setUserInputHandler`` / ``setUserOutputHandler``;
- a *PopEF-data-usage predicate* returns a :class:`PopefDataUsagePolicy` and
  steers ``SessionConfig.pred_tensor_data`` (whether tensor/feed data stored in
  the PopEF file is bound to its anchor automatically).

``predicate_factory.anchor_callbacks`` and ``predicate_factory.popef_data_usage``
build the usual ones, with the seed's defaults: anchor callbacks accept with
``BIND_USER_CB`` and reject with ``BIND_EMPTY_CB``; data usage accepts with
``USE_USER_DATA`` and rejects with ``USE_POPEF_DATA_IF_ANY``.

``andBind(accept, reject, *preds)`` returns ``accept`` when every predicate
returns ``accept`` (conjunction); ``orBind`` when at least one does.
A "scalar" anchor (``predNonScalarType``) is one of rank 0.
"""

from __future__ import annotations

import enum
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Iterable, Sequence, TypeVar

from host_runtime.errors import BadRequestError
from host_runtime.popef.model import Anchor, ProgramFlow

__all__ = [
    "AnchorCallbackPolicy",
    "PopefDataUsagePolicy",
    "AnchorCallbackPredicate",
    "PopefDataUsagePredicate",
    "AnchorWithPolicy",
    "ProgramsWithPolicy",
    "null_anchor_callback_predicate",
    "null_popef_data_usage_predicate",
    "predicate_factory",
]


class AnchorCallbackPolicy(enum.IntEnum):
    """What to bind to an anchor when a user handler is installed."""

    BIND_USER_CB = 0
    """Bind the user's callback."""
    BIND_EMPTY_CB = 1
    """Bind an empty callback (inputs read zeros, outputs are dropped)."""
    SKIP_CB = 2
    """Bind nothing; leave the anchor as it was."""


class PopefDataUsagePolicy(enum.IntEnum):
    """Whether PopEF tensor / feed data feeds an anchor automatically."""

    USE_POPEF_DATA_IF_ANY = 0
    """Bind the model's tensor or feed data to the anchor, if it has any."""
    USE_USER_DATA = 1
    """Do not: the user binds their own data source."""


AnchorCallbackPredicate = Callable[[Anchor], AnchorCallbackPolicy]
PopefDataUsagePredicate = Callable[[Anchor], PopefDataUsagePolicy]

null_anchor_callback_predicate: AnchorCallbackPredicate | None = None
null_popef_data_usage_predicate: PopefDataUsagePredicate | None = None

P = TypeVar("P", AnchorCallbackPolicy, PopefDataUsagePolicy)


@dataclass(frozen=True)
class AnchorWithPolicy(Generic[P]):
    """A policy for one anchor, named by its name or handle (or the Anchor itself)."""

    anchor: Any
    policy: P

    def matches(self, a: Anchor) -> bool:
        if isinstance(self.anchor, Anchor):
            return self.anchor.handle() == a.handle() and self.anchor.name() == a.name()
        return bool(self.anchor == a.name() or self.anchor == a.handle())


@dataclass(frozen=True)
class ProgramsWithPolicy(Generic[P]):
    """A policy for the anchors used by any of ``programsIndexes``."""

    programsIndexes: Sequence[int] = field(default_factory=tuple)
    policy: Any = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "programsIndexes", tuple(int(p) for p in self.programsIndexes))


def _check_policy(value: Any, policy_type: type[enum.IntEnum], what: str) -> Any:
    try:
        return policy_type(value)
    except (ValueError, TypeError):
        raise BadRequestError(
            f"{what} must be a {policy_type.__name__} ("
            + ", ".join(m.name for m in policy_type) + f"), got {value!r}") from None


def _uses_any(anchor: Anchor, programs: Iterable[int]) -> bool:
    mine = set(anchor.programs())
    return any(p in mine for p in programs)


def _flow_pred(which: str, policy_type: type[enum.IntEnum], accept_default: Any,
               reject_default: Any) -> Callable[..., Callable[[Anchor], Any]]:
    """``predProgramFlowLoad`` / ``Main`` / ``Save`` of one policy type."""
    def factory(flow: ProgramFlow, accept_policy: Any = accept_default,
                reject_policy: Any = reject_default) -> Callable[[Anchor], Any]:
        if not isinstance(flow, ProgramFlow):
            raise BadRequestError(f"expected a popef.ProgramFlow, got {type(flow).__name__}")
        acc = _check_policy(accept_policy, policy_type, "accept_policy")
        rej = _check_policy(reject_policy, policy_type, "reject_policy")
        programs = tuple(getattr(flow, which)())

        def pred(anchor: Anchor) -> Any:
            return acc if _uses_any(anchor, programs) else rej
        return pred
    factory.__name__ = f"predProgramFlow{which.capitalize()}"
    factory.__doc__ = f"Accept the anchors used by any of the flow's {which} programs."
    return factory


def _program_indexes(policy_type: type[enum.IntEnum], accept_default: Any,
                     reject_default: Any) -> Callable[..., Callable[[Anchor], Any]]:
    """``predProgramIndexes`` of one policy type."""
    def predProgramIndexes(programs: Sequence[Any], accept_policy: Any = None,
                           reject_policy: Any = None) -> Callable[[Anchor], Any]:
        """Two forms, as in the seed.

        ``predProgramIndexes([0, 2], accept_policy, reject_policy)``: accept the
        anchors used by any of the programs. ``predProgramIndexes([ProgramsWithPolicy(
        [0], policy), ...], reject_policy)``: the policy of the first group whose
        programs use the anchor, else ``reject_policy``.
        """
        items = list(programs)
        if items and all(isinstance(p, ProgramsWithPolicy) for p in items):
            if reject_policy is not None and accept_policy is not None:
                raise BadRequestError("the grouped form is predProgramIndexes("
                                      "programs_policies, reject_policy): one policy, got two")
            given = reject_policy if reject_policy is not None else accept_policy
            rej = _check_policy(reject_default if given is None else given,
                                policy_type, "reject_policy")
            groups = [(g.programsIndexes, _check_policy(g.policy, policy_type,
                                                        "ProgramsWithPolicy.policy"))
                      for g in items]

            def grouped(anchor: Anchor) -> Any:
                for progs, pol in groups:
                    if _uses_any(anchor, progs):
                        return pol
                return rej
            return grouped
        if not all(isinstance(p, int) and not isinstance(p, bool) for p in items):
            raise BadRequestError(
                "predProgramIndexes expects a list of program indices (int) or a list of "
                f"ProgramsWithPolicy, got {items!r}")
        acc = _check_policy(accept_default if accept_policy is None else accept_policy,
                            policy_type, "accept_policy")
        rej = _check_policy(reject_default if reject_policy is None else reject_policy,
                            policy_type, "reject_policy")
        progs = tuple(items)
        return lambda anchor: acc if _uses_any(anchor, progs) else rej
    return predProgramIndexes


def _make(name: str, policy_type: type[enum.IntEnum], accept_default: Any, reject_default: Any,
          with_non_scalar: bool) -> types.ModuleType:
    ns = types.ModuleType(f"{__name__}.predicate_factory.{name}")
    ns.__doc__ = (f"Predicates returning {policy_type.__name__}; defaults: accept "
                  f"{accept_default.name}, reject {reject_default.name}.")
    policies = (policy_type, accept_default, reject_default)

    def predProgramNotAssigned(accept_policy: Any = accept_default,
                               reject_policy: Any = reject_default) -> Callable[[Anchor], Any]:
        """Accept the anchors no program uses."""
        acc = _check_policy(accept_policy, policy_type, "accept_policy")
        rej = _check_policy(reject_policy, policy_type, "reject_policy")
        return lambda anchor: rej if anchor.programs() else acc

    def predNonScalarType(accept_policy: Any = accept_default,
                          reject_policy: Any = reject_default) -> Callable[[Anchor], Any]:
        """Accept the anchors whose tensors are not scalars (rank > 0)."""
        acc = _check_policy(accept_policy, policy_type, "accept_policy")
        rej = _check_policy(reject_policy, policy_type, "reject_policy")
        return lambda anchor: acc if anchor.tensorInfo().shape() else rej

    def predAnchorsPolicies(accepted_anchors_policies: Sequence[AnchorWithPolicy[Any]],
                            reject_policy: Any = reject_default) -> Callable[[Anchor], Any]:
        """The policy given for the anchor (by name or handle), else ``reject_policy``."""
        rules = list(accepted_anchors_policies)
        for r in rules:
            if not isinstance(r, AnchorWithPolicy):
                raise BadRequestError(f"predAnchorsPolicies expects AnchorWithPolicy items, got {r!r}")
        pairs = [(r, _check_policy(r.policy, policy_type, "AnchorWithPolicy.policy")) for r in rules]
        rej = _check_policy(reject_policy, policy_type, "reject_policy")

        def pred(anchor: Anchor) -> Any:
            for rule, pol in pairs:
                if rule.matches(anchor):
                    return pol
            return rej
        return pred

    def andBind(accept_policy: Any, reject_policy: Any, *pred: Callable[[Anchor], Any]
                ) -> Callable[[Anchor], Any]:
        """``accept_policy`` when every predicate returns it, else ``reject_policy``."""
        acc = _check_policy(accept_policy, policy_type, "accept_policy")
        rej = _check_policy(reject_policy, policy_type, "reject_policy")
        preds = _callables(pred)
        return lambda anchor: acc if all(p(anchor) == acc for p in preds) else rej

    def orBind(accept_policy: Any, reject_policy: Any, *pred: Callable[[Anchor], Any]
               ) -> Callable[[Anchor], Any]:
        """``accept_policy`` when at least one predicate returns it, else ``reject_policy``."""
        acc = _check_policy(accept_policy, policy_type, "accept_policy")
        rej = _check_policy(reject_policy, policy_type, "reject_policy")
        preds = _callables(pred)
        return lambda anchor: acc if any(p(anchor) == acc for p in preds) else rej

    ns.predProgramFlowLoad = _flow_pred("load", *policies)  # type: ignore[attr-defined]
    ns.predProgramFlowMain = _flow_pred("main", *policies)  # type: ignore[attr-defined]
    ns.predProgramFlowSave = _flow_pred("save", *policies)  # type: ignore[attr-defined]
    ns.predProgramNotAssigned = predProgramNotAssigned  # type: ignore[attr-defined]
    if with_non_scalar:
        ns.predNonScalarType = predNonScalarType  # type: ignore[attr-defined]
    ns.predProgramIndexes = _program_indexes(*policies)  # type: ignore[attr-defined]
    ns.predAnchorsPolicies = predAnchorsPolicies  # type: ignore[attr-defined]
    ns.andBind = andBind  # type: ignore[attr-defined]
    ns.orBind = orBind  # type: ignore[attr-defined]
    names = ["predProgramFlowLoad", "predProgramFlowMain", "predProgramFlowSave",
             "predProgramNotAssigned", "predProgramIndexes", "predAnchorsPolicies",
             "andBind", "orBind"]
    if with_non_scalar:
        names.insert(4, "predNonScalarType")
    ns.__all__ = names  # type: ignore[attr-defined]
    return ns


def _callables(preds: tuple[Any, ...]) -> tuple[Callable[[Anchor], Any], ...]:
    for p in preds:
        if not callable(p):
            raise BadRequestError(f"andBind/orBind combine predicates (callables), got {p!r}")
    return preds


predicate_factory = types.ModuleType(f"{__name__}.predicate_factory")
predicate_factory.__doc__ = "Predefined anchor predicates (seed 002, 10.2.1)."
predicate_factory.anchor_callbacks = _make(  # type: ignore[attr-defined]
    "anchor_callbacks", AnchorCallbackPolicy, AnchorCallbackPolicy.BIND_USER_CB,
    AnchorCallbackPolicy.BIND_EMPTY_CB, with_non_scalar=True)
predicate_factory.popef_data_usage = _make(  # type: ignore[attr-defined]
    "popef_data_usage", PopefDataUsagePolicy, PopefDataUsagePolicy.USE_USER_DATA,
    PopefDataUsagePolicy.USE_POPEF_DATA_IF_ANY, with_non_scalar=False)
predicate_factory.AnchorWithPolicy = AnchorWithPolicy  # type: ignore[attr-defined]
predicate_factory.ProgramsWithPolicy = ProgramsWithPolicy  # type: ignore[attr-defined]
predicate_factory.__all__ = ["anchor_callbacks", "popef_data_usage",  # type: ignore[attr-defined]
                             "AnchorWithPolicy", "ProgramsWithPolicy"]
