"""How a Ring hands its hot calls to the C core (``shm._ringcore``) and takes them back.

``shm/_ringcore.c`` (built by setup.py when a compiler is there) has the same steps
as the Python path of the ring's ends for write, read, acquire_write,
try_acquire_write, publish, acquire_read, try_acquire_read, release, readable and
writable, on the same layout, semaphores and ordering. A ``Core`` is made per Ring
and its bound methods are set on the Ring instance (``_C_METHODS``), shadowing the
class's methods, so a call is one C call (see "Hot paths in C" in shm/ring.py).

The core does the common case, or hands the call back to the Python path by calling
the Ring's ``_c_<method>(code, first, *arguments)``: each end's module
(shm/_ring_producer.py, shm/_ring_consumer.py) has those, next to the steps they
finish. ``code`` says where the core stopped:

- ``_GENERAL``: nothing was done; the Python path runs the call from the start;
- ``_NO_TOKEN``: a first wait of ``first`` s took no token (deadline, peer check due,
  interrupt); the Python path goes on waiting (``_RingWaits._wait_slow``) and
  finishes the call (the ``try_`` variants raise WouldBlock);
- ``_TOKEN``: the token is taken and banked (``_spare_free``/``_spare_full``); the
  Python path finishes the call with it.

The core acts only once this process has taken the end's role through the Python
path (``Core.producer``/``Core.consumer``), and stops at close (``_stop_core``): a
thread inside a core call holds the core (its mapping and semaphores) until it
returns. :class:`_RingHandOff` is one of the concept classes ``shm.ring.Ring`` is
made of; what it reads of the others is declared at the top of its body.
"""

from __future__ import annotations

from typing import Any

from ._packed import RegionPart
from .region import Region

# Return codes of the C core's hand-over (see shm/_ringcore.c).
_GENERAL, _NO_TOKEN, _TOKEN = -1, -2, -3

_C_METHODS = ("write", "acquire_write", "try_acquire_write", "publish", "acquire_read",
              "try_acquire_read", "release", "read", "readable", "writable")
"""The Ring methods the core's methods of the same names shadow on each instance."""


class _RingHandOff:
    """The C core serving this Ring's hot calls, if any.

    Owns ``_core`` (the ``shm._ringcore.Core``; None: the Python path does
    everything), set by ``__init__``.
    """

    # -- what the core is made over (the mapping: shm._ring_life; the token bank and
    #    the spin budget: shm._ring_waits) -----------------------------------------
    _region: Region | RegionPart
    _name: str
    _payload: list[memoryview]
    _slot_size: int
    _num_slots: int
    _stride: int
    _spin_max_ns: int
    _spin_min_ns: int
    _spare_free: list[None]
    _spare_full: list[None]

    def __init__(self, ringcore: Any) -> None:
        """Make the C core and set its methods on this instance; ``ringcore``: the
        ``shm._ringcore`` module, None for the Python path alone."""
        self._core: Any = None
        if ringcore is not None:
            core = self._core = ringcore.Core(
                self, self._region.buf, self._payload, self._slot_size, self._num_slots,
                self._stride,
                self._spin_max_ns, self._spin_min_ns, self._spare_free, self._spare_full)
            self.__dict__.update({method: getattr(core, method) for method in _C_METHODS})

    def c_handle(self) -> Any | None:
        """This process's end of the ring for C extensions, or None without the C core.

        An opaque object (the C core of this ``Ring``; None when ``shm._ringcore`` is
        not built or the ring was made with ``ring_c`` off). A C extension turns it into a
        ``ShmRingEnd *`` with the C API declared in ``shm/_ringcore.h`` (capsule
        ``shm._ringcore._C_API``) and holds a reference to it while it uses the end:
        the handle keeps the ring's mapping and semaphores alive. The C API never
        waits: it acts on an end whose role this process has taken through the Python
        methods (a first read or write) and that is open and valid, and otherwise does
        nothing, for the caller to use the Python methods.
        """
        return self._core

    def _stop_core(self) -> None:
        """close(): every later call takes the Python path (which raises the close)."""
        # A thread inside a core call, or holding one of its methods, holds the core
        # (and so the mapping and the semaphores); closed sends it to the Python path.
        if self._core is not None:
            self._core.closed = 1
            for method in _C_METHODS:
                self.__dict__.pop(method, None)
