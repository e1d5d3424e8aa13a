"""Fixtures and helpers shared by the integration and fault tests.

The fixtures are re-exported by ``tests/integration/conftest.py`` and
``tests/faults/conftest.py``; a module that defines a fixture of the same name
overrides them.

- ``private_machine``: the module's own emulated machine (``IPU_EMULATOR_HOME``
  in a fresh directory) and a default device wait of up to 120 s, so that
  module-scoped runners of other test processes cannot starve it. Use it with
  ``pytestmark = pytest.mark.usefixtures("private_machine")``.
- ``model_path`` / ``model`` / ``weights``: the seeds' example model
  (``tensor_C = tensor_A * weights + tensor_B``) written for the module's
  ``SHAPE`` (module attribute, default ``(1, 4)``), and its weights.
- ``gather_path`` / ``gather_model``: ``out = data[idx]`` (data 0, 10, 20, 30);
  an out-of-range ``idx`` makes onnxruntime fail on the device.
- ``device``: one IPU of the machine for the module, waiting ``PATIENT``ly.
- ``daemon``: an ``ipu-emulator daemon`` (2 IPUs, its own socket and
  shared-memory tag) for the module; see ``tests/daemon_rig.py``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import select
import signal
from datetime import timedelta
from typing import Any, Iterable, Iterator

import numpy as np
import psutil
import pytest

from host_runtime import popef
from host_runtime.devices._manager import Device, DeviceManager, DeviceWaitConfig, DeviceWaitStrategy

__all__ = ["PATIENT", "DEFAULT_SHAPE", "SPAWN", "module_shape", "weights_of", "write_example",
           "write_gather", "spawn", "private_machine", "model_path", "model", "weights",
           "gather_path", "gather_model", "device", "daemon", "run_in_threads", "processes",
           "running"]

# Other test processes may hold IPUs of the same machine for a while: wait for one.
PATIENT = DeviceWaitConfig(timedelta(seconds=120), timedelta(seconds=0.05))

DEFAULT_SHAPE = (1, 4)

SPAWN = mp.get_context("spawn")


def run_in_threads(target: Any, args: Any) -> None:
    """Run ``target(*a)`` for each ``a`` in ``args`` on its own thread, all at once; join all.

    ``target`` records its own results and errors (an exception in a thread is not raised here).
    """
    import threading
    threads = [threading.Thread(target=target, args=tuple(a) if isinstance(a, (tuple, list))
                                else (a,)) for a in args]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
"""Peers of the shm tests start with 'spawn' (a fork would copy this process's threads)."""


def module_shape(request: pytest.FixtureRequest) -> tuple[int, ...]:
    """The requesting module's ``SHAPE`` (the example model's tensor shape)."""
    return tuple(getattr(request.module, "SHAPE", DEFAULT_SHAPE))


def write_example(directory: Any, shape: tuple[int, ...], **options: Any) -> str:
    """Write the seeds' example model as ``directory/simple.popef``; its path."""
    from tools.generate_simple_popef import write_simple_popef

    path = directory / "simple.popef"
    write_simple_popef(path, shape=shape, **options)
    return str(path)


def weights_of(model: popef.Model, shape: tuple[int, ...]) -> np.ndarray:
    """The example model's ``weights`` tensor data, shaped ``shape``."""
    return np.frombuffer(model.tensorData("weights").data, np.float32).reshape(shape)


def write_gather(path: Any) -> str:
    """Write the gather model (``out = data[idx]``, data = 0, 10, 20, 30) to ``path``."""
    from onnx import TensorProto, helper, numpy_helper

    from host_runtime.poprt.compiler import write_popef
    from ipu_emulator.compiler import CompileOptions, ModelSpec, compile_onnx

    graph = helper.make_graph(
        [helper.make_node("Gather", ["data", "idx"], ["out"], axis=0)], "gather",
        [helper.make_tensor_value_info("idx", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1])],
        initializer=[numpy_helper.from_array(np.arange(4, dtype=np.float32) * 10, "data")])
    onnx_model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    write_popef(compile_onnx(ModelSpec(onnx_model), CompileOptions(name="gather")), path)
    return str(path)


def spawn(target: Any, *args: Any) -> mp.process.BaseProcess:
    """Start ``target(*args)`` in a spawned daemon process."""
    proc = SPAWN.Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


