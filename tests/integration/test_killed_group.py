"""A host killed together with its IPU processes leaves shared memory that nobody of
its own can remove (``timeout`` sends SIGTERM to the whole process group): the next
process to make a DeviceManager with that tag removes it."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from shm.cleanup import list_objects
from tools.generate_simple_popef import write_simple_popef

pytestmark = pytest.mark.usefixtures("private_machine")

_HOST = textwrap.dedent("""
    import sys, time
    import numpy as np
    import host_runtime as model_runtime
    runner = model_runtime.ModelRunner(sys.argv[1])
    x = np.ones((1, 4), np.float32)
    runner.execute({"tensor_A": x, "tensor_B": x})
    print("ready", flush=True)
    time.sleep(120)
""")


def test_the_next_process_removes_what_a_killed_process_group_left(tmp_path) -> None:
    path = str(tmp_path / "simple.popef")
    write_simple_popef(path, shape=(1, 4))
    host = subprocess.Popen([sys.executable, "-c", _HOST, path], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        ready, _, _ = select.select([host.stdout], [], [], 120)
        assert ready and host.stdout is not None and host.stdout.readline() == "ready\n"
        os.killpg(host.pid, signal.SIGTERM)   # the host, its template, its IPU processes
        assert host.wait(60) == -signal.SIGTERM
    finally:
        if host.poll() is None:
            os.killpg(host.pid, signal.SIGKILL)
            host.wait(60)
    deadline = time.monotonic() + 30
    while True:   # every process of the group gone: none may still unlink anything
        try:
            os.killpg(host.pid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, "the killed group's processes did not exit"
        time.sleep(0.05)   # (bounded) polling for their exits
    left = {o.entry for o in list_objects() if o.pid == host.pid}
    assert left, "expected the killed host's rings and regions to be left behind"
    subprocess.run([sys.executable, "-c", "import host_runtime; host_runtime.DeviceManager()"],
                   check=True, timeout=120)
    assert not {o.entry for o in list_objects() if o.pid == host.pid}
