"""The IPU emulator's knobs: the IPU process, its launch, the daemon, and the machine.

:class:`IpuSettings` extends ``shm.settings.ShmSettings`` (the mechanism and its
rules are there). The host's ``HostSettings`` extends this class in turn, so a
host's settings object carries these knobs down to the IPU processes it starts:
the launcher puts them into each process's environment (``to_env()``), where
the process reads them with ``IpuSettings.current()`` once it starts. A daemon
takes its own when it starts and gives them to the IPU processes of its pool.

The machine's knobs (home, configuration file, IPU count, version, tiles,
memory, compute threads) are read at each use (``IpuSettings.read``), by
:mod:`ipu_emulator.system`: they say which machine, and tests and the pytest
plugin change them at run time.
"""

from __future__ import annotations

from dataclasses import dataclass

from ipu_emulator.faults import setting as _faults_setting
from shm.settings import (EACH_USE, ShmSettings, accepts, choice, flag, integer, knob, level,
                          micros, seconds, text)

__all__ = ["IpuSettings", "IPU_VERSION_NAMES"]

_IPU = "an IPU process starts"
_DAEMON = "the daemon starts"

IPU_VERSION_NAMES = {"ipu2": "ipu2", "ipu21": "ipu21", "2": "ipu2", "21": "ipu21"}
"""The texts an IPU version may be given as, and the version each names."""


@dataclass(frozen=True)
class IpuSettings(ShmSettings):
    """The knobs of ``ipu_emulator`` (and, inherited, of ``shm``)."""

    device_spin_us: float = knob(
        50.0, "IPU_EMULATOR_DEVICE_SPIN_US", micros,
        "an IPU process's poll of an empty input ring before it blocks, while recent inputs "
        "came quickly; 0: never poll", when=_IPU)
    yielded_us: float = knob(
        5.0, "IPU_EMULATOR_YIELDED_US", micros,
        "a `sched_yield` between polls that took longer ran another task on this CPU: the "
        "poller blocks instead (IPU process unless it keeps apart, host on one CPU); "
        "0: never", when=f"{_IPU}; a runner is made")
    zero_copy: bool = knob(
        True, "IPU_EMULATOR_ZERO_COPY", flag,
        "`0`: the IPU process copies stream transfers instead of computing in ring slots "
        "(for measurements)", when=_IPU)
    prepack: bool = knob(
        True, "IPU_EMULATOR_PREPACK", flag,
        "`0`: IPU processes compute with the model's weights where they lie, one read-only "
        "copy in shared memory for all replicas, instead of each keeping its own copy "
        "prepacked for speed (MatMul-heavy models several times slower; `docs/memory.md`)",
        when="a runner or session is made")
    keep_apart: bool = knob(
        True, "IPU_EMULATOR_KEEP_APART", flag,
        "`0`: the scheduler alone places IPU processes (else a busy one holds a CPU of its "
        "own, one per CPU machine-wide, off the CPU of the host thread that submits its "
        "requests)", when=_IPU)
    forkserver: bool = knob(
        True, "IPU_EMULATOR_FORKSERVER", flag,
        "`0`: start every IPU process as a fresh `python -m ipu_emulator` instead of forking "
        "it from the host's template process (started once, with numpy and onnxruntime "
        "imported once; its log is `forkserver.log`)", when=_IPU)
    device_log_level: str = knob(
        "WARNING", "IPU_EMULATOR_DEVICE_LOG_LEVEL", level,
        "logging level of IPU processes (their `ipuN.log` files, under `$IPU_EMULATOR_HOME`)",
        when=_IPU)
    start_timeout: float = knob(
        120.0, "IPU_EMULATOR_START_TIMEOUT", seconds,
        "how long an IPU process may take to start (a fresh Python imports onnxruntime)",
        when=_IPU)
    daemon_log_level: str = knob(
        "INFO", "IPU_EMULATOR_DAEMON_LOG_LEVEL", level,
        "logging level of `ipu-emulator daemon` (its `--log-level` default)", when=_DAEMON)
    daemon_handover_timeout: float = knob(
        30.0, "IPU_EMULATOR_DAEMON_HANDOVER_TIMEOUT", seconds,
        "how long a daemon's reset of an IPU between hosts may take before it restarts the "
        "IPU process", when=_DAEMON)
    faults: str = knob(
        "", "IPU_EMULATOR_FAULTS", accepts("JSON, or a file's path")(_faults_setting),
        "faults to inject (JSON text, or the path of a JSON or YAML file; see "
        "`docs/faults.md`): a bad one is refused naming the fault, the field and the value",
        when="a runner or session is made; the daemon starts", shown="none")
    trace: str | None = knob(
        None, "IPU_EMULATOR_TRACE", text(shown="a file's path"),
        "record a timeline of the host and its IPU processes into this file (Chrome trace "
        "JSON, written at exit; `%p`: the process's pid); see docs/tracing.md",
        when="the program first uses the runtime (imports `host_runtime.devices`)",
        shown="none")
    trace_events: int = knob(
        65536, "IPU_EMULATOR_TRACE_EVENTS", integer(16, 1 << 24),
        "events each process keeps while tracing (the oldest are dropped past it; 48 bytes "
        "each in an IPU process's shared memory)", when="tracing starts")
    force_modules: bool = knob(
        False, "IPU_EMULATOR_FORCE_MODULES", flag,
        "`1`: `ipu-emulator run`, `ipu_emulator.run.install()` and the pytest plugin's "
        "`--ipu-emulator-modules` map `model_runtime`, `popef` and `poprt` onto the emulator "
        "even where Graphcore's real modules are installed (else they refuse)",
        when=EACH_USE)
    # -- which machine (read at each use, by ipu_emulator.system) --
    home: str | None = knob(
        None, "IPU_EMULATOR_HOME", text(r"/.*", "an absolute path (starting with /)",
                                         "an absolute path"),
        "the machine's folder: lock files, IPU process logs, the daemon's socket (must be "
        "your own folder)", when=EACH_USE,
        shown="`~/.ipu_emulator`, else `/tmp/ipu_emulator-<uid>`")
    config: str | None = knob(
        None, "IPU_EMULATOR_CONFIG", text(shown="a file's path"),
        "YAML file of the machine: `num_ipus`, `ipu_version`, `tiles_per_ipu`, "
        "`memory_per_tile`, `compute_threads` (the variables below override it)",
        when=EACH_USE, shown="none")
    num_ipus: int | None = knob(
        None, "IPU_EMULATOR_NUM_IPUS", integer(0, 64),
        "the machine's IPUs", when=EACH_USE, shown="4")
    ipu_version: str | None = knob(
        None, "IPU_EMULATOR_IPU_VERSION", choice(IPU_VERSION_NAMES),
        "their version: `ipu2` or `ipu21` (or `2`, `21`)", when=EACH_USE, shown="`ipu21`")
    tiles_per_ipu: int | None = knob(
        None, "IPU_EMULATOR_TILES_PER_IPU", integer(1, 1 << 20),
        "tiles of each IPU", when=EACH_USE, shown="1472")
    memory_per_tile: int | None = knob(
        None, "IPU_EMULATOR_MEMORY_PER_TILE", integer(1, 1 << 32, units=True),
        "bytes of each tile (a suffix `k`, `KiB`, `m`, `MiB` may scale them)",
        when=EACH_USE, shown="638976 (624 KiB)")
    compute_threads: int | None = knob(
        None, "IPU_EMULATOR_COMPUTE_THREADS", integer(1, 256),
        "onnxruntime threads of each IPU process", when=EACH_USE, shown="1")
