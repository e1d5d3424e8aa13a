"""Weights held once: the replicas of a model share one read-only copy in shared memory.

A chain of MatMul layers (a few MiB of float32 weights) in 2 replicas, checked from the
outside: /dev/shm holds one weights region, each IPU process maps it read-only and its
pages are shared (``/proc/<pid>/smaps``), answers equal onnxruntime's, a replica's own
tensors do not reach another's, and a killed IPU process or a reset leaves the shared
weights as they were. With prepacking on (the default) each IPU process keeps its own
copy and the region goes once the replicas are loaded; either way /dev/shm is empty after
``close()`` and after the runner is dropped.
"""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

import host_runtime as model_runtime
from host_runtime import popef, settings
from host_runtime.errors import DeviceLostError, SharedMemoryFullError
from ipu_emulator.executable import Executable, weights_span
from tests._helpers import file_mapping, kill_and_wait, shm_mapping, smaps_of, tag_objects
from tools._chain_model import chain_model, reference

pytestmark = pytest.mark.usefixtures("private_machine")

LAYERS, WIDTH, BATCH = 2, 512, 2          # 2 MiB of weights
WEIGHTS = LAYERS * WIDTH * WIDTH * 4


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, str]:
    from host_runtime.poprt.compiler import compile as poprt_compile

    model = chain_model(layers=LAYERS, width=WIDTH, batch=BATCH)
    out = poprt_compile(model, tmp_path_factory.mktemp("chain"), popef_name="chain.popef")
    return model, str(out.popef_path)


def _expected_weights(path: str) -> bytes:
    exe = popef.load_model([path]).executable.payload()
    start, length = weights_span(exe)
    assert length >= WEIGHTS   # the compiler put every MatMul weight there
    return bytes(memoryview(exe)[start:start + length])


