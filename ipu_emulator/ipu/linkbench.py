"""One end of an emulated IPU-Link, driven by the IPU process's own stream code.

For ``python -m tools.bench pipeline``: the hop of a pipeline stage between two
processes, without onnxruntime. ``LinkEnd`` is a :class:`DeviceProcess` (its control
and event rings, its waits) and a ``_RingIO`` over an input and an output link ring
in direct mode, set up as a RUN of a sharded executable sets up one IPU of several
(``DeviceProcess.as_group_member``).
"""

from __future__ import annotations

import ctypes

import numpy as np

from shm import Ring
from ipu_emulator.ipu import process
from ipu_emulator.ipu._stream_io import _Loaded, _RingIO, _Stream
from ipu_emulator.ipu.interpreter import ZeroCopyGroup
from ipu_emulator.ipu_protocol import MODE_DIRECT

__all__ = ["LinkEnd"]

_IN, _OUT = "__ipulink/0/1/a", "__ipulink/1/0/b"


class LinkEnd:
    """One end of the link ping-pong: an IPU process's stream code over two link rings.

    ``relay()`` is one Main iteration of a pipeline stage whose part takes the
    activation from its input link and writes it to its output link, done as the
    interpreter does a zero-copy iteration: first the C step (``_RingIO.run_group``:
    poll for the input, then take it, call the part, publish, release, in one C call),
    else step by step in Python (``acquire_input``: poll, then block in slices;
    ``acquire_output``; the call; ``release_input``; ``publish_output``), which also
    adds the C step's entry for that pair of slots. The part is a ``memmove`` of the
    activation from the input slot to the output slot (what onnxruntime's write of the
    output costs), not onnxruntime.
    """

    def __init__(self, control: str, events: str, host_pid: int, ring_in: str,
                 ring_out: str, nbytes: int) -> None:
        self.nbytes = nbytes
        self.dev = process.DeviceProcess(process.DeviceOptions(
            control=control, events=events, host_pid=host_pid))
        self.dev.as_group_member()
        self.loaded = _Loaded("hop", None, [])
        for i, (handle, name, direction) in enumerate(((_IN, ring_in, "in"),
                                                       (_OUT, ring_out, "out"))):
            st = _Stream(i, handle, direction, self.nbytes, Ring.attach(name), MODE_DIRECT)
            self.loaded.streams.append(st)
            self.loaded.by_handle[handle] = st
        self.io = _RingIO(self.dev, self.loaded)
        self.group = ZeroCopyGroup((_IN,), (nbytes,), (_OUT,), (nbytes,))

    def relay(self) -> None:
        """One iteration: the activation from the input link to the output link."""
        io = self.io
        if io.run_group(self.group):
            return
        src = io.acquire_input(_IN, self.nbytes)
        try:
            dst = io.acquire_output(_OUT, self.nbytes)
            key = (_address(src), _address(dst))
            entry = self.group.calls.get(key)
            if entry is None:
                entry = self.group.calls[key] = (None, ctypes.memmove,
                                                 (key[1], key[0], self.nbytes))
            entry[1](*entry[2])
        finally:
            io.release_input(_IN)
        io.publish_output(_OUT)

    def send(self, data: memoryview) -> None:
        """Start the ping-pong: one activation into the output link."""
        self.io.acquire_output(_OUT, self.nbytes)[:] = data
        self.io.publish_output(_OUT)

    def close(self) -> None:
        self.group.calls.clear()
        self.loaded.close()
        self.dev.close()


def _address(view: memoryview) -> int:
    return int(np.frombuffer(view, np.uint8).ctypes.data)
