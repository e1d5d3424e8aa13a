"""A Session's state (host_runtime.session._state): its life and its binding's phase,
walked through on a loopback device, and the tables that say which move is allowed."""

from __future__ import annotations

import numpy as np
import pytest

from host_runtime.errors import InvalidStateError
from host_runtime.session._session import Session
from host_runtime.session._state import Call, Life, LifeEvent, Phase, PhaseEvent, next_phase
from tests.unit._loopback import model, model_path, weights  # noqa: F401  (fixtures)

SHAPE = (2, 3)


def _wire(s: Session, saved: list[np.ndarray], out: list[np.ndarray]) -> None:
    ones = np.ones(SHAPE, np.float32)

    def feed(view: memoryview) -> None:
        np.frombuffer(view, np.float32)[:] = ones.ravel()

    def zero(view: memoryview) -> None:
        np.frombuffer(view, np.float32)[:] = 0
    s.setCallbackForAnchor("tensor_A", feed)
    s.setCallbackForAnchor("tensor_B", zero)
    s.setCallbackForAnchor("tensor_C", lambda v: out.append(np.frombuffer(v, np.float32).copy()))
    s.setCallbackForAnchor("weights_saved",
                           lambda v: saved.append(np.frombuffer(v, np.float32).copy()))


def test_a_sessions_life_and_binding_on_a_shared_device(loopback_device, model, weights):
    saved: list[np.ndarray] = []
    out: list[np.ndarray] = []
    with Session(model) as a, Session(model) as b:
        assert a._binding is None and a._life is Life.OPEN
        a.bindToDevice(loopback_device)
        assert a._binding is not None and a._binding.phase is Phase.LOADED
        _wire(a, saved, out)
        a.runMainPrograms()                       # the load programs first, then Main
        assert a._binding.phase is Phase.PRIMED
        np.testing.assert_allclose(out[-1].reshape(SHAPE), weights, rtol=1e-6)
        b.bindToDevice(loopback_device)           # a's implicit save runs; a is ATTACHED
        assert len(saved) == 1 and a._binding.phase is Phase.ATTACHED
        assert b._binding is not None and b._binding.phase is Phase.LOADED
        a.runMainPrograms()                       # loaded again, its load programs again
        assert a._binding.phase is Phase.PRIMED and len(out) == 2
        a.stop()
        assert a.isStopped() and a._life is Life.STOPPED
        with pytest.raises(InvalidStateError,
                           match=r"^the session is stopped; call reload\(\) before running"):
            a.runMainPrograms()
        a.reload()
        assert not a.isStopped() and a._binding.phase is Phase.LOADED
        a.unloadFromDevice()                      # the binding goes whole
        assert a._binding is None and a.device() is None
        with pytest.raises(InvalidStateError,
                           match="^unloadFromDevice: the session is not bound to a device$"):
            a.unloadFromDevice()
    assert a._life is Life.CLOSED and a.isStopped()
    with pytest.raises(InvalidStateError, match="^the session is closed$"):
        a.runMainPrograms()


def test_the_tables_allow_only_the_moves_of_the_diagram():
    assert Life.OPEN.after(LifeEvent.STOP) is Life.STOPPED
    assert Life.STOPPED.after(LifeEvent.RELOAD) is Life.OPEN
    assert Life.CLOSED.after(LifeEvent.CLOSE) is Life.CLOSED
    with pytest.raises(InvalidStateError, match="^the session is closed$"):
        Life.CLOSED.after(LifeEvent.RELOAD)
    Life.OPEN.refuse(Call.RUN)
    Life.STOPPED.refuse(Call.USE)
    with pytest.raises(InvalidStateError, match="^the session is stopped"):
        Life.STOPPED.refuse(Call.RUN)
    assert next_phase(Phase.ATTACHED, PhaseEvent.LOAD) is Phase.LOADED
    assert next_phase(Phase.LOADED, PhaseEvent.LOAD_PROGRAMS_RAN) is Phase.PRIMED
    assert next_phase(Phase.PRIMED, PhaseEvent.LOAD) is Phase.LOADED
    assert next_phase(Phase.PRIMED, PhaseEvent.DEACTIVATED) is Phase.ATTACHED
    assert next_phase(Phase.ATTACHED, PhaseEvent.LOAD_PROGRAMS_RAN) is Phase.ATTACHED
