"""predicate_factory (seed 002, 10.2.1): every function, both namespaces, the seed's defaults."""

from __future__ import annotations

import pytest

from host_runtime import popef
from host_runtime.errors import BadRequestError
from host_runtime.session.predicates import (AnchorCallbackPolicy as ACP, AnchorWithPolicy,
                                     PopefDataUsagePolicy as PDP, ProgramsWithPolicy,
                                     predicate_factory)

ac = predicate_factory.anchor_callbacks
pdu = predicate_factory.popef_data_usage

FLOW = popef.ProgramFlow(load=[0], main=[1, 3], save=[2])
W = popef.Anchor("weights", programs=[0], tensor_info=popef.TensorInfo(popef.DataType.F32, [4]),
                 type=popef.TensorType.INPUT)
A = popef.Anchor("A", "h_A", programs=[1], tensor_info=popef.TensorInfo(popef.DataType.F32, [1, 4]),
                 type=popef.TensorType.INPUT)
S = popef.Anchor("scalar", programs=[3], tensor_info=popef.TensorInfo(popef.DataType.S32, []),
                 type=popef.TensorType.INPUT)
SAVED = popef.Anchor("saved", programs=[2], tensor_info=popef.TensorInfo(popef.DataType.F32, [4]),
                     type=popef.TensorType.OUTPUT)
FREE = popef.Anchor("free", programs=[], type=popef.TensorType.INPUT)
ALL = [W, A, S, SAVED, FREE]


def results(pred):
    return [pred(a) for a in ALL]


def test_enum_values_match_the_seed():
    assert [(m.name, m.value) for m in ACP] == [("BIND_USER_CB", 0), ("BIND_EMPTY_CB", 1),
                                                ("SKIP_CB", 2)]
    assert [(m.name, m.value) for m in PDP] == [("USE_POPEF_DATA_IF_ANY", 0), ("USE_USER_DATA", 1)]


def test_namespaces_list_the_seed_functions():
    assert ac.__all__ == ["predProgramFlowLoad", "predProgramFlowMain", "predProgramFlowSave",
                          "predProgramNotAssigned", "predNonScalarType", "predProgramIndexes",
                          "predAnchorsPolicies", "andBind", "orBind"]
    assert not hasattr(pdu, "predNonScalarType")  # anchor_callbacks only, as in the seed
    assert "orBind" in pdu.__all__ and "predAnchorsPolicies" in pdu.__all__


@pytest.mark.parametrize("ns,acc,rej", [(ac, ACP.BIND_USER_CB, ACP.BIND_EMPTY_CB),
                                        (pdu, PDP.USE_USER_DATA, PDP.USE_POPEF_DATA_IF_ANY)])
def test_program_flow_predicates_with_defaults(ns, acc, rej):
    assert results(ns.predProgramFlowLoad(FLOW)) == [acc, rej, rej, rej, rej]
    assert results(ns.predProgramFlowMain(FLOW)) == [rej, acc, acc, rej, rej]
    assert results(ns.predProgramFlowSave(FLOW)) == [rej, rej, rej, acc, rej]
    assert results(ns.predProgramNotAssigned()) == [rej, rej, rej, rej, acc]


def test_explicit_policies_override_defaults():
    pred = ac.predProgramFlowMain(FLOW, ACP.SKIP_CB, ACP.BIND_USER_CB)
    assert results(pred) == [ACP.BIND_USER_CB, ACP.SKIP_CB, ACP.SKIP_CB, ACP.BIND_USER_CB,
                             ACP.BIND_USER_CB]


def test_non_scalar_type():
    assert results(ac.predNonScalarType()) == [ACP.BIND_USER_CB, ACP.BIND_USER_CB,
                                               ACP.BIND_EMPTY_CB, ACP.BIND_USER_CB,
                                               ACP.BIND_EMPTY_CB]


def test_program_indexes_list_form():
    assert results(pdu.predProgramIndexes([2, 3])) == [
        PDP.USE_POPEF_DATA_IF_ANY, PDP.USE_POPEF_DATA_IF_ANY, PDP.USE_USER_DATA,
        PDP.USE_USER_DATA, PDP.USE_POPEF_DATA_IF_ANY]
    assert results(ac.predProgramIndexes([0], ACP.SKIP_CB, ACP.BIND_USER_CB))[:2] == [
        ACP.SKIP_CB, ACP.BIND_USER_CB]


