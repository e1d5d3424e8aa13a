"""One IPU driven over its rings directly (launcher + protocol, no Session), on both kinds
(tests/devices/conftest.py): an IPU process (``launch_ipu``) and a loopback IPU
(``launch_loopback``) are the same ``IpuConnection``."""

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


def test_the_protocol_round_trips_and_a_clean_shutdown(kind, tmp_path):
    before = ours()
    proc = kind.launch(IpuSpec(ipu_id=3, ipu_version=2, tiles_per_ipu=8, label="test ipu"),
                       log_dir=str(tmp_path))
    where = (f"loopback IPU in pid {os.getpid()}" if kind.in_thread
             else f"IPU process pid {proc.pid}")
    try:
        ready = proc.wait_ready(timeout=60)
        assert ready.pid == proc.pid and ready.package_hash == package_hash()
        assert (proc.pid == os.getpid()) is kind.in_thread
        assert (ready.ipu_id, ready.ipu_version, ready.capacity) == (3, 2, 8 * 624 * 1024)
        assert proc.alive() and proc.returncode() is None and proc.wait_exit(0.01) is None
        assert proc.describe_exit() == f"test ipu ({where}) is running"
        # a malformed message is ignored; the IPU keeps serving
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
        assert not proc.alive() and proc.returncode() == 0
        assert proc.describe_exit() == f"test ipu ({where}) exited with code 0"
    finally:
        proc.close()
        proc.close()   # idempotent
    assert ours() == before
    # an IPU process logs to the folder; a loopback IPU logs through the host's logging
    assert os.path.exists(tmp_path / "ipu3.log") is not kind.in_thread
    if kind.in_thread:
        assert proc.log_tail() == "" and proc.thread.daemon


@pytest.mark.ipu_kinds("process", reason="a loopback IPU has no start-up of its own to die in")
def test_a_process_that_dies_while_starting_is_reported(kind, tmp_path, monkeypatch):
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
