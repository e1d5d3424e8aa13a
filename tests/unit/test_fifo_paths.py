"""A FIFO (or a device) at a path the emulator reads is refused by name at once, never
waited on: the machine config, the faults file, poprt's YAML files, poprt_exec's inputs
(the PopEF reader: tests/unit/test_popef_damage.py)."""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, Iterator

import pytest

from ipu_emulator.errors import ConfigYamlError
from ipu_emulator.safe_files import open_regular
from ipu_emulator.yaml_config import load_yaml_file
from shm.settings import SettingsError


@pytest.fixture
def fifo(tmp_path) -> Iterator[str]:
    path = str(tmp_path / "fifo")
    os.mkfifo(path)
    done = threading.Event()

    def rescue() -> None:   # should a read block after all: a writer ends it (and the test fails)
        if not done.wait(20):
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
    t = threading.Thread(target=rescue, daemon=True)
    t.start()
    yield path
    done.set()
    t.join()


def _refused(call: Callable[[], Any], kind: type[BaseException], text: str) -> None:
    with pytest.raises(kind) as exc:
        call()
    assert text in str(exc.value), str(exc.value)


def test_open_regular_names_what_the_path_is(fifo):
    _refused(lambda: open_regular(fifo), OSError, "not a regular file but a FIFO")
    _refused(lambda: open_regular("/dev/null"), OSError, "not a regular file but a character "
             "device")
    _refused(lambda: open_regular(os.path.dirname(fifo)), OSError, "but a folder")


def test_yaml_files_machine_config_and_sharding(fifo):
    _refused(lambda: load_yaml_file(fifo, "sharding config"), ConfigYamlError,
             f"cannot read sharding config '{fifo}': not a regular file but a FIFO")


def test_the_faults_setting(fifo):
    from host_runtime.settings import HostSettings

    _refused(lambda: HostSettings.from_env({"IPU_EMULATOR_FAULTS": fifo}), SettingsError,
             "nor a readable file: not a regular file but a FIFO")


def test_the_machine_config(fifo, monkeypatch):
    from ipu_emulator.system import SystemConfigError, load_system_config

    _refused(lambda: load_system_config({"IPU_EMULATOR_CONFIG": fifo}), SystemConfigError,
             "not a regular file but a FIFO")


def test_poprt_exec_inputs(fifo):
    from tools.poprt_exec import _given

    _refused(lambda: _given([f"x={fifo}"]), SystemExit,
             f"poprt_exec: --input x={fifo}: not a regular file but a FIFO; expected a .npy")
    _refused(lambda: _given(["x=/dev/zero"]), SystemExit, "but a character device")
