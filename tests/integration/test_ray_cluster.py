"""A two-node local Ray cluster of emulated IPUs: each node a daemon of 2 IPUs, offered to
Ray as the resource ``IPU``; unchanged Model Runtime code in actors that ask for one IPU
lands two a node, attaches through its own node's daemon, answers right; a fifth waits
until one is killed, whose IPU comes back; no IPU is ever lent twice."""

from __future__ import annotations

import os
from typing import Any, Iterator

import numpy as np
import psutil
import pytest

from ipu_emulator import cluster
from ipu_emulator.daemon import socket_protocol as wire
from tests._helpers import tag_objects

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install "
                                        "'ipu-emulator[ray]')")

_WAIT = 120.0   # bound of every wait on the cluster (a loaded 2-core machine)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Any]]:
    """Two nodes, each with a daemon of 2 IPUs; the driver connected (loopback only)."""
    from ray.cluster_utils import Cluster

    from ray._private import ray_constants
    from tests.daemon_rig import DaemonRig

    # every address of the cluster on loopback (the driver's and nodes' own IP too)
    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"   # the raylets' processes
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    rigs: list[Any] = []
    c = None
    try:
        for k in range(2):
            rigs.append(DaemonRig(tmp_path_factory.mktemp(f"node{k}"), num_ipus=2))
        c = Cluster()
        for rig in rigs:
            c.add_node(num_cpus=1, resources={cluster.IPU_RESOURCE: 2},
                       object_store_memory=80 << 20, include_dashboard=False,
                       node_ip_address=cluster.LOOPBACK,
                       env_vars=cluster.node_environment(rig.socket, {}))
        ray.init(address=c.address, _node_ip_address=cluster.LOOPBACK,
                 include_dashboard=False, log_to_driver=False,
                 runtime_env={"worker_process_setup_hook": cluster.SETUP_HOOK})
        yield rigs
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if c is not None:
            c.shutdown()
        for rig in rigs:
            rig.stop()
        ray_constants.ENABLE_RAY_CLUSTER = saved
        os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)


def _inference_actor() -> Any:
    """The actor class (made here so Ray ships it by value: workers need not import the
    test suite): unchanged Model Runtime code, no word of Ray or of daemons in it."""

    @ray.remote(num_cpus=0, resources={cluster.IPU_RESOURCE: 1})
    class Inference:
        def __init__(self, path: str) -> None:
            import model_runtime   # Graphcore's name (the job's worker_process_setup_hook)

            self.runner = model_runtime.ModelRunner(path)

        def run(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
            return self.runner.execute({"tensor_A": a, "tensor_B": b})["tensor_C"]

        def where(self) -> tuple[int, str, str]:
            return (os.getpid(), ray.get_runtime_context().get_node_id(),
                    os.environ.get(wire.ENV_VAR, ""))

    return Inference


def _lent(rigs: list[Any]) -> dict[str, list[int]]:
    """Each node's daemon socket -> the pids its IPUs are lent to."""
    return {rig.socket: sorted(i["holder"] for i in rig.status()["ipus"]
                               if i["holder"] is not None) for rig in rigs}


def test_actors_land_two_a_node_attach_their_own_daemon_and_a_fifth_waits(
        nodes, model_path, weights):
    before = tag_objects()
    Inference = _inference_actor()
    actors = [Inference.remote(model_path) for _ in range(4)]
    where = ray.get([a.where.remote() for a in actors], timeout=_WAIT)
    by_node: dict[str, list[tuple[int, str]]] = {}
    for pid, node, sock in where:
        by_node.setdefault(node, []).append((pid, sock))
    assert sorted(len(v) for v in by_node.values()) == [2, 2], where
    for placed in by_node.values():   # one node's actors, its own daemon
        assert len({sock for _, sock in placed}) == 1
    lent = _lent(nodes)
    for placed in by_node.values():
        sock = placed[0][1]
        assert lent[sock] == sorted(pid for pid, _ in placed)   # each IPU to one actor
    rng = np.random.default_rng(3)
    feeds = [(rng.standard_normal((1, 4)).astype(np.float32),
              rng.standard_normal((1, 4)).astype(np.float32)) for _ in actors]
    outs = ray.get([a.run.remote(x, y) for a, (x, y) in zip(actors, feeds)], timeout=_WAIT)
    for (x, y), out in zip(feeds, outs):
        np.testing.assert_allclose(out, x * weights + y, rtol=1e-6)

    # a fifth asks for an IPU: none is free, Ray holds it back
    fifth = Inference.remote(model_path)
    pending = fifth.where.remote()
    ready, _ = ray.wait([pending], timeout=1.0)
    assert ready == [], "a fifth actor ran while every IPU was taken"
    killed_pid, killed_node, killed_sock = where[0]
    ray.kill(actors[0])
    pid5, node5, sock5 = ray.get(pending, timeout=_WAIT)
    assert (node5, sock5) == (killed_node, killed_sock)   # the freed IPU's node
    lent = _lent(nodes)
    assert killed_pid not in lent[killed_sock] and pid5 in lent[killed_sock]
    all_lent = [p for pids in lent.values() for p in pids]
    assert len(all_lent) == len(set(all_lent)) == 4
    x, y = feeds[0]
    np.testing.assert_allclose(ray.get(fifth.run.remote(x, y), timeout=_WAIT),
                               x * weights + y, rtol=1e-6)
    # the rest killed too: once their processes are gone and the daemons have reset the
    # IPUs (status answers after resets), nothing of theirs is left in /dev/shm
    procs = [psutil.Process(pid) for pid, _, _ in where[1:]] + [psutil.Process(pid5)]
    for a in [*actors[1:], fifth]:
        ray.kill(a)
    _, alive = psutil.wait_procs(procs, timeout=_WAIT)
    assert not alive, f"killed actors still running: {alive}"
    assert _lent(nodes) == {rig.socket: [] for rig in nodes}
    assert tag_objects() == before
