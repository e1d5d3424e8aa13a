"""Constant inputs held once: PopEF tensor data and frozen inputs of the Load program.

The seeds' example model (``tensor_C = tensor_A * weights + tensor_B``, ``weights`` PopEF
tensor data streamed in by the Load program) with 256 KiB of weights, in 2 replicas,
checked from the outside: /dev/shm holds one constants region (``_cst``) for both, each
IPU process maps it read-only and its pages are shared (``/proc/<pid>/smaps``), the
replicas' own device memory never holds the weights, and answers equal numpy's. A model
whose Main program writes the weights gets a copy per replica; a killed IPU process, a
reset and a new Load run leave the shared copy as it was; /dev/shm is empty after close.
A chain of MatMuls over 2 IPUs (sharded, pipelined) in 2 replicas: every IPU process
maps the one region; a constant input of Main read on one IPU of two is shared while
that IPU still waits for each request, and goes with each request otherwise.
"""

from __future__ import annotations

import dataclasses
import gc
import os
from typing import Callable

import numpy as np
import pytest

import host_runtime as model_runtime
from host_runtime import popef, settings
from host_runtime.session import Session
from ipu_emulator.executable import Copy
from tests._helpers import kill_and_wait, shm_mapping, tag_objects
from tests.crafted import A, B, C, EXEC, craft, load_parts
from tools.generate_simple_popef import write_simple_popef

pytestmark = pytest.mark.usefixtures("private_machine")

SHAPE = (64, 1024)                     # 256 KiB of float32 weights
NBYTES = SHAPE[0] * SHAPE[1] * 4


@pytest.fixture(scope="module")
def simple(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, np.ndarray]:
    path = str(tmp_path_factory.mktemp("cst") / "simple.popef")
    write_simple_popef(path, shape=SHAPE)
    return path, _weights(path)


@pytest.fixture(scope="module")
def writing(simple: tuple[str, np.ndarray], tmp_path_factory: pytest.TempPathFactory) -> str:
    """The example model whose Main program also writes its weights: weights := tensor_C
    after each iteration (each request sees the previous request's output as weights)."""
    path = str(tmp_path_factory.mktemp("cst") / "writing.popef")
    craft(simple[0], path,
          iteration=lambda b: (A(b), B(b), EXEC(b), C(b), Copy("tensor_C", "weights")))
    return path


def _weights(path: str) -> np.ndarray:
    model = popef.load_model([path])
    td = model.tensorData("weights")
    assert td is not None
    return np.frombuffer(td.data, np.float32).reshape(SHAPE).copy()


def _read(name: str, n: int = NBYTES) -> np.ndarray:
    with open("/dev/shm/" + name, "rb") as f:
        return np.frombuffer(f.read(n), np.float32).reshape(SHAPE)


def _weights_offset(path: str) -> int:
    return load_parts(path)[1].tensors["weights"].offset


def _ab(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"tensor_A": rng.standard_normal(SHAPE).astype(np.float32),
            "tensor_B": rng.standard_normal(SHAPE).astype(np.float32)}


def _feed(value: object) -> Callable[[memoryview], None]:
    """A stream callback that fills each transfer with ``value`` (an array or a number)."""
    flat = np.asarray(value, np.float32).ravel()

    def cb(view: memoryview) -> None:
        np.frombuffer(view, np.float32)[:] = flat
    return cb


def _callbacks(s: Session, feeds: dict[str, object], got: list[np.ndarray]) -> None:
    """Feed each input of ``feeds``, collect ``tensor_C``'s transfers into ``got``, drop
    ``weights_saved``'s."""
    for name, value in feeds.items():
        s.setCallbackForAnchor(name, _feed(value))
    s.setCallbackForAnchor("tensor_C", lambda v: got.append(
        np.frombuffer(v, np.float32).reshape(SHAPE).copy()))
    s.setCallbackForAnchor("weights_saved", lambda v: None)


def _check_shared(r: model_runtime.ModelRunner, name: str) -> None:
    for rid in (0, 1):
        (pid,) = r.device_pids(rid)
        # onnxruntime read these pages: resident here, shared, none private to this process
        assert int(_mapped_shared(pid, name, NBYTES)["Rss"]) >= NBYTES


def _mapped_shared(pid: int, name: str, nbytes: int, private_too: bool = True
                   ) -> dict[str, int | str]:
    """``pid`` maps ``name`` read-only (a write faults, never lands), at least ``nbytes``
    of it shared (with ``private_too``: none of it private); its smaps entry."""
    m = shm_mapping(pid, name)
    assert m["perms"] == "r--s", m
    assert int(m["Shared_Clean"]) + int(m["Shared_Dirty"]) >= nbytes, m
    if private_too:
        assert int(m["Private_Clean"]) + int(m["Private_Dirty"]) == 0, m
    return m


