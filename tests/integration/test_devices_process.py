"""One IPU process driven over its rings directly (launcher + protocol, no Session)."""

from __future__ import annotations

import os

import pytest

from ipu_emulator import package_hash, ipu_protocol
from ipu_emulator.ipu.launcher import IpuProcessError, IpuSpec, launch_ipu
from ipu_emulator.ipu_protocol import Message, Op
from shm import naming
from shm.cleanup import list_objects


def ours() -> set[str]:
    return {o.entry for o in list_objects(naming.current_tag())}


def next_event(proc) -> Message:
    return ipu_protocol.receive(proc.events, timeout=60)


def test_ipu_process_protocol_round_trips_and_clean_shutdown(tmp_path):
    before = ours()
    proc = launch_ipu(IpuSpec(ipu_id=3, ipu_version=2, tiles_per_ipu=8, label="test ipu"),
                      log_dir=str(tmp_path))
    try:
        ready = proc.wait_ready()
        assert ready.pid == proc.pid and ready.package_hash == package_hash()
        assert (ready.ipu_id, ready.ipu_version, ready.capacity) == (3, 2, 8 * 624 * 1024)
        assert proc.alive() and proc.describe_exit().endswith("is running")
        # a malformed message is ignored; the process keeps serving
        proc.control.write(b"\0" * 4, tag=77)
        ipu_protocol.send(proc.control, Message(Op.PING, seq=1))
        assert next_event(proc) == Message(Op.DONE, seq=1)
        ipu_protocol.send(proc.control, Message(Op.RUN, seq=2, body=[0]))
        err = next_event(proc)
        assert (err.op, err.seq, err.body["kind"]) == (Op.ERROR, 2, "state")
        assert err.body["message"] == "test ipu has no executable loaded"
        ipu_protocol.send(proc.control, Message(Op.LOAD, seq=3, body={"spec_region": "/nope"}))
        err = next_event(proc)
        assert err.op is Op.ERROR and "cannot open load spec /nope" in err.body["message"]
        ipu_protocol.send(proc.control, Message(Op.SHUTDOWN))
        assert next_event(proc).op is Op.BYE
        assert proc.wait_exit(60) == 0
        assert proc.describe_exit() == f"test ipu (IPU process pid {proc.pid}) exited with code 0"
    finally:
        proc.close()
        proc.close()   # idempotent
    assert ours() == before
    assert os.path.exists(tmp_path / "ipu3.log")


def test_a_process_that_dies_while_starting_is_reported(tmp_path, monkeypatch):
    # started fresh (it imports onnxruntime first): a warm fork from the template may be
    # ready before the kill below, and then it did not die "while starting"
    monkeypatch.setenv("IPU_EMULATOR_FORKSERVER", "0")
    before = ours()
    proc = launch_ipu(IpuSpec(ipu_id=0), log_dir=str(tmp_path))
    try:
        proc.kill()   # stands in for a crash during start-up
        with pytest.raises(IpuProcessError, match=r"ipu 0 \(IPU process pid \d+\) was killed by "
                                            r"signal SIGKILL \(9\) while starting"):
            proc.wait_ready(timeout=60)
    finally:
        proc.close()
    assert ours() == before
