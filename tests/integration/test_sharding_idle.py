"""A model compiled for 4 IPUs whose nodes occupy 3 of them (PopRT's manual sharding
example: 3 shards, ``num_ipus = 4``) over real IPU processes.

The conv chain of ``tools._chain_model`` is cut at three points (IPUs 0, 1, 2), sharded
and pipelined, through ``host_runtime.poprt.compile``, the ``poprt`` command line (PopRT's
list form of shard.yaml) and PopRT's API (Sharder, CompilerOptions, Compiler.compile,
poprt.runtime.Runner). The device holds 4 IPUs (4 IPU processes, as the hardware holds
the IPUs it attaches); IPU 3 is loaded with nothing and runs nothing (it maps no link
and no region of the session); the answers equal onnxruntime's; nothing is left in
/dev/shm. A session unbound from the device is dropped by every IPU, the idle one
included; ``num_ipus`` without sharding runs on the device's first IPU. Killing the idle
IPU's process still loses the whole device (tests/faults/test_sharding_faults.py).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import host_runtime as model_runtime
from host_runtime import poprt as poprt_api
from host_runtime.poprt.compiler import Compiler, CompilerOptions
from host_runtime.poprt.compiler import compile as poprt_compile
from shm import naming
from shm.cleanup import list_objects
from tools import popef_dump, poprt
from tools._chain_model import conv_chain, reference

pytestmark = pytest.mark.usefixtures("private_machine")

POINTS = {"relu1": 0, "relu3": 1, "fc": 2}   # 3 shards; IPU 3 holds no node
SHAPE = (1, 3, 8, 8)


@pytest.fixture(scope="module")
def model():
    return conv_chain(blocks=6)


def xs(n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(SHAPE).astype(np.float32) for _ in range(n)]


def ours() -> set[str]:
    return {o.entry for o in list_objects(naming.current_tag())}


def mapped(pid: int) -> set[str]:
    """The sessions' shared memory (links, device memory, executables) an IPU process maps."""
    with open(f"/proc/{pid}/maps") as f:
        names = {line.split("/dev/shm/", 1)[1].split()[0] for line in f if "/dev/shm/" in line}
    return {n for n in names if n.rsplit("_", 1)[-1] in ("link", "mem", "exe")}


def check_device(runner) -> None:
    """4 IPUs held, one process each; IPUs 0..2 run their parts, IPU 3 nothing."""
    dev = runner._replicas[0].session.device()
    pids = dev.pids()
    assert dev.numIpus() == 4 and len(set(pids)) == 4
    assert dev.link.width == 4 and dev.link.active == [0, 1, 2]
    maps = [mapped(pid) for pid in pids]
    assert all(maps[k] for k in range(3)) and maps[3] == set()


