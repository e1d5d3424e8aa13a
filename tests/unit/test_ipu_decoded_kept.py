"""A pool IPU process keeps the executables it decoded, by their bytes
(``ipu_emulator.ipu._loading.Decoded``): a host that loads the same executable as an
earlier host gets a copy of the decoded one; any other bytes are decoded (and checked)."""

from __future__ import annotations

from typing import Any

import pytest

from ipu_emulator.compiler import CompileOptions, ModelSpec, compile_onnx
from ipu_emulator.executable import Executable
from ipu_emulator.ipu import _loading
from ipu_emulator.ipu._loading import KEPT_DECODED, Decoded, Executables, Loader
from ipu_emulator.ipu._host_memory import HostMemory
from ipu_emulator.ipu._options import DeviceOptions
from ipu_emulator.ipu._stream_io import _RequestError
from ipu_emulator.ipu_protocol import ErrorKind
from tests.models import simple_model


@pytest.fixture(scope="module")
def exe_bytes() -> bytes:
    result = compile_onnx(ModelSpec(simple_model((2, 3), seed=4)), CompileOptions())
    return result.executable.to_bytes()


def test_kept_by_their_bytes_and_handed_out_as_copies(exe_bytes: bytes) -> None:
    kept = Decoded()
    assert kept.get(exe_bytes) is None
    exe = Executable.from_bytes(exe_bytes)
    first = kept.put(exe_bytes, exe)
    again = kept.get(bytes(bytearray(exe_bytes)))   # equal bytes, another object
    assert again is not None and again is not first and again is not exe
    assert again.name == exe.name and again.programs == exe.programs
    assert bytes(again.weights) == bytes(exe.weights)
    again.weights = b""   # what an interpreter does with its copy: the kept one keeps them
    third = kept.get(exe_bytes)
    assert third is not None and bytes(third.weights) == bytes(exe.weights)
    other = bytearray(exe_bytes)
    other[-1] ^= 1
    assert kept.get(bytes(other)) is None   # one byte differs: not the same executable


def test_the_least_recently_used_goes_beyond_the_bound(exe_bytes: bytes,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    exe = Executable.from_bytes(exe_bytes)
    kept = Decoded()
    keys = [exe_bytes + bytes([k]) for k in range(KEPT_DECODED + 1)]
    for key in keys[:KEPT_DECODED]:
        kept.put(key, exe)
    assert kept.get(keys[0]) is not None          # now the most recently used
    kept.put(keys[-1], exe)
    assert kept.get(keys[1]) is None              # the least recently used went
    assert all(kept.get(k) is not None for k in (keys[0], *keys[2:]))
    monkeypatch.setattr(_loading, "KEPT_DECODED_BYTES", len(exe_bytes) - 1)
    small = Decoded()
    assert small.put(exe_bytes, exe) is exe and small.get(exe_bytes) is None   # too large


def _loader(pool: bool) -> Loader:
    opts = DeviceOptions(control="c", events="e", host_pid=1, pool=pool)
    return Loader(lambda: opts, Executables(HostMemory()), None, set())  # type: ignore[arg-type]


def test_a_pool_loader_decodes_the_same_bytes_once(exe_bytes: bytes,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    decoded: list[int] = []
    real = Executable.from_bytes

    def counting(data: Any, **kwargs: Any) -> Executable:
        decoded.append(len(data))
        return real(data, **kwargs)

    monkeypatch.setattr(_loading.Executable, "from_bytes", counting)
    pool = _loader(pool=True)
    one = pool._decode(exe_bytes, None, True)
    two = pool._decode(bytes(bytearray(exe_bytes)), None, True)
    assert len(decoded) == 1 and one is not two and one.name == two.name
    # weights given apart (a host's region or file) are never kept: decoded each time
    weights_at = len(exe_bytes) - len(one.weights)
    data, weights = exe_bytes[:weights_at], memoryview(exe_bytes)[weights_at:]
    pool._decode(data, weights, True)
    pool._decode(data, weights, True)
    assert len(decoded) == 3
    lone = _loader(pool=False)   # an IPU process of one host keeps none
    lone._decode(exe_bytes, None, True)
    lone._decode(exe_bytes, None, True)
    assert len(decoded) == 5
    damaged = bytearray(exe_bytes)
    damaged[-1] ^= 1
    for _ in range(2):   # checked each time, never kept
        with pytest.raises(_RequestError) as info:
            pool._decode(bytes(damaged), None, True)
        assert info.value.kind is ErrorKind.EXECUTABLE and "checksum" in str(info.value)
    assert len(decoded) == 7
