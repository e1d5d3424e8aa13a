"""``CompilerOptions``: every option of PopRT 1.5's compiler, with its default.

Options in ``ACTING`` change what the emulator compiles (the program, its layout or
its interface); the others tune Poplar's performance on a real IPU: they are
checked, accepted and kept in the PopEF file (the metadata's engine options, as
``poprt.<name>``), and leave the emulated results unchanged (docs/poprt_compile.md).
"""

from __future__ import annotations

from typing import Any, Callable

from host_runtime.errors import BadRequestError

__all__ = ["CompilerOptions", "ACTING", "FIELDS"]

# name -> (default, type)
FIELDS: dict[str, tuple[Any, type]] = {
    "num_ipus": (1, int),
    "ipu_version": ("", str),
    "batches_per_step": (1, int),
    "partials_type": ("half", str),
    "available_memory_proportion": (0.6, float),
    "num_io_tiles": (0, int),
    "enable_model_fusion": (False, bool),
    "enable_prefetch_datastreams": (True, bool),
    "stream_buffering_depth": (1, int),
    "enable_pad_conv_channel": (False, bool),
    "serialize_ir": (False, bool),
    "serialized_ir_dest": ("", str),
    "enable_gather_simplifier": (True, bool),
    "engine_options": ({}, dict),
    "show_compilation_progress_bar": (True, bool),
    "custom_patterns": ([], list),
    "custom_transform_applier_settings": ({}, dict),
    "opaque_blobs": ({}, dict),
    "use_128bit_conv_unit_load": (False, bool),
    "enable_fast_reduce": (False, bool),
    "enable_outlining": (True, bool),
    "group_host_sync": (False, bool),
    "rearrange_streams_on_host": (False, bool),
    "rearrange_anchors_on_host": (True, bool),
    "outline_threshold": (1.0, float),
    "enable_non_stable_softmax": (False, bool),
    "enable_pipelining": (False, bool),
    "enable_engine_caching": (False, bool),
    "cache_path": ("", str),
    "subgraph_copying_strategy": (0, int),
    "virtual_graph_mode": ("off", str),
    "compilation_progress_logger": (None, object),
    "virtual_graph_split_ratios": ([], list),
    "time_limit_scheduler": (1e9, float),
    "swap_limit_scheduler": (int(1e9), int),
    "transitive_closure_optimization_threshold": (100000, int),
    "constant_weights": (True, bool),
    "create_host_transferable_tensor_with_offset": (False, bool),
    "enable_multi_stage_reduce": (True, bool),
    "enable_efficient_overlap_io_topo_cons": (False, bool),
}

ACTING = {
    "num_ipus": "IPUs the program is sharded over",
    "ipu_version": "the target IPU (\"\": the machine's, from the emulator's system config)",
    "batches_per_step": "device iterations per Main program run",
    "partials_type": "checked (half or float) and recorded; the emulator accumulates as "
                     "onnxruntime's CPU kernels do, at least as precisely as half partials",
    "num_io_tiles": "tiles kept for I/O: the compute memory is (tiles - num_io_tiles) x "
                    "bytes per tile",
    "enable_model_fusion": "compiles a model fused by MFConverter with one sub-graph per model",
    "serialize_ir": "writes the compiled ONNX model to serialized_ir_dest",
    "serialized_ir_dest": "where serialize_ir writes",
    "engine_options": "kept in the PopEF metadata's engine options",
    "opaque_blobs": "written to the PopEF file as opaque blobs (name -> text)",
    "enable_pipelining": "pipelines the IPUs' stages (with virtual_graph_mode manual)",
    "virtual_graph_mode": "\"manual\" shards by the Sharder's (or manual_sharding's) maps; "
                          "\"off\" compiles for one program set; \"auto\" and "
                          "\"execution_phase\" are refused by name",
    "constant_weights": "False exports float weights as PopEF tensor data loaded by the Load "
                        "program instead of compiling them into the executable",
    "compilation_progress_logger": "called with (0, 100) before and (100, 100) after compiling",
}

_PROPORTIONS = frozenset({"available_memory_proportion"})

_CHOICES = {"partials_type": ("half", "float"),
            "virtual_graph_mode": ("off", "manual", "auto", "execution_phase"),
            "ipu_version": ("", "ipu2", "ipu21")}


