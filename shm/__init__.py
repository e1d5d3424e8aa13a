"""The wire: named shared-memory regions and SPSC rings between processes.

``shm`` imports nothing else of this project.
"""

from __future__ import annotations

from . import limits, naming
from ._address import buffer_address
from .cleanup import remove_dead
from .errors import (FileSizeLimitError, OutOfFileDescriptorsError, PeerDiedError,
                     RingInvalidatedError, RingTimeoutError, ShmClosedError, ShmError,
                     ShmForkedError, ShmFullError, WaitInterrupted, WouldBlock)
from .liveness import ExitWatch, PeerWatch, describe_process, pid_alive, process_state
from .region import Region
from .ring import PEER_CHECK, Ring

__all__ = [
    "ExitWatch",
    "FileSizeLimitError",
    "OutOfFileDescriptorsError",
    "PEER_CHECK",
    "PeerDiedError",
    "PeerWatch",
    "Region",
    "Ring",
    "RingInvalidatedError",
    "RingTimeoutError",
    "ShmClosedError",
    "ShmError",
    "ShmForkedError",
    "ShmFullError",
    "WaitInterrupted",
    "WouldBlock",
    "buffer_address",
    "describe_process",
    "limits",
    "naming",
    "pid_alive",
    "process_state",
    "remove_dead",
]