@pytest.mark.parametrize("prepack", [True, False])
def test_two_replicas_share_one_read_only_copy_of_the_popef_fed_weights(simple, prepack):
    path, w = simple
    at = _weights_offset(path)
    cfg = model_runtime.ModelRunnerConfig(replication_factor=2)
    with settings.override(prepack=prepack), model_runtime.ModelRunner(path, config=cfg) as r:
        for rid in (0, 1):
            x = _ab(rid)
            np.testing.assert_allclose(r.execute(x, replica_id=rid)["tensor_C"],
                                       x["tensor_A"] * w + x["tensor_B"], rtol=1e-6)
        (name,) = tag_objects("cst")       # one region for both replicas
        np.testing.assert_array_equal(_read(name), w)
        _check_shared(r, name)
        mems = tag_objects("mem")
        assert len(mems) == 2
        for mem in mems:   # the replicas' own device memory never held them
            with open("/dev/shm/" + mem, "rb") as f:
                f.seek(at)
                assert f.read(NBYTES) == bytes(NBYTES)
    assert tag_objects() == []


def test_a_frozen_input_of_the_load_program_is_shared_and_overrides_the_popef_data(simple):
    path, w = simple
    frozen = np.full(SHAPE, 3.0, np.float32)
    cfg = model_runtime.ModelRunnerConfig(replication_factor=2)
    cfg.frozen_inputs = model_runtime.InputMemoryView()
    cfg.frozen_inputs["weights"] = frozen
    with model_runtime.ModelRunner(path, config=cfg) as r:
        for rid in (0, 1):
            x = _ab(10 + rid)
            np.testing.assert_allclose(r.execute(x, replica_id=rid)["tensor_C"],
                                       x["tensor_A"] * 3.0 + x["tensor_B"], rtol=1e-6)
        (name,) = tag_objects("cst")
        np.testing.assert_array_equal(_read(name), frozen)
        _check_shared(r, name)
    assert tag_objects() == []


def test_runners_of_the_same_file_share_the_region(simple):
    path, w = simple
    with model_runtime.ModelRunner(path) as r1, model_runtime.ModelRunner(path) as r2:
        x = _ab(15)
        for r in (r1, r2):
            np.testing.assert_allclose(r.execute(x)["tensor_C"],
                                       x["tensor_A"] * w + x["tensor_B"], rtol=1e-6)
        (name,) = tag_objects("cst")
        assert all(shm_mapping(r.device_pids()[0], name)["perms"] == "r--s" for r in (r1, r2))
    assert tag_objects() == []


def test_different_frozen_values_get_regions_of_their_own(simple):
    path, w = simple
    runners = []
    try:
        for k in (1, 2):
            cfg = model_runtime.ModelRunnerConfig()
            cfg.frozen_inputs = model_runtime.InputMemoryView()
            cfg.frozen_inputs["weights"] = np.full(SHAPE, float(k), np.float32)
            runners.append(model_runtime.ModelRunner(path, config=cfg))
        x = _ab(17)
        for k, r in zip((1, 2), runners):
            np.testing.assert_allclose(r.execute(x)["tensor_C"],
                                       x["tensor_A"] * k + x["tensor_B"], rtol=1e-6)
        assert sorted(float(_read(n)[0, 0]) for n in tag_objects("cst")) == [1.0, 2.0]
    finally:
        for r in runners:
            r.close()
    assert tag_objects() == []


