"""``popef_dump PATH [PATH...] [--json]``: show what PopEF files hold.

Prints the blobs of every file, then the model they form: metadata, options,
anchors, fused-model sub-graphs and the program flow, as aligned tables for an
engineer or, with ``--json``, as one JSON document for machines.

Exit status: 0 the files form a consistent model; 1 the files are readable
but do not form one (e.g. a weights-only file, or files that disagree: the
reason is printed); 2 a file cannot be read (damaged, truncated, missing),
with one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Sequence

from host_runtime import popef
from host_runtime.errors import PopefError

__all__ = ["main", "describe"]


def describe(reader: popef.Reader) -> dict[str, Any]:
    """Everything the dump shows, as plain JSON-ready values."""
    per_file: dict[str, int] = {}
    indices = []
    for b in reader.blobs():
        indices.append(per_file.get(b.path, 0))
        per_file[b.path] = indices[-1] + 1
    blobs = [{
        "file": b.path, "index": i, "type": b.type.label, "name": b.name, "offset": b.offset,
        "size": b.size, "payload_size": b.payload_size, "crc32": f"0x{b.checksum:08x}",
        "checksum_ok": True,  # the reader refuses a blob whose checksum is wrong
        "compressed": b.compressed,
        **({"transfers": b.aux} if b.type is popef.BlobType.FEED_DATA else {}),
        **({"decompressed_size": b.aux} if b.compressed else {}),
    } for i, b in zip(indices, reader.blobs())]
    files = []
    for p in reader.paths():
        try:
            size: int | None = os.path.getsize(p)
        except OSError:
            size = None
        files.append({"path": p, "size": size,
                      "blobs": sum(1 for b in reader.blobs() if b.path == p)})
    out: dict[str, Any] = {"files": files, "blobs": blobs, "metadata": None, "anchors": [],
                           "subgraphs": {}, "programFlow": None}
    try:
        popef.ModelBuilder(reader).createModel()
        out["model_check"] = {"ok": True, "error": None}
    except PopefError as exc:
        out["model_check"] = {"ok": False, "error": str(exc)}
    mds = reader.metadata()
    if not mds:
        return out
    md = mds[0]
    flow = md.programFlow()
    out["metadata"] = {
        "executable": md.executable(), "replicationFactor": md.replicationFactor(),
        "numIpus": md.numIpus(), "ipuVersion": md.ipuVersion(),
        "isInference": md.isInference(), "deviceIterations": md.deviceIterations(),
        "engineOptions": md.engineOptions(), "deviceOptions": md.deviceOptions(),
    }
    out["programFlow"] = {"load": flow.load(), "main": flow.main(), "save": flow.save()}
    with_data = {t.info.name() for t in reader.tensors()}
    feeds = {f.info.name(): f.numTransfers for f in reader.feeds()}
    for a in md.anchors():
        info = a.tensorInfo()
        out["anchors"].append({
            "name": a.name(), "handle": a.handle(), "type": a.type().value,
            "shape": info.shape(), "dtype": info.dataType().value,
            "sizeInBytes": info.sizeInBytes(), "isPerReplica": a.isPerReplica(),
            "programs": a.programs(), "tensorData": a.name() in with_data,
            "feedTransfers": feeds.get(a.name(), 0),
        })
    out["subgraphs"] = md.subgraphs()
    out["sharding"] = _sharding(reader, md.executable()) if md.numIpus() > 1 else None
    return out


def _sharding(reader: popef.Reader, name: str) -> dict[str, Any] | None:
    """Which nodes, anchors and tensors live on which IPU and stage (multi-IPU executables)."""
    from ipu_emulator.compiler import describe_parts
    from ipu_emulator.executable import Executable, ExecutableError

    for blob in reader.executables():
        if blob.name == name:
            try:
                return describe_parts(Executable.from_bytes(blob.executable()))
            except (ExecutableError, PopefError):
                return None
    return None


def _clean(value: object) -> str:
    """Text safe for a terminal table: control characters and newlines escaped."""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii")
                   for c in text)


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]], indent: str = "  ") -> str:
    cells = [[_clean(h) for h in headers]] + [[_clean(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    # Numbers are right-aligned, everything else left-aligned.
    numeric = [bool(rows) and all(isinstance(r[i], int) and not isinstance(r[i], bool)
                                  for r in rows) for i in range(len(headers))]
    lines = []
    for row in cells:
        text = "  ".join(c.rjust(w) if num else c.ljust(w)
                         for c, w, num in zip(row, widths, numeric))
        lines.append(indent + text.rstrip())
    return "\n".join(lines)


def _yes(v: bool) -> str:
    return "yes" if v else "no"


def _programs(progs: list[int], flow: dict[str, list[int]] | None) -> str:
    if not progs:
        return "-"
    parts = []
    for p in progs:
        phases = [ph for ph in ("load", "main", "save") if flow and p in flow[ph]]
        parts.append(f"{p} ({'/'.join(phases)})" if phases else str(p))
    return ", ".join(parts)


def render(d: dict[str, Any]) -> str:
    """The human-readable dump of ``describe``'s result."""
    out: list[str] = []
    for f in d["files"]:
        size = "?" if f["size"] is None else f"{f['size']} bytes"
        out.append(f"PopEF file {_clean(f['path'])} ({size}, {f['blobs']} blobs)")
    out.append("")
    out.append("Blobs")
    several = len(d["files"]) > 1
    headers = (["file"] if several else []) + [
        "#", "type", "name", "offset", "size", "payload", "crc32", "checksum", "compressed"]
    rows = []
    for b in d["blobs"]:
        comp = f"yes ({b['decompressed_size']} bytes)" if b["compressed"] else "no"
        rows.append(([os.path.basename(b["file"])] if several else []) + [
            b["index"], b["type"], b["name"], b["offset"], b["size"], b["payload_size"],
            b["crc32"], "ok" if b["checksum_ok"] else "BAD", comp])
    out.append(_table(headers, rows) if rows else "  (no blobs)")
    out.append("")
    md = d["metadata"]
    if md is None:
        out.append("Metadata: none (these files do not hold a model's metadata)")
    else:
        out.append("Metadata")
        out.append(_table(["", ""], [
            ("executable", md["executable"]),
            ("replication factor", md["replicationFactor"]),
            ("IPUs", md["numIpus"]),
            ("IPU version", md["ipuVersion"]),
            ("inference", _yes(md["isInference"])),
            ("device iterations", md["deviceIterations"]),
        ]).split("\n", 1)[1])
        out.append("")
        out.append("Options")
        opts = [("engine", k, v) for k, v in sorted(md["engineOptions"].items())]
        opts += [("device", k, v) for k, v in sorted(md["deviceOptions"].items())]
        out.append(_table(["kind", "option", "value"], opts) if opts else "  (none)")
        out.append("")
        out.append("Anchors")
        flow = d["programFlow"]
        rows = []
        for a in d["anchors"]:
            data = "yes" if a["tensorData"] else "no"
            if a["feedTransfers"]:
                data = f"feed x{a['feedTransfers']}" + (" + data" if a["tensorData"] else "")
            rows.append([a["name"], a["handle"], a["type"], str(a["shape"]), a["dtype"],
                         a["sizeInBytes"], _yes(a["isPerReplica"]),
                         _programs(a["programs"], flow), data])
        out.append(_table(["name", "handle", "type", "shape", "dtype", "bytes", "per-replica",
                           "programs", "tensor data"], rows) if rows else "  (none)")
        out.append("")
        out.append("Sub-graphs")
        if d["subgraphs"]:
            members = {m for ms in d["subgraphs"].values() for m in ms}
            rows = [[g, ", ".join(ms)] for g, ms in d["subgraphs"].items()]
            shared = [a["name"] for a in d["anchors"] if a["name"] not in members]
            if shared:
                rows.append(["(all)", ", ".join(shared)])
            out.append(_table(["graph", "anchors"], rows))
        else:
            out.append("  none (not a fused model)")
        if d.get("sharding"):
            out.append("")
            out.extend(_render_sharding(d["sharding"]))
        out.append("")
        out.append("Program flow")
        out.append(_table(["phase", "programs"], [
            (ph, ", ".join(str(p) for p in flow[ph]) or "-") for ph in ("load", "main", "save")
        ]))
    out.append("")
    check = d["model_check"]
    out.append("Model check: " + ("ok" if check["ok"] else f"FAILED: {_clean(check['error'])}"))
    return "\n".join(out) + "\n"


