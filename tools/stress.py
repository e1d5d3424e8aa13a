"""``ipu-emulator stress``: hammer the runtime with many hosts, threads, batch sizes and faults.

::

    ipu-emulator stress [--duration S] [--requests N] [--hosts N] [--threads N]
                        [--replicas N] [--scenario NAME ...] [--seed N] [--daemon] [--json]
                        [--metrics-port PORT [--metrics-address ADDR]]

Each scenario starts ``--hosts`` host processes (``tools._stress_host``, fresh
Pythons) on a private emulated machine (own IPU_EMULATOR_HOME and shm tag,
``hosts x replicas`` IPUs) and checks every result against numpy:

- ``mixed``: execute / executeAsync, runner- or user-allocated outputs, dicts of
  numpy, memory views or fresh ``empty_shared`` arrays (read and written in place
  by the IPU process), random replicas, ``thread_safe`` runners;
- ``batching``: dynamic batching with random batch sizes on a batch-4 model;
- ``fused``: the PopRT Runner on a fused model, random branches;
- ``kill-ipu``: SIGKILL random IPU processes while requests run (``auto_reset``; every
  other host batches dynamically):
  each request returns the right value or fails with DeviceLostError /
  DeviceTimeoutError, none hangs, and requests after the faults succeed;
- ``kill-pipeline``: a MatMul/Relu chain pipelined over 2 IPUs (one IPU process per
  stage, ``auto_reset``) under load while random IPU processes are SIGKILLed: the
  whole device is lost and reloaded; the same checks as ``kill-ipu``;
- ``kill-host``: SIGKILL random host processes (replaced while time remains):
  their IPU processes exit and /dev/shm holds nothing of theirs, others go on;
- ``daemon``: hosts attach, run and detach through a private daemon in a loop.
- ``fork``: while its workers execute (as in ``mixed``), each host forks children
  one after another: a child's use of the host's runner must raise ForkedProcessError
  (counted as failed as expected), a runner the child makes must answer right, and
  the child's letting go (exit hooks, close(), del, os._exit) must leave the host's
  /dev/shm objects and runner intact and nothing of its own.
- ``interrupt``: KeyboardInterrupts land in the hosts' threads while they are inside
  ``execute``, ``executeAsync``, a future's wait or ``runMainPrograms`` (a real SIGINT
  whose handler raises in a host's main thread, which is a worker too; asynchronous
  exceptions in its other threads), every 5-40 ms; a thread of each host runs a
  Session's queues whose callbacks raise now and then (every other host batches
  dynamically). An interrupted request or a run a callback failed is failed as
  expected; every other answer, and every queue output buffer, must be its own.
- ``faults``: each host runs the example model one request at a time under a seeded
  schedule of injected faults of every kind (``ipu_emulator.faults``), with and
  without ``auto_reset``, then a pipelined model with ``link_down``
  (``tools._stress_faults``): an answer is right, failed as expected (the class the
  fault must give; the class of the failure a replica nothing reset keeps giving,
  after which the host makes a new runner), wrong or hung; it reports the faults
  injected, the resets and the recovery times. Short by default (about 12 requests
  per phase; ``--requests`` sets it).
- ``shared-machine``: what another user of the machine can do (``tools._stress_shared``):
  each host runs a 4 MiB model with ``auto_reset`` while a thread of it truncates and
  rewrites the model's PopEF file in place (and writes it back), fills /dev/shm with a
  file of its own for a moment (at most ``--shm-fill-mib``, removed at once) and kills
  the runner's IPU process; every tenth request makes a new runner of the file as it
  is then. An answer is right or fails with a named error (counted as expected); a
  host killed by a signal (SIGBUS) fails the scenario. Run as root, the whole command
  runs in a mount namespace of its own whose /dev/shm is a private tmpfs of
  ``--private-shm-mib`` (default 256), so that /dev/shm is filled to its last byte
  without any other process of the machine seeing it (``0``: the machine's /dev/shm,
  filled by ``--shm-fill-mib`` at most).

While a scenario runs, a progress line (requests, rate, failures so far) is
rewritten in place on a terminal; when stdout is not one, a plain line is
printed as each scenario ends (neither with ``--json``). ``--metrics-port``
serves the same live counters as Prometheus metrics (tools._stress_live).

At the end no process the run started may be alive and nothing of its tag may
be in /dev/shm (a leak is removed and reported as a failure). Exit 0 when every
scenario passed, 1 otherwise, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict
from typing import Any

import numpy as np

from tools._stress_live import LiveStats, Progress, ScenarioResult, StressCollector
from tools._stress_rig import HostProc, Rig
from tools._stress_spec import HostSpec

__all__ = ["SCENARIOS", "ScenarioResult", "main", "run"]

_log = logging.getLogger(__name__)

SCENARIOS = ("mixed", "batching", "fused", "kill-ipu", "kill-pipeline", "kill-host", "daemon",
             "fork", "interrupt", "faults", "shared-machine")
_IPUS_PER_DEVICE = {"kill-pipeline": 2, "faults": 2}   # IPUs of the scenario's model (sharded)


def _machine_ipus(name: str, opts: argparse.Namespace) -> int:
    """IPUs a scenario's hosts hold at once (fork: each host's child makes a runner of
    one IPU while the host holds its own; interrupt: each host's queue session has one;
    shared-machine: each host makes a second runner now and then)."""
    held = int(opts.hosts * opts.replicas * _IPUS_PER_DEVICE.get(name, 1))
    return held + int(opts.hosts) if name in ("fork", "interrupt", "shared-machine") else held
_STARTUP_ALLOWANCE = 120.0     # seconds a host may take to import and load its model


class _Scenario:
    """Runs one scenario's hosts and faults on the rig."""

    def __init__(self, rig: Rig, name: str, opts: argparse.Namespace, rng: random.Random,
                 live: LiveStats | None = None) -> None:
        self.rig, self.name, self.opts, self.rng = rig, name, opts, rng
        self.live = live
        self.result = ScenarioResult(name)
        self.hosts: list[HostProc] = []
        self.latencies: list[float] = []
        self.use_daemon = opts.daemon or name == "daemon"

    def _spec(self, duration: float | None) -> HostSpec:
        # The fault scenarios run every other host with dynamic batching.
        batching = self.name == "batching" or (
            self.name in ("kill-ipu", "kill-host", "interrupt") and len(self.hosts) % 2 == 1)
        o = self.opts
        return HostSpec(scenario=self.name, seed=self.rng.randrange(1 << 30),
                        models=self.rig.models, batching=batching, replicas=o.replicas,
                        threads=o.threads, duration=duration, max_seconds=o.max_seconds,
                        requests=o.requests, hang_timeout=o.hang_timeout,
                        inject_wrong=o.inject_wrong, shm_fill_mib=o.shm_fill_mib,
                        daemon_socket=self.rig.daemon_socket if self.use_daemon else None)

    def _start(self, duration: float | None) -> HostProc:
        host = self.rig.start_host(self._spec(duration))
        self.hosts.append(host)
        self.result.hosts += 1
        return host

    def _pool_size(self) -> int:
        """IPUs of the scenario's daemon. In the daemon scenario hosts x threads runners of
        ``replicas`` IPUs attach at once; a runner takes its IPUs one by one, waiting for the
        next while holding the first, so fewer than n x (r - 1) + 1 IPUs could deadlock, and
        that many makes runners wait for each other without."""
        o = self.opts
        if self.name != "daemon":
            return _machine_ipus(self.name, o)
        return int(max(o.hosts * o.replicas // 2, o.hosts * o.threads * (o.replicas - 1) + 1,
                   o.replicas))

    def run(self) -> ScenarioResult:
        t0 = time.monotonic()
        if self.live is not None:
            self.live.begin(self)
        self.rig.refresh_models(self.name)
        if self.use_daemon:
            self.rig.start_daemon(self._pool_size())
        try:
            self._run()
        finally:
            self.result.problems.extend(self.rig.stop_daemon())
        self._check_tag_empty()
        self.result.seconds = round(time.monotonic() - t0, 1)
        if self.live is not None:
            self.live.end(self.result)
        return self.result

    def _run(self) -> None:
        duration = self.opts.duration
        for _ in range(self.opts.hosts):
            self._start(duration)
        limit = time.monotonic() + _STARTUP_ALLOWANCE + (duration or self.opts.max_seconds) \
            + 2 * self.opts.hang_timeout
        if self.name in ("kill-ipu", "kill-pipeline"):
            self._kill_ipus(limit)
        elif self.name == "kill-host":
            self._kill_hosts(limit, duration)
        self._collect(limit)
        if self.latencies:
            self.result.p50_ms = round(float(np.percentile(self.latencies, 50)), 2)
            self.result.p99_ms = round(float(np.percentile(self.latencies, 99)), 2)

    # ------------------------------------------------------------------ faults
    def _live(self) -> list[HostProc]:
        return [h for h in self.hosts if not h.killed and h.proc.poll() is None]

    def _ipu_pids(self, host: HostProc) -> list[int]:
        if not self.use_daemon or self.rig.daemon_socket is None:
            return [p.pid for p in self.rig.ipu_processes_of(host.proc.pid)]
        from ipu_emulator.daemon import socket_protocol as wire

        try:
            status = wire.request(self.rig.daemon_socket, {"op": "status"}, timeout=10.0)
        except (OSError, ValueError):
            return []
        return [i["pid"] for i in status["ipus"] if i.get("holder") == host.proc.pid and i["pid"]]

    def _held_by(self, pid: int, timeout: float) -> list[str]:
        """IPUs the daemon still lends to ``pid`` after waiting up to ``timeout`` s for none."""
        if not self.use_daemon or self.rig.daemon_socket is None:
            return []
        from ipu_emulator.daemon import socket_protocol as wire

        end = time.monotonic() + timeout
        while True:
            try:
                status = wire.request(self.rig.daemon_socket, {"op": "status"}, timeout=10.0)
                held = [str(i["ipu"]) for i in status["ipus"] if i.get("holder") == pid]
            except (OSError, ValueError) as exc:
                return [f"(status failed: {exc})"]
            if not held or time.monotonic() > end:
                return held
            time.sleep(0.05)

    def _pause(self) -> None:
        time.sleep(self.rng.uniform(0.3, 1.0))

    def _kill_ipus(self, limit: float) -> None:
        """SIGKILL a random IPU process of a running host until every host quiesced."""
        while time.monotonic() < limit:
            live = self._live()
            if not live:
                break
            for h in live:
                if h.quiesce.is_set():
                    h.go()
            targets = [h for h in live if h.ready.is_set() and not h.quiesce.is_set()
                       and time.time() < h.deadline - 0.5]
            if not targets and all(h.quiesce.is_set() for h in live):
                break
            if targets:
                host = self.rng.choice(targets)
                pids = self._ipu_pids(host)
                if pids:
                    pid = self.rng.choice(pids)
                    try:
                        os.kill(pid, signal.SIGKILL)
                        self.result.ipus_killed += 1
                    except OSError:
                        pass
            self._pause()
        for h in self.hosts:
            h.go()

    def _kill_hosts(self, limit: float, duration: float | None) -> None:
        """SIGKILL a random ready host, then start another while time remains."""
        while not any(h.ready.wait(0.1) for h in self.hosts) and time.monotonic() < limit:
            pass
        end = time.monotonic() + (duration or self.opts.max_seconds)
        while time.monotonic() < min(limit, end - 1.0):
            self._pause()
            live = [h for h in self._live() if h.ready.is_set()]
            if len(self._live()) < 2 or not live or time.monotonic() >= end - 1.0:
                continue       # one host always goes on
            host = self.rng.choice(live)
            self.rig.scan_once()
            host.ipu_pids = self._ipu_pids(host) if not self.use_daemon else []
            host.proc.kill()
            host.proc.wait()
            host.killed = True
            self.result.hosts_killed += 1
            remaining = end - time.monotonic()
            if remaining > 2.0:
                self._start(remaining if duration else None)

    # ------------------------------------------------------------------ results
    def _collect(self, limit: float) -> None:
        res = self.result
        for h in self.hosts:
            if h.killed:
                continue
            try:
                code = h.proc.wait(max(1.0, limit - time.monotonic()))
            except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired
                h.proc.kill()
                code = h.proc.wait()
                res.hung += 1
                res.problems.append(f"hung: host {h.index} (pid {h.proc.pid}) did not finish; "
                                    f"killed")
            out = h.result()
            if out is None:
                res.errors += 1
                res.problems.append(f"host {h.index} (pid {h.proc.pid}) exited with code "
                                    f"{code} without a result: {h.stderr_tail()}")
                continue
            for k in ("ok", "expected", "wrong", "hung", "errors", "cycles"):
                setattr(res, k, getattr(res, k) + int(out[k]))
            extra = out.get("extra") or {}
            res.faults += int(extra.get("injected", 0))
            res.resets += int(extra.get("resets", 0))
            res.recovery_ms.extend(float(x) for x in extra.get("recovery_ms", []))
            self.latencies.extend(out["latencies_ms"])
            res.problems.extend(f"host {h.index}: {p}" for p in out["problems"])
            if code not in (0, 3):
                res.errors += 1
                res.problems.append(f"host {h.index} exited with code {code}: {h.stderr_tail()}")
        for h in self.hosts:
            if h.killed:
                pids = {h.proc.pid, *h.ipu_pids}
                res.orphans_checked += len(h.ipu_pids)
                live, objs = self.rig.wait_gone(pids, 30.0)
                for pid in live:
                    res.leaks += 1
                    res.problems.append(f"leak: IPU process {pid} of killed host {h.proc.pid} "
                                        "still alive 30 s after the kill")
                held = self._held_by(h.proc.pid, 30.0)
                if held:
                    res.leaks += 1
                    res.problems.append(f"leak: the daemon still lends IPU(s) {held} to killed "
                                        f"host {h.proc.pid} 30 s after the kill")
                for entry in objs:
                    res.leaks += 1
                    res.problems.append(f"leak: /dev/shm/{entry} of killed host "
                                        f"{h.proc.pid} still there 30 s after the kill")

    def _check_tag_empty(self) -> None:
        """Every host (and the daemon) has exited: nothing of the tag may be left. An IPU
        process whose host left abnormally removes the host's objects: give it 10 s."""
        res = self.result
        end = time.monotonic() + 10.0
        left = self.rig.shm_objects()
        while left and time.monotonic() < end:
            time.sleep(0.05)
            left = self.rig.shm_objects()
        for entry in left:
            res.leaks += 1
            res.problems.append(f"leak: /dev/shm/{entry} left after every process exited")
            try:
                os.unlink(os.path.join("/dev/shm", entry))
            except OSError:
                pass


