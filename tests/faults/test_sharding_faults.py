"""Faults of multi-IPU devices: failure is whole-device.

- the process of an IPU that runs nothing (a model of 3 shards on 4 IPUs) killed: the
  device is lost all the same;
- an IPU process of a pipelined device killed under load: every pending request fails
  with DeviceLostError naming that IPU, the device's other IPU processes are gone too;
- with auto_reset, the next request runs on a freshly attached device of all its IPUs;
- a SIGKILLed host leaves no IPU process of the group and nothing in /dev/shm;
- a program error on one IPU in the middle of the main loop (ModelRunner's fast path)
  fails every pending request with DeviceExecutionError naming that IPU, the other IPUs
  end their loops (none waits on an IPU-Link), the device is not lost, auto_reset makes
  the next request work, and nothing is left in /dev/shm.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import onnx
import psutil
import pytest

import host_runtime as model_runtime
from host_runtime.errors import DeviceExecutionError, DeviceLostError, ModelRuntimeError
from shm import naming
from shm.cleanup import list_objects
from tools import poprt
from tools._chain_model import chain_model, reference, write_shard_yaml
from tests._helpers import kill_and_wait, processes

LAYERS, WIDTH, BATCH = 4, 64, 2
WAIT = 60.0

pytestmark = pytest.mark.usefixtures("private_machine")


@pytest.fixture(scope="module")
def chain():
    return chain_model(LAYERS, width=WIDTH, batch=BATCH, seed=11)


@pytest.fixture(scope="module")
def pipelined_path(tmp_path_factory, chain):
    tmp = tmp_path_factory.mktemp("pipelined")
    onnx.save(chain, str(tmp / "chain.onnx"))
    write_shard_yaml(tmp / "shard.yaml", LAYERS, 2, pipelined=True)
    assert poprt.main(["--input_model", str(tmp / "chain.onnx"), "--num_ipus", "2",
                       "--manual_sharding_config", str(tmp / "shard.yaml"),
                       "--enable_pipelining", "--batches_per_step", "2", "--export_popef",
                       "--output_dir", str(tmp / "out")]) == 0
    return str(tmp / "out" / "executable.popef")


def ours() -> set[str]:
    return {o.entry for o in list_objects(naming.current_tag())}




def x_of(k: int) -> np.ndarray:
    return np.random.default_rng(k).standard_normal((BATCH, WIDTH)).astype(np.float32)


class Load:
    """Threads that keep requests in flight until told to stop; record results and errors."""

    def __init__(self, runner, chain, threads: int = 4) -> None:
        self.runner, self.chain = runner, chain
        self.stop = threading.Event()
        self.ok = 0
        self.errors: list[BaseException] = []
        self.lock = threading.Lock()
        self.started = threading.Semaphore(0)
        self.threads = [threading.Thread(target=self._run, args=(t,)) for t in range(threads)]
        for t in self.threads:
            t.start()

    def _run(self, t: int) -> None:
        k = t
        while not self.stop.is_set() and k < t + 100000:
            x = x_of(k)
            try:
                y = self.runner.execute({"x": x})["y"]
            except Exception as exc:
                with self.lock:
                    self.errors.append(exc)
                self.started.release()
                return
            np.testing.assert_allclose(y, reference(self.chain, x), rtol=1e-4, atol=1e-4)
            with self.lock:
                self.ok += 1
            self.started.release()
            k += 4

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(WAIT)
            assert not t.is_alive(), "a request hung after the IPU died"


def test_killed_ipu_of_a_pipelined_device_fails_every_pending_request(pipelined_path, chain):
    with model_runtime.ModelRunner(pipelined_path) as r:
        dev = r._replicas[0].session.device()
        pids = dev.pids()
        load = Load(r, chain)
        for _ in range(8):                        # the pipeline is running under load
            assert load.started.acquire(timeout=WAIT)
        kill_and_wait(pids[1])
        # not told to stop: each thread's next request fails, and the thread ends (told
        # at once, threads that had just been answered, all of them on a loaded machine,
        # could stop without sending another)
        for t in load.threads:
            t.join(WAIT)
        load.join()
        assert load.errors, "no request saw the device die"
        for e in load.errors:
            assert isinstance(e, DeviceLostError), repr(e)
        assert any(f"IPU process {pids[1]} was killed by signal SIGKILL" in str(e)
                   and "IPU 1 of the device" in str(e) for e in load.errors), load.errors
        # the whole device is lost: no IPU process of the group is left
        gone, alive = psutil.wait_procs(processes(pids), timeout=WAIT)
        assert not alive, f"IPU processes of the lost device still run: {alive}"
        with pytest.raises(DeviceLostError):
            r.execute({"x": x_of(0)})


@pytest.fixture(scope="module")
def idle_path(tmp_path_factory):
    """A conv chain pipelined over IPUs 0..2 of a 4-IPU device: IPU 3 is idle."""
    from host_runtime.poprt.compiler import compile as poprt_compile
    from tools._chain_model import conv_chain

    points = {"relu1": 0, "relu3": 1, "fc": 2}
    model = conv_chain(blocks=4)
    out = poprt_compile(model, tmp_path_factory.mktemp("idle"), num_ipus=4,
                        sharding_info=points, pipelining_info=points, enable_pipelining=True,
                        batches_per_step=3)
    return str(out.popef_path), model


def test_killed_idle_ipu_still_loses_the_whole_device(idle_path):
    """IPU 3 runs nothing, but it is one of the device's IPUs: its death loses the device
    (DeviceLostError naming IPU 3), and the other IPU processes are killed."""
    path, model = idle_path
    x = np.random.default_rng(2).standard_normal((1, 3, 8, 8)).astype(np.float32)
    with model_runtime.ModelRunner(path) as r:
        np.testing.assert_allclose(r.execute({"x": x})["y"], reference(model, x),
                                   rtol=1e-5, atol=1e-5)
        dev = r._replicas[0].session.device()
        pids = dev.pids()
        assert len(pids) == 4 and dev.link.active == [0, 1, 2]
        kill_and_wait(pids[3])
        with pytest.raises(DeviceLostError, match=rf"IPU process {pids[3]} was killed by signal "
                                                  r"SIGKILL \(9\) \(ipu \d+, IPU 3 of the "
                                                  r"device\); the whole device is lost"):
            r.execute({"x": x})
        gone, alive = psutil.wait_procs(processes(pids), timeout=WAIT)
        assert not alive, f"IPU processes of the lost device still run: {alive}"


def test_auto_reset_restarts_and_reloads_all_ipus(pipelined_path, chain):
    cfg = model_runtime.ModelRunnerConfig(auto_reset=True)
    with model_runtime.ModelRunner(pipelined_path, config=cfg) as r:
        x = x_of(1)
        np.testing.assert_allclose(r.execute({"x": x})["y"], reference(chain, x),
                                   rtol=1e-4, atol=1e-4)
        old = r._replicas[0].session.device().pids()
        kill_and_wait(old[0])
        # sent after the exit: every one served after the reset (none was in flight)
        futs = [(x, r.executeAsync({"x": x})) for x in (x_of(k) for k in range(2, 10))]
        for x, f in futs:
            assert f.wait(WAIT)
            assert f.exception() is None, f.exception()
            np.testing.assert_allclose(f["y"], reference(chain, x), rtol=1e-4, atol=1e-4)
        x = x_of(20)
        np.testing.assert_allclose(r.execute({"x": x})["y"], reference(chain, x),
                                   rtol=1e-4, atol=1e-4)
        new = r._replicas[0].session.device().pids()
        assert len(new) == 2 and not set(new) & set(old)


def test_a_request_after_a_later_ipu_died_is_served_after_a_reset(pipelined_path, chain):
    """The second IPU of a pipelined device is gone before a plain ``execute``: the
    device is reset first and the request served (auto_reset), even though the live
    first IPU would take the request's input at once. ``execute``'s fused path polls a
    device of one IPU process only after laying the inputs (a device gone with none of
    them taken gets the request again); here it must poll before: the check that runs
    after laying is made to see the input taken, and must never be asked."""
    cfg = model_runtime.ModelRunnerConfig(auto_reset=True)
    with model_runtime.ModelRunner(pipelined_path, config=cfg) as r:
        x = x_of(1)
        np.testing.assert_allclose(r.execute({"x": x})["y"], reference(chain, x),
                                   rtol=1e-4, atol=1e-4)
        life = r._replicas[0]._life
        real, asked = life.gone, []

        def gone_once_taken() -> bool:   # the first IPU took the input: the race lost
            asked.append(1)
            path = life.path
            deadline = time.monotonic() + 10
            while any(i.ring.readable() for i in path.inputs) and time.monotonic() < deadline:
                os.sched_yield()
            return real()

        life.gone = gone_once_taken
        old = r._replicas[0].session.device().pids()
        kill_and_wait(old[1])
        x = x_of(2)
        np.testing.assert_allclose(r.execute({"x": x})["y"], reference(chain, x),
                                   rtol=1e-4, atol=1e-4)
        new = r._replicas[0].session.device().pids()
        assert len(new) == 2 and not set(new) & set(old)
        assert asked == []


HOST = textwrap.dedent("""
    import sys, threading
    import numpy as np
    import host_runtime as model_runtime
    r = model_runtime.ModelRunner(sys.argv[1])
    x = np.ones((2, 64), np.float32)
    r.execute({"x": x})
    print(",".join(map(str, r._replicas[0].session.device().pids())), flush=True)
    def spin():
        while True:
            r.execute({"x": x})
    for _ in range(2):
        threading.Thread(target=spin, daemon=True).start()
    sys.stdin.read()