def test_a_program_that_writes_the_weights_gets_its_own_copy_per_replica(simple, writing):
    _, w = simple
    at = _weights_offset(writing)
    cfg = model_runtime.ModelRunnerConfig(replication_factor=2)
    with model_runtime.ModelRunner(writing, config=cfg) as r:
        x = _ab(20)
        a, b = x["tensor_A"], x["tensor_B"]
        first = r.execute(x, replica_id=0)["tensor_C"]
        np.testing.assert_allclose(first, a * w + b, rtol=1e-6)
        second = r.execute(x, replica_id=0)["tensor_C"]   # its weights are now `first`
        np.testing.assert_allclose(second, a * first + b, rtol=1e-5)
        # replica 0's writes did not reach replica 1, nor the shared value
        np.testing.assert_allclose(r.execute(x, replica_id=1)["tensor_C"], first, rtol=1e-6)
        (name,) = tag_objects("cst")
        np.testing.assert_array_equal(_read(name), w)
        for rid in (0, 1):
            (pid,) = r.device_pids(rid)
            assert shm_mapping(pid, name)["perms"] == "r--s"
        # Each replica's device memory, read once its IPU process has finished the
        # iteration: an output reaches the host before the iteration's last steps (its
        # write of the weights) are done, so the files are opened now and read after
        # close(), whose STOP the IPU takes only between iterations.
        mems = [open("/dev/shm/" + mem, "rb") for mem in tag_objects("mem")]
    try:
        # each replica computes with its own copy, in its own device memory
        held = []
        for f in mems:
            f.seek(at)
            held.append(np.frombuffer(f.read(NBYTES), np.float32).reshape(SHAPE))
    finally:
        for f in mems:
            f.close()
    assert len(held) == 2
    assert sorted(float(h[0, 0]) for h in held) == sorted(
        [float(first[0, 0]), float(second[0, 0])])
    assert tag_objects() == []


def test_a_new_load_run_restores_a_written_copy_from_the_shared_value(simple, writing):
    """A Session whose Main writes its weights: running the Load program again brings the
    PopEF value back; a callback set on the weights takes effect at the next Load run (not
    before: the device keeps what the last Load wrote), and removing it brings back the
    shared value."""
    _, w = simple
    x = _ab(30)
    a, b = x["tensor_A"], x["tensor_B"]
    got: list[np.ndarray] = []
    with Session(writing) as s:
        _callbacks(s, x, got)
        s.runLoadPrograms()
        s.runMainPrograms()
        s.runMainPrograms()
        np.testing.assert_allclose(got[0], a * w + b, rtol=1e-6)
        np.testing.assert_allclose(got[1], a * got[0] + b, rtol=1e-5)
        s.runLoadPrograms()
        s.runMainPrograms()
        np.testing.assert_allclose(got[2], got[0], rtol=1e-6)
        twos = np.full(SHAPE, 2.0, np.float32)
        s.setCallbackForAnchor("weights", _feed(twos))
        s.runMainPrograms()      # the device still has what the last Load wrote, written on
        np.testing.assert_allclose(got[3], a * got[2] + b, rtol=1e-5)
        s.runLoadPrograms()
        s.runMainPrograms()
        np.testing.assert_allclose(got[4], a * 2.0 + b, rtol=1e-6)
        s.setCallbackForAnchor("weights", None)   # the PopEF data again
        s.runLoadPrograms()
        s.runMainPrograms()
        np.testing.assert_allclose(got[5], got[0], rtol=1e-6)
    assert tag_objects() == []


def test_a_callback_set_on_read_only_weights_takes_effect_at_the_next_load_run(simple):
    path, w = simple
    x = _ab(35)
    a, b = x["tensor_A"], x["tensor_B"]
    got: list[np.ndarray] = []
    fives = np.full(SHAPE, 5.0, np.float32)
    with Session(path) as s:
        _callbacks(s, x, got)
        s.runMainPrograms()
        (name,) = tag_objects("cst")
        s.setCallbackForAnchor("weights", _feed(fives))
        s.runMainPrograms()
        s.runLoadPrograms()
        s.runMainPrograms()
        assert tag_objects("cst") == []   # no session of this process uses it any more
        np.testing.assert_allclose(got[0], a * w + b, rtol=1e-6)
        np.testing.assert_allclose(got[1], a * w + b, rtol=1e-6)
        np.testing.assert_allclose(got[2], a * 5.0 + b, rtol=1e-6)
        assert name
    assert tag_objects() == []


def test_a_killed_ipu_process_and_a_reset_leave_the_shared_copy_intact(simple, writing):
    _, w = simple
    cfg = model_runtime.ModelRunnerConfig(replication_factor=2, auto_reset=True)
    with model_runtime.ModelRunner(writing, config=cfg) as r:
        x = _ab(40)
        a, b = x["tensor_A"], x["tensor_B"]
        first = r.execute(x, replica_id=0)["tensor_C"]
        np.testing.assert_allclose(r.execute(x, replica_id=1)["tensor_C"], first, rtol=1e-6)
        (name,) = tag_objects("cst")
        (old,) = r.device_pids(0)
        kill_and_wait(old)
        # replica 1 goes on with its own copy; replica 0 is reset and loads the weights
        # again from the shared value, not from what it had written
        np.testing.assert_allclose(r.execute(x, replica_id=1)["tensor_C"], a * first + b,
                                   rtol=1e-5)
        np.testing.assert_allclose(r.execute(x, replica_id=0)["tensor_C"], first, rtol=1e-6)
        assert r.device_pids(0) != [old]
        assert tag_objects("cst") == [name]
        np.testing.assert_array_equal(_read(name), w)
    assert tag_objects() == []


