"""Every transfer carries its request's sequence number (``ipu_protocol.stream_tag``).

- The IPU process: every output of an iteration carries the number of its inputs, on
  the step-by-step path and in the C step; inputs of one iteration that carry two
  numbers fail the iteration with a named PROTOCOL error (never a silent answer);
  0 ("not numbered", a callback's transfer) agrees with any number.
- The host: an output that carries another number than the transfer it was read for is
  a ``SequenceMismatchError`` (and the replica is then unusable, as after a lost device).
- The ring records the tag of the last message read and published, which is how an
  interrupted reader or writer finds out what it did.
"""

from __future__ import annotations

import numpy as np
import pytest

import host_runtime as model_runtime
from host_runtime.errors import DeviceLostError, SequenceMismatchError
from ipu_emulator.ipu import _iteration
from ipu_emulator.ipu._stream_io import _RequestError
from ipu_emulator.ipu_protocol import SEQ_SHIFT, TAG_DATA, TAG_SHARED, ErrorKind, stream_tag
from shm import Ring
from tests.unit._loopback import model, model_path, weights  # noqa: F401  (fixtures)
from tests.unit.test_ringio_step import MAIN, SLOTS, _pair
from tests.unit.test_ringio_step import rig  # noqa: F401  (fixture)

SHAPE = (2, 3)


def test_the_tag_holds_a_kind_and_a_number() -> None:
    assert stream_tag(TAG_DATA, 0) == 0
    assert stream_tag(TAG_SHARED, 5) == 2 | 5 << SEQ_SHIFT
    assert _iteration.input_action(stream_tag(TAG_SHARED, 77)) is _iteration.InAction.HOST
    assert _iteration.input_action(stream_tag(TAG_DATA, 77)) is _iteration.InAction.SLOT


@pytest.mark.parametrize("path", ["step by step", "C step"])
def test_outputs_carry_the_number_of_their_inputs(rig, path) -> None:
    rig.warm()   # one pass step by step: the C step is then bound
    if path == "C step":
        rig.no_step_by_step()
    for seq in (7, 8, 1 << 40):
        a, b = _pair(seq % 1000)
        rig.host["tensor_A"].write(a, stream_tag(TAG_DATA, seq))
        rig.host["tensor_B"].write(b, stream_tag(TAG_DATA, seq))
        rig.interp.run_program(MAIN, rig.io)
        out, tag = rig.result()
        assert tag == stream_tag(TAG_DATA, seq)
        np.testing.assert_allclose(out, a * rig.weights + b, rtol=1e-6)


def test_an_unnumbered_input_agrees_with_any_number(rig) -> None:
    rig.warm()
    a, b = _pair(3)
    rig.host["tensor_A"].write(a, stream_tag(TAG_DATA, 0))
    rig.host["tensor_B"].write(b, stream_tag(TAG_DATA, 9))
    rig.interp.run_program(MAIN, rig.io)
    assert rig.result()[1] == stream_tag(TAG_DATA, 9)


@pytest.mark.parametrize("warm", [False, True], ids=["step by step", "C step declines"])
def test_inputs_of_two_transfers_in_one_iteration_fail_it_by_name(rig, warm) -> None:
    if warm:
        rig.warm()
    a, b = _pair(4)
    rig.host["tensor_A"].write(a, stream_tag(TAG_DATA, 11))
    rig.host["tensor_B"].write(b, stream_tag(TAG_DATA, 12))
    with pytest.raises(_RequestError) as info:
        rig.interp.run_program(MAIN, rig.io)
    assert info.value.kind is ErrorKind.PROTOCOL
    assert str(info.value) == (
        "input stream 'tensor_B' holds transfer 12, the other inputs of this iteration are "
        "transfer 11: the host's input streams are out of step")
    assert rig.host["tensor_C"].readable() == 0   # no answer was written
    for name in ("tensor_A", "tensor_B"):         # nothing is left held
        assert rig.host[name].writable() == SLOTS


def test_the_ring_records_the_last_tags_read_and_published() -> None:
    with Ring.create(64, 2) as ring:
        assert ring.last_read_tag() is None and ring.last_published_tag() is None
        ring.write(b"x", 5 << SEQ_SHIFT)
        assert ring.last_published_tag() == 5 << SEQ_SHIFT
        assert ring.last_read_tag() is None
        assert ring.read(0) == (b"x", 5 << SEQ_SHIFT)
        assert ring.last_read_tag() == 5 << SEQ_SHIFT
        view = ring.acquire_write(0)
        assert ring.holding()
        view[:1] = b"y"
        ring.publish(1, 6 << SEQ_SHIFT)
        assert not ring.holding()
        got, tag = ring.acquire_read(0)
        assert (bytes(got), tag, ring.unreleased()) == (b"y", 6 << SEQ_SHIFT, 1)
        assert ring.last_read_tag() == 6 << SEQ_SHIFT
        del got
        ring.release()
        assert ring.unreleased() == 0
        ring.reset()
        assert ring.last_read_tag() is None and ring.last_published_tag() is None


def test_an_output_of_another_transfer_is_a_named_error_never_an_answer(
        loopback_device, model, weights, monkeypatch) -> None:
    """A device that tags its outputs one transfer ahead (on every path: the C step is
    off) gives the host outputs of the wrong transfer: the host refuses them."""
    monkeypatch.setattr(_iteration, "_stepcore", None)
    real = _iteration.IterationNumber.tag
    monkeypatch.setattr(_iteration.IterationNumber, "tag",
                        lambda self, kind: real(self, kind) + (1 << SEQ_SHIFT))
    runner = model_runtime.ModelRunner(model, model_runtime.ModelRunnerConfig(
        replica_to_device={0: loopback_device}))
    try:
        a, b = _pair(5)
        with pytest.raises(SequenceMismatchError) as info:
            runner.execute({"tensor_A": a, "tensor_B": b})
        assert str(info.value) == (
            "replica 0: output 'tensor_C' read from the device carries transfer 2, expected "
            "transfer 1: the replica's streams are out of step, so none of its results can "
            "be trusted")
        assert (info.value.expected, info.value.got) == (1, 2)
        with pytest.raises(DeviceLostError, match=r"^replica 0 is unusable after an earlier "
                                                  r"failure \(replica 0: output 'tensor_C'"):
            runner.execute({"tensor_A": a, "tensor_B": b})
    finally:
        runner.close()
