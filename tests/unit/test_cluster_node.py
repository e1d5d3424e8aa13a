"""The Ray node's command line and environment (ipu_emulator.cluster): loopback unless told,
the IPU resource, the daemon's socket handed to the raylet; wrong requests named."""

from __future__ import annotations

import json

import pytest

from ipu_emulator import cluster
from ipu_emulator.daemon import socket_protocol as wire


@pytest.fixture(autouse=True)
def ray_on_path(monkeypatch):
    monkeypatch.setattr(cluster.shutil, "which", lambda name, path=None: "/x/bin/ray")


def test_a_head_offers_its_ipus_on_loopback_with_the_dashboard_off():
    cmd = cluster.ray_start_command(ipus=2, head=True, port=6380, num_cpus=1)
    assert cmd[:2] == ["/x/bin/ray", "start"]
    assert cmd[cmd.index("--node-ip-address") + 1] == "127.0.0.1"
    assert json.loads(cmd[cmd.index("--resources") + 1]) == {"IPU": 2}
    assert "--head" in cmd and "--include-dashboard=false" in cmd
    assert cmd[cmd.index("--port") + 1] == "6380" and cmd[cmd.index("--num-cpus") + 1] == "1"


def test_a_worker_joins_the_head_it_is_given():
    cmd = cluster.ray_start_command(ipus=4, head=False, address="127.0.0.1:6380")
    assert cmd[cmd.index("--address") + 1] == "127.0.0.1:6380" and "--head" not in cmd
    assert json.loads(cmd[cmd.index("--resources") + 1]) == {"IPU": 4}
    assert "--object-store-memory" not in cmd


def test_the_object_store_is_bounded_when_asked():
    cmd = cluster.ray_start_command(ipus=1, head=True, object_store_memory=80 << 20)
    assert cmd[cmd.index("--object-store-memory") + 1] == str(80 << 20)


@pytest.mark.parametrize("kwargs, message", [
    ({"ipus": 0, "head": True}, "a node offers at least 1 IPU, got 0"),
    ({"ipus": 1, "head": True, "object_store_memory": 0},
     "--object-store-memory must be a positive number of bytes, got 0"),
    ({"ipus": 1, "head": True, "address": "h:1"}, "either the head (no address) or joins one"),
    ({"ipus": 1, "head": False}, "either the head (no address) or joins one"),
])
def test_wrong_node_requests_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        cluster.ray_start_command(**kwargs)


def test_the_raylet_gets_the_nodes_daemon_socket():
    env = cluster.node_environment("/run/d.sock", {"PATH": "/bin"})
    assert env == {"PATH": "/bin", wire.ENV_VAR: "/run/d.sock", "RAY_USAGE_STATS_ENABLED": "0"}
    with pytest.raises(ValueError, match="must be an absolute path, got 'd.sock'"):
        cluster.node_environment("d.sock", {})


def test_without_ray_the_error_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(cluster.shutil, "which", lambda name, path=None: None)
    with pytest.raises(cluster.RayMissingError, match=r"pip install 'ipu-emulator\[ray\]'"):
        cluster.ray_start_command(ipus=1, head=True)