# ---------------------------------------------------------------------------- report
_COLUMNS = ("scenario", "hosts", "events", "ok", "failed as expected", "wrong", "hung",
            "errors", "p50 ms", "p99 ms", "leaks", "verdict")


def _row(r: ScenarioResult) -> list[str]:
    killed = f"{r.hosts_killed} hosts killed" if r.name == "kill-host" else \
        f"{r.ipus_killed} ipus killed" if r.name in ("kill-ipu", "kill-pipeline") else \
        f"{r.cycles} attaches" if r.name == "daemon" else \
        f"{r.cycles} forks" if r.name == "fork" else \
        f"{r.cycles} interrupts" if r.name == "interrupt" else \
        (f"{r.faults} faults, {r.resets} resets, recovery "
         + (f"p50 {float(np.percentile(r.recovery_ms, 50)):.0f} / max "
            f"{max(r.recovery_ms):.0f} ms" if r.recovery_ms else "-")) \
        if r.name == "faults" else \
        f"{r.faults} changes" if r.name == "shared-machine" else "-"
    return [r.name, str(r.hosts), killed, str(r.ok), str(r.expected), str(r.wrong), str(r.hung),
            str(r.errors), "-" if r.p50_ms is None else f"{r.p50_ms:.2f}",
            "-" if r.p99_ms is None else f"{r.p99_ms:.2f}", str(r.leaks),
            "PASS" if r.passed else "FAIL"]