""")


@pytest.mark.allow_shm_leak   # checked here, after the IPU processes had their chance
@pytest.mark.embedded_only   # through a daemon the IPU processes are the daemon's: test_daemon_faults.py
def test_killed_host_leaves_no_ipu_process_and_nothing_in_dev_shm(pipelined_path):
    before = ours()
    child = subprocess.Popen([sys.executable, "-c", HOST, pipelined_path],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = child.stdout.readline().strip()
        assert line, "host child did not start"
        pids = [int(p) for p in line.split(",")]
        assert len(pids) == 2
        assert any("_link" in e and f"_{child.pid}_" in e for e in ours() - before)
        child.kill()
        child.wait(30)
        gone, alive = psutil.wait_procs(processes(pids), timeout=WAIT)
        assert not alive, f"IPU processes still running: {alive}"
        assert ours() - before == set()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


# -- a program error on one IPU in the middle of the main loop --------------------------

def gather_chain(ipus: int) -> onnx.ModelProto:
    """x -> Relu (IPU 0) -> Gather(., idx) (IPU 1) -> Relu ... (one per further IPU) -> y.
    ``idx`` streams to IPU 1 only: an out-of-range index fails IPU 1's part, and no
    other, at the iteration that reads it."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Relu", ["x"], ["r0"], name="n0"),
             helper.make_node("Gather", ["r0", "idx"], ["g1"], name="n1", axis=0)]
    prev = "g1"
    for k in range(2, ipus):
        nodes.append(helper.make_node("Relu", [prev], [f"r{k}"], name=f"n{k}"))
        prev = f"r{k}"
    nodes.append(helper.make_node("Identity", [prev], ["y"], name="out"))
    g = helper.make_graph(nodes, "gather_chain",
                          [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4, 3]),
                           helper.make_tensor_value_info("idx", TensorProto.INT64, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    return m


def gather_popef(tmp, ipus: int, pipelined: bool) -> str:
    from host_runtime.poprt.compiler import compile as poprt_compile

    points = {f"n{k}": k for k in range(ipus)}
    points["out"] = ipus - 1
    out = poprt_compile(gather_chain(ipus), tmp, num_ipus=ipus, sharding_info=points,
                        pipelining_info=points if pipelined else None,
                        enable_pipelining=pipelined, batches_per_step=ipus if pipelined else 1)
    return str(out.popef_path)


GX = np.arange(12, dtype=np.float32).reshape(4, 3) - 5


def gather_ref(idx: np.ndarray) -> np.ndarray:
    return np.maximum(GX, 0)[idx]


def good_idx(k: int) -> np.ndarray:
    return np.array([k % 4, (k + 1) % 4], np.int64)


BAD_IDX = np.array([9, 0], np.int64)     # out of range on IPU 1


def ipu1_failure(e: BaseException) -> bool:
    text = str(e)
    return (isinstance(e, DeviceExecutionError) and "IPU 1 of the device" in text
            and "Gather" in text and "out of data bounds" in text)


@pytest.mark.parametrize("ipus,pipelined", [(2, True), (4, False), (4, True)],
                         ids=["2ipu-pipelined", "4ipu-sharded", "4ipu-pipelined"])
def test_program_error_on_one_ipu_in_the_main_loop(tmp_path, ipus, pipelined):
    path = gather_popef(tmp_path, ipus, pipelined)
    before = ours()
    with model_runtime.ModelRunner(path) as r:
        for k in range(2 * ipus):     # the loop runs on every IPU
            np.testing.assert_array_equal(r.execute({"x": GX, "idx": good_idx(k)})["y"],
                                          gather_ref(good_idx(k)))
        dev = r._replicas[0].session.device()
        pids = dev.pids()
        assert len(pids) == ipus
        bad = 3
        futs, refused = [], []
        for k in range(6):            # in flight together; request `bad` fails on IPU 1
            idx = BAD_IDX if k == bad else good_idx(k)
            try:
                futs.append((k, idx, r.executeAsync({"x": GX, "idx": idx})))
            except ModelRuntimeError as exc:   # the failure was already seen
                refused.append(exc)
        outcomes = {}
        for k, idx, f in futs:
            assert f.wait(WAIT), f"request {k} hung after IPU 1 failed"
            e = f.exception()
            outcomes[k] = e
            if e is None:
                assert k < bad, f"request {k} after the failing one succeeded"
                np.testing.assert_array_equal(f["y"], gather_ref(idx))
            else:
                assert ipu1_failure(e), repr(e)
        assert outcomes[bad] is not None
        for exc in refused:
            assert "IPU 1 of the device" in str(exc), repr(exc)
        # the device's main loop ended on every IPU: the loop future (done once every
        # IPU process has answered) failed with IPU 1's error, and no IPU process died
        loop = r._replicas[0]._loop
        assert loop.done() and ipu1_failure(loop.exception()), loop.exception()
        assert dev._link.check() is None
        assert all(psutil.pid_exists(p) for p in pids)
        with pytest.raises(ModelRuntimeError, match="IPU 1 of the device"):
            r.execute({"x": GX, "idx": good_idx(0)})   # no auto_reset: the replica is done
    assert ours() - before == set()

    cfg = model_runtime.ModelRunnerConfig(auto_reset=True)
    with model_runtime.ModelRunner(path, config=cfg) as r:
        np.testing.assert_array_equal(r.execute({"x": GX, "idx": good_idx(1)})["y"],
                                      gather_ref(good_idx(1)))
        with pytest.raises(DeviceExecutionError, match="IPU 1 of the device") as info:
            r.execute({"x": GX, "idx": BAD_IDX})
        assert ipu1_failure(info.value)
        for k in range(2 * ipus):     # auto_reset: the device works again
            np.testing.assert_array_equal(r.execute({"x": GX, "idx": good_idx(k)})["y"],
                                          gather_ref(good_idx(k)))
    assert ours() - before == set()
