"""A ModelRunner of a file it has read before takes the model it kept (host_runtime.popef
._cache), as long as the file is the same: written again, even with its old times put
back, it is read again; large files and other kinds of path are never kept."""

from __future__ import annotations

import os

import numpy as np
import pytest

import host_runtime as model_runtime
from host_runtime import popef
from host_runtime.popef import _cache
from tests._helpers import weights_of, write_example

SHAPE = (1, 4)
_read = popef.load_model   # not counted


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The paths of every parse of PopEF files by a runner, from an empty cache."""
    _cache.forget_all()
    seen: list[list[str]] = []
    real = popef.load_model

    def counting(paths, **kwargs):
        seen.append([os.fspath(p) for p in paths])
        return real(paths, **kwargs)
    monkeypatch.setattr(popef, "load_model", counting)
    yield seen
    _cache.forget_all()


def answer(path: str, device) -> np.ndarray:
    a = np.arange(4, dtype=np.float32).reshape(SHAPE)
    b = np.full(SHAPE, 0.5, np.float32)
    with model_runtime.ModelRunner(path, model_runtime.ModelRunnerConfig(
            replica_to_device={0: device})) as runner:
        return runner.execute({"tensor_A": a, "tensor_B": b})["tensor_C"]


def expected(path: str) -> np.ndarray:
    w = weights_of(_read([path]), SHAPE)
    return np.arange(4, dtype=np.float32).reshape(SHAPE) * w + 0.5


def test_runners_of_one_file_read_it_once(tmp_path, reads, loopback_device):
    path = write_example(tmp_path, SHAPE)
    want = expected(path)
    for _ in range(3):
        np.testing.assert_allclose(answer(path, loopback_device), want, rtol=1e-6)
    assert reads == [[path]]


def test_a_file_written_again_is_read_again_even_with_its_old_times(tmp_path, reads,
                                                                     loopback_device):
    path = write_example(tmp_path, SHAPE, seed=0)
    first = expected(path)
    np.testing.assert_allclose(answer(path, loopback_device), first, rtol=1e-6)
    before = os.stat(path)
    (tmp_path / "other").mkdir()
    other = write_example(tmp_path / "other", SHAPE, seed=1)
    with open(other, "rb") as f:
        data = f.read()
    assert len(data) == before.st_size   # same size: only the content differs
    with open(path, "r+b") as f:   # in place: the same inode
        f.write(data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))   # its old times back
    assert os.stat(path).st_ino == before.st_ino
    second = expected(path)
    assert not np.allclose(first, second)
    np.testing.assert_allclose(answer(path, loopback_device), second, rtol=1e-6)
    assert reads == [[path], [path]]


def test_a_file_replaced_by_rename_is_read_again(tmp_path, reads, loopback_device):
    path = write_example(tmp_path, SHAPE, seed=0)
    answer(path, loopback_device)
    (tmp_path / "new").mkdir()
    os.replace(write_example(tmp_path / "new", SHAPE, seed=2), path)
    np.testing.assert_allclose(answer(path, loopback_device), expected(path), rtol=1e-6)
    assert len(reads) == 2


def test_only_small_regular_files_are_kept(tmp_path):
    small = tmp_path / "small"
    small.write_bytes(b"x" * 10)
    big = tmp_path / "big"
    with open(big, "wb") as f:
        f.truncate(_cache.MAX_FILE_BYTES)   # sparse: its size is what counts
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert _cache.files_key([str(small)]) is not None
    assert _cache.files_key([str(big)]) is None
    assert _cache.files_key([str(small), str(big)]) is None   # together
    assert _cache.files_key([str(fifo)]) is None
    assert _cache.files_key([str(tmp_path)]) is None
    assert _cache.files_key([str(tmp_path / "missing")]) is None


def test_the_last_models_are_kept_and_the_oldest_dropped(tmp_path):
    _cache.forget_all()
    keys, models = [], []
    try:
        for i in range(_cache.MAX_MODELS + 1):
            p = tmp_path / f"m{i}"
            p.write_bytes(bytes([i]) * 8)
            key = _cache.files_key([str(p)])
            models.append(object())
            _cache.keep_model(key, models[-1], [str(p)])   # type: ignore[arg-type]
            keys.append(key)
        assert _cache.kept_model(keys[0]) is None
        assert [_cache.kept_model(k) for k in keys[1:]] == models[1:]
        # a file written between its read and keep() is not kept under its old identity
        p = tmp_path / "m0"
        key = _cache.files_key([str(p)])
        p.write_bytes(b"changed!")
        _cache.keep_model(key, object(), [str(p)])   # type: ignore[arg-type]
        assert _cache.kept_model(key) is None
    finally:
        _cache.forget_all()


@pytest.mark.parametrize("change", ["weights replaced", "tensor added", "anchor renamed",
                                    "shape set"])
def test_a_kept_model_a_program_changed_is_not_handed_out_again(tmp_path, reads,
                                                                 loopback_device, change):
    """A program that changes a runner's model (a copy of the kept one) changes nothing
    of the kept one: the next runner of the file answers as the file says."""
    path = write_example(tmp_path, SHAPE)
    want = expected(path)
    with model_runtime.ModelRunner(path, model_runtime.ModelRunnerConfig(
            replica_to_device={0: loopback_device})) as runner:
        model = runner.model
    if change == "weights replaced":
        t = model.tensorData("weights")
        t.data = np.full(SHAPE, 7, np.float32).tobytes()
    elif change == "tensor added":
        model.tensors.append(popef.TensorData("extra", b"\0" * 4))
    elif change == "anchor renamed":
        model.metadata.anchors()[0].setName("renamed")
    else:
        model.metadata.anchors()[0].tensorInfo().setShape([1, 4])   # equal, a new object
    np.testing.assert_allclose(answer(path, loopback_device), want, rtol=1e-6)
    assert len(reads) == 1   # the kept model was never handed to the program


def test_a_kept_model_changed_in_place_is_not_handed_out_again(tmp_path, reads,
                                                                 loopback_device):
    """Belt and braces: a kept model changed by other means (here: reached directly) is
    read again from its file."""
    path = write_example(tmp_path, SHAPE)
    want = expected(path)
    answer(path, loopback_device)
    (kept,) = [m for m, _ in _cache._models.values()]
    kept.tensorData("weights").data = np.full(SHAPE, 7, np.float32).tobytes()
    np.testing.assert_allclose(answer(path, loopback_device), want, rtol=1e-6)
    assert len(reads) == 2


def test_a_runner_shows_its_own_copy_of_a_shared_model_and_a_given_one_as_it_is(
        tmp_path, reads, loopback_device):
    path = write_example(tmp_path, SHAPE)
    cfg = model_runtime.ModelRunnerConfig(replica_to_device={0: loopback_device})
    with model_runtime.ModelRunner(path, cfg) as a:
        assert a.model is a.model
        ma = a.model
    with model_runtime.ModelRunner(path, cfg) as b:
        mb = b.model
    assert ma is not mb and reads == [[path]]   # one model read, shown twice as copies
    assert [x.name() for x in ma.metadata.anchors()] == [x.name() for x in mb.metadata.anchors()]
    given = _read([path])
    with model_runtime.ModelRunner(given, cfg) as c:
        assert c.model is given


def test_a_kept_model_with_weights_is_shown_as_a_copy_made_of_its_fields(
        tmp_path, reads, loopback_device):
    """A kept model whose executable carries weights (its decoded programs are kept on the
    blob, with views of the payload) is shown as a copy too, made of its fields only: the
    runtime's caches stay with the kept model. PopRT's ``Runner(path)`` reads ``model`` at
    construction, so this is every small compiled model with weights."""
    import copy

    from onnx import TensorProto, helper, numpy_helper

    from host_runtime.poprt.compiler import Compiler

    w = np.random.default_rng(3).standard_normal((40, 40)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])], "mm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, (2, 40))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, (2, 40))],
        [numpy_helper.from_array(w, "W")])
    path = str(tmp_path / "mm.popef")
    Compiler.compile_and_export(helper.make_model(graph, opset_imports=[
        helper.make_opsetid("", 11)]), ["y"], path)
    cfg = model_runtime.ModelRunnerConfig(replica_to_device={0: loopback_device})
    x = np.random.default_rng(4).standard_normal((2, 40)).astype(np.float32)
    with model_runtime.ModelRunner(path, cfg) as a:
        shown = a.model
        np.testing.assert_allclose(a.execute({"x": x})["y"], x @ w, rtol=1e-5)
    assert reads == [[path]]
    kept = _cache.kept_model(_cache.files_key([path]))
    assert kept is not None and shown is not kept and shown.executable is not kept.executable
    assert not hasattr(shown.executable, "_decoded_programs")
    assert bytes(shown.executable.payload()) == bytes(kept.executable.payload())
    shown.metadata.anchors()[0].setName("renamed")
    assert "renamed" not in [an.name() for an in kept.metadata.anchors()]
    with model_runtime.ModelRunner(copy.deepcopy(kept), cfg) as b:
        np.testing.assert_allclose(b.execute({"x": x})["y"], x @ w, rtol=1e-5)


def test_a_child_forked_while_another_thread_holds_the_cache_can_use_it(tmp_path):
    """The cache's lock is the child's own after a fork: a thread of the parent that held
    it at the fork does not leave the child waiting for it forever."""
    import threading

    p = tmp_path / "m"
    p.write_bytes(b"x" * 8)
    key = _cache.files_key([str(p)])
    held, release = threading.Event(), threading.Event()

    def holder() -> None:
        with _cache._lock:
            held.set()
            release.wait(30)
    t = threading.Thread(target=holder)
    t.start()
    try:
        assert held.wait(30)
        pid = os.fork()
        if pid == 0:   # the child: the holder thread is not here
            try:
                _cache.keep_model(key, object(), [str(p)])   # type: ignore[arg-type]
                code = 0 if _cache.kept_model(key) is not None else 3
            except BaseException:
                code = 4
            os._exit(code)
        import select
        import signal

        fd = os.pidfd_open(pid)
        try:
            exited = select.select([fd], [], [], 30)[0]   # readable once the child exits
        finally:
            os.close(fd)
        if not exited:   # stuck on the lock
            os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
    finally:
        release.set()
        t.join(30)
        _cache.forget_all()
    assert exited, "the child waited for the parent thread's hold of the cache's lock"
    assert os.waitstatus_to_exitcode(status) == 0
