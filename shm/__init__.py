"""The wire: named shared-memory regions and SPSC rings between processes.

``shm`` imports nothing else of this project.
"""

from __future__ import annotations

from . import naming
from ._address import buffer_address
from .cleanup import remove_dead
from .errors import (PeerDiedError, RingInvalidatedError, RingTimeoutError, ShmClosedError,
                     ShmError, ShmForkedError, WouldBlock)
from .liveness import ExitWatch, PeerWatch, pid_alive
from .region import Region
from .ring import WAIT_SLICE, Ring

__all__ = [
    "ExitWatch",
    "PeerDiedError",
    "PeerWatch",
    "Region",
    "Ring",
    "RingInvalidatedError",
    "RingTimeoutError",
    "ShmClosedError",
    "ShmError",
    "ShmForkedError",
    "WAIT_SLICE",
    "WouldBlock",
    "buffer_address",
    "naming",
    "pid_alive",
    "remove_dead",
]
