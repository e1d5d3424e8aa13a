"""The one description of a Main iteration (ipu_emulator.ipu._iteration), with or
without the C extensions (tests/unit/test_stepcore.py runs it in C)."""

from __future__ import annotations

from ipu_emulator.ipu import _iteration
import shm.ring as ring_module
from shm import Ring

NBYTES = 64


def test_a_ring_without_the_c_core_has_no_handle_and_no_step(monkeypatch) -> None:
    """IPU_EMULATOR_RING_C=0 (or no C core): the Python path serves every iteration."""
    from ipu_emulator.ipu_protocol import MODE_DIRECT

    monkeypatch.setattr(ring_module, "_ringcore", None)
    far = Ring.create(NBYTES, 2)
    near = Ring.attach(far.name)
    try:
        assert far.c_handle() is None and near.c_handle() is None
        plan = _iteration.plan_stream("in", MODE_DIRECT)
        assert _iteration.make_step([(near, NBYTES, plan)], [], {}, {}) is None
    finally:
        near.close()
        far.close()
        far.unlink()


def test_stream_plans_by_mode() -> None:
    from ipu_emulator.ipu_protocol import MODE_DIRECT, MODE_EVENT, MODE_NULL

    def flags(direction, mode):
        p = _iteration.plan_stream(direction, mode)
        return (p.null, p.need_event, p.out_event, p.c_step, p.poll)
    #                                       null   need   out    c_step poll
    assert flags("in", MODE_EVENT) ==         (False, True, False, True, False)
    assert flags("in", MODE_DIRECT) ==        (False, False, False, True, True)
    assert flags("in", MODE_NULL) ==          (True, False, False, False, False)
    assert flags("out", MODE_EVENT) ==        (False, False, True, False, False)
    assert flags("out", MODE_DIRECT) ==       (False, False, False, True, False)
    assert flags("out", MODE_NULL) ==         (True, False, False, False, False)
