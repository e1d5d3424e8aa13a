"""``ModelBuilder``: assemble one ``Model`` from the blobs of one or more files.

Consistency rules (each violation is a ``PopefError`` naming file, blob, offset):

- exactly one metadata blob (identical copies in several files count once);
- the executable the metadata names is present (identical copies count once;
  executables of other names are ignored with a warning);
- every tensor-data blob names an anchor of the metadata and holds exactly
  that anchor's ``sizeInBytes()``; every feed-data blob holds a whole number
  of such transfers;
- blobs of the same kind and name found twice must be identical;
- the executable, the anchors and the program flow keep the rules of
  ``ipu_emulator.validate`` (``ModelRuleError`` names the rule broken).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Iterable, Sequence, TypeVar, Union

from host_runtime.errors import PopefError
from host_runtime.popef._check import check_model
from host_runtime.popef.model import (ExecutableBlob, FeedData, Metadata, Model, Opaque,
                                      TensorData)
from host_runtime.popef.reader import Blob, BlobInfo, PendingChecksums, Reader
from shm.errors import echo

__all__ = ["ModelBuilder", "load_model"]

_log = logging.getLogger(__name__)

PathLike = Union[str, "os.PathLike[str]"]
Source = Union[Reader, PathLike]
T = TypeVar("T", ExecutableBlob, TensorData, FeedData, Opaque)


class ModelBuilder:
    """Merges readers (or files) into one checked ``Model``: ``createModel()``."""

    def __init__(self, readers: Source | Iterable[Source]) -> None:
        if isinstance(readers, (Reader, str, os.PathLike)):
            sources: list[Source] = [readers]
        else:
            try:
                sources = list(readers)
            except TypeError:
                raise PopefError(f"ModelBuilder expects a popef.Reader, a path or a list of "
                                 f"them, got {type(readers).__name__}") from None
        self._readers: list[Reader] = []
        for s in sources:
            if isinstance(s, Reader):
                self._readers.append(s)
            elif isinstance(s, (str, os.PathLike)):
                r = Reader()
                r.parseFile(s)
                self._readers.append(r)
            else:
                raise PopefError(f"ModelBuilder expects a popef.Reader or a path, got "
                                 f"{type(s).__name__}")

    def createModel(self) -> Model:
        entries: list[tuple[BlobInfo, Blob]] = []
        paths: list[str] = []
        for r in self._readers:
            entries.extend(r.entries())
            paths.extend(r.paths())
        where = ", ".join(repr(p) for p in paths) if paths else "<no file parsed>"

        metadata = _unique_metadata(entries, where)
        md_info, md = metadata
        executables = _dedupe(entries, ExecutableBlob, _same_executable)
        exe_entry = executables.pop(md.executable(), None)
        if exe_entry is None:
            raise PopefError(
                f"metadata names executable {echo(md.executable())} but no executable blob of "
                f"that name was found in {where}; found "
                f"{sorted(executables) or 'no executable blobs'}",
                path=md_info.path, blob=md_info.label, offset=md_info.offset)
        for name, (info, _) in executables.items():
            _log.warning("ignoring executable %r in %s at offset %d: the metadata names %r",
                         name, info.path, info.offset, md.executable())

        anchors = {a.name(): a for a in md.anchors()}
        tensors = _dedupe(entries, TensorData, _same_bytes)
        for name, (info, t) in tensors.items():
            anchor = anchors.get(name)
            if anchor is None:
                raise PopefError(f"tensor data names anchor {echo(name)}, which the metadata does "
                                 f"not have; anchors are {sorted(anchors)}",
                                 path=info.path, blob=info.label, offset=info.offset)
            expected = anchor.tensorInfo().sizeInBytes()
            if len(t.data) != expected:
                raise PopefError(f"tensor data for anchor {echo(name)} has {len(t.data)} bytes, "
                                 f"expected {expected} ({echo(anchor.tensorInfo())})",
                                 path=info.path, blob=info.label, offset=info.offset)
        feeds = _dedupe(entries, FeedData, _same_bytes)
        for name, (info, fd) in feeds.items():
            anchor = anchors.get(name)
            if anchor is None:
                raise PopefError(f"feed data names anchor {echo(name)}, which the metadata does "
                                 f"not have; anchors are {sorted(anchors)}",
                                 path=info.path, blob=info.label, offset=info.offset)
            expected = anchor.tensorInfo().sizeInBytes() * fd.num_transfers
            if len(fd.data) != expected:
                raise PopefError(f"feed data for anchor {echo(name)} has {len(fd.data)} bytes, "
                                 f"expected {fd.num_transfers} transfers of "
                                 f"{anchor.tensorInfo().sizeInBytes()} bytes = {expected}",
                                 path=info.path, blob=info.label, offset=info.offset)
        opaques = _dedupe(entries, Opaque, _same_bytes)
        model = Model(metadata=md, executable=exe_entry[1],
                      tensors=[t for _, t in tensors.values()],
                      feeds=[f for _, f in feeds.values()],
                      opaques=[o for _, o in opaques.values()])
        check_model(model, path=md_info.path, blob=md_info.label, strict=False)
        return model


def _unique_metadata(entries: Sequence[tuple[BlobInfo, Blob]],
                     where: str) -> tuple[BlobInfo, Metadata]:
    found = [(i, b) for i, b in entries if isinstance(b, Metadata)]
    if not found:
        raise PopefError(f"no metadata blob in {where}; a model needs exactly one")
    first_info, first = found[0]
    for info, md in found[1:]:
        if md != first:
            raise PopefError(
                f"two metadata blobs disagree: this one and the one in {echo(first_info.path, 200)} "
                f"at offset {first_info.offset} (executables {echo(first.executable())} and "
                f"{echo(md.executable())}); a model needs exactly one metadata",
                path=info.path, blob=info.label, offset=info.offset)
    return first_info, first


def _dedupe(entries: Sequence[tuple[BlobInfo, Blob]], kind: type[T],
            same: Callable[[Any, Any], bool]) -> dict[str, tuple[BlobInfo, T]]:
    out: dict[str, tuple[BlobInfo, T]] = {}
    for info, blob in entries:
        if not isinstance(blob, kind):
            continue
        name = blob.name()
        prev = out.get(name)
        if prev is None:
            out[name] = (info, blob)
        elif not same(prev[1], blob):
            raise PopefError(f"two {info.type.label} blobs named {echo(name)} disagree: this one "
                             f"and the one in {echo(prev[0].path, 200)} at offset {prev[0].offset}",
                             path=info.path, blob=info.label, offset=info.offset)
    return out


def _same_bytes(a: Any, b: Any) -> bool:
    return bool(a == b)


def _same_executable(a: ExecutableBlob, b: ExecutableBlob) -> bool:
    if a.compressed == b.compressed:
        return a.data == b.data
    return a.payload() == b.payload()


def load_model(paths: PathLike | Iterable[PathLike], *,
               pending: PendingChecksums | None = None) -> Model:
    """Parse the file(s) at ``paths`` and build one checked model (``pending``: the
    checksums of mapped payloads are left there, see ``reader.PendingChecksums``)."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    reader = Reader(pending=pending)
    for p in paths:
        reader.parseFile(p)
    return ModelBuilder(reader).createModel()