def _x(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((BATCH, WIDTH)).astype(np.float32)


def test_two_replicas_share_one_read_only_copy_of_the_weights(chain):
    model, path = chain
    cfg = model_runtime.ModelRunnerConfig(replication_factor=2)
    with settings.override(prepack=False), model_runtime.ModelRunner(path, config=cfg) as r:
        for rid in (0, 1):
            x = _x(rid)
            np.testing.assert_allclose(r.execute({"x": x}, replica_id=rid)["y"],
                                       reference(model, x), rtol=1e-4, atol=1e-5)
        (name,) = tag_objects("wts")      # one region for both replicas
        with open("/dev/shm/" + name, "rb") as f:
            assert f.read() == _expected_weights(path)
        for rid in (0, 1):
            (pid,) = r.device_pids(rid)
            m = shm_mapping(pid, name)
            assert m["perms"] == "r--s", m   # read-only: a write faults, never lands
            # onnxruntime computed with these pages: resident here, shared with the other
            # replica's process (and the host's), none of them private to this process
            assert int(m["Rss"]) >= WEIGHTS, m
            assert int(m["Shared_Clean"]) + int(m["Shared_Dirty"]) >= WEIGHTS, m
            assert int(m["Private_Clean"]) + int(m["Private_Dirty"]) == 0, m
    assert tag_objects() == []


def test_with_prepacking_each_ipu_has_its_copy_and_the_region_goes_after_loading(chain):
    model, path = chain
    cfg = model_runtime.ModelRunnerConfig(replication_factor=2)
    with settings.override(prepack=True), model_runtime.ModelRunner(path, config=cfg) as r:
        for rid in (0, 1):
            x = _x(10 + rid)
            np.testing.assert_allclose(r.execute({"x": x}, replica_id=rid)["y"],
                                       reference(model, x), rtol=1e-4, atol=1e-5)
        assert tag_objects("wts") == []
        for rid in (0, 1):
            (pid,) = r.device_pids(rid)
            with open(f"/proc/{pid}/maps", encoding="utf-8") as f:
                assert "_wts" not in f.read()
    assert tag_objects() == []


def test_a_replica_s_tensors_do_not_reach_another_and_the_weights_do_not_change(chain):
    model, path = chain
    cfg = model_runtime.ModelRunnerConfig(replication_factor=2)
    with settings.override(prepack=False), model_runtime.ModelRunner(path, config=cfg) as r:
        xs = [_x(20), _x(21)]
        futs = [(x, r.executeAsync({"x": x}, replica_id=k % 2)) for k, x in
                enumerate(xs * 3)]
        for x, f in futs:
            f.wait()
            np.testing.assert_allclose(f["y"].numpy(), reference(model, x), rtol=1e-4,
                                       atol=1e-5)
        (name,) = tag_objects("wts")
        with open("/dev/shm/" + name, "rb") as f:
            assert f.read() == _expected_weights(path)


def test_a_killed_ipu_process_and_a_reset_leave_the_shared_weights_intact(chain):
    model, path = chain
    cfg = model_runtime.ModelRunnerConfig(replication_factor=2, auto_reset=True)
    with settings.override(prepack=False), model_runtime.ModelRunner(path, config=cfg) as r:
        x = _x(30)
        want = reference(model, x)
        for rid in (0, 1):
            np.testing.assert_allclose(r.execute({"x": x}, replica_id=rid)["y"], want,
                                       rtol=1e-4, atol=1e-5)
        (name,) = tag_objects("wts")
        (old,) = r.device_pids(0)
        kill_and_wait(old)
        # the other replica computes on with the same pages, the killed one is reset
        np.testing.assert_allclose(r.execute({"x": x}, replica_id=1)["y"], want, rtol=1e-4,
                                   atol=1e-5)
        np.testing.assert_allclose(r.execute({"x": x}, replica_id=0)["y"], want, rtol=1e-4,
                                   atol=1e-5)
        assert r.device_pids(0) != [old]
        assert tag_objects("wts") == [name]   # reloaded from the same region
        with open("/dev/shm/" + name, "rb") as f:
            assert f.read() == _expected_weights(path)
    assert tag_objects() == []


def test_a_dropped_runner_leaves_nothing_in_dev_shm(chain):
    model, path = chain
    cfg = model_runtime.ModelRunnerConfig(replication_factor=2)
    gc.disable()
    try:
        with settings.override(prepack=False):
            r = model_runtime.ModelRunner(path, config=cfg)
        x = _x(40)
        np.testing.assert_allclose(r.execute({"x": x}, replica_id=1)["y"], reference(model, x),
                                   rtol=1e-4, atol=1e-5)
        assert len(tag_objects("wts")) == 1
        del r   # reference counting alone
        assert tag_objects() == []
    finally:
        gc.enable()


def test_a_model_that_does_not_fit_is_refused_before_anything_starts(chain, monkeypatch):
    import psutil

    from host_runtime.devices import _shm_space

    _, path = chain
    free = WEIGHTS // 2
    monkeypatch.setattr(_shm_space.os, "statvfs",
                        lambda p: os.statvfs_result((4096, 1, free, free, free, 0, 0, 0, 0, 255)))
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    cfg = model_runtime.ModelRunnerConfig(replication_factor=2)
    with settings.override(prepack=False), pytest.raises(SharedMemoryFullError,
                       match=rf"needs \d+ bytes .*of shared memory \({WEIGHTS} bytes of weights "
                             rf"once.*but /dev/shm has {free} bytes"):
        model_runtime.ModelRunner(path, config=cfg)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before
    assert tag_objects() == []


def test_weights_given_apart_are_checked_by_the_executable_checksum(chain):
    _, path = chain
    exe = bytes(popef.load_model([path]).executable.payload())
    start, length = weights_span(exe)
    whole = Executable.from_bytes(exe)
    apart = Executable.from_bytes(exe[:start], weights=memoryview(exe)[start:])
    assert bytes(apart.weights) == bytes(whole.weights) == exe[start:]
    assert [g.external for g in apart.graphs] == [g.external for g in whole.graphs]
    damaged = bytearray(exe[start:])
    damaged[length // 2] ^= 1
    with pytest.raises(Exception, match="body checksum mismatch"):
        Executable.from_bytes(exe[:start], weights=damaged)
    with pytest.raises(Exception, match="weights section of 1 bytes"):
        Executable.from_bytes(exe[:start], weights=b"x")


def test_a_model_with_external_data_compiles_loads_and_runs(tmp_path):
    """ONNX external data (how models over protobuf's 2 GiB keep their weights): compiled
    into the executable's weights section, shared by the replicas, run as the model says."""
    import onnx

    from host_runtime.poprt.compiler import compile as poprt_compile

    model = chain_model(layers=2, width=256, batch=BATCH, seed=3)
    onnx.save_model(chain_model(layers=2, width=256, batch=BATCH, seed=3),
                    str(tmp_path / "m.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="m.data", size_threshold=0)
    assert (tmp_path / "m.data").stat().st_size >= 2 * 256 * 256 * 4
    out = poprt_compile(str(tmp_path / "m.onnx"), tmp_path / "out", popef_name="m.popef")
    exe = Executable.from_bytes(popef.load_model([str(out.popef_path)]).executable.payload())
    assert {w.name for g in exe.graphs for w in g.external} == {"w0", "w1"}
    assert all(len(g.model) < 64 * 1024 for g in exe.graphs)   # the graph holds no weights
    cfg = model_runtime.ModelRunnerConfig(replication_factor=2)
    with settings.override(prepack=False), \
            model_runtime.ModelRunner(str(out.popef_path), config=cfg) as r:
        for rid in (0, 1):
            x = _x(50 + rid)[:, :256].copy()
            np.testing.assert_allclose(r.execute({"x": x}, replica_id=rid)["y"],
                                       reference(model, x), rtol=1e-4, atol=1e-5)


def test_starting_the_template_early_makes_its_log_folder(tmp_path):
    """A runner starts the IPU processes' template while it reads the model; on a machine
    whose folders do not exist yet it makes them (else the template could not start and
    every IPU process would start without it)."""
    from ipu_emulator.ipu.launcher import prestart

    logs = tmp_path / "fresh" / "logs"
    prestart(log_dir=str(logs))
    assert logs.is_dir()


def test_with_prepacking_a_replaced_popef_file_is_not_read_again(chain, tmp_path):
    """With prepacking on an IPU process reads the weights from the PopEF file the host
    read; once that file is replaced, the host hands them over in shared memory instead
    (the bytes it mapped), and the answers stay those of the model it read."""
    import shutil

    model, path = chain
    copy = tmp_path / "c.popef"
    shutil.copyfile(path, copy)
    read = popef.load_model([str(copy)])
    other = tmp_path / "other.popef"
    other.write_bytes(b"not a PopEF file")
    os.replace(other, copy)            # a new file at that path
    with settings.override(prepack=True), model_runtime.ModelRunner(read) as r:
        x = _x(60)
        np.testing.assert_allclose(r.execute({"x": x})["y"], reference(model, x), rtol=1e-4,
                                   atol=1e-5)
        assert tag_objects("wts") == []   # used for the load, then let go
    assert tag_objects() == []


def test_with_prepacking_weights_need_no_room_in_dev_shm(chain, monkeypatch):
    """A model read from a file, prepacking on: its weights never go through /dev/shm, so a
    /dev/shm too small for them (Docker's 64 MiB and a large model) does not refuse it."""
    from host_runtime.devices import _shm_space

    model, path = chain
    # more than the IPU's control and event rings (ipu_protocol.RINGS_BYTES); less than the
    # session's rings and regions with the weights (2 MiB) added
    free = 2105600 + 4096
    monkeypatch.setattr(_shm_space.os, "statvfs",
                        lambda p: os.statvfs_result((4096, 1, free, free, free, 0, 0, 0, 0, 255)))
    with settings.override(prepack=True), model_runtime.ModelRunner(path) as r:
        x = _x(70)
        np.testing.assert_allclose(r.execute({"x": x})["y"], reference(model, x), rtol=1e-4,
                                   atol=1e-5)


@pytest.mark.parametrize("prepack", [True, False])
def test_a_popef_file_changed_in_place_after_it_was_read_changes_nothing(chain, tmp_path,
                                                                         prepack):
    """A PopEF file written over in place, or cut short, after it was read: the model was
    read from a private snapshot of the file (host_runtime.popef.reader), so the runner
    made from it, and its IPU processes loaded again by a reset, compute with the weights
    as they were read; nothing faults (SIGBUS) and nothing is left in /dev/shm."""
    import shutil

    model, path = chain
    copy = tmp_path / "c.popef"
    shutil.copyfile(path, copy)
    read = popef.load_model([str(copy)])
    exe = read.executable.payload()
    start, length = weights_span(exe)
    from host_runtime.popef.reader import file_span
    snap, at = file_span(exe[start:])
    assert snap != str(copy) and "(deleted)" in os.readlink(snap)   # the snapshot
    with open(copy, "r+b") as f:     # one byte of the weights, in place
        f.seek(at + length // 2)
        byte = f.read(1)
        f.seek(at + length // 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    cfg = model_runtime.ModelRunnerConfig()
    cfg.auto_reset = True
    x = _x(77)
    with settings.override(prepack=prepack), model_runtime.ModelRunner(read, config=cfg) as r:
        np.testing.assert_allclose(r.execute({"x": x})["y"], reference(model, x), rtol=1e-4,
                                   atol=1e-5)
        os.truncate(copy, 4096)      # and cut short under the running runner
        (pid,) = r.device_pids(0)
        kill_and_wait(pid)
        try:   # the dead IPU process is seen before the request is sent, or by it
            r.execute({"x": x})
        except DeviceLostError:
            pass
        np.testing.assert_allclose(r.execute({"x": x})["y"], reference(model, x), rtol=1e-4,
                                   atol=1e-5)   # reloaded from the snapshot
    assert tag_objects() == []


def test_large_external_data_stays_in_its_file_while_compiling(tmp_path, monkeypatch):
    """Initializers too large for protobuf (over 2 GiB in all) are never loaded into the
    model: the compiler reads them from their external data file in place, checks the
    model with onnxruntime over them, and copies them into the executable's weights
    section. The threshold is lowered here so that a small model takes that path
    (``python -m tools.bench memory --weights-mib 2200`` runs one over 2 GiB)."""
    import onnx

    from host_runtime.poprt.compiler import compile as poprt_compile
    from ipu_emulator.compiler import _onnx
    from ipu_emulator.errors import CompileError

    monkeypatch.setattr(_onnx, "STASH_MIN_BYTES", 64 * 1024)
    seen = []
    real = _onnx._stash
    monkeypatch.setattr(_onnx, "_stash", lambda *a: seen.append(a[0].name) or real(*a))
    model = chain_model(layers=2, width=256, batch=BATCH, seed=4)
    onnx.save_model(chain_model(layers=2, width=256, batch=BATCH, seed=4),
                    str(tmp_path / "m.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="m.data", size_threshold=0)
    out = poprt_compile(str(tmp_path / "m.onnx"), tmp_path / "out", popef_name="m.popef")
    assert sorted(seen) == ["w0", "w1"]
    with model_runtime.ModelRunner(str(out.popef_path)) as r:
        x = _x(80)[:, :256].copy()
        np.testing.assert_allclose(r.execute({"x": x})["y"], reference(model, x), rtol=1e-4,
                                   atol=1e-5)
    with pytest.raises(CompileError, match="fp16 is not supported for them"):
        poprt_compile(str(tmp_path / "m.onnx"), tmp_path / "out16", popef_name="m.popef",
                      precision="fp16")
    assert not _onnx._stashed()   # let go after each compilation


def test_with_prepacking_aligned_weights_are_prepacked_from_the_file_where_they_lie(chain):
    """The compiler's PopEF file holds the weights 64-aligned; with prepacking on the IPU
    process hands them to onnxruntime where they lie in its mapping of the file (no copy
    of them first) and keeps that mapping, whose pages it lets go once the session is
    made: none of them stays resident in it; the answers are onnxruntime's."""
    from host_runtime.popef.reader import file_span

    model, path = chain
    exe = popef.load_model([path]).executable.payload()
    start, _ = weights_span(exe)
    _, at = file_span(exe[start:])
    assert at % 64 == 0, at
    with settings.override(prepack=True), model_runtime.ModelRunner(path) as r:
        x = _x(80)
        np.testing.assert_allclose(r.execute({"x": x})["y"], reference(model, x), rtol=1e-4,
                                   atol=1e-5)
        (pid,) = r.device_pids(0)
        assert file_mapping(pid, path) is None   # not the user's file: the host's snapshot
        folder = os.path.dirname(os.path.realpath(path)) + "/#"
        with open(f"/proc/{pid}/maps", encoding="utf-8") as f:
            (snap,) = {ln.split(None, 5)[5].rstrip("\n") for ln in f
                       if len(ln.split(None, 5)) == 6 and ln.split(None, 5)[5].startswith(folder)}
        assert snap.endswith(" (deleted)"), snap   # an unnamed file in the file's folder
        m = smaps_of(pid, " " + snap)
        assert m is not None and m["Size"] >= WEIGHTS, m
        assert m["Rss"] < WEIGHTS // 4, m


def test_with_prepacking_unaligned_weights_are_copied_by_onnxruntime(chain, tmp_path):
    """A PopEF file whose weights are not aligned (the executable written before its
    metadata): onnxruntime copies them, the IPU process lets its mapping of the file go
    once the session is made, and the answers are the same."""
    model, path = chain
    read = popef.load_model([path])
    odd = tmp_path / "odd.popef"
    with popef.Writer(str(odd)) as w:
        w.writeExecutableBlob(read.executable)
        w.writeMetadata(read.metadata)
    from host_runtime.popef.reader import file_span
    exe = popef.load_model([str(odd)]).executable.payload()
    start, _ = weights_span(exe)
    _, at = file_span(exe[start:])
    assert at % 64 != 0, at
    with settings.override(prepack=True), model_runtime.ModelRunner(str(odd)) as r:
        x = _x(81)
        np.testing.assert_allclose(r.execute({"x": x})["y"], reference(model, x), rtol=1e-4,
                                   atol=1e-5)
        (pid,) = r.device_pids(0)
        assert file_mapping(pid, str(odd)) is None
    assert tag_objects() == []


def test_a_damaged_popef_file_is_refused_by_its_checksum_while_the_runner_starts(chain,
                                                                              tmp_path):
    """The host checks a large payload's checksum on a thread while the runner starts its
    IPU processes and loads them: a file damaged before it was read is refused with the
    PopEF checksum error all the same, and nothing is left in /dev/shm."""
    import shutil

    from host_runtime.errors import PopefError

    _, path = chain
    bad = tmp_path / "bad.popef"
    shutil.copyfile(path, bad)
    exe = popef.load_model([path]).executable.payload()
    start, length = weights_span(exe)
    from host_runtime.popef.reader import file_span
    _, at = file_span(exe[start:])
    with open(bad, "r+b") as f:     # one byte of the weights
        f.seek(at + length // 3)
        byte = f.read(1)
        f.seek(at + length // 3)
        f.write(bytes([byte[0] ^ 0x10]))
    for prepack in (True, False):
        with settings.override(prepack=prepack), \
                pytest.raises(PopefError, match=r"payload checksum mismatch: stored 0x[0-9a-f]{8}"
                                                r", computed 0x[0-9a-f]{8}"):
            model_runtime.ModelRunner(str(bad))
        assert tag_objects() == []


def test_ipu_processes_of_another_user_get_the_weights_through_shared_memory(chain,
                                                                             monkeypatch):
    """An IPU process that runs as another user (a daemon's) cannot open the host's
    snapshot of the PopEF file: the weights go through a shared region instead."""
    import subprocess

    from host_runtime.session import _loading

    if os.geteuid() == 0:   # the check itself, on a process of another user
        other = subprocess.Popen(["sleep", "30"], user=65534)
        try:
            assert not _loading._same_user([other.pid])
        finally:
            other.kill()
            other.wait()
    assert _loading._same_user([os.getpid()])
    monkeypatch.setattr(_loading, "_same_user", lambda pids: False)
    made = []
    real = _loading.shared_weights
    monkeypatch.setattr(_loading, "shared_weights",
                        lambda *a: made.append(real(*a)) or made[-1])
    model, _ = chain
    x = _x(82)
    with settings.override(prepack=True), model_runtime.ModelRunner(chain[1]) as r:
        np.testing.assert_allclose(r.execute({"x": x})["y"], reference(model, x), rtol=1e-4,
                                   atol=1e-5)
        (pid,) = r.device_pids(0)
        with open(f"/proc/{pid}/maps", encoding="utf-8") as f:
            assert "(deleted)" not in f.read()   # no snapshot of the file mapped there
    assert len(made) == 1 and made[0].size >= WEIGHTS   # the shared region, not the file
    del made
    assert tag_objects() == []