def run_and_compare(runner, model, seed: int) -> None:
    batch = xs(6, seed)
    futs = [runner.executeAsync({"x": x}) for x in batch]   # several in flight
    for x, f in zip(batch, futs):
        np.testing.assert_allclose(f.result(timeout=120)["y"], reference(model, x),
                                   rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(runner.execute({"x": batch[0]})["y"],
                               reference(model, batch[0]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pipelined", [False, True], ids=["sharded", "pipelined"])
def test_three_shards_on_four_ipus(tmp_path, model, pipelined):
    before = ours()
    out = poprt_compile(model, tmp_path, num_ipus=4, sharding_info=POINTS,
                        pipelining_info=POINTS if pipelined else None,
                        enable_pipelining=pipelined, batches_per_step=3 if pipelined else 1)
    assert out.result.executable.num_ipus == 4
    assert [p.idle for p in out.result.executable.parts] == [False, False, False, True]
    with model_runtime.ModelRunner(str(out.popef_path)) as r:
        check_device(r)
        run_and_compare(r, model, seed=1 + pipelined)
    assert ours() - before == set()


def test_poprt_command_line_with_poprts_shard_yaml(tmp_path, model, capsys):
    """poprt --num_ipus 4 --manual_sharding_config shard.yaml (PopRT's list form)."""
    onnx.save(model, str(tmp_path / "m.onnx"))
    (tmp_path / "shard.yaml").write_text("".join(
        f"-\n  node: {node}\n  device: {ipu}\n  stage: {ipu}\n" for node, ipu in POINTS.items()))
    assert poprt.main(["--input_model", str(tmp_path / "m.onnx"), "--num_ipus", "4",
                       "--manual_sharding_config", str(tmp_path / "shard.yaml"),
                       "--enable_pipelining", "--batches_per_step", "6", "--export_popef",
                       "--output_dir", str(tmp_path / "out")]) == 0
    assert ("poprt: sharded over 4 IPUs (pipelined); IPU(s) [3] hold no node and stay idle"
            in capsys.readouterr().out)
    path = str(tmp_path / "out" / "executable.popef")
    assert model_runtime.popef.load_model([path]).metadata.numIpus() == 4
    assert popef_dump.main([path]) == 0
    text = capsys.readouterr().out
    assert "Sharding (pipelined, 3 stages) over 4 IPUs" in text
    assert "ipu 2  stage 2  7 nodes: conv4, relu4, conv5, relu5, pool, flatten, fc" in text
    assert "ipu 3  idle: holds no node of the model, runs nothing" in text
    assert "Model check: ok" in text
    with model_runtime.ModelRunner(path) as r:
        check_device(r)
        run_and_compare(r, model, seed=3)


def test_poprt_api_as_the_manual_sharding_example(model):
    """Sharder + CompilerOptions(num_ipus=4, manual, pipelining) + Compiler.compile +
    poprt.runtime.Runner, as PopRT's shard.py does."""
    sharded = poprt_api.converter.Sharder(sharding_info=POINTS,
                                          pipelining_info=POINTS).run(model)
    options = CompilerOptions()
    options.num_ipus = 4
    options.enable_pipelining = True
    options.virtual_graph_mode = "manual"
    options.batches_per_step = 6
    exe = Compiler.compile(sharded.SerializeToString(), [o.name for o in sharded.graph.output],
                           options)
    config = poprt_api.runtime.RuntimeConfig()
    config.timeout_ns = 0
    runner = poprt_api.runtime.Runner(exe, config)
    try:
        check_device(runner._runner)
        for x in xs(3, seed=4):
            y = np.zeros((1, 5), np.float32)
            runner.execute({"x": x}, {"y": y})
            np.testing.assert_allclose(y, reference(model, x), rtol=1e-5, atol=1e-5)
    finally:
        del runner


def test_num_ipus_without_sharding_runs_on_the_first_ipu_of_the_device(tmp_path, model):
    """No sharding option: one program set, on IPU 0 of a device of num_ipus IPUs."""
    out = poprt_compile(model, tmp_path, num_ipus=4)
    assert out.result.executable.num_ipus == 4 and not out.result.executable.parts
    with model_runtime.ModelRunner(str(out.popef_path)) as r:
        dev = r._replicas[0].session.device()
        assert dev.numIpus() == 4 and len(set(dev.pids())) == 4 and dev.link.active == [0]
        x = xs(1, seed=6)[0]
        np.testing.assert_allclose(r.execute({"x": x})["y"], reference(model, x),
                                   rtol=1e-5, atol=1e-5)


def test_a_session_unbound_is_dropped_by_every_ipu_of_the_device(tmp_path, model):
    """Session A runs on all 4 IPUs, then session B (IPU 3 idle) on the same device: when
    A goes, IPU 3 (which B never loaded) drops A's part too."""
    from host_runtime.devices._manager import DeviceManager
    from host_runtime.session._session import Session
    from tests._helpers import PATIENT

    four = poprt_compile(model, tmp_path / "four", num_ipus=4,
                         sharding_info={"relu1": 0, "relu3": 1, "relu5": 2})   # tail: IPU 3
    three = poprt_compile(model, tmp_path / "three", num_ipus=4, sharding_info=POINTS)
    assert [p.idle for p in four.result.executable.parts] == [False] * 4
    x = xs(1, seed=7)[0]
    got: list[np.ndarray] = []

    def connect(s: Session) -> None:
        s.setCallbackForAnchor("x", lambda v: v.cast("B").__setitem__(slice(None), x.tobytes()))
        s.setCallbackForAnchor("y", lambda v: got.append(np.frombuffer(v, np.float32).copy()))

    with DeviceManager().getDevice(4, wait_config=PATIENT) as dev:
        a, b = Session(str(four.popef_path)), Session(str(three.popef_path))
        try:
            for s in (a, b):
                connect(s)
                s.bindToDevice(dev)
                s.runMainPrograms()
            assert mapped(dev.pids()[3])            # IPU 3 still holds A's part
            a.close()
            assert mapped(dev.pids()[3]) == set()
            b.runMainPrograms()
        finally:
            a.close()
            b.close()
    assert len(got) == 3
    for y in got:
        np.testing.assert_allclose(y.reshape(1, 5), reference(model, x), rtol=1e-5, atol=1e-5)
