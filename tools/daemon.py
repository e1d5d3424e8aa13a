"""``ipu-emulator daemon``: serve a pool of warm emulated IPUs; ``daemon status``: show it.

::

    ipu-emulator daemon [--socket PATH] [--num-ipus N] [--ipu-version ipu2|ipu21]
                        [--tiles-per-ipu T] [--memory-per-tile B] [--compute-threads K]
                        [--metrics-port PORT [--metrics-address ADDR]]
    ipu-emulator daemon status [--socket PATH] [--json]
    ipu-emulator daemon faults [--socket PATH] [--clear] [--add JSON] [--json]

``--faults FILE`` (or ``IPU_EMULATOR_FAULTS`` in its environment) gives the
daemon's IPUs a schedule of faults (docs/faults.md); ``daemon faults`` lists it
with its counts and changes it while the daemon runs (live injection: the IPUs,
held ones too, see it before their next Main run).

The daemon runs in the foreground and logs to stderr; SIGTERM or SIGINT
stops it (its IPU processes, its socket and its shared-memory objects go).
Pool settings not given default to the emulated machine's configuration
(``$IPU_EMULATOR_CONFIG``, ``IPU_EMULATOR_*``). Hosts use it when
``IPU_EMULATOR_DAEMON`` names its socket.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys

from host_runtime.settings import HostSettings
from ipu_emulator.daemon import socket_protocol as wire
from ipu_emulator.system import SystemConfigError, load_system_config


def _socket_path(arg: str | None) -> str:
    return arg or HostSettings.read("daemon") or wire.default_socket_path()


def _status(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ipu-emulator daemon status",
                                     description="print the daemon's pool: each IPU, its "
                                     "state and the pid of the host holding it; then each "
                                     "attached device: its id, its IPUs and its holder")
    parser.add_argument("--socket", help="the daemon's socket (default: $IPU_EMULATOR_DAEMON "
                        "or $IPU_EMULATOR_HOME/daemon.sock)")
    parser.add_argument("--json", action="store_true", help="print the raw status reply")
    a = parser.parse_args(argv)
    path = _socket_path(a.socket)
    try:
        reply = wire.request(path, {"op": "status"}, timeout=10.0)
    except (OSError, ValueError) as exc:
        print(f"ipu-emulator daemon status: error: no daemon answers at {path}: {exc}",
              file=sys.stderr)
        return 1
    if a.json:
        print(json.dumps(reply, indent=2))
        return 0
    s = reply["system"]
    print(f"daemon pid {reply['daemon_pid']} at {reply['socket']}: {s['num_ipus']} x "
          f"{s['ipu_version']}, {s['tiles_per_ipu']} tiles x {s['memory_per_tile']} bytes")
    for ipu in reply["ipus"]:
        holder = f"held by pid {ipu['holder']}" if ipu["holder"] else "-"
        device = ipu.get("device")
        print(f"ipu {ipu['ipu']:<3} {ipu['state']:<10} process {ipu['pid'] or '-':<8} "
              f"{holder:<20} hosts served {ipu['hosts_served']}"
              + (f"  device {device}" if device is not None and device >= 0 else ""))
    for dev in reply.get("devices", []):
        name = f"device {dev['device_id']}" if dev["device_id"] >= 0 else "device (no id)"
        ipus = ",".join(str(i) for i in dev["ipus"])
        print(f"{name}: {len(dev['ipus'])} ipu{'s' if len(dev['ipus']) != 1 else ''} "
              f"[{ipus}] held by pid {dev['holder']} ({'/'.join(dev['states'])})")
    return 0


def _faults(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ipu-emulator daemon faults",
                                     description="list, add or clear the faults a running "
                                     "daemon's IPUs follow (docs/faults.md)")
    parser.add_argument("--socket", help="the daemon's socket (default: $IPU_EMULATOR_DAEMON "
                        "or $IPU_EMULATOR_HOME/daemon.sock)")
    parser.add_argument("--clear", action="store_true", help="remove every fault first")
    parser.add_argument("--add", metavar="JSON", help="faults to add: a JSON list of fault "
                        "objects (or one object), or the path of a JSON or YAML file")
    parser.add_argument("--json", action="store_true", help="print the raw reply")
    a = parser.parse_args(argv)
    from ipu_emulator.faults import FaultSpecError, parse_faults

    req: dict[str, object] = {"op": "faults", "clear": a.clear}
    if a.add:
        try:
            req["add"] = [f.to_dict() for f in parse_faults(a.add, "--add")]
        except FaultSpecError as exc:
            print(f"ipu-emulator daemon faults: error: {exc}", file=sys.stderr)
            return 2
    path = _socket_path(a.socket)
    try:
        reply = wire.request(path, req, timeout=10.0)
    except (OSError, ValueError) as exc:
        print(f"ipu-emulator daemon faults: error: no daemon answers at {path}: {exc}",
              file=sys.stderr)
        return 1
    if not reply.get("ok"):
        print(f"ipu-emulator daemon faults: error: {reply.get('message', reply)}",
              file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(reply, indent=2))
        return 0
    for i, f in enumerate(reply["faults"]):
        print(f"fault {i}: {json.dumps(f['fault'])}  runs seen {f['seen']}, fired {f['fired']}")
    if not reply["faults"]:
        print("no faults")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "status":
        return _status(args[1:])
    if args and args[0] == "faults":
        return _faults(args[1:])
    parser = argparse.ArgumentParser(
        prog="ipu-emulator daemon",
        description="serve a pool of warm emulated IPUs to host processes over a unix socket "
        "(hosts: IPU_EMULATOR_DAEMON=<socket>); 'ipu-emulator daemon status' shows the pool")
    parser.add_argument("--socket", help="socket path (default $IPU_EMULATOR_HOME/daemon.sock)")
    parser.add_argument("--num-ipus", type=int)
    parser.add_argument("--ipu-version", choices=("ipu2", "ipu21"))
    parser.add_argument("--tiles-per-ipu", type=int)
    parser.add_argument("--memory-per-tile", type=int)
    parser.add_argument("--compute-threads", type=int)
    parser.add_argument("--metrics-port", type=int, metavar="PORT",
                        help="serve Prometheus metrics at http://ADDRESS:PORT/metrics (0: a "
                        "free port, logged): the pool's IPUs, attaches and their waits, "
                        "resets, restarts, IPU process deaths, per-IPU hosts and held time")
    parser.add_argument("--metrics-address", default="127.0.0.1", metavar="ADDRESS",
                        help="address /metrics listens on (default 127.0.0.1)")
    parser.add_argument("--faults", metavar="FILE",
                        help="faults its IPUs follow: a JSON or YAML file of a list of faults "
                        "(docs/faults.md; default: $IPU_EMULATOR_FAULTS)")
    parser.add_argument("--log-level", default=None)
    parser.add_argument("--trace", metavar="FILE",
                        help="record a timeline of the daemon and its IPU processes into FILE, "
                             "written when it stops (docs/tracing.md)")
    a = parser.parse_args(args)
    from shm.settings import SettingsError

    try:
        settings = HostSettings.current()
        if a.faults is not None:
            settings = settings.replace(faults=a.faults)
    except SettingsError as exc:
        text = str(exc)
        if a.faults is not None and text.startswith("IPU_EMULATOR_FAULTS"):
            text = "--faults" + text[len("IPU_EMULATOR_FAULTS"):]
        print(f"ipu-emulator daemon: error: {text}", file=sys.stderr)
        return 2
    if a.log_level is None:
        a.log_level = settings.daemon_log_level
    logging.basicConfig(level=a.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s ipu-emulator-daemon[{os.getpid()}] "
                        "%(levelname)s %(message)s")
    from ipu_emulator.daemon.daemon_metrics import MetricsServeError
    from ipu_emulator.daemon.server import Daemon, DaemonError

    try:
        system = load_system_config()
        overrides = {k: v for k, v in (("num_ipus", a.num_ipus), ("ipu_version", a.ipu_version),
                                       ("tiles_per_ipu", a.tiles_per_ipu),
                                       ("memory_per_tile", a.memory_per_tile),
                                       ("compute_threads", a.compute_threads)) if v is not None}
        system = dataclasses.replace(system, **overrides)
        if a.metrics_port is not None and not 0 <= a.metrics_port <= 65535:
            raise ValueError(f"--metrics-port must be in 0..65535, got {a.metrics_port}")
        daemon = Daemon(system, a.socket, metrics_port=a.metrics_port,
                        metrics_address=a.metrics_address, settings=settings)
    except (SystemConfigError, ValueError, DaemonError) as exc:
        print(f"ipu-emulator daemon: error: {exc}", file=sys.stderr)
        return 2
    from ipu_emulator import trace

    if trace.active():   # IPU_EMULATOR_TRACE=FILE, started by an import
        trace.set_role("daemon")
    elif a.trace:
        trace.start(a.trace, role="daemon")
    else:
        trace.start_from_settings(role="daemon")
    try:
        return daemon.run()
    except (DaemonError, MetricsServeError) as exc:
        logging.getLogger("ipu_emulator.daemon.server").error("%s", exc)
        print(f"ipu-emulator daemon: error: {exc}", file=sys.stderr)
        return 1
    finally:
        if trace.active():
            trace.stop()


if __name__ == "__main__":
    sys.exit(main())
