"""Sharded and pipelined models over real IPU processes (host_runtime.devices._ipu_group).

A chain of named MatMul/Relu nodes is compiled with the ``poprt`` command line over 2
and 4 IPUs, with and without pipelining, run through ModelRunner (and a Session with
callbacks) and compared with onnxruntime in this process. Each IPU of the device runs
its part in its own process, and the tensors crossing IPUs go through the link rings
that only those two IPU processes map.
"""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest

import host_runtime as model_runtime
from host_runtime import popef
from host_runtime.devices._manager import DeviceManager
from host_runtime.errors import BadRequestError
from host_runtime.session._session import Session
from tests._helpers import PATIENT
from tools import poprt
from tools._chain_model import chain_model, reference, write_shard_yaml

LAYERS = 8
WIDTH = 32
BATCH = 2

pytestmark = pytest.mark.usefixtures("private_machine")


@pytest.fixture(scope="module")
def chain():
    return chain_model(LAYERS, width=WIDTH, batch=BATCH, seed=7)


def compile_cli(tmp: str, chain, ipus: int, pipelined: bool, bps: int) -> str:
    """The command line of the issue: poprt --num_ipus N --manual_sharding_config ..."""
    model = os.path.join(tmp, "chain.onnx")
    onnx.save(chain, model)
    shard = write_shard_yaml(os.path.join(tmp, "shard.yaml"), LAYERS, ipus, pipelined)
    out = os.path.join(tmp, "out")
    argv = ["--input_model", model, "--num_ipus", str(ipus), "--manual_sharding_config", shard,
            "--batches_per_step", str(bps), "--export_popef", "--output_dir", out]
    if pipelined:
        argv.append("--enable_pipelining")
    assert poprt.main(argv) == 0
    return os.path.join(out, "executable.popef")


def inputs(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((BATCH, WIDTH)).astype(np.float32) for _ in range(n)]


def mapped_links(pid: int) -> set[str]:
    with open(f"/proc/{pid}/maps") as f:
        return {os.path.basename(line.split()[-1]) for line in f
                if "_link" in line and "/dev/shm/" in line}


@pytest.mark.parametrize("ipus,pipelined,bps", [(2, False, 1), (2, True, 2), (4, False, 1),
                                                (4, True, 4)],
                         ids=["2ipu-sharded", "2ipu-pipelined", "4ipu-sharded", "4ipu-pipelined"])
def test_model_runner_matches_onnxruntime(tmp_path, chain, ipus, pipelined, bps):
    path = compile_cli(str(tmp_path), chain, ipus, pipelined, bps)
    xs = inputs(4 * ipus, seed=ipus + 10 * pipelined)
    with model_runtime.ModelRunner(path) as r:
        futs = [r.executeAsync({"x": x}) for x in xs]       # several requests in flight
        outs = [f.result(timeout=120)["y"] for f in futs]
        for x, y in zip(xs, outs):
            np.testing.assert_allclose(y, reference(chain, x), rtol=1e-5, atol=1e-5)
        out = r.execute({"x": xs[0]})["y"]                  # and one at a time
        np.testing.assert_allclose(out, reference(chain, xs[0]), rtol=1e-5, atol=1e-5)

        # one IPU process per IPU, each running its part: the device has N processes
        dev = r._replicas[0].session.device()
        assert dev.numIpus() == ipus and len(set(dev.pids())) == ipus
        assert dev.link.width == ipus
        # the activations cross between neighbouring IPU processes: IPU k maps exactly
        # the links to and from its neighbours (plus the sync token without pipelining)
        links = [mapped_links(pid) for pid in dev.pids()]
        assert all(links[k] for k in range(ipus))
        for k in range(1, ipus - 1):
            assert links[k] & links[k - 1] and links[k] & links[k + 1]
        if ipus > 2:
            assert not (links[0] & links[2]) or not pipelined


def test_session_callbacks_on_a_sharded_model(tmp_path, chain):
    path = compile_cli(str(tmp_path), chain, 2, False, 1)
    x = inputs(1, seed=3)[0]
    got: list[np.ndarray] = []
    with Session(path) as s:
        s.setCallbackForAnchor("x", lambda v: v.cast("B").__setitem__(slice(None), x.tobytes()))
        s.setCallbackForAnchor("y", lambda v: got.append(
            np.frombuffer(v, np.float32).reshape(BATCH, WIDTH).copy()))
        s.runMainPrograms()
        s.runMainPrograms()
        assert len(s.device().pids()) == 2
    assert len(got) == 2
    for y in got:
        np.testing.assert_allclose(y, reference(chain, x), rtol=1e-5, atol=1e-5)


def test_replication_needs_replicas_times_ipus(tmp_path, chain):
    path = compile_cli(str(tmp_path), chain, 2, True, 2)
    cfg = model_runtime.ModelRunnerConfig()
    cfg.replication_factor = 2
    xs = inputs(8, seed=5)
    with model_runtime.ModelRunner(path, config=cfg) as r:
        pids = [p for rep in r._replicas for p in rep.session.device().pids()]
        assert len(set(pids)) == 4                        # 2 replicas x 2 IPUs
        futs = [r.executeAsync({"x": x}, replica_id=k % 2) for k, x in enumerate(xs)]
        for x, f in zip(xs, futs):
            np.testing.assert_allclose(f.result(timeout=120)["y"], reference(chain, x),
                                       rtol=1e-5, atol=1e-5)


