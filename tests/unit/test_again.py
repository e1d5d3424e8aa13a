"""host_runtime._again: a kept error is raised as a copy (type, message, attributes,
cause), so that the raising frames are attached to the copy, never to the kept one."""

from __future__ import annotations

import pytest

from host_runtime._again import again
from host_runtime.errors import (DeviceLostError, ForkedProcessError, RemoteTraceback,
                                 SequenceMismatchError)
from shm.errors import PeerDiedError


def _raise(exc: BaseException) -> None:
    raise exc


@pytest.mark.parametrize("kept", [
    DeviceLostError("device 0 (ipu 0): IPU process 12 was killed by signal SIGKILL (9)"),
    SequenceMismatchError("out of step", expected=3, got=4),
    ForkedProcessError("made in another process", owner_pid=1, pid=2),
    PeerDiedError("ring r: peer process 7 exited", 7),
])
def test_a_copy_has_the_kept_errors_type_message_attributes_and_cause(kept):
    kept.__cause__ = RemoteTraceback("Traceback (most recent call last): ...")
    for _ in range(3):
        with pytest.raises(type(kept)) as info:
            try:
                _raise(ValueError("being handled"))
            except ValueError:
                _raise(again(kept))
        copy = info.value
        assert copy is not kept and type(copy) is type(kept)
        assert str(copy) == str(kept) and copy.args == kept.args
        assert copy.__dict__ == kept.__dict__
        assert copy.__cause__ is kept.__cause__
        assert copy.__suppress_context__   # not shown as raised while handling ValueError
        assert kept.__traceback__ is None   # the kept one never holds a caller's frames


def test_an_error_that_cannot_be_made_again_is_raised_with_its_traceback_reset():
    class Odd(Exception):
        def __new__(cls, *args: object) -> "Odd":
            if len(args) != 2:
                raise TypeError("Odd takes two arguments")
            return super().__new__(cls, *args)

    kept = Odd(1, 2)
    kept.args = ("changed",)   # what __new__ gets back no longer fits it
    with pytest.raises(Odd) as info:
        _raise(kept)
    assert again(kept) is kept and kept.__traceback__ is None
    del info
