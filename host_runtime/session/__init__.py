"""Session: one model bound to one device; its anchors, callbacks, predicates and the programs it runs."""

from __future__ import annotations

from host_runtime.session._session import CallbackFactory, CallbackHandle, CallbackInfo, LaunchPolicy, Session, SessionConfig
from host_runtime.session.predicates import AnchorCallbackPolicy, AnchorCallbackPredicate, AnchorWithPolicy, PopefDataUsagePolicy, PopefDataUsagePredicate, ProgramsWithPolicy, null_anchor_callback_predicate, null_popef_data_usage_predicate, predicate_factory

# for the other packages of host_runtime (not part of the public surface)
from host_runtime.session._config import DROP_STOP_TIMEOUT as DROP_STOP_TIMEOUT
from host_runtime.session._weights import check_model_fits as check_model_fits

__all__ = ["CallbackFactory", "CallbackHandle", "CallbackInfo", "LaunchPolicy", "Session", "SessionConfig", "AnchorCallbackPolicy", "AnchorCallbackPredicate", "AnchorWithPolicy", "PopefDataUsagePolicy", "PopefDataUsagePredicate", "ProgramsWithPolicy", "null_anchor_callback_predicate", "null_popef_data_usage_predicate", "predicate_factory"]
