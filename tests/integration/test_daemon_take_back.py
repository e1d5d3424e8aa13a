"""The daemon's take-back of an IPU (HOST 0) against answers its last host left unread.

A closing host does not wait for the answer of its last request (its STOP): the daemon
reads past such answers while it waits for its HOST 0's. Hosts number their requests
from 1; were the daemon's HOST 0 numbered the same, it would take a host's stale answer
for its own, lend the IPU before the process had reset, and the reset (which clears the
control ring) would then wipe the next host's hand-over and first request."""

from __future__ import annotations

import os

from shm.spin import spin_until

from ipu_emulator import ipu_protocol
from ipu_emulator.daemon._pool import PooledIpu
from ipu_emulator.ipu.launcher import IpuSpec
from ipu_emulator.ipu_protocol import HANDOVER_SEQ, Message, Op


def _lend(ipu: PooledIpu) -> None:
    """Hand the IPU to this process and read the hand-over's answer, as a host's link does."""
    ipu.hand_over_soon(os.getpid(), 1, "ipu 0")
    assert ipu.proc is not None
    assert ipu_protocol.receive(ipu.proc.events, timeout=10).seq == HANDOVER_SEQ


def test_take_back_waits_for_its_own_answer_not_one_the_host_left_unread(tmp_path) -> None:
    ipu = PooledIpu(IpuSpec(ipu_id=0), str(tmp_path))
    ipu.start()
    try:
        proc = ipu.proc
        assert proc is not None
        for _ in range(5):
            _lend(ipu)
            # as a closing host: its first request, its answer left unread
            ipu_protocol.send(proc.control, Message(Op.PING, seq=1), timeout=10)
            assert spin_until(proc.events.readable, 10 * 10**9)
            ipu.take_back()
            # the next host's hand-over and first request are served, in order
            _lend(ipu)
            ipu_protocol.send(proc.control, Message(Op.PING, seq=1), timeout=10)
            answer = ipu_protocol.receive(proc.events, timeout=10)
            assert (answer.op, answer.seq) == (Op.DONE, 1)
            ipu.take_back()
    finally:
        ipu.close_process(polite=True)