def test_a_dropped_runner_leaves_nothing_in_dev_shm(simple):
    path, w = simple
    cfg = model_runtime.ModelRunnerConfig(replication_factor=2)
    gc.disable()
    try:
        r = model_runtime.ModelRunner(path, config=cfg)
        x = _ab(50)
        np.testing.assert_allclose(r.execute(x, replica_id=1)["tensor_C"],
                                   x["tensor_A"] * w + x["tensor_B"], rtol=1e-6)
        assert len(tag_objects("cst")) == 1
        del r   # reference counting alone
        assert tag_objects() == []
    finally:
        gc.enable()


def _cst_values_raw(name: str, handles: dict[str, int]) -> dict[str, bytes]:
    """The values a constants region holds (handles sorted, each 64-byte aligned)."""
    out, at = {}, 0
    with open("/dev/shm/" + name, "rb") as f:
        data = f.read()
    for h in sorted(handles):
        out[h] = data[at:at + handles[h]]
        at += -(-handles[h] // 64) * 64
    return out


def _cst_values(name: str, handles: dict[str, int]) -> dict[str, np.ndarray]:
    """The float32 [SHAPE] values a constants region holds (see _cst_values_raw)."""
    return {h: np.frombuffer(v, np.float32).reshape(SHAPE)
            for h, v in _cst_values_raw(name, handles).items()}


def _holds_b_and_weights(name: str, b: np.ndarray, w: np.ndarray) -> None:
    """Constants region ``name`` holds exactly ``tensor_B`` = ``b`` and the weights ``w``."""
    values = _cst_values(name, {"tensor_B": NBYTES, "weights": NBYTES})
    np.testing.assert_array_equal(values["tensor_B"], b)
    np.testing.assert_array_equal(values["weights"], w)


@pytest.mark.parametrize("batching", [False, True])
def test_a_frozen_input_of_main_is_shared_not_sent_with_each_request(simple, batching):
    path, w = simple
    at = load_parts(path)[1].tensors["tensor_B"].offset
    frozen = np.random.default_rng(60).standard_normal(SHAPE).astype(np.float32)
    cfg = model_runtime.ModelRunnerConfig(replication_factor=2)
    cfg.frozen_inputs = model_runtime.InputMemoryView()
    cfg.frozen_inputs["tensor_B"] = frozen
    if batching:
        cfg.batching_dim = 0
        cfg.timeout_ns = 1_000_000      # a partial batch goes after 1 ms
    with model_runtime.ModelRunner(path, config=cfg) as r:
        assert [d.name for d in r.getExecuteInputs()] == ["tensor_A"]
        for rid in (0, 1):
            a = _ab(61 + rid)["tensor_A"]
            rows = 5 if batching else SHAPE[0]    # a partial batch: padded, frozen kept
            np.testing.assert_allclose(
                r.execute({"tensor_A": a[:rows]}, replica_id=rid)["tensor_C"],
                (a * w + frozen)[:rows], rtol=1e-6)
        (name,) = tag_objects("cst")
        _holds_b_and_weights(name, frozen, w)
        for rid in (0, 1):
            (pid,) = r.device_pids(rid)
            _mapped_shared(pid, name, 2 * NBYTES)
        for mem in tag_objects("mem"):
            with open("/dev/shm/" + mem, "rb") as f:
                f.seek(at)
                assert f.read(NBYTES) == bytes(NBYTES)
    assert tag_objects() == []


def test_with_every_main_input_frozen_they_go_with_each_request(simple):
    """A Main that would stream nothing in would not wait for requests: then the frozen
    inputs of Main travel with each request as before (the weights are still shared)."""
    path, w = simple
    a = np.full(SHAPE, 2.0, np.float32)
    b = np.full(SHAPE, -1.0, np.float32)
    cfg = model_runtime.ModelRunnerConfig()
    cfg.frozen_inputs = model_runtime.InputMemoryView()
    cfg.frozen_inputs["tensor_A"] = a
    cfg.frozen_inputs["tensor_B"] = b
    with model_runtime.ModelRunner(path, config=cfg) as r:
        for _ in range(2):
            np.testing.assert_allclose(r.execute({})["tensor_C"], a * w + b, rtol=1e-6)
        (name,) = tag_objects("cst")
        np.testing.assert_array_equal(_read(name), w)
        assert os.stat("/dev/shm/" + name).st_size < 2 * NBYTES
    assert tag_objects() == []


def test_a_session_back_on_a_device_after_another_reads_its_inputs_as_they_are_now(simple):
    """The device keeps a session's executable while another session runs; a callback set
    on the weights meanwhile is read when the session comes back (its Load runs again),
    not the shared value the device's copy was built with."""
    from host_runtime.devices._manager import DeviceManager
    from tests._helpers import PATIENT

    path, w = simple
    x = _ab(70)
    a, b = x["tensor_A"], x["tensor_B"]

    def session(dev: object, got: list[np.ndarray]) -> Session:
        s = Session(path)
        s.bindToDevice(dev)   # type: ignore[arg-type]
        _callbacks(s, x, got)
        return s

    first: list[np.ndarray] = []
    other: list[np.ndarray] = []
    with DeviceManager().getDevice(1, wait_config=PATIENT) as dev:
        s1 = session(dev, first)
        s2 = session(dev, other)
        try:
            s1.runMainPrograms()
            s2.runMainPrograms()         # s1's executable stays cached on the device
            s1.setCallbackForAnchor("weights", _feed(5.0))
            s1.runMainPrograms()
        finally:
            s1.close()
            s2.close()
    np.testing.assert_allclose(first[0], a * w + b, rtol=1e-6)
    np.testing.assert_allclose(other[0], a * w + b, rtol=1e-6)
    np.testing.assert_allclose(first[1], a * 5.0 + b, rtol=1e-6)
    assert tag_objects() == []


def test_an_injected_error_and_its_reset_bring_back_the_shared_values(simple, writing):
    """docs/faults.md: an application error on the third run, auto_reset: the replica's
    written weights go back to the PopEF value, the frozen input of Main stays, and the
    shared region is as it was."""
    from host_runtime.errors import ApplicationRuntimeError
    from ipu_emulator import faults

    _, w = simple
    frozen = np.full(SHAPE, 0.5, np.float32)
    cfg = model_runtime.ModelRunnerConfig(auto_reset=True)
    cfg.frozen_inputs = model_runtime.InputMemoryView()
    cfg.frozen_inputs["tensor_B"] = frozen
    a = _ab(80)["tensor_A"]
    with faults.inject(kind="application_error", after=2) as plan:
        r = model_runtime.ModelRunner(writing, config=cfg)
    try:
        c1 = r.execute({"tensor_A": a})["tensor_C"]
        np.testing.assert_allclose(c1, a * w + frozen, rtol=1e-6)
        c2 = r.execute({"tensor_A": a})["tensor_C"]
        np.testing.assert_allclose(c2, a * c1 + frozen, rtol=1e-5)
        with pytest.raises(ApplicationRuntimeError):
            r.execute({"tensor_A": a})
        np.testing.assert_allclose(r.execute({"tensor_A": a})["tensor_C"], c1, rtol=1e-6)
        (name,) = tag_objects("cst")
        _holds_b_and_weights(name, frozen, w)
    finally:
        r.close()
        plan.close()
    assert tag_objects() == []


# -- models over several IPUs: each IPU process of each replica maps the one region ------------

LAYERS, WIDTH, ROWS = 4, 64, 2          # 4 weights of 16 KiB, 2 on each of 2 IPUs


def _compile_chain(tmp: str, model: object, pipelined: bool, tensor_data: bool) -> str:
    import onnx

    from tools import poprt
    from tools._chain_model import write_shard_yaml

    onnx.save(model, os.path.join(tmp, "m.onnx"))
    argv = ["--input_model", os.path.join(tmp, "m.onnx"), "--num_ipus", "2",
            "--manual_sharding_config", write_shard_yaml(os.path.join(tmp, "s.yaml"), LAYERS, 2,
                                                         pipelined),
            "--batches_per_step", "2" if pipelined else "1", "--export_popef",
            "--output_dir", os.path.join(tmp, "out")]
    argv += ["--enable_pipelining"] * pipelined + ["--weights_as_tensor_data"] * tensor_data
    assert poprt.main(argv) == 0
    return os.path.join(tmp, "out", "executable.popef")


def _with_b(before: int) -> object:
    """The chain with a second input ``b`` added to the input of layer ``before``."""
    from onnx import TensorProto, helper

    from tools._chain_model import chain_model

    m = chain_model(LAYERS, width=WIDTH, batch=ROWS, seed=3)
    nodes = list(m.graph.node)
    at = next(k for k, n in enumerate(nodes) if n.name == f"mm{before}")
    src = nodes[at].input[0]
    nodes[at].input[0] = "xb"
    nodes.insert(at, helper.make_node("Add", [src, "b"], ["xb"], name="add_b"))
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    m.graph.input.append(helper.make_tensor_value_info("b", TensorProto.FLOAT, [ROWS, WIDTH]))
    return m


@pytest.fixture(scope="module")
def chains(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[str, object]]:
    """Models over 2 IPUs: the chain with its weights as PopEF tensor data, sharded and
    pipelined; the chain with a second input on the first IPU (pipelined) or the second
    (sharded)."""
    from tools._chain_model import chain_model

    chain = chain_model(LAYERS, width=WIDTH, batch=ROWS, seed=3)
    out: dict[str, tuple[str, object]] = {}
    for name, model, pipelined, td in [("sharded", chain, False, True),
                                      ("pipelined", chain, True, True),
                                      ("b-on-ipu1-sharded", _with_b(2), False, False),
                                      ("b-on-ipu0-pipelined", _with_b(0), True, False)]:
        out[name] = (_compile_chain(str(tmp_path_factory.mktemp("cst")), model, pipelined, td),
                     model)
    return out


def _ort(model: object, **feeds: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(),  # type: ignore[attr-defined]
                                providers=["CPUExecutionProvider"])
    return np.asarray(sess.run(None, feeds)[0])


def _chain_weights(model: object) -> dict[str, bytes]:
    from onnx import numpy_helper

    return {i.name: numpy_helper.to_array(i).tobytes()
            for i in model.graph.initializer}  # type: ignore[attr-defined]


def _rows(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((ROWS, WIDTH)).astype(np.float32)


def _mems_hold(values: list[bytes]) -> list[bool]:
    """For each device-memory region of this test: whether it holds any of ``values``."""
    out = []
    for mem in tag_objects("mem"):
        with open("/dev/shm/" + mem, "rb") as f:
            data = f.read()
        out.append(any(v in data for v in values))
    return out


@pytest.mark.parametrize("kind", ["sharded", "pipelined"])
def test_each_ipu_of_each_replica_of_a_model_over_two_ipus_maps_the_one_copy(chains, kind):
    path, model = chains[kind]
    weights = _chain_weights(model)
    cfg = model_runtime.ModelRunnerConfig(replication_factor=2)
    with model_runtime.ModelRunner(path, config=cfg) as r:
        for rid in (0, 1):
            xs = [_rows(10 * rid + k) for k in range(3)]
            futs = [r.executeAsync({"x": x}, replica_id=rid) for x in xs]
            for x, f in zip(xs, futs):
                np.testing.assert_allclose(f.result(timeout=60)["y"], _ort(model, x=x),
                                           rtol=1e-5, atol=1e-5)
        (name,) = tag_objects("cst")       # one region for both replicas' 4 IPU processes
        values = _cst_values_raw(name, {h: len(v) for h, v in weights.items()})
        assert values == weights
        pids = [pid for rid in (0, 1) for pid in r.device_pids(rid)]
        assert len(set(pids)) == 4
        for pid in pids:   # each maps it read-only and its pages are shared, none its own
            _mapped_shared(pid, name, 2 * len(weights["w0"]))
        mems = _mems_hold(list(weights.values()))
        assert len(mems) >= 4 and not any(mems)   # no IPU's own memory holds a weight
    assert tag_objects() == []


@pytest.mark.parametrize("how", ["frozen", "tensor-data"])
@pytest.mark.parametrize("kind", ["b-on-ipu1-sharded", "b-on-ipu0-pipelined"])
def test_a_constant_input_of_main_on_one_ipu_of_two_is_shared(chains, kind, how):
    """``b`` frozen, or PopEF tensor data: the IPU that reads it still waits for each
    request (it streams ``x`` in itself, or the activations of the IPU that does)."""
    path, model = chains[kind]
    b = _rows(99)
    cfg = model_runtime.ModelRunnerConfig()
    source: object = path
    if how == "frozen":
        cfg.frozen_inputs = model_runtime.InputMemoryView()
        cfg.frozen_inputs["b"] = b
    else:
        pm = popef.load_model([path])
        source = dataclasses.replace(pm, tensors=[*pm.tensors,
                                                  popef.TensorData("b", b.tobytes())])
    with model_runtime.ModelRunner(source, config=cfg) as r:  # type: ignore[arg-type]
        assert [d.name for d in r.getExecuteInputs()] == ["x"]
        xs = [_rows(k) for k in range(4)]
        futs = [r.executeAsync({"x": x}) for x in xs]
        for x, f in zip(xs, futs):
            np.testing.assert_allclose(f.result(timeout=60)["y"], _ort(model, x=x, b=b),
                                       rtol=1e-5, atol=1e-5)
        (name,) = tag_objects("cst")
        assert _cst_values_raw(name, {"b": b.nbytes}) == {"b": b.tobytes()}
        reader = 1 if kind.startswith("b-on-ipu1") else 0
        pids = r.device_pids(0)
        assert shm_mapping(pids[reader], name)["perms"] == "r--s"
        assert shm_mapping(pids[1 - reader], name) == {}   # the other IPU's part never reads it
        mems = _mems_hold([b.tobytes()])
        assert len(mems) >= 2 and not any(mems)
    assert tag_objects() == []


def test_a_frozen_input_on_an_ipu_that_would_not_wait_for_requests_goes_with_each_one(chains):
    """Frozen ``x`` (or ``x`` as PopEF tensor data) of the model whose second IPU reads
    ``b``: the first IPU would read only ``x`` and so run ahead of the requests; ``x``
    goes through the ring with each request instead."""
    from host_runtime.devices import paced_by_requests

    path, model = chains["b-on-ipu1-sharded"]
    pm = popef.load_model([path])
    main, exe = pm.metadata.programFlow().main(), pm.executable.payload()
    assert paced_by_requests(exe, main, ["b"], ["x"])
    assert not paced_by_requests(exe, main, ["x"], ["b"])
    x = _rows(7)
    cfg = model_runtime.ModelRunnerConfig()
    cfg.frozen_inputs = model_runtime.InputMemoryView()
    cfg.frozen_inputs["x"] = x
    with_data = dataclasses.replace(pm, tensors=[*pm.tensors,
                                                 popef.TensorData("x", x.tobytes())])
    for source, c in [(path, cfg), (with_data, model_runtime.ModelRunnerConfig())]:
        with model_runtime.ModelRunner(source, config=c) as r:  # type: ignore[arg-type]
            for k in range(2):
                b = _rows(20 + k)
                np.testing.assert_allclose(r.execute({"b": b})["y"], _ort(model, x=x, b=b),
                                           rtol=1e-5, atol=1e-5)
            assert tag_objects("cst") == []
        assert tag_objects() == []


def test_a_killed_ipu_process_of_one_part_leaves_the_shared_copy_intact(chains):
    path, model = chains["pipelined"]
    weights = _chain_weights(model)
    cfg = model_runtime.ModelRunnerConfig(replication_factor=2, auto_reset=True)
    gc.disable()
    r = model_runtime.ModelRunner(path, config=cfg)
    try:
        x = _rows(30)
        want = _ort(model, x=x)
        for rid in (0, 1):
            np.testing.assert_allclose(r.execute({"x": x}, replica_id=rid)["y"], want,
                                       rtol=1e-5, atol=1e-5)
        (name,) = tag_objects("cst")
        old = r.device_pids(0)
        kill_and_wait(old[1])    # the second IPU of replica 0
        np.testing.assert_allclose(r.execute({"x": x}, replica_id=1)["y"], want,
                                   rtol=1e-5, atol=1e-5)
        # replica 0 is reset: its new IPU processes map the same region again
        np.testing.assert_allclose(r.execute({"x": x}, replica_id=0)["y"], want,
                                   rtol=1e-5, atol=1e-5)
        new = r.device_pids(0)
        assert not set(new) & set(old)
        assert tag_objects("cst") == [name]
        assert _cst_values_raw(name, {h: len(v) for h, v in weights.items()}) == weights
        for pid in new:
            assert shm_mapping(pid, name)["perms"] == "r--s"
    except BaseException:
        r.close()
        gc.enable()
        raise
    del r   # reference counting alone
    gc.enable()
    assert tag_objects() == []


def test_a_constant_inputs_ring_is_not_counted_in_dev_shm_until_it_carries_values(
        simple, monkeypatch):
    """The weights' ring (fed from the constants region) is left out of the room asked
    of /dev/shm; once a callback feeds them, the next Load run asks for it."""
    import host_runtime.session._rings as streams

    asked: list[list[str]] = []
    real = streams.check_room

    def spy(what: str, items: list[tuple[str, int]]) -> None:
        asked.append([n for n, _ in items])
        real(what, items)
    monkeypatch.setattr(streams, "check_room", spy)
    path, w = simple
    x = _ab(90)
    got: list[np.ndarray] = []
    with Session(path) as s:
        _callbacks(s, x, got)
        s.runLoadPrograms()
        s.runMainPrograms()
        assert len(asked) == 1
        assert any("'tensor_A'" in n for n in asked[0])
        assert not any("'weights'" in n for n in asked[0])
        s.setCallbackForAnchor("weights", _feed(3.0))
        s.runLoadPrograms()
        s.runMainPrograms()
        assert len(asked) == 2 and [n for n in asked[1] if "anchor" in n] == [
            "ring of anchor 'weights'"]
    np.testing.assert_allclose(got[0], x["tensor_A"] * w + x["tensor_B"], rtol=1e-6)
    np.testing.assert_allclose(got[1], x["tensor_A"] * 3.0 + x["tensor_B"], rtol=1e-6)
    assert tag_objects() == []


def test_popef_tensor_data_of_a_main_input_is_shared_not_sent_with_each_iteration(simple):
    """``tensor_B`` given as PopEF tensor data: read by Main, from the constants region
    (not through each replica's ring); its ring is never written."""
    path, w = simple
    b = np.random.default_rng(95).standard_normal(SHAPE).astype(np.float32)
    model = popef.load_model([path])
    model = dataclasses.replace(model, tensors=[*model.tensors,
                                                popef.TensorData("tensor_B", b.tobytes())])
    cfg = model_runtime.ModelRunnerConfig(replication_factor=2)
    with model_runtime.ModelRunner(model, config=cfg) as r:
        assert [d.name for d in r.getExecuteInputs()] == ["tensor_A"]
        for rid in (0, 1):
            for k in range(2):
                a = _ab(96 + k)["tensor_A"]
                np.testing.assert_allclose(r.execute({"tensor_A": a}, replica_id=rid)[
                    "tensor_C"], a * w + b, rtol=1e-6)
        (name,) = tag_objects("cst")
        _holds_b_and_weights(name, b, w)
        for rid in (0, 1):
            (pid,) = r.device_pids(rid)
            _mapped_shared(pid, name, 2 * NBYTES, private_too=False)
        # only tensor_A's rings carry values; tensor_B's are never written (no page of
        # their slots in /dev/shm)
        full = [n for n in tag_objects("in") if os.stat("/dev/shm/" + n).st_blocks * 512
                >= NBYTES]
        assert len(full) == 2, full
    assert tag_objects() == []


def test_popef_tensor_data_of_every_main_input_goes_through_the_rings(simple):
    """Every input of Main PopEF tensor data: fed through the rings as before (a Main
    reading only constants would not wait for requests)."""
    path, w = simple
    a = np.full(SHAPE, 3.0, np.float32)
    b = np.full(SHAPE, 0.25, np.float32)
    model = popef.load_model([path])
    model = dataclasses.replace(model, tensors=[
        *model.tensors, popef.TensorData("tensor_A", a.tobytes()),
        popef.TensorData("tensor_B", b.tobytes())])
    with model_runtime.ModelRunner(model) as r:
        for _ in range(2):
            np.testing.assert_allclose(r.execute({})["tensor_C"], a * w + b, rtol=1e-6)
        (name,) = tag_objects("cst")
        assert os.stat("/dev/shm/" + name).st_size < 2 * NBYTES   # the weights alone
    assert tag_objects() == []


def test_a_callback_set_on_main_tensor_data_takes_effect_at_the_next_run(simple):
    path, w = simple
    x = _ab(97)
    a, b = x["tensor_A"], x["tensor_B"]
    model = popef.load_model([path])
    model = dataclasses.replace(model, tensors=[*model.tensors,
                                                popef.TensorData("tensor_B", b.tobytes())])
    got: list[np.ndarray] = []
    with Session(model) as s:
        _callbacks(s, {"tensor_A": a}, got)
        s.runMainPrograms()
        assert len(tag_objects("cst")) == 1
        s.setCallbackForAnchor("tensor_B", _feed(-2.0))
        s.runMainPrograms()
        s.setCallbackForAnchor("tensor_B", None)    # the PopEF data again
        s.runMainPrograms()
    np.testing.assert_allclose(got[0], a * w + b, rtol=1e-6)
    np.testing.assert_allclose(got[1], a * w - 2.0, rtol=1e-6)
    np.testing.assert_allclose(got[2], a * w + b, rtol=1e-6)
    assert tag_objects() == []
