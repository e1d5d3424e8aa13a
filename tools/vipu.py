"""``ipu-emulator vipu``: V-IPU's partition commands against the daemon (docs/vipu.md).

    ipu-emulator vipu create partition NAME --size N [--reconfigurable]
    ipu-emulator vipu list partitions
    ipu-emulator vipu get partition NAME [--ipu-configs [--gcd 0] [--output FILE]]
    ipu-emulator vipu remove partition NAME

``--socket PATH`` (any command) names the daemon; default ``IPU_EMULATOR_DAEMON``,
else ``$IPU_EMULATOR_HOME/daemon.sock``. The logic is :mod:`ipu_emulator.vipu`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from ipu_emulator import safe_files
from ipu_emulator.errors import VipuError
from ipu_emulator.vipu import VipuClient, controller_socket, ipuof_config


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ipu-emulator vipu",
                                description="V-IPU partitions held by the IPU emulator daemon")
    p.add_argument("--socket", help="the daemon's socket (default: IPU_EMULATOR_DAEMON, else "
                   "$IPU_EMULATOR_HOME/daemon.sock)")
    sub = p.add_subparsers(dest="command", required=True)
    create = sub.add_parser("create", help="create a partition")
    create.add_argument("what", choices=["partition"])
    create.add_argument("name")
    create.add_argument("--size", type=int, required=True, help="IPUs (a power of 2)")
    create.add_argument("--reconfigurable", action="store_true",
                        help="jobs may use its IPUs as smaller devices too")
    lst = sub.add_parser("list", help="list the partitions and their state")
    lst.add_argument("what", choices=["partitions"])
    get = sub.add_parser("get", help="show a partition, or its IPUoF configuration")
    get.add_argument("what", choices=["partition"])
    get.add_argument("name")
    get.add_argument("--ipu-configs", action="store_true",
                     help="print the IPUoF configuration a job of the partition uses")
    get.add_argument("--gcd", type=int, default=None,
                     help="graph compile domain (a partition here has one: 0)")
    get.add_argument("--output", "-o", help="write the IPUoF configuration to this file "
                     "(for IPUOF_CONFIG_PATH) instead of printing it")
    rm = sub.add_parser("remove", help="remove a partition nobody uses")
    rm.add_argument("what", choices=["partition"])
    rm.add_argument("name")
    return p


def _table(parts: list[dict[str, Any]]) -> str:
    rows = [("ID", "IPUS", "POOL IPUS", "RECONFIG", "STATE", "USED BY")]
    for p in parts:
        rows.append((p["name"], str(p["size"]), " ".join(map(str, p["ipus"])),
                     "true" if p["reconfigurable"] else "false", p["state"].upper(),
                     " ".join(f"pid {h}" for h in p["holders"]) or "-"))
    widths = [max(len(r[k]) for r in rows) for k in range(len(rows[0]))]
    line = "-" * (sum(widths) + 3 * (len(widths) - 1) + 2)
    out = [line]
    for k, r in enumerate(rows):
        out.append(" " + " | ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        if k == 0:
            out.append(line)
    out.append(line)
    return "\n".join(out)


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    socket = os.path.abspath(args.socket) if args.socket else controller_socket()
    client = VipuClient(socket)
    if args.command == "create":
        client.create(args.name, args.size, args.reconfigurable)
        print(f"create partition ({args.name}): success.")
    elif args.command == "list":
        print(_table(client.list()))
    elif args.command == "remove":
        client.remove(args.name)
        print(f"remove partition ({args.name}): success.")
    else:
        return _get(client, args)
    return 0


def _get(client: VipuClient, args: argparse.Namespace) -> int:
    part = client.get(args.name)
    if args.gcd not in (None, 0):
        raise VipuError(f"get partition ({args.name}): failed: --gcd {args.gcd}: the partition "
                        "has one graph compile domain, 0", "request")
    if not (args.ipu_configs or args.output):
        print(_table([part]))
        return 0
    text = json.dumps(ipuof_config(part, client.socket), indent=2) + "\n"
    if args.output:
        safe_files.write_atomic(args.output, text.encode())
        print(f"IPUoF configuration of partition ({args.name}) written: {args.output}",
              file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
