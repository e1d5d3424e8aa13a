"""A /dev/shm too small for a model's rings: ModelRunner raises SharedMemoryFullError
saying what was asked (bytes, which ring) and what /dev/shm has, and leaves nothing."""

from __future__ import annotations

import pytest

import host_runtime as model_runtime
import host_runtime.devices._shm_space as shm_space
from host_runtime.errors import ModelRuntimeError, SharedMemoryFullError
import shm.region
from shm import ShmError
from tools.generate_simple_popef import write_simple_popef

pytestmark = pytest.mark.usefixtures("private_machine")


@pytest.fixture(scope="module")
def big_model(tmp_path_factory):
    # [512, 1024] float32: 2 MiB a transfer, rings of several slots per anchor
    return write_simple_popef(tmp_path_factory.mktemp("shm") / "big.popef", shape=(512, 1024))


def test_too_small_shm_is_refused_before_creating(big_model, monkeypatch):
    monkeypatch.setattr(shm_space, "free_bytes", lambda: (1 << 20, 64 << 20))
    with pytest.raises(SharedMemoryFullError) as info:
        model_runtime.ModelRunner(model_runtime.PopefPaths([str(big_model)]))
    msg = str(info.value)
    assert "this model's rings and regions need" in msg
    assert "ring of anchor 'tensor_A'" in msg and "2097152" in msg
    assert "/dev/shm has 1048576 bytes free of 67108864" in msg
    assert "--shm-size" in msg


def test_a_shm_failure_at_creation_is_translated(big_model, monkeypatch):
    monkeypatch.setattr(shm_space, "check_room", lambda *a, **k: None)

    import host_runtime.session._rings as streams

    class FullRing:
        @staticmethod
        def create(slot_size, num_slots, kind="ring", prefault=True, settings=None,
                   sparse=False):
            raise ShmError(f"cannot create a shared-memory region of {slot_size * num_slots} "
                           "bytes: /dev/shm has 4096 bytes free")
    monkeypatch.setattr(streams, "Ring", FullRing)
    with pytest.raises(SharedMemoryFullError) as info:
        model_runtime.ModelRunner(model_runtime.PopefPaths([str(big_model)]))
    msg = str(info.value)
    assert "cannot create the ring of anchor" in msg and "slots of 2097152 bytes" in msg
    assert "/dev/shm has" in msg
    assert isinstance(info.value, ModelRuntimeError) and not isinstance(info.value, ShmError)


def test_device_rings_failure_is_translated(monkeypatch, tmp_path):
    """The IPU processes' own rings: same error class, naming them."""
    real = shm.region._check_room

    def full(size, prefault):
        if size < 1 << 16:   # the session's own rings (made while the device attaches)
            return real(size, prefault)
        raise ShmError(f"cannot create a shared-memory region of {size} bytes: full")
    monkeypatch.setattr(shm.region, "_check_room", full)
    path = write_simple_popef(tmp_path / "small.popef")
    with pytest.raises(SharedMemoryFullError, match="control and event rings of IPU"):
        model_runtime.ModelRunner(model_runtime.PopefPaths([str(path)]))
    monkeypatch.setattr(shm.region, "_check_room", real)
