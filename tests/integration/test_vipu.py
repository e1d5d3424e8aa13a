"""V-IPU partitions on the daemon: ``ipu-emulator vipu``, hosts inside a partition,
the Slurm prolog/epilog of docs/examples, and the named errors (docs/vipu.md).

One daemon of 4 IPUs serves the module; each test makes its own partitions and
removes them. The example model computes ``tensor_C = tensor_A * weights + tensor_B``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from host_runtime.devices._manager import DeviceManager
from host_runtime.errors import (BadRequestError, DeviceUnavailableError, PartitionBusyError,
                                 PartitionNotFoundError, PartitionTooSmallError)
from ipu_emulator.daemon import socket_protocol as wire
from ipu_emulator.errors import VipuError
from ipu_emulator.vipu import VipuClient
from tests.daemon_rig import REPO, DaemonRig, shm_entries
from tools import vipu as vipu_cli

SHAPE = (1, 4)
EXAMPLES = REPO / "docs" / "examples"
_VIPU_VARS = ("IPUOF_VIPU_API_PARTITION_ID", "IPUOF_CONFIG_PATH", "IPUOF_VIPU_API_HOST",
              "IPUOF_VIPU_API_PORT")


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonRig]:
    d = DaemonRig(tmp_path_factory.mktemp("vipu"), num_ipus=4)
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture
def env(rig: DaemonRig, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> VipuClient:
    """This process talks to the module's daemon; no V-IPU setting but the test's."""
    for name in _VIPU_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))   # an empty ~/.ipuof.conf.d
    monkeypatch.setenv(wire.ENV_VAR, rig.socket)
    client = VipuClient(rig.socket)
    yield client
    for p in client.list():
        client.remove(p["name"])


def held_by(rig: DaemonRig, pid: int) -> list[int]:
    return sorted(i["ipu"] for i in rig.status()["ipus"] if i["holder"] == pid)


def test_cli_create_list_get_remove(env: VipuClient, rig: DaemonRig, capsys, tmp_path: Path):
    assert vipu_cli.main(["create", "partition", "pa", "--size", "2"]) == 0
    assert vipu_cli.main(["create", "partition", "pb", "--size", "1", "--reconfigurable"]) == 0
    assert capsys.readouterr().out.splitlines() == ["create partition (pa): success.",
                                                    "create partition (pb): success."]
    parts = {p["name"]: p for p in env.list()}
    assert parts["pa"]["ipus"] == [0, 1] and parts["pb"]["ipus"] == [2]   # aligned, disjoint
    assert parts["pa"]["state"] == "free" and parts["pb"]["reconfigurable"] is True
    assert vipu_cli.main(["list", "partitions"]) == 0
    rows = [r for r in capsys.readouterr().out.splitlines() if "|" in r]
    assert rows[1].split("|")[0].strip() == "pa" and "FREE" in rows[1]
    config = tmp_path / "pa.conf"
    assert vipu_cli.main(["get", "partition", "pa", "--ipu-configs", "-o", str(config)]) == 0
    conf = json.loads(config.read_text())
    assert conf["partition"] == "pa" and conf["controller"]["socket"] == rig.socket
    assert conf["devices"] == [{"id": 2, "ipus": [0, 1], "pool_ipus": [0, 1]}]  # one device
    with pytest.raises(VipuError, match=r"create partition \(pc\): failed: partition size must "
                       r"be a power of 2 \(1, 2, 4, \.\.\.\), got 3") as exc:
        env.create("pc", 3)
    assert exc.value.kind == "partition_size"
    with pytest.raises(VipuError, match="partition 'pa' already exists"):
        env.create("pa", 1)
    with pytest.raises(VipuError, match="no aligned block of 2 IPU"):
        env.create("pc", 2)                   # 3 is free, but 2-3 is not
    assert vipu_cli.main(["remove", "partition", "pa"]) == 0
    assert "remove partition (pa): success." in capsys.readouterr().out
    with pytest.raises(VipuError, match="partition 'pa' not found; this daemon's partitions: "
                       "'pb'") as exc:
        env.get("pa")
    assert exc.value.kind == "partition_not_found"


def test_host_sees_exactly_its_partition(env: VipuClient, rig: DaemonRig, monkeypatch):
    env.create("lower", 2)
    env.create("upper", 2, reconfigurable=True)           # pool IPUs 2 and 3
    monkeypatch.setenv("IPUOF_VIPU_API_PARTITION_ID", "upper")
    dm = DeviceManager()
    assert dm.partition == "upper" and dm.system.num_ipus == 2
    with dm.getDevice(1) as first, dm.getDevice(1) as second:
        assert (first.id, first.ipus(), second.id, second.ipus()) == (0, [0], 1, [1])
        assert held_by(rig, os.getpid()) == [2, 3]        # the partition's, numbered 0..1
        assert [p["state"] for p in env.list()] == ["free", "busy"]
        assert env.get("upper")["holders"] == [os.getpid()]
        with pytest.raises(VipuError, match=r"partition 'upper' is in use by pid\(s\) "
                           rf"\[{os.getpid()}\]") as exc:
            env.remove("upper")
        assert exc.value.kind == "partition_in_use"
        with pytest.raises(PartitionBusyError, match="V-IPU partition 'upper' is in use: "
                           r"asked for a device of 1 IPU\(s\)") as busy:
            dm.getDevice(1)
        assert busy.value.partition == "upper"
    with dm.getDevice(2) as pair:
        assert (pair.id, pair.ipus()) == (2, [0, 1])
    monkeypatch.delenv("IPUOF_VIPU_API_PARTITION_ID")
    outside = DeviceManager()                              # no partition: the whole pool
    assert outside.partition is None and outside.system.num_ipus == 4
    with pytest.raises(DeviceUnavailableError, match=r"busy: ipu 0 \(holder unknown\)"):
        outside.getSpecificDevice(0)                       # partitioned: not for others
    assert held_by(rig, os.getpid()) == []


def test_missing_and_too_small_partitions(env: VipuClient, monkeypatch):
    monkeypatch.setenv("IPUOF_VIPU_API_PARTITION_ID", "nowhere")
    with pytest.raises(PartitionNotFoundError, match=r"V-IPU partition 'nowhere' .* partition "
                       r"'nowhere' not found; .* 'ipu-emulator vipu create partition nowhere "
                       r"--size N'") as exc:
        DeviceManager()
    assert exc.value.partition == "nowhere"
    env.create("one", 1)
    env.create("fixed", 2)
    monkeypatch.setenv("IPUOF_VIPU_API_PARTITION_ID", "one")
    with pytest.raises(PartitionTooSmallError, match=r"V-IPU partition 'one' has 1 IPU\(s\); "
                       r"asked for a device of 2 IPU\(s\)"):
        DeviceManager().getDevice(2)
    monkeypatch.setenv("IPUOF_VIPU_API_PARTITION_ID", "fixed")
    with pytest.raises(PartitionTooSmallError, match=r"'fixed' is not reconfigurable: it is "
                       r"one device of 2 IPUs; asked for a device of 1 IPU\(s\)"):
        DeviceManager().getDevice(1)
    with pytest.raises(PartitionTooSmallError, match=r"'fixed' \(2 IPU\(s\), not "
                       r"reconfigurable\) offers device id\(s\) \[2\]; asked for device 0"):
        DeviceManager().getSpecificDevice(0)


def test_ipuof_config_file_and_folder(env: VipuClient, monkeypatch, tmp_path: Path):
    env.create("byfile", 1)
    vipu_cli.main(["get", "partition", "byfile", "--ipu-configs", "--output",
                   str(tmp_path / "x.conf")])
    monkeypatch.setenv("IPUOF_CONFIG_PATH", str(tmp_path / "x.conf"))
    monkeypatch.delenv(wire.ENV_VAR)                       # the config names the daemon
    dm = DeviceManager()
    assert (dm.partition, dm.system.num_ipus) == ("byfile", 1)
    monkeypatch.delenv("IPUOF_CONFIG_PATH")
    folder = tmp_path / ".ipuof.conf.d"                    # HOME is tmp_path
    folder.mkdir()
    (folder / "byfile.conf").write_text((tmp_path / "x.conf").read_text())
    assert DeviceManager().partition == "byfile"
    (folder / "real.conf").write_text('{"attributes": {}, "devices": []}')  # not ours
    assert DeviceManager().partition == "byfile"
    (folder / "other.conf").write_text((tmp_path / "x.conf").read_text())
    with pytest.raises(BadRequestError, match="holds 2 IPUoF configs"):
        DeviceManager()
    monkeypatch.setenv("IPUOF_VIPU_API_PARTITION_ID", "byfile")
    monkeypatch.setenv("IPUOF_VIPU_API_HOST", "10.0.0.7")
    with pytest.raises(BadRequestError, match="IPUOF_VIPU_API_HOST='10.0.0.7': the emulator's "
                       "V-IPU controller is the daemon on this machine"):
        DeviceManager()


JOB = textwrap.dedent("""
    import json, os, sys
    import numpy as np
    import model_runtime
    from ipu_emulator.daemon import socket_protocol as wire
    runner = model_runtime.ModelRunner(model_runtime.PopefPaths([sys.argv[1]]))
    a = np.arange(4, dtype=np.float32).reshape(1, 4)
    b = np.full((1, 4), 0.5, np.float32)
    out = runner.execute({"tensor_A": a, "tensor_B": b})["tensor_C"]
    st = wire.request(os.environ["IPU_EMULATOR_DAEMON"], {"op": "status"})
    held = sorted(i["ipu"] for i in st["ipus"] if i["holder"] == os.getpid())
    runner.close()
    print(json.dumps({"out": out.tolist(), "held": held, "pid": os.getpid()}))