def _render_sharding(sh: dict[str, Any]) -> list[str]:
    kind = f"pipelined, {sh['num_stages']} stages" if sh["pipelining"] else "sharded"
    lines = [f"Sharding ({kind}) over {len(sh['ipus'])} IPUs"]
    for i in sh["ipus"]:
        if i.get("idle"):
            lines.append(f"  ipu {i['ipu']}  idle: holds no node of the model, runs nothing")
            continue
        nodes = i["nodes"]
        shown = ", ".join(_clean(n) for n in nodes[:12]) + (", ..." if len(nodes) > 12 else "")
        lines.append(f"  ipu {i['ipu']}  stage {i['stages']}  {len(nodes)} nodes: {shown}")
        lines.append(f"    anchors   in: {', '.join(i['anchors_in']) or '-'}; "
                     f"out: {', '.join(i['anchors_out']) or '-'}")
        lines.append(f"    links     in: {', '.join(i['links_in']) or '-'}; "
                     f"out: {', '.join(i['links_out']) or '-'}")
        lines.append(f"    tensors   {', '.join(_clean(t) for t in i['tensors'][:16])}"
                     f"{', ...' if len(i['tensors']) > 16 else ''}  "
                     f"({i['required_bytes']} bytes of device memory)")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="popef_dump", description="Show the blobs, metadata, anchors and program flow "
        "of PopEF files (several files are read as one model).")
    parser.add_argument("paths", nargs="+", metavar="PATH", help="PopEF file(s)")
    parser.add_argument("--json", action="store_true", help="print JSON for machines")
    args = parser.parse_args(argv)
    reader = popef.Reader()
    try:
        for p in args.paths:
            reader.parseFile(p)
    except PopefError as exc:
        print(f"popef_dump: error: {exc}", file=sys.stderr)
        return 2
    d = describe(reader)
    reconfigure = getattr(sys.stdout, "reconfigure", None)
    if reconfigure is not None:
        reconfigure(errors="backslashreplace")  # odd names never crash the dump
    try:
        if args.json:
            sys.stdout.write(json.dumps(d, indent=2) + "\n")
        else:
            sys.stdout.write(render(d))
        sys.stdout.flush()
    except BrokenPipeError:  # `popef_dump x | head`
        return 0
    if not d["model_check"]["ok"]:
        print(f"popef_dump: the files do not form a model: {d['model_check']['error']}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
