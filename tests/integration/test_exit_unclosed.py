"""Programs that exit without closing what they opened still exit cleanly.

Each case runs a small script in a subprocess with its own emulated machine and
shared-memory tag, leaves a Session / Device / ModelRunner / Ring open (with a
thread of ours blocked on a ring) and returns from the script. It must exit
with code 0 (no SIGSEGV from an exit hook unmapping a semaphore under a waiting
thread), every IPU process it started must be gone, and /dev/shm must hold
nothing of its tag.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import textwrap

import psutil
import pytest

SHAPE = (1, 4)     # the example model (model_path fixture); the scripts assume it

_PRELUDE = """
import os, sys, psutil
def report():
    kids = psutil.Process().children(recursive=True)
    print("CHILDREN", " ".join(str(p.pid) for p in kids), flush=True)
"""

_SESSION_MAIN = """
import numpy as np
from host_runtime.devices._manager import DeviceManager
from host_runtime.session._session import Session
s = Session([sys.argv[1]])
dev = DeviceManager().getDevice(1)
s.bindToDevice(dev)
a = np.full((1, 4), 2, np.float32)
b = np.full((1, 4), 1, np.float32)
out = np.zeros((1, 4), np.float32)
def feed(arr):
    def cb(view): np.frombuffer(view, np.float32)[:] = arr.ravel()
    return cb
def sink(view): out[:] = np.frombuffer(view, np.float32).reshape(1, 4)
s.setCallbackForAnchor("tensor_A", feed(a))
s.setCallbackForAnchor("tensor_B", feed(b))
s.setCallbackForAnchor("tensor_C", sink)
s.runLoadPrograms()
s.runMainPrograms()
w = np.frombuffer(s.model().tensorData("weights").data, np.float32).reshape(1, 4)
print("OUT", "OK" if np.allclose(out, a * w + b, rtol=1e-6) else out, flush=True)
report()
"""

_SESSION_BIND = """
from host_runtime.devices._manager import DeviceManager
from host_runtime.session._session import Session
s = Session([sys.argv[1]])
s.bindToDevice(DeviceManager().getDevice(1))
report()
"""

_DEVICE = """
from host_runtime.devices._manager import DeviceManager
dev = DeviceManager().getDevice(1)
report()
"""

_RUNNER = """
import numpy as np
import host_runtime
r = host_runtime.ModelRunner(host_runtime.PopefPaths([sys.argv[1]]))
x = {d.name: np.ones(d.shape, d.numpy_data_type()) for d in r.getExecuteInputs()}
print("OUT", r.execute(x)["tensor_C"].shape, flush=True)
report()
"""

# A reader thread blocked on a ring at exit; an exit hook registered before the ring
# was made (so it runs after every hook registered later) still uses the ring: it
# publishes a message and waits for the reader to get it.
_RING = """
import atexit, threading
got = threading.Event()
def last_hook():
    r.write(b"bye")
    print("READER GOT IT" if got.wait(30) else "READER LOST", flush=True)
atexit.register(last_hook)
from shm import Ring
r = Ring.create(64, 4)
started = threading.Event()
def reader():
    started.set()
    data, _ = r.acquire_read()
    if bytes(data) == b"bye":
        got.set()
threading.Thread(target=reader, daemon=True).start()
started.wait()
report()
"""

CASES = {
    "session_main_run": (_SESSION_MAIN, "OUT OK"),
    "session_bound": (_SESSION_BIND, None),
    "device": (_DEVICE, None),
    "model_runner": (_RUNNER, "OUT (1, 4)"),
    "ring_blocked_reader": (_RING, "READER GOT IT"),
}


def _objects(tag: str) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if f"ipuemu_{tag}_" in n)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("case", sorted(CASES))
def test_exit_without_close_is_clean(case, model_path, tmp_path):
    body, expected = CASES[case]
    script = tmp_path / f"{case}.py"
    script.write_text(textwrap.dedent(_PRELUDE) + textwrap.dedent(body))
    tag = "x" + secrets.token_hex(4)
    env = dict(os.environ, IPU_EMULATOR_HOME=str(tmp_path / "machine"),
               IPU_EMULATOR_SHM_TAG=tag, IPU_EMULATOR_NUM_IPUS="1")
    proc = subprocess.run([sys.executable, "-X", "faulthandler", str(script), model_path],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != -11, proc.stderr
    assert proc.returncode == 0, proc.stderr
    assert "Fatal Python error" not in proc.stderr
    assert "ignored SHUTDOWN" not in proc.stderr
    if expected is not None:
        assert expected in proc.stdout, proc.stdout + proc.stderr
    children = [ln for ln in proc.stdout.splitlines() if ln.startswith("CHILDREN")]
    assert len(children) == 1, proc.stdout
    pids = [int(p) for p in children[0].split()[1:]]
    if case != "ring_blocked_reader":
        assert pids, "the script should have started an IPU process"
    alive = [p for p in pids if _running(p)]
    assert alive == [], f"IPU processes left running: {alive}"
    assert _objects(tag) == []