""")


def test_slurm_prolog_job_epilog(env: VipuClient, rig: DaemonRig, model_path: str, weights,
                                 tmp_path: Path):
    env.create("other", 1)                                 # the job's partition is not ipu 0
    before = shm_entries(rig.tag)
    job_env = dict(os.environ, SLURM_JOB_ID="4242", VIPU_PARTITION_SIZE="2",
                   VIPU_RECONFIGURABLE="1",
                   IPU_EMULATOR=f"{sys.executable} -m tools.cli", PYTHONPATH=str(REPO))
    prolog = subprocess.run(["sh", str(EXAMPLES / "vipu_prolog.sh")], env=job_env, cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert prolog.returncode == 0, prolog.stderr
    assert prolog.stdout == "export IPUOF_VIPU_API_PARTITION_ID=slurm-4242\n"
    assert env.get("slurm-4242")["ipus"] == [2, 3]         # outlived the prolog's client
    program = tmp_path / "job.py"                          # unchanged: `import model_runtime`
    program.write_text(JOB)
    job = subprocess.run([sys.executable, "-m", "tools.cli", "run", "--quiet", str(program),
                          model_path], cwd=REPO, timeout=120,
                         env=dict(job_env, IPUOF_VIPU_API_PARTITION_ID="slurm-4242"),
                         capture_output=True, text=True)
    assert job.returncode == 0, job.stderr
    result = json.loads(job.stdout)
    a = np.arange(4, dtype=np.float32).reshape(1, 4)
    np.testing.assert_allclose(result["out"], a * weights + 0.5, rtol=1e-6)
    assert result["held"] == [2]                           # its partition's first IPU
    epilog = subprocess.run(["sh", str(EXAMPLES / "vipu_epilog.sh")], env=job_env, cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert epilog.returncode == 0, epilog.stderr
    assert "remove partition (slurm-4242): success." in epilog.stderr
    assert [p["name"] for p in env.list()] == ["other"]
    assert shm_entries(pid=result["pid"]) == set()         # the job left nothing behind
    assert shm_entries(rig.tag) == before
    again = subprocess.run(["sh", str(EXAMPLES / "vipu_epilog.sh")], env=job_env, cwd=REPO,
                           capture_output=True, text=True, timeout=120)
    assert again.returncode != 0
    assert "remove partition (slurm-4242): failed: partition 'slurm-4242' not found" in \
        again.stderr


def test_epilog_refuses_a_partition_in_use(env: VipuClient, monkeypatch):
    env.create("slurm-77", 1)
    monkeypatch.setenv("IPUOF_VIPU_API_PARTITION_ID", "slurm-77")
    job_env = dict(os.environ, SLURM_JOB_ID="77", VIPU_REMOVE_TRIES="1",
                   IPU_EMULATOR=f"{sys.executable} -m tools.cli", PYTHONPATH=str(REPO))
    with DeviceManager().getDevice(1):
        busy = subprocess.run(["sh", str(EXAMPLES / "vipu_epilog.sh")], env=job_env, cwd=REPO,
                              capture_output=True, text=True, timeout=120)
    assert busy.returncode == 1
    assert (f"ipu-emulator vipu: error: remove partition (slurm-77): failed: partition "
            f"'slurm-77' is in use by pid(s) [{os.getpid()}]") in busy.stderr
    done = subprocess.run(["sh", str(EXAMPLES / "vipu_epilog.sh")], env=job_env, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert env.list() == []


def test_partitions_outlive_the_daemon_in_its_home(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    # a V-IPU controller keeps its partitions; so does the daemon, in its home: a daemon
    # started on the same home takes them back, less one its smaller pool cannot hold
    home = tmp_path / "home"
    first = DaemonRig(tmp_path / "a", num_ipus=4, home=home)
    try:
        client = VipuClient(first.socket)
        client.create("job-a", 2)
        client.create("job-b", 1, reconfigurable=True)
        client.create("gone", 1)
        client.remove("gone")
    finally:
        first.stop()
    kept = json.loads((home / "partitions.json").read_text())
    assert [p["name"] for p in kept["partitions"]] == ["job-a", "job-b"]
    assert (home / "partitions.json").stat().st_mode & 0o077 == 0
    second = DaemonRig(tmp_path / "b", num_ipus=4, home=home)
    try:
        parts = {p["name"]: p for p in VipuClient(second.socket).list()}
        assert {n: (p["ipus"], p["reconfigurable"], p["state"]) for n, p in parts.items()} == {
            "job-a": ([0, 1], False, "free"), "job-b": ([2], True, "free")}
        # a host inside a kept partition gets its IPUs
        monkeypatch.setenv(wire.ENV_VAR, second.socket)
        monkeypatch.setenv("IPUOF_VIPU_API_PARTITION_ID", "job-a")
        monkeypatch.setenv("HOME", str(tmp_path))
        with DeviceManager().getDevice(2) as dev:
            assert held_by(second, os.getpid()) == [0, 1]
            assert dev.numIpus() == 2
    finally:
        second.stop()
    # a pool of 2 cannot hold job-b's ipu 2: it is left out, named in the log
    third = DaemonRig(tmp_path / "c", num_ipus=2, home=home)
    try:
        assert [p["name"] for p in VipuClient(third.socket).list()] == ["job-a"]
    finally:
        third.stop()
    assert any("'job-b'" in line and "left out" in line for line in third.lines)


def test_create_takes_unused_ipus_only(env: VipuClient, rig: DaemonRig):
    # V-IPU allocates unused IPUs: none a job outside the partitions holds
    with DeviceManager().getSpecificDevice(0):            # no partition: pool ipu 0
        with pytest.raises(VipuError, match=r"cannot create partition 'all' of size 4: every "
                           r"aligned block of 4 IPU\(s\) outside the other partitions has IPUs "
                           rf"in use by jobs outside any partition \(ipu 0 by pid "
                           rf"{os.getpid()}\); retry once they release them") as exc:
            env.create("all", 4)
        assert exc.value.kind == "partition_size"
        env.create("late", 1)
        assert env.get("late")["ipus"] == [1] and env.get("late")["state"] == "free"
    env.remove("late")
    env.create("all", 4)                                   # released: all four are unused
    assert env.get("all")["ipus"] == [0, 1, 2, 3]


def test_replicas_on_a_partition_that_is_one_device(env: VipuClient, rig: DaemonRig,
                                                     model_path: str, weights, monkeypatch):
    # Poplar attaches a replicated graph to the partition's one device (of R IPUs)
    import host_runtime as model_runtime

    env.create("fixed2", 2)
    monkeypatch.setenv("IPUOF_VIPU_API_PARTITION_ID", "fixed2")
    cfg = model_runtime.ModelRunnerConfig()
    cfg.replication_factor = 2
    a = np.arange(4, dtype=np.float32).reshape(1, 4)
    b = np.full((1, 4), 0.5, np.float32)
    with model_runtime.ModelRunner(model_path, config=cfg) as runner:
        assert held_by(rig, os.getpid()) == [0, 1]
        for rid in (0, 1):
            out = runner.execute({"tensor_A": a + rid, "tensor_B": b}, replica_id=rid)
            np.testing.assert_allclose(out["tensor_C"], (a + rid) * weights + 0.5, rtol=1e-6)
    assert held_by(rig, os.getpid()) == [] and env.get("fixed2")["state"] == "free"
    cfg.replication_factor = 4                             # more than the device holds
    with pytest.raises(PartitionTooSmallError, match="'fixed2' is not reconfigurable"):
        model_runtime.ModelRunner(model_path, config=cfg)


def test_a_partition_made_again_is_read_again(env: VipuClient, rig: DaemonRig, monkeypatch):
    env.create("p", 1)                                     # pool ipu 0
    monkeypatch.setenv("IPUOF_VIPU_API_PARTITION_ID", "p")
    dm = DeviceManager()
    env.remove("p")
    env.create("blocker", 1)                               # takes ipu 0
    env.create("p", 1)                                     # now pool ipu 1
    with dm.getDevice(1) as dev:
        assert dev.ipus() == [0] and held_by(rig, os.getpid()) == [1]
    env.remove("p")
    env.create("p", 2, reconfigurable=True)                # another device: a new manager
    with pytest.raises(PartitionNotFoundError, match=r"V-IPU partition 'p' was removed and "
                       r"made again since this process read it \(1 IPU\(s\), not "
                       r"reconfigurable; now 2, reconfigurable\): make a new DeviceManager"):
        dm.getDevice(1)


def test_device_counts_and_advice_inside_a_partition(env: VipuClient, monkeypatch):
    from host_runtime.poprt import runtime

    env.create("fixed", 2)
    env.create("flex", 2, reconfigurable=True)
    monkeypatch.setenv("IPUOF_VIPU_API_PARTITION_ID", "fixed")
    assert runtime.DeviceManager().get_num_devices() == 1      # one device, id 2
    assert DeviceManager().device_ids == [2]
    monkeypatch.setenv("IPUOF_VIPU_API_PARTITION_ID", "flex")
    assert runtime.DeviceManager().get_num_devices() == 3      # 0, 1 and the pair
    with pytest.raises(DeviceUnavailableError, match=r"asked for a device of 3 IPUs; devices "
                       r"have a power of two IPUs \(1, 2, 4, \.\.\.\)"):
        DeviceManager().getDevice(3)


def test_a_host_with_its_own_ipus_leaves_the_partitions_alone(env: VipuClient, rig: DaemonRig,
                                                              monkeypatch):
    from host_runtime.devices import DeviceWaitConfig, DeviceWaitStrategy

    env.create("jobs", 1)                                  # pool ipu 0, free
    monkeypatch.delenv(wire.ENV_VAR)                       # embedded, on the daemon's home
    monkeypatch.setenv("IPU_EMULATOR_HOME", rig.env["IPU_EMULATOR_HOME"])
    dm = DeviceManager()
    assert dm.daemon is None
    with pytest.raises(DeviceUnavailableError, match=r"busy: ipu 0 \(in V-IPU partition 'jobs': "
                       r"IPUOF_VIPU_API_PARTITION_ID and the daemon use it\)"):
        dm.getSpecificDevice(0, wait_config=DeviceWaitConfig(DeviceWaitStrategy.NO_WAIT))


def test_an_unreachable_daemon_is_named_by_what_named_it(env: VipuClient, monkeypatch,
                                                         tmp_path: Path):
    conf = tmp_path / "x.conf"
    conf.write_text(json.dumps({"ipuof-config-version": 1, "partition": "p",
                                "controller": {"socket": str(tmp_path / "nobody.sock")}}))
    monkeypatch.setenv("IPUOF_CONFIG_PATH", str(conf))
    monkeypatch.delenv(wire.ENV_VAR)
    with pytest.raises(DeviceUnavailableError, match=rf"cannot reach the IPU emulator daemon at "
                       rf".*nobody.sock \(the IPUoF config {conf}\): .*; start it with "
                       rf"'ipu-emulator daemon --socket PATH' or change the IPUoF config {conf}"):
        DeviceManager()
