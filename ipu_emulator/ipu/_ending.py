"""How a request of the IPU process ends other than by finishing: one value, one exception.

A request (a RUN, a LOOP, a LOAD waiting on a ring) is cut short by a control message
or by the host going away. Wherever that is found out, deep in a stream wait or
between two iterations of a loop, :class:`RunEnded` is raised with the
:class:`Ending`; the serving loop (``DeviceProcess.serve``) catches it in one place and
acts on the value:

- ``STOPPED``: STOP arrived while a program ran: the run answers STOPPED, the STOP DONE;
- ``SHUTDOWN``: SHUTDOWN arrived: say BYE and exit;
- ``HOST_GONE``: the host died: unlink its objects and exit;
- ``CLIENT_GONE``: pool mode: the host using this IPU died, or the daemon takes the IPU
  back (HOST): forget that host and serve on.

A ring's own peer watch may end a wait first (``shm.PeerDiedError``), and a watch thread
may interrupt it (``shm.WaitInterrupted``); :data:`PASSES` is what every layer between
the wait and the serving loop lets through untouched.
"""

from __future__ import annotations

import enum

from shm import PeerDiedError, WaitInterrupted

__all__ = ["Ending", "RunEnded", "PASSES"]


class Ending(enum.Enum):
    STOPPED = "stopped"
    SHUTDOWN = "shutdown"
    HOST_GONE = "host gone"
    CLIENT_GONE = "client gone"


class RunEnded(Exception):
    """What runs must end now, for ``ending``."""

    def __init__(self, ending: Ending) -> None:
        super().__init__(ending.value)
        self.ending = ending


PASSES: tuple[type[BaseException], ...] = (RunEnded, PeerDiedError, WaitInterrupted)
"""Exceptions that end a request and reach the serving loop unchanged."""
