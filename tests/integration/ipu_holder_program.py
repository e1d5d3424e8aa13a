"""Run by tests/integration/test_ipu_exclusive.py in fresh processes: a host that attaches
IPUs as a user's program does (``DeviceManager().getDevice``; embedded, or through the
daemon ``IPU_EMULATOR_DAEMON`` names) and says when it held which.

    python -m tests.integration.ipu_holder_program churn N   # attach, hold, release N times
    python -m tests.integration.ipu_holder_program hold      # attach one; hold until stdin closes

``churn`` waits for an IPU as long as it takes (WAIT_WITH_TIMEOUT, 120 s) and prints
``RESULT [[ipus, t_attached, t_released], ...]`` with CLOCK_MONOTONIC times, which all
processes of the machine share: two holds of one IPU that overlap in time were handed
out twice. ``hold`` prints ``HOLDING [ipus]`` and releases when its stdin closes.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import timedelta


def main(argv: list[str]) -> int:
    import host_runtime as model_runtime

    dm = model_runtime.DeviceManager()
    if argv[0] == "hold":
        dev = dm.getDevice(1)
        print("HOLDING " + json.dumps(dev.ipus()), flush=True)
        sys.stdin.read()
        dev.close()
        return 0
    wait = model_runtime.DeviceWaitConfig(timedelta(seconds=120), timedelta(seconds=0.01))
    held = []
    for _ in range(int(argv[1])):
        dev = dm.getDevice(1, wait_config=wait)
        attached = time.monotonic()
        ipus = dev.ipus()
        time.sleep(0.005)   # hold it a little: a second holder now would overlap
        released = time.monotonic()
        dev.close()
        held.append([ipus, attached, released])
    print("RESULT " + json.dumps(held), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
