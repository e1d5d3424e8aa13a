"""The fault schedule (ipu_emulator.faults) without IPU processes: specs checked naming
the fault, the field and the value; the counters of a table shared by its readers (as
IPU processes, restarted ones too, share the owner's); ``after``, ``times``,
``probability`` with ``seed``; live changes; the settings knob."""

from __future__ import annotations

import pytest

from host_runtime import settings
from host_runtime.errors import RecoverableRuntimeError, RecoveryAction
from ipu_emulator import faults
from ipu_emulator.faults import Fault, FaultSpecError, FaultTable, parse_faults
from shm.settings import SettingsError


@pytest.mark.parametrize("spec,message", [
    ('[{"kind": "boom"}]', "fault 0: field 'kind' = 'boom': expected one of application_error"),
    ('[{"after": 1}]', "fault 0: field 'kind' is missing"),
    ('[{"kind": "hang"}, {"kind": "hang", "ipu": -1}]', "fault 1: field 'ipu' = -1"),
    ('[{"kind": "hang", "times": 0}]', "field 'times' = 0: expected an integer in 1.."),
    ('[{"kind": "hang", "after": "2"}]', "field 'after' = '2'"),
    ('[{"kind": "recoverable_error", "action": "REBOOT"}]', "field 'action' = 'REBOOT': "
     "expected one of IPU_RESET, LINK_RESET, PARTITION_RESET, FULL_RESET"),
    ('[{"kind": "hang", "action": "IPU_RESET"}]', "field 'action' = 'IPU_RESET': expected no "
     "action"),
    ('[{"kind": "slow"}]', "field 'delay_ms' is missing"),
    ('[{"kind": "slow", "delay_ms": 0}]', "field 'delay_ms' = 0"),
    ('[{"kind": "crash", "probability": 1.5, "seed": 1}]', "field 'probability' = 1.5"),
    ('[{"kind": "crash", "probability": 0.5}]', "field 'seed' is missing"),
    ('[{"kind": "crash", "probability": 0.5, "seed": 1, "after": 2}]', "field 'after' = 2"),
    ('[{"kind": "crash", "seed": 1}]', "field 'seed' = 1: expected no seed"),
    ('[{"kind": "crash", "when": 1}]', "field 'when' = 1: expected one of the fields"),
    ('[{"kind": ', "not valid JSON"),
    ("no/such/file.yaml", "nor a readable file"),
])
def test_a_bad_spec_names_the_fault_field_and_value(spec, message):
    with pytest.raises(FaultSpecError, match="IPU_EMULATOR_FAULTS") as info:
        parse_faults(spec)
    assert message in str(info.value)
    with pytest.raises(SettingsError, match="IPU_EMULATOR_FAULTS"):   # the knob refuses it too
        settings.current().replace(faults=spec)


def test_files_and_defaults(tmp_path):
    (tmp_path / "f.yaml").write_text("- kind: recoverable_error\n  ipu: 2\n  times: 3\n")
    (tmp_path / "f.json").write_text('{"kind": "slow", "delay_ms": 5}')
    assert parse_faults(str(tmp_path / "f.yaml")) == [
        Fault("recoverable_error", ipu=2, times=3, action="IPU_RESET")]
    assert parse_faults(str(tmp_path / "f.json")) == [Fault("slow", delay_ms=5.0)]
    assert settings.current().replace(faults=str(tmp_path / "f.json")).faults == \
        '[{"delay_ms":5.0,"kind":"slow"}]'
    assert parse_faults("") == []


def test_after_times_and_counts_shared_by_every_reader():
    table = FaultTable.create(parse_faults('[{"kind": "application_error", "after": 2, '
                                           '"times": 2}, {"kind": "hang", "ipu": 1}]'))
    try:
        first = FaultTable.attach(table.name)      # an IPU process ...
        fired = [first.fire(0, False) for _ in range(3)]
        first.close()
        again = FaultTable.attach(table.name)      # ... and the one that replaced it
        fired += [again.fire(0, False) for _ in range(3)]
        assert [f[1].kind if f else None for f in fired] == [
            None, None, "application_error", "application_error", None, None]
        assert again.fire(1, False)[1].kind == "hang"    # ipu 1 only; runs of ipu 0 not counted
        assert [(seen, n) for _, seen, n in table.counts()] == [(7, 2), (1, 1)]
        again.close()
    finally:
        table.close()


def test_probability_with_a_seed_replays_and_link_down_needs_a_link():
    spec = '[{"kind": "slow", "delay_ms": 1, "probability": 0.3, "seed": 7, "times": 5}]'
    runs = []
    for _ in range(2):
        table = FaultTable.create(parse_faults(spec))
        runs.append([table.fire(0, False) is not None for _ in range(40)])
        table.close()
    assert runs[0] == runs[1] and sum(runs[0]) == 5
    table = FaultTable.create(parse_faults('[{"kind": "link_down"}]'))
    assert table.fire(0, has_link=False) is None and table.fire(0, has_link=True) is not None
    assert [(seen, n) for _, seen, n in table.counts()] == [(1, 1)]
    table.close()


def test_a_plan_live_and_its_settings():
    with faults.inject(kind="hang", after=1) as plan:
        text = settings.current().faults
        assert text == "plan:" + plan.table.name and faults.table_for(text) is plan.table
    assert settings.current().faults == ""
    plan.add({"kind": "crash"})
    assert [f.kind for f in plan.faults] == ["hang", "crash"]
    reader = FaultTable.attach(plan.table.name)
    assert [f.kind for f in reader.faults()] == ["hang", "crash"]
    plan.clear()
    assert reader.faults() == [] and reader.fire(0, True) is None
    reader.close()
    plan.close()
    with pytest.raises(FaultSpecError, match="no fault plan"):
        faults.table_for(text)


def test_error_classes_keep_their_fields_when_pickled():
    import pickle

    err = RecoverableRuntimeError("x", recovery_action=RecoveryAction.LINK_RESET,
                                  ipu="device 0 (ipu 0)", replica=1, program=1)
    back = pickle.loads(pickle.dumps(err))
    assert (type(back), str(back), back.recovery_action, back.ipu, back.replica, back.program) \
        == (RecoverableRuntimeError, "x", RecoveryAction.LINK_RESET, "device 0 (ipu 0)", 1, 1)