def finish(proc: mp.process.BaseProcess, timeout: float = 120) -> None:
    """Join a child process; fail the test if it hangs or exits non-zero."""
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join()
        pytest.fail(f"child process {proc.pid} did not finish within {timeout:g} s")
    assert proc.exitcode == 0, f"child process failed with exit code {proc.exitcode} (see stderr)"


# -- fixtures -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def private_machine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    from host_runtime.runner import config as _config

    with pytest.MonkeyPatch.context() as mp_:
        mp_.setenv("IPU_EMULATOR_HOME", str(tmp_path_factory.mktemp("machine")))
        mp_.setattr(_config, "_default_wait_config", lambda: DeviceWaitConfig(
            DeviceWaitStrategy.WAIT_WITH_TIMEOUT, timeout=timedelta(seconds=120),
            sleepTime=timedelta(milliseconds=50)))
        yield


@pytest.fixture(scope="module")
def model_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_example(tmp_path_factory.mktemp("example"), module_shape(request))


@pytest.fixture(scope="module")
def model(model_path: str) -> popef.Model:
    return popef.load_model([model_path])


@pytest.fixture(scope="module")
def weights(request: pytest.FixtureRequest, model: popef.Model) -> np.ndarray:
    return weights_of(model, module_shape(request))


@pytest.fixture(scope="module")
def gather_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_gather(tmp_path_factory.mktemp("gather") / "gather.popef")


@pytest.fixture(scope="module")
def gather_model(gather_path: str) -> popef.Model:
    return popef.load_model([gather_path])


@pytest.fixture(scope="module")
def device() -> Iterator[Device]:
    dev = DeviceManager().getDevice(1, wait_config=PATIENT)
    yield dev
    dev.close()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tests.daemon_rig import DaemonRig
    rig = DaemonRig(tmp_path_factory.mktemp("daemon"))
    try:
        yield rig
    finally:
        rig.stop()


def kill_and_wait(pid: int, timeout: float = 60.0) -> None:
    """SIGKILL an IPU process and wait until it has exited (every thread: what a pidfd sees)."""
    fd = os.pidfd_open(pid)
    try:
        os.kill(pid, signal.SIGKILL)
        ready, _, _ = select.select([fd], [], [], timeout)
        assert ready, f"IPU process {pid} did not die"
    finally:
        os.close(fd)


def processes(pids: Iterable[int]) -> list[psutil.Process]:
    """Handles on those of ``pids`` that exist (one that exits while this looks is left
    out: asking ``pid_exists`` first and ``Process`` next races with its exit)."""
    found = []
    for pid in pids:
        try:
            found.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    return found


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def tag_objects(kind: str | None = None) -> list[str]:
    """This test process's /dev/shm objects (of ``kind``: the name's last part), sorted."""
    prefix = f"ipuemu_{os.environ['IPU_EMULATOR_SHM_TAG']}_"
    return sorted(n for n in os.listdir("/dev/shm") if (n.startswith(prefix) or n.startswith(
        "sem." + prefix)) and (kind is None or n.endswith("_" + kind)))


def shm_mapping(pid: int, name: str) -> dict[str, int | str]:
    """The smaps entry of ``/dev/shm/<name>`` in ``pid``: perms and sizes in bytes."""
    return smaps_of(pid, "/dev/shm/" + name) or {}


def file_mapping(pid: int, path: str) -> dict[str, int | str] | None:
    """Sizes (bytes) and perms of ``pid``'s mappings of the file at ``path`` (None: not
    mapped)."""
    return smaps_of(pid, " " + os.path.realpath(path))


def smaps_of(pid: int, suffix: str) -> dict[str, int | str] | None:
    """``pid``'s smaps entries whose line ends with ``suffix``, sizes (bytes) summed and the
    perms of the last; None if there is none."""
    found: dict[str, int | str] | None = None
    inside = False
    with open(f"/proc/{pid}/smaps", encoding="utf-8") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and ":" not in head[0]:
                inside = line.rstrip().endswith(suffix)
                if inside:
                    found = found if found is not None else {}
                    found["perms"] = head[1]
            elif inside and found is not None and len(head) >= 3 and head[2] == "kB":
                key = head[0].rstrip(":")
                found[key] = int(found.get(key, 0)) + int(head[1]) * 1024
    return found
