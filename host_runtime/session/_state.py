"""A Session's state: its life, what binds it to a device, and the moves between them.

Two things change as a session is used, independently of each other:

- its **life** (:class:`Life`), whatever it is bound to::

      OPEN --stop()--> STOPPED --reload()--> OPEN
      OPEN, STOPPED --close()--> CLOSED          (stop() again: STOPPED stays STOPPED;
                                                 stop(), close() of CLOSED: CLOSED stays)

  STOPPED refuses to run programs, CLOSED refuses every call (:meth:`Life.refuse`);
  a stop() outlasts an unbind: only reload() makes the session runnable again.

- its **binding** to one device (:class:`host_runtime.session._binding.Binding`,
  None while unbound), whose :class:`Phase` says where the session's executable is
  on that device::

      (unbound) --bindToDevice / first use--> ATTACHED
      ATTACHED --LOAD--> LOADED --the load programs ran--> PRIMED
      LOADED, PRIMED --LOAD (reload(), or after another session had the device)--> LOADED
      LOADED, PRIMED --another session takes the device--> ATTACHED
      any --unbind, or the device is closed--> (unbound: the Binding is dropped)

  Main runs the load programs first while LOADED; the implicit save programs run
  only when PRIMED (and OPEN). A LOAD that only brings the device's constant inputs
  up to date keeps the phase. The main loop (``session.direct``) runs on a PRIMED
  binding until stop(); whether it still runs is its future's to say.

The moves are the tables ``_LIFE_AFTER`` and ``_PHASE_AFTER``; what each life refuses,
with the message the caller gets, is ``_REFUSED``.
"""

from __future__ import annotations

import enum

from host_runtime.errors import InvalidStateError

__all__ = ["Life", "LifeEvent", "Call", "Phase", "PhaseEvent", "next_phase"]


class LifeEvent(enum.Enum):
    STOP = "stop"
    RELOAD = "reload"
    CLOSE = "close"


class Call(enum.Enum):
    """What a caller asks of the session, as far as its life decides."""

    USE = "use"   # any call of the seed's API but stop() / close()
    RUN = "run"   # running programs (or starting the main loop)


class Life(enum.Enum):
    """The session's life (see the module docstring)."""

    OPEN = "open"
    """Programs may run."""
    STOPPED = "stopped"
    """stop() was called: no program runs until reload()."""
    CLOSED = "closed"
    """close() was called (or the session was dropped): nothing more."""

    def after(self, event: LifeEvent) -> "Life":
        """The life after ``event``; InvalidStateError for reload() once closed."""
        life = _LIFE_AFTER.get((self, event))
        if life is None:
            raise InvalidStateError("the session is closed")
        return life

    def refuse(self, call: Call) -> None:
        """Raise the InvalidStateError of ``call`` if this life refuses it."""
        message = _REFUSED.get((self, call))
        if message is not None:
            raise InvalidStateError(message)


_LIFE_AFTER: dict[tuple[Life, LifeEvent], Life] = {
    (Life.OPEN, LifeEvent.STOP): Life.STOPPED,
    (Life.STOPPED, LifeEvent.STOP): Life.STOPPED,
    (Life.OPEN, LifeEvent.RELOAD): Life.OPEN,
    (Life.STOPPED, LifeEvent.RELOAD): Life.OPEN,
    (Life.OPEN, LifeEvent.CLOSE): Life.CLOSED,
    (Life.STOPPED, LifeEvent.CLOSE): Life.CLOSED,
    # close() and stop() of a closed session (idempotent; another thread's close) do nothing
    (Life.CLOSED, LifeEvent.CLOSE): Life.CLOSED,
    (Life.CLOSED, LifeEvent.STOP): Life.CLOSED,
}

_REFUSED: dict[tuple[Life, Call], str] = {
    (Life.CLOSED, Call.USE): "the session is closed",
    (Life.CLOSED, Call.RUN): "the session is closed",
    (Life.STOPPED, Call.RUN): "the session is stopped; call reload() before running programs",
}


class PhaseEvent(enum.Enum):
    LOAD = "LOAD sent"
    LOAD_PROGRAMS_RAN = "the load programs ran"
    DEACTIVATED = "another session took the device"


class Phase(enum.Enum):
    """Where the session's executable is on its bound device (see the module docstring)."""

    ATTACHED = "attached"
    """Bound; the executable is not loaded as the device's active one (not yet, or
    another session had the device since)."""
    LOADED = "loaded"
    """Loaded, the device's active session; the load programs have not run since."""
    PRIMED = "primed"
    """Loaded, the device's active session, and the load programs ran since."""


_PHASE_AFTER: dict[tuple[Phase, PhaseEvent], Phase] = {
    (Phase.ATTACHED, PhaseEvent.LOAD): Phase.LOADED,
    (Phase.LOADED, PhaseEvent.LOAD): Phase.LOADED,
    (Phase.PRIMED, PhaseEvent.LOAD): Phase.LOADED,
    (Phase.LOADED, PhaseEvent.LOAD_PROGRAMS_RAN): Phase.PRIMED,
    (Phase.PRIMED, PhaseEvent.LOAD_PROGRAMS_RAN): Phase.PRIMED,
    # (a run that ended after the device went to another session: nothing to remember)
    (Phase.ATTACHED, PhaseEvent.LOAD_PROGRAMS_RAN): Phase.ATTACHED,
    (Phase.ATTACHED, PhaseEvent.DEACTIVATED): Phase.ATTACHED,
    (Phase.LOADED, PhaseEvent.DEACTIVATED): Phase.ATTACHED,
    (Phase.PRIMED, PhaseEvent.DEACTIVATED): Phase.ATTACHED,
}


def next_phase(phase: Phase, event: PhaseEvent) -> Phase:
    """The phase of a binding after ``event``."""
    return _PHASE_AFTER[phase, event]