def format_table(results: list[ScenarioResult]) -> str:
    rows = [list(_COLUMNS)] + [_row(r) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in
                       enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for r in results:
        for p in r.problems[:10]:
            lines.append(f"  {r.name}: {p}")
        if len(r.problems) > 10:
            lines.append(f"  {r.name}: ... {len(r.problems) - 10} more")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- main
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ipu-emulator stress",
        description="Hammer the runtime with many hosts, threads, batch sizes and faults on a "
        "private emulated machine; check every result against numpy, and that nothing hangs "
        "or leaks.")
    p.add_argument("--duration", type=float, help="seconds of load per scenario (default 20, "
                   "or unbounded up to --max-seconds when --requests is given)")
    p.add_argument("--requests", type=int, help="requests per host per scenario")
    p.add_argument("--hosts", type=int, default=2, help="host processes (default 2)")
    p.add_argument("--threads", type=int, default=3, help="threads per host (default 3)")
    p.add_argument("--replicas", type=int, default=2, help="replicas per runner (default 2)")
    p.add_argument("--scenario", action="append", choices=SCENARIOS,
                   help="scenario to run; repeatable (default: mixed)")
    p.add_argument("--seed", type=int, help="random seed (default: random, printed)")
    p.add_argument("--daemon", action="store_true",
                   help="start a private daemon and run every scenario's hosts through it")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--hang-timeout", type=float, default=30.0,
                   help="seconds after which a request counts as hung (default 30)")
    p.add_argument("--max-seconds", type=float, default=600.0, help=argparse.SUPPRESS)
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    p.add_argument("--trace", metavar="FILE",
                   help="record a timeline of every host process (and the daemon) and their "
                        "IPU processes into FILE (docs/tracing.md)")
    p.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="serve the live counters as Prometheus metrics at "
                   "http://ADDRESS:PORT/metrics while the run lasts (0: a free port, printed)")
    p.add_argument("--metrics-address", default="127.0.0.1", metavar="ADDRESS",
                   help="address /metrics listens on (default 127.0.0.1)")
    p.add_argument("--shm-fill-mib", type=int, default=256, metavar="MIB",
                   help="shared-machine: the most /dev/shm is filled with (default 256)")
    p.add_argument("--private-shm-mib", type=int, default=256, metavar="MIB",
                   help="shared-machine, as root: run in a mount namespace whose /dev/shm "
                   "is a private tmpfs of MIB (default 256; 0: the machine's /dev/shm)")
    # Internal hook (tests): the first N checks of each host expect a wrong value.
    p.add_argument("--inject-wrong", type=int, default=0, help=argparse.SUPPRESS)
    return p