def _coerce(name: str, value: Any) -> Any:
    default, kind = FIELDS[name]
    if kind is object:
        if value is not None and not callable(value):
            raise BadRequestError(f"CompilerOptions.{name} must be callable(int, int) or None, "
                                  f"got {type(value).__name__}")
        return value
    if kind is bool:
        if not isinstance(value, bool):
            raise BadRequestError(f"CompilerOptions.{name} must be a bool, got {value!r}")
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise BadRequestError(f"CompilerOptions.{name} must be an int, got {value!r}")
        return int(value)
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise BadRequestError(f"CompilerOptions.{name} must be a number, got {value!r}")
        if name in _PROPORTIONS and not 0.0 < value <= 1.0:   # (NaN fails too)
            raise BadRequestError(f"CompilerOptions.{name} is a proportion: expected a number "
                                  f"in (0, 1], got {value!r}")
        return float(value)
    if kind is str:
        if not isinstance(value, str):
            raise BadRequestError(f"CompilerOptions.{name} must be a str, got {value!r}")
        choices = _CHOICES.get(name)
        if choices is not None and value not in choices:
            raise BadRequestError(f"CompilerOptions.{name} must be one of {list(choices)}, got "
                                  f"{value!r}")
        return value
    if kind is dict:
        if not isinstance(value, dict):
            raise BadRequestError(f"CompilerOptions.{name} must be a dict, got {value!r}")
        return dict(value)
    if not isinstance(value, (list, tuple)):
        raise BadRequestError(f"CompilerOptions.{name} must be a list, got {value!r}")
    return list(value)


class CompilerOptions:
    """The options of ``Compiler.compile``: PopRT 1.5's fields and defaults.

    Unknown names are refused (``AttributeError``), values are type-checked.
    ``CompilerOptions.from_dict({...})`` builds one from a dict; ``to_dict()`` gives
    it back."""

    num_ipus: int
    ipu_version: str
    batches_per_step: int
    partials_type: str
    available_memory_proportion: float
    num_io_tiles: int
    enable_model_fusion: bool
    enable_prefetch_datastreams: bool
    stream_buffering_depth: int
    enable_pad_conv_channel: bool
    serialize_ir: bool
    serialized_ir_dest: str
    enable_gather_simplifier: bool
    engine_options: dict[str, Any]
    show_compilation_progress_bar: bool
    custom_patterns: list[Any]
    custom_transform_applier_settings: dict[str, Any]
    opaque_blobs: dict[str, Any]
    use_128bit_conv_unit_load: bool
    enable_fast_reduce: bool
    enable_outlining: bool
    group_host_sync: bool
    rearrange_streams_on_host: bool
    rearrange_anchors_on_host: bool
    outline_threshold: float
    enable_non_stable_softmax: bool
    enable_pipelining: bool
    enable_engine_caching: bool
    cache_path: str
    subgraph_copying_strategy: int
    virtual_graph_mode: str
    compilation_progress_logger: Callable[[int, int], None] | None
    virtual_graph_split_ratios: list[Any]
    time_limit_scheduler: float
    swap_limit_scheduler: int
    transitive_closure_optimization_threshold: int
    constant_weights: bool
    create_host_transferable_tensor_with_offset: bool
    enable_multi_stage_reduce: bool
    enable_efficient_overlap_io_topo_cons: bool

    def __init__(self) -> None:
        for name, (default, _kind) in FIELDS.items():
            object.__setattr__(self, name, default.copy() if isinstance(default, (dict, list))
                               else default)

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in FIELDS:
            raise AttributeError(f"CompilerOptions has no option {name!r}; the options are "
                                 f"{', '.join(FIELDS)}")
        object.__setattr__(self, name, _coerce(name, value))

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "CompilerOptions":
        """Options from a dict of option names to values."""
        if not isinstance(d, dict):
            raise BadRequestError(f"CompilerOptions.from_dict expects a dict, got "
                                  f"{type(d).__name__}")
        opts = CompilerOptions()
        for k, v in d.items():
            setattr(opts, k, v)
        return opts

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in FIELDS}

    def tuning(self) -> dict[str, str]:
        """The performance options that differ from their defaults, as engine options
        (``poprt.<name>`` -> text) kept in the PopEF metadata."""
        out: dict[str, str] = {}
        for name, (default, _kind) in FIELDS.items():
            value = getattr(self, name)
            if name in ACTING or value == default:
                continue
            out[f"poprt.{name}"] = repr(value)
        return out

    @property
    def progress(self) -> Callable[[int, int], None] | None:
        logger = getattr(self, "compilation_progress_logger")
        return logger if callable(logger) else None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CompilerOptions) and self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        changed = {k: v for k, v in self.to_dict().items() if v != FIELDS[k][0]}
        return f"CompilerOptions({', '.join(f'{k}={v!r}' for k, v in changed.items())})"
