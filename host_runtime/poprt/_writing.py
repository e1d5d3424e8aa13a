"""Writing compiled models: PopEF files and their metadata, each file replaced whole."""

from __future__ import annotations

import os
import pathlib
from typing import TYPE_CHECKING, BinaryIO, Callable

from shm.errors import echo

from host_runtime._atomic_file import AtomicFile
from host_runtime.errors import BadRequestError

if TYPE_CHECKING:  # pragma: no cover
    from host_runtime.popef import Metadata
    from ipu_emulator.compiler import CompileResult

__all__ = ["write_file", "metadata_for", "write_popef"]


def write_file(path: pathlib.Path, write: Callable[[BinaryIO], None]) -> None:
    """``write(f)`` fills a new file that then replaces ``path`` whole (a temporary file in
    its folder, created O_EXCL|O_NOFOLLOW, renamed into place: ``_atomic_file``): a
    symlink put at ``path`` meanwhile is replaced, never written through, and on an OS
    error (no space, no permission) ``path`` is as it was and a BadRequestError says
    what happened."""
    try:
        with AtomicFile(path) as f:
            write(f)
    except (OSError, BadRequestError) as exc:
        cause = exc.__cause__ if isinstance(exc, BadRequestError) and exc.__cause__ else exc
        text = getattr(cause, "strerror", None) or str(exc)
        raise BadRequestError(f"cannot write {echo(str(path), 200)}: {text}") from None


def metadata_for(result: "CompileResult",
                 engine_options: dict[str, str] | None = None) -> "Metadata":
    """The PopEF metadata describing a compiled executable (``engine_options``: kept in the
    metadata, as Poplar's engine options are)."""
    from host_runtime.popef import Anchor, DataType, Metadata, ProgramFlow, TensorInfo, TensorType

    exe = result.executable
    anchors = [Anchor(a.name, a.handle, TensorInfo(DataType(a.dtype), a.shape),
                      is_per_replica=False,
                      type=TensorType.INPUT if a.direction == "in" else TensorType.OUTPUT,
                      programs=a.programs)
               for a in result.anchors]
    flow = ProgramFlow(result.program_flow["load"], result.program_flow["main"],
                       result.program_flow["save"])
    return Metadata(anchors, flow, replication_factor=1, num_ipus=exe.num_ipus,
                    ipu_version=exe.ipu_version, executable=exe.name, is_inference=True,
                    device_iterations=exe.device_iterations, subgraphs=result.subgraphs,
                    engine_options=engine_options)


def write_popef(result: "CompileResult", dest: str | os.PathLike[str] | BinaryIO, *,
                compress: bool = False, engine_options: dict[str, str] | None = None,
                opaques: dict[str, bytes] | None = None) -> None:
    """Write metadata, executable and weights' tensor data (and ``opaques``, name -> bytes)
    to a PopEF file or stream."""
    from host_runtime.popef import Writer

    exe = result.executable
    with Writer(dest) as w:
        w.writeMetadata(metadata_for(result, engine_options))
        for name, data in sorted((opaques or {}).items()):
            w.writeOpaque(name, data)
        w.writeExecutable(exe.name, exe.to_bytes(), compress=compress)
        for a in result.anchors:
            if a.data is not None:
                w.writeTensorData(a.name, a.data)