def run(opts: argparse.Namespace, live: LiveStats | None = None,
        progress: Progress | None = None) -> tuple[list[ScenarioResult], list[str]]:
    """Run the scenarios; return their results and the run-wide problems (leaks).

    ``live``: counters as they go (``--metrics-port``); ``progress``: a line per scenario.
    """
    scenarios = opts.scenario or ["mixed"]
    rng = random.Random(opts.seed)
    rig = Rig(num_ipus=max(_machine_ipus(name, opts) for name in scenarios), seed=opts.seed % 1000,
              keep=opts.keep)
    results: list[ScenarioResult] = []
    problems: list[str] = []
    parts = _trace_parts(rig, opts.trace)
    try:
        for name in scenarios:
            _log.info("scenario %s", name)
            results.append(_Scenario(rig, name, opts, rng, live).run())
            if progress is not None:
                progress.scenario_done()
    except BaseException:
        rig.kill_all()      # e.g. Ctrl-C: do not wait for the hosts' deadlines
        raise
    finally:
        problems = rig.finish()
        if parts is not None:
            _write_trace(parts, opts.trace)
        if opts.keep:
            print(f"ipu-emulator stress: work directory kept: {rig.workdir}", file=sys.stderr)
    return results, problems


def _trace_parts(rig: Rig, path: str | None) -> str | None:
    """--trace: each process of the rig writes its own trace into a folder (None: off)."""
    if not path:
        return None
    parts = tempfile.mkdtemp(prefix="ipuemu-stress-trace-")
    rig.env["IPU_EMULATOR_TRACE"] = os.path.join(parts, "trace-%p.json")
    return parts


