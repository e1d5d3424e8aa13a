"""Run by tests/faults/test_shm_full.py in a private mount namespace whose /dev/shm is a
small tmpfs of its own (so that no other test sees it full): a runner is made, then
/dev/shm is filled to the last byte by a file of this program (as another user filling
the shared /dev/shm would), and the runner goes on. Nothing may be killed by SIGBUS: the
runner's requests are answered right, a new region or runner is refused with a named
error, and once the file is removed a new runner works. Prints ``RESULT {json}``.

    python -m tests.faults.shm_full_program POPEF
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np

FILLER = "/dev/shm/shm_full_program.filler"


def fill() -> int:
    """Write ``FILLER`` until /dev/shm has no byte left; its size."""
    fd = os.open(FILLER, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    block = b"\xa5" * (1 << 20)
    written = 0
    try:
        for _ in range(1 << 14):   # bounded: the tmpfs is a few MiB
            try:
                written += os.write(fd, block)
            except OSError:
                break
        for _ in range(1 << 10):   # the last partial MiB, a page at a time
            try:
                written += os.write(fd, block[:4096])
            except OSError:
                break
    finally:
        os.close(fd)
    return written


def main(path: str) -> dict[str, Any]:
    import host_runtime as model_runtime
    from shm import Region, ShmFullError
    from shm.cleanup import list_objects

    report: dict[str, Any] = {}
    one = np.ones((1, 4), np.float32)
    runner = model_runtime.ModelRunner(path)
    w = runner.execute({"tensor_A": one, "tensor_B": 0 * one})["tensor_C"]
    sparse = Region.create(1 << 20, prefault=False)   # made before /dev/shm fills
    header_only = Region.create(1 << 20, backed=4096)  # a constant's ring: slots unbacked
    try:
        report["filled"] = fill()
        report["free_after_fill"] = os.statvfs("/dev/shm").f_bavail
        sparse.buf[:] = b"\x01" * sparse.size      # every page: backed since it was made
        report["sparse_ok"] = bool(sparse.buf[sparse.size - 1] == 1)
        wrong = 0
        for i in range(200):   # the event ring, the device memory: pages touched late
            out = runner.execute({"tensor_A": one * i, "tensor_B": one})["tensor_C"]
            wrong += not np.allclose(out, w * i + 1, rtol=1e-6)
        report["wrong"] = wrong
        header_only.buf[:4096] = b"\x02" * 4096       # its backed part
        try:
            header_only.back()    # before its slots would carry values: refused, named
            report["back_error"] = None
        except ShmFullError as exc:
            report["back_error"] = [type(exc).__name__, str(exc)]
        try:
            Region.create(1 << 20, prefault=False)
            report["region_error"] = None
        except ShmFullError as exc:
            report["region_error"] = [type(exc).__name__, str(exc)]
        try:
            model_runtime.ModelRunner(path).close()
            report["runner_error"] = None
        except Exception as exc:
            report["runner_error"] = [type(exc).__name__, str(exc)]
    finally:
        os.unlink(FILLER)
        for region in (sparse, header_only):
            region.close()
            region.unlink()
    again = model_runtime.ModelRunner(path)
    report["again_right"] = bool(np.allclose(
        again.execute({"tensor_A": one * 3, "tensor_B": one})["tensor_C"], w * 3 + 1))
    again.close()
    runner.close()
    report["left"] = sorted(o.entry for o in list_objects() if o.pid == os.getpid())
    return report


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1])), flush=True)
