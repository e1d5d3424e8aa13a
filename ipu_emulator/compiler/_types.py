"""What the compiler's parts share: targets, options, results, and the memory-fit check.

``_backend`` (one IPU, fusion) and ``_sharding`` (several IPUs) both build on this module,
so neither imports the other's internals.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import onnx

from ipu_emulator.errors import CompileError
from ipu_emulator.executable import Executable, numpy_dtype
from shm.errors import echo

if TYPE_CHECKING:  # pragma: no cover
    from ipu_emulator.compiler._prepare import Prepared

__all__ = [
    "Target", "TARGETS", "ModelSpec", "CompileOptions", "AnchorDesc", "CompileResult",
    "LOAD_PROGRAM", "MAIN_PROGRAM", "SAVE_PROGRAM", "INDEX_NAME", "INDEX_DTYPE", "INDEX_SHAPE",
    "ipu_memory", "check_fit", "count",
]

LOAD_PROGRAM, MAIN_PROGRAM, SAVE_PROGRAM = 0, 1, 2
INDEX_NAME = "index"
INDEX_DTYPE = "S32"
INDEX_SHAPE = (1,)


@dataclass(frozen=True)
class Target:
    """An IPU generation: ``tiles`` x ``bytes_per_tile`` of memory per IPU."""

    name: str
    version: int
    tiles: int = 1472
    bytes_per_tile: int = 624 * 1024

    @property
    def memory_bytes(self) -> int:
        return self.tiles * self.bytes_per_tile


TARGETS: dict[str, Target] = {"ipu2": Target("ipu2", 2), "ipu21": Target("ipu21", 21)}


@dataclass
class ModelSpec:
    """One ONNX model to compile: a path, bytes or a ModelProto, and its per-model options.

    ``input_shapes`` fixes dynamic dims (``{"X": [1, 2]}``); ``precision`` is
    ``"fp32"`` or ``"fp16"``. External data is read from ``base_dir`` (default:
    the model file's folder) and never from outside it.
    """

    source: "str | os.PathLike[str] | bytes | onnx.ModelProto"
    input_shapes: dict[str, list[int]] = field(default_factory=dict)
    precision: str = "fp32"
    base_dir: "str | os.PathLike[str] | None" = None


@dataclass
class CompileOptions:
    """Options that apply to the whole executable."""

    name: str = "executable"
    ipu_version: str = "ipu21"
    device_iterations: int = 1            # --batches_per_step
    weights_as_tensor_data: bool = False  # float initializers -> tensor-data anchors (Load)
    save_weights: bool = False            # Save program streams weights to "<w>_saved"
    max_tensor_size: int = -1             # bytes; -1: no limit
    num_ipus: int = 1
    fuse: bool | None = None              # None: fuse when several models are given
    # manual sharding (ipu_emulator.compiler._sharding): node name -> IPU / pipeline stage
    sharding_info: dict[str, int] | None = None
    pipelining_info: dict[str, int] | None = None
    enable_pipelining: bool = False
    machine_ipus: int | None = None       # IPUs of the target machine (None: the system config)
    ipu_memory: int = 0                   # bytes of one IPU (0: the target's tiles x memory)


@dataclass(frozen=True)
class AnchorDesc:
    """What the front end needs to write one PopEF anchor (and its tensor data)."""

    name: str
    handle: str
    direction: str                  # "in" (host -> device) or "out"
    dtype: str                      # PopEF data type name: "F32", "S32"...
    shape: tuple[int, ...]
    programs: tuple[int, ...]
    kind: str                       # "input", "output", "weight", "saved", "index"
    subgraph: str | None = None     # "graph0"... for fused models
    data: bytes | None = field(default=None, repr=False)   # tensor data (weights)

    @property
    def nbytes(self) -> int:
        n = numpy_dtype(self.dtype).itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass
class CompileResult:
    executable: Executable
    anchors: list[AnchorDesc]
    program_flow: dict[str, list[int]]      # {"load": [0], "main": [1], "save": [2]}
    output_model: onnx.ModelProto           # the transformed (or fused) ONNX model
    models: list[onnx.ModelProto]           # each model after transformation
    subgraphs: dict[str, list[str]]         # fused: "graph0" -> its anchor names
    fused: bool
    # --precision fp16: output -> (max, mean) relative error to the fp32 model on a sample
    fp16_error: dict[str, tuple[float, float]] = field(default_factory=dict)
    # the non-tensor tail (ZipMap...) the host runs on each result (compiler._tail)
    host_tail: onnx.ModelProto | None = None


def ipu_memory(opts: CompileOptions, target: Target) -> int:
    return int(opts.ipu_memory) if opts.ipu_memory else target.memory_bytes


def _made_of(per_ipu: int, target: Target) -> str:
    """What an IPU's ``per_ipu`` bytes are, for messages."""
    if per_ipu == target.memory_bytes:
        return f"{target.tiles} tiles x {target.bytes_per_tile} bytes per tile"
    return (f"{per_ipu} bytes: the machine's IPU_EMULATOR_TILES_PER_IPU x "
            "IPU_EMULATOR_MEMORY_PER_TILE, less num_io_tiles")


def count(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def check_fit(prepared: list[Prepared], opts: CompileOptions, target: Target,
               memory_bytes: int, constants: int, activations: int, required: int) -> None:
    per_ipu = ipu_memory(opts, target)
    total = per_ipu * opts.num_ipus
    largest: tuple[int, str, str] = (0, "", "")
    for p in prepared:
        for name, (dtype, shape, nbytes) in p.sizes.items():
            desc = f"{dtype}{list(shape)}"
            if opts.max_tensor_size != -1 and nbytes > opts.max_tensor_size:
                raise CompileError(
                    f"model {echo(p.label, 200)}: tensor {echo(name)} ({desc}) is {nbytes} bytes, more than "
                    f"max_tensor_size of {opts.max_tensor_size} bytes")
            if nbytes > per_ipu:
                raise CompileError(
                    f"model {echo(p.label, 200)}: tensor {echo(name)} ({desc}) is {nbytes} bytes, more than "
                    f"the {per_ipu} bytes of one {target.name} IPU ({_made_of(per_ipu, target)})")
            if nbytes > largest[0]:
                largest = (nbytes, name, desc)
    if required > total:
        raise CompileError(
            f"the model does not fit the device memory of {opts.num_ipus} {target.name} IPU(s): "
            f"it needs {required} bytes (device tensors {memory_bytes}, constants {constants}, "
            f"peak activations {activations}) but the device has {total} bytes "
            f"({_made_of(per_ipu, target)} per IPU); the "
            f"largest tensor is {echo(largest[1])} ({largest[2]}) with {largest[0]} bytes"
            + ("; shard it over several IPUs (--num_ipus N --manual_sharding_config "
               "shard.yaml)" if len(prepared) == 1 else ""))