def test_program_indexes_grouped_form_first_matching_group_wins():
    pred = ac.predProgramIndexes([ProgramsWithPolicy([1], ACP.SKIP_CB),
                                  ProgramsWithPolicy([1, 2], ACP.BIND_USER_CB)])
    assert results(pred) == [ACP.BIND_EMPTY_CB, ACP.SKIP_CB, ACP.BIND_EMPTY_CB, ACP.BIND_USER_CB,
                             ACP.BIND_EMPTY_CB]
    pred = ac.predProgramIndexes([ProgramsWithPolicy([0], ACP.BIND_USER_CB)], ACP.SKIP_CB)
    assert results(pred)[:2] == [ACP.BIND_USER_CB, ACP.SKIP_CB]
    assert ProgramsWithPolicy([0, 1], ACP.SKIP_CB).programsIndexes == (0, 1)


def test_anchors_policies_by_name_or_handle():
    pred = pdu.predAnchorsPolicies([AnchorWithPolicy("weights", PDP.USE_USER_DATA),
                                    AnchorWithPolicy("h_A", PDP.USE_USER_DATA)])
    assert results(pred) == [PDP.USE_USER_DATA, PDP.USE_USER_DATA, PDP.USE_POPEF_DATA_IF_ANY,
                             PDP.USE_POPEF_DATA_IF_ANY, PDP.USE_POPEF_DATA_IF_ANY]
    pred = ac.predAnchorsPolicies([AnchorWithPolicy(SAVED, ACP.SKIP_CB)], ACP.BIND_USER_CB)
    assert results(pred) == [ACP.BIND_USER_CB] * 3 + [ACP.SKIP_CB, ACP.BIND_USER_CB]


def test_and_bind_is_a_conjunction_or_bind_a_disjunction():
    main = ac.predProgramFlowMain(FLOW)
    non_scalar = ac.predNonScalarType()
    both = ac.andBind(ACP.BIND_USER_CB, ACP.SKIP_CB, main, non_scalar)
    either = ac.orBind(ACP.BIND_USER_CB, ACP.SKIP_CB, main, non_scalar)
    assert results(both) == [ACP.SKIP_CB, ACP.BIND_USER_CB, ACP.SKIP_CB, ACP.SKIP_CB, ACP.SKIP_CB]
    assert results(either) == [ACP.BIND_USER_CB, ACP.BIND_USER_CB, ACP.BIND_USER_CB,
                               ACP.BIND_USER_CB, ACP.SKIP_CB]
    load_or_save = pdu.orBind(PDP.USE_USER_DATA, PDP.USE_POPEF_DATA_IF_ANY,
                              pdu.predProgramFlowLoad(FLOW), pdu.predProgramFlowSave(FLOW))
    assert [load_or_save(a) for a in (W, A, SAVED)] == [PDP.USE_USER_DATA,
                                                        PDP.USE_POPEF_DATA_IF_ANY,
                                                        PDP.USE_USER_DATA]


def test_bad_arguments_name_what_was_expected():
    with pytest.raises(BadRequestError, match="AnchorCallbackPolicy"):
        ac.predProgramFlowLoad(FLOW, "yes")
    with pytest.raises(BadRequestError, match="ProgramFlow"):
        ac.predProgramFlowLoad([0])
    with pytest.raises(BadRequestError, match="program indices"):
        ac.predProgramIndexes(["a"])
    with pytest.raises(BadRequestError, match="AnchorWithPolicy"):
        pdu.predAnchorsPolicies(["weights"])
    with pytest.raises(BadRequestError, match="predicates"):
        ac.orBind(ACP.BIND_USER_CB, ACP.SKIP_CB, 3)


def test_public_surface():
    import host_runtime.session.predicates as predicates

    assert predicates.__all__ == [
        "AnchorCallbackPolicy", "PopefDataUsagePolicy", "AnchorCallbackPredicate",
        "PopefDataUsagePredicate", "AnchorWithPolicy", "ProgramsWithPolicy",
        "null_anchor_callback_predicate", "null_popef_data_usage_predicate", "predicate_factory"]
    assert predicates.null_anchor_callback_predicate is None
    assert predicates.null_popef_data_usage_predicate is None