def test_sharded_model_refused_on_a_one_ipu_device(tmp_path, chain):
    path = compile_cli(str(tmp_path), chain, 2, False, 1)
    dm = DeviceManager()
    with dm.getDevice(1, wait_config=PATIENT) as dev, Session(path) as s:
        with pytest.raises(BadRequestError, match=r"sharded over 2 IPUs, but device \d .*has 1; "
                                                  r"attach a device of 2 IPUs"):
            s.bindToDevice(dev)


def test_pipelined_model_over_the_daemon(tmp_path, chain, daemon, monkeypatch):
    from ipu_emulator.daemon import socket_protocol as wire

    path = compile_cli(str(tmp_path), chain, 2, True, 2)
    monkeypatch.setenv(wire.ENV_VAR, daemon.socket)
    xs = inputs(6, seed=9)
    with model_runtime.ModelRunner(path) as r:
        assert sorted(r._replicas[0].session.device().pids()) == sorted(daemon.pool_pids)
        futs = [r.executeAsync({"x": x}) for x in xs]
        for x, f in zip(xs, futs):
            np.testing.assert_allclose(f.result(timeout=120)["y"], reference(chain, x),
                                       rtol=1e-5, atol=1e-5)


def gather_chain() -> onnx.ModelProto:
    """x -> Relu (IPU 0) -> Gather(., idx) (IPU 1): a bad index fails IPU 1's part."""
    from onnx import TensorProto, helper

    g = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"], name="relu"),
         helper.make_node("Gather", ["r", "idx"], ["y"], name="gather", axis=0)], "gather",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3]),
         helper.make_tensor_value_info("idx", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    return m


def test_a_failing_part_fails_the_run_and_the_device_stays_usable(tmp_path):
    from host_runtime.errors import DeviceExecutionError
    from host_runtime.poprt.compiler import compile as poprt_compile

    out = poprt_compile(gather_chain(), tmp_path, num_ipus=2,
                        sharding_info={"relu": 0, "gather": 1})
    x = np.arange(12, dtype=np.float32).reshape(4, 3) - 5
    idx = np.array([2, 0], np.int64)
    got: list[np.ndarray] = []
    with Session(str(out.popef_path)) as s:
        s.setCallbackForAnchor("x", lambda v: v.cast("B").__setitem__(slice(None), x.tobytes()))
        s.setCallbackForAnchor("idx", lambda v: v.cast("B").__setitem__(slice(None),
                                                                       idx.tobytes()))
        s.setCallbackForAnchor("y", lambda v: got.append(
            np.frombuffer(v, np.float32).reshape(2, 3).copy()))
        s.runMainPrograms()
        np.testing.assert_array_equal(got[-1], np.maximum(x, 0)[[2, 0]])
        idx = np.array([9, 0], np.int64)                    # out of range on IPU 1
        with pytest.raises(DeviceExecutionError, match="program 1 failed"):
            s.runMainPrograms()
        idx = np.array([3, 1], np.int64)
        s.runMainPrograms()                                 # IPU 0 was stopped, links reset
        assert len(got) == 2                                # the failed run gave no output
        np.testing.assert_array_equal(got[-1], np.maximum(x, 0)[[3, 1]])
        s.stop()
        s.reload()
        s.runMainPrograms()
        assert len(got) == 3
        np.testing.assert_array_equal(got[-1], np.maximum(x, 0)[[3, 1]])


def test_poprt_runner_and_dynamic_batching_on_a_pipelined_model(tmp_path, chain):
    from host_runtime.poprt import Runner, RuntimeConfig

    path = compile_cli(str(tmp_path), chain, 2, True, 2)
    x = inputs(1, seed=21)[0]
    with Runner(path, RuntimeConfig()) as runner:
        y = np.zeros((BATCH, WIDTH), np.float32)
        runner.execute({"x": x}, {"y": y})
        np.testing.assert_allclose(y, reference(chain, x), rtol=1e-5, atol=1e-5)
    cfg = model_runtime.ModelRunnerConfig()
    cfg.batching_dim = 0
    cfg.timeout_ns = 0
    rows = np.random.default_rng(4).standard_normal((5, WIDTH)).astype(np.float32)
    with model_runtime.ModelRunner(path, config=cfg) as r:
        futs = [r.executeAsync({"x": rows[k:k + 1]}) for k in range(4)]   # 1-row requests
        got = np.concatenate([f.result(timeout=120)["y"] for f in futs])
    want = np.concatenate([reference(chain, rows[k:k + 2]) for k in (0, 2)])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pipelined", [False, True], ids=["sharded", "pipelined"])
def test_empty_shared_inputs_and_outputs(tmp_path, pipelined):
    """An input in host shared memory goes to IPU 0; the output's redirection it carries
    names a tensor IPU 1 writes: IPU 0 drops it, the result still lands in the array."""
    from host_runtime.memory._shared import SHARED_MIN_BYTES

    big = chain_model(LAYERS, width=64, batch=16, seed=3)       # 4 KiB tensors
    assert 64 * 16 * 4 >= SHARED_MIN_BYTES
    path = compile_cli(str(tmp_path), big, 2, pipelined, 2 if pipelined else 1)
    rng = np.random.default_rng(8)
    xs = [model_runtime.empty_shared((16, 64), np.float32) for _ in range(4)]
    ys = [model_runtime.empty_shared((16, 64), np.float32) for _ in range(4)]
    for x in xs:
        x[...] = rng.standard_normal((16, 64))
    with model_runtime.ModelRunner(path) as r:
        for _ in range(2):
            futs = [r.executeAsync({"x": x}, {"y": y}) for x, y in zip(xs, ys)]
            for f in futs:
                f.result(timeout=120)
            for x, y in zip(xs, ys):
                np.testing.assert_allclose(y, reference(big, np.asarray(x)), rtol=1e-5,
                                           atol=1e-5)
                y[...] = 0


@pytest.fixture(scope="module")
def daemon4(tmp_path_factory):
    from tests.daemon_rig import DaemonRig

    rig = DaemonRig(tmp_path_factory.mktemp("daemon4"), num_ipus=4)
    try:
        yield rig
    finally:
        rig.stop()


def test_daemon_status_groups_the_ipus_of_a_sharded_device(tmp_path, chain, daemon4,
                                                           monkeypatch):
    """A host holding a 2-IPU device of a 4-IPU daemon: status (raw and printed) shows that
    device, its id, its two IPUs and the holder, as well as the IPUs one by one."""
    import json
    import subprocess
    import sys

    from ipu_emulator.daemon import socket_protocol as wire
    from tests.daemon_rig import REPO

    path = compile_cli(str(tmp_path), chain, 2, False, 1)
    monkeypatch.setenv(wire.ENV_VAR, daemon4.socket)
    xs = inputs(3, seed=17)
    status_cmd = [sys.executable, "-m", "tools.cli", "daemon", "status", "--socket",
                  daemon4.socket]
    with model_runtime.ModelRunner(path) as r:
        for x in xs:
            np.testing.assert_allclose(r.execute({"x": x})["y"], reference(chain, x),
                                       rtol=1e-5, atol=1e-5)
        dev = r._replicas[0].session.device()
        ipus = dev.ipus()
        assert len(ipus) == 2 and dev.id >= 4      # a multi-IPU device id of the seeds
        raw = subprocess.run(status_cmd + ["--json"], cwd=REPO, capture_output=True,
                             text=True, timeout=120)
        assert raw.returncode == 0, raw.stderr
        st = json.loads(raw.stdout)
        assert st["devices"] == [{"device_id": dev.id, "ipus": ipus, "holder": os.getpid(),
                                  "states": ["held"]}]
        for ipu in st["ipus"]:
            held = ipu["ipu"] in ipus
            assert (ipu["state"], ipu["holder"], ipu["device"]) == (
                ("held", os.getpid(), dev.id) if held else ("free", None, None))
        text = subprocess.run(status_cmd, cwd=REPO, capture_output=True, text=True,
                              timeout=120)
        assert text.returncode == 0, text.stderr
        lines = text.stdout.splitlines()
        assert lines[0].startswith(f"daemon pid {daemon4.proc.pid} at {daemon4.socket}: 4 x ")
        assert (f"device {dev.id}: 2 ipus [{ipus[0]},{ipus[1]}] held by pid {os.getpid()} "
                f"(held)") in lines
        for k in ipus:
            line = next(ln for ln in lines if ln.startswith(f"ipu {k} "))
            assert line.split()[2] == "held" and line.endswith(f"device {dev.id}")
    st = daemon4.status()
    assert st["devices"] == [] and {i["state"] for i in st["ipus"]} == {"free"}


def test_a_sharding_file_alone_says_how_many_ipus(tmp_path, chain):
    """PopRT's command line has no --num_ipus: ``poprt --input_model m.onnx
    --manual_sharding_config shard.yaml`` takes the IPUs the file names (3 shards: 4 IPUs,
    the last idle), and the executable runs right."""
    import yaml

    model = str(tmp_path / "chain.onnx")
    onnx.save(chain, model)
    shard = tmp_path / "shard.yaml"
    shard.write_text(yaml.safe_dump([{"node": "relu0", "device": 0},
                                     {"node": "relu1", "device": 1},
                                     {"node": f"relu{LAYERS - 1}", "device": 2}]))
    out = tmp_path / "out"
    assert poprt.main(["--input_model", model, "--manual_sharding_config", str(shard),
                       "--export_popef", "--output_dir", str(out)]) == 0
    path = str(out / "executable.popef")
    assert popef.load_model([path]).metadata.numIpus() == 4
    xs = inputs(3, seed=3)
    with model_runtime.ModelRunner(path) as r:
        for x in xs:
            np.testing.assert_allclose(r.execute({"x": x})["y"], reference(chain, x),
                                       rtol=1e-5, atol=1e-5)