def _write_trace(parts: str, path: str) -> None:
    """The processes' traces as one file at ``path`` (killed hosts wrote none)."""
    from ipu_emulator import trace

    traces = []
    for name in sorted(os.listdir(parts)):
        if name.endswith(".json"):
            with open(os.path.join(parts, name), encoding="utf-8") as f:
                traces.append(json.load(f))
    trace.write(trace.combine(traces), os.path.abspath(path))
    shutil.rmtree(parts, ignore_errors=True)
    print(f"ipu-emulator stress: timeline of {len(traces)} processes written to {path}",
          file=sys.stderr)


def _serve_metrics(live: LiveStats, port: int, address: str) -> Any:
    from prometheus_client import CollectorRegistry

    from ipu_emulator.daemon.daemon_metrics import MetricsServer

    registry = CollectorRegistry()
    registry.register(StressCollector(live))
    try:
        server = MetricsServer(registry, port, address)
    except OSError as exc:
        print(f"ipu-emulator stress: cannot serve /metrics at {address}:{port}: {exc}",
              file=sys.stderr)
        return None
    print(f"ipu-emulator stress: serving /metrics at {server.url}", file=sys.stderr, flush=True)
    return server


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    opts = parser.parse_args(argv)
    for name, hi in (("hosts", 64), ("threads", 256), ("replicas", 64),
                     ("requests", 1 << 40)):
        value = getattr(opts, name)
        if value is not None and not 1 <= value <= hi:
            parser.error(f"--{name} must be in 1..{hi}, got {value}")
    for name in ("duration", "hang_timeout", "max_seconds"):
        value = getattr(opts, name)
        if value is not None and not 0 < value <= 86400:   # NaN fails too
            parser.error(f"--{name.replace('_', '-')} must be in (0, 86400] seconds, "
                         f"got {value}")
    if "kill-host" in (opts.scenario or ()) and opts.hosts < 2:
        parser.error(f"kill-host needs --hosts 2 or more (one host always runs), got {opts.hosts}")
    if opts.duration is None and opts.requests is None:
        opts.duration = 20.0
    if opts.metrics_port is not None and not 0 <= opts.metrics_port <= 65535:
        parser.error(f"--metrics-port must be in 0..65535, got {opts.metrics_port}")
    if opts.shm_fill_mib < 1 or opts.private_shm_mib < 0:
        parser.error(f"--shm-fill-mib must be at least 1 and --private-shm-mib at least 0, "
                     f"got {opts.shm_fill_mib} and {opts.private_shm_mib}")
    if opts.seed is None:
        opts.seed = random.SystemRandom().randrange(1 << 31)
    if "shared-machine" in (opts.scenario or ()) and opts.private_shm_mib:
        from tools._stress_shared import reexec_in_private_shm

        args = list(sys.argv[1:] if argv is None else argv)
        code = reexec_in_private_shm(args + ["--seed", str(opts.seed)], opts.private_shm_mib)
        if code is not None:
            return code
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="ipu-emulator stress: %(message)s")
    live = LiveStats()
    server = None
    if opts.metrics_port is not None:
        server = _serve_metrics(live, opts.metrics_port, opts.metrics_address)
        if server is None:
            return 2
    # a line per scenario on stdout (rewritten live on a terminal); none with --json
    progress = None if opts.json else Progress(live, sys.stdout)
    try:
        results, problems = run(opts, live, progress)
    except KeyboardInterrupt:
        print("ipu-emulator stress: interrupted (hosts killed, leaks cleaned up)", file=sys.stderr)
        return 130
    finally:
        if progress is not None:
            progress.close()
        if server is not None:
            server.close()
    passed = all(r.passed for r in results) and not problems
    verdict = (f"{'PASS' if passed else 'FAIL'}: {len(results)} scenarios, "
               f"{sum(r.ok for r in results)} requests checked, "
               f"{sum(r.wrong for r in results)} wrong, {sum(r.hung for r in results)} hung, "
               f"{sum(r.errors for r in results)} errors, "
               f"{sum(r.leaks for r in results) + len(problems)} leaks (seed {opts.seed})")
    if opts.json:
        print(json.dumps({"passed": passed, "seed": opts.seed, "verdict": verdict,
                          "scenarios": [dict(asdict(r), passed=r.passed) for r in results],
                          "problems": problems}, indent=2))
    else:
        print(format_table(results))
        for p in problems:
            print(f"  run: {p}")
        print(verdict)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
