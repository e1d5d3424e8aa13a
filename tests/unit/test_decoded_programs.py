"""The decoded programs of a PopEF executable blob are kept per blob and its bytes, and
decoded again when the bytes change."""

from __future__ import annotations

import pytest

from host_runtime import popef
from host_runtime.popef import decoded_programs
from ipu_emulator.errors import ExecutableError
from ipu_emulator.executable import Executable
from tools.generate_simple_popef import write_simple_popef


@pytest.fixture(scope="module")
def payloads(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, bytes]:
    """The executables of the example model at [1,4] and at [2,4] (other ONNX bytes)."""
    out = []
    for shape in ((1, 4), (2, 4)):
        path = str(tmp_path_factory.mktemp("m") / "m.popef")
        write_simple_popef(path, shape=shape)
        out.append(bytes(popef.load_model([path]).executable.payload()))
    return out[0], out[1]


def test_decoded_programs_are_kept_per_blob_and_its_bytes(payloads):
    blob = popef.ExecutableBlob("e", payloads[0])
    first = decoded_programs(blob)
    assert decoded_programs(blob) is first
    assert first.programs == Executable.from_bytes(payloads[0], graphs=False).programs
    blob.data = payloads[1]   # new bytes: decoded again, never the old ones
    second = decoded_programs(blob)
    assert second is not first
    assert second.streams == Executable.from_bytes(payloads[1], graphs=False).streams
    assert second.streams != first.streams


def test_decoded_programs_of_writable_or_damaged_bytes_are_not_kept(payloads):
    cls = popef.ExecutableBlob
    buf = bytearray(payloads[0])
    blob = cls("e", memoryview(buf))   # may change in place: decoded each time
    assert decoded_programs(blob) is not decoded_programs(blob)
    damaged = cls("e", payloads[0][:40])
    for _ in range(2):
        with pytest.raises(ExecutableError):
            decoded_programs(damaged)
