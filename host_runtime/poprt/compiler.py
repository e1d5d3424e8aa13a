"""The PopRT compiler front end: ONNX models -> PopEF (``poprt.compiler``).

PopRT's Python API: ``Compiler.compile(model, outputs, CompilerOptions())`` returns an
in-memory ``Executable`` (a ``popef.Model`` every runner takes; ``to_bytes()`` is the
PopEF file), ``Compiler.compile_and_export`` writes it (``_compile_api``).

``compile()`` runs the emulator's compiler back end
(``ipu_emulator.compiler.compile_onnx``) and writes its result with the PopEF
``Writer``: the metadata (anchors, program flow, sub-graphs of fused models),
the executable (zlib-compressed with ``compress=True``) and one tensor-data
blob per weight when weights are exported as tensor data. It also writes the
transformed ONNX model (``output_model``).

``load_config_yaml()`` reads seed 004's model fusion configuration: global
keys apply to every model of ``model_fusion``, per-model keys override them,
and relative paths resolve against the YAML file's folder.
"""

from __future__ import annotations

import logging
import os
import pathlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence, cast

from shm.errors import echo

from host_runtime.errors import BadRequestError
from host_runtime.poprt._writing import metadata_for, write_popef
from host_runtime.poprt._writing import write_file as _write_file

if TYPE_CHECKING:  # pragma: no cover
    import onnx

    from ipu_emulator.compiler import CompileResult, ModelSpec

__all__ = [
    "compile",
    "write_outputs",
    "CompileOutput",
    "FusionConfig",
    "load_config_yaml",
    "parse_input_shape",
    "metadata_for",
    "write_popef",
    "POPEF_NAME",
]

_log = logging.getLogger(__name__)

POPEF_NAME = "executable.popef"
_MAX_DIM = 1 << 40   # the executable format's bound on one dim


@dataclass
class CompileOutput:
    """What ``compile`` produced: the back end's result and the files written."""

    result: "CompileResult"
    popef_path: pathlib.Path | None = None
    output_model_path: pathlib.Path | None = None


def parse_input_shape(text: str) -> tuple[str, list[int]]:
    """``"X=1,3,224,224"`` -> ``("X", [1, 3, 224, 224])``; ``"X="`` is a scalar."""
    name, sep, dims = str(text).rpartition("=")
    if not sep or not name:
        raise BadRequestError(f"input shape {echo(text)} must look like NAME=d0,d1,... "
                              "(for example X=1,3,224,224)")
    try:
        shape = [int(d) for d in dims.replace(" ", "").split(",") if d != ""]
    except ValueError:
        raise BadRequestError(f"input shape {echo(text)}: dims must be integers") from None
    if any(d < 0 for d in shape):
        raise BadRequestError(f"input shape {echo(text)}: dims must be non-negative")
    big = [d for d in shape if d > _MAX_DIM]
    if big:
        raise BadRequestError(f"input shape {echo(text)}: dim {echo(big[0])} exceeds the limit of "
                              f"{_MAX_DIM}")
    return name, shape


def _shapes(items: Any, where: str) -> dict[str, list[int]]:
    if items is None:
        return {}
    if isinstance(items, str):
        items = [items]
    if not isinstance(items, (list, tuple)):
        raise BadRequestError(f"{where}: input_shape must be a list of 'NAME=d0,d1,...' strings, "
                              f"got {type(items).__name__}")
    out: dict[str, list[int]] = {}
    for it in items:
        name, dims = parse_input_shape(it)
        out[name] = dims
    return out


def compile(models: "ModelSpec | Sequence[ModelSpec] | str | os.PathLike[str] | onnx.ModelProto",
            output_dir: str | os.PathLike[str] | None = None, *,
            export_popef: "bool | str | os.PathLike[str]" = True, popef_name: str = POPEF_NAME,
            output_model: str | os.PathLike[str] | None = None,
            ipu_version: str = "ipu21", batches_per_step: int = 1,
            weights_as_tensor_data: bool = False, save_weights: bool = False,
            max_tensor_size: int = -1, compress: bool = False,
            name: str = "executable", fuse: bool | None = None,
            input_shapes: dict[str, list[int]] | None = None,
            precision: str | None = None, num_ipus: int = 1,
            sharding_info: dict[str, int] | None = None,
            pipelining_info: dict[str, int] | None = None,
            enable_pipelining: bool = False,
            manual_sharding_config: str | os.PathLike[str] | None = None,
            ipu_memory: int = 0) -> CompileOutput:
    """Compile one model (or fuse several ``ModelSpec``) and write the outputs.

    ``export_popef`` writes ``<output_dir>/<popef_name>`` (``popef_name`` must stay inside
    ``output_dir``, given relative or absolute); ``export_popef`` given as a path writes the
    PopEF there instead. ``output_model`` receives the transformed ONNX model. Both paths
    may be absolute or relative (to ``output_dir``) and may lie outside ``output_dir``.
    ``input_shapes``/``precision`` apply when ``models`` is a path or a ModelProto.
    Raises ``ipu_emulator.errors.CompileError`` when the model is refused.

    Sharding (PopRT's manual sharding): ``num_ipus`` IPUs, ``sharding_info`` (node name
    -> IPU), ``pipelining_info`` (node name -> stage) and ``enable_pipelining``, or
    ``manual_sharding_config``, a YAML file holding those two maps (the explicit maps
    win). ``ipu_memory`` overrides the bytes of one IPU (0: the target's).
    """
    from ipu_emulator.compiler import (CompileOptions, ModelSpec, check_map, compile_onnx,
                                       load_sharding_yaml)

    shard: dict[str, int] = {}
    stages: dict[str, int] = {}
    if manual_sharding_config is not None:
        shard, stages = load_sharding_yaml(manual_sharding_config)
    shard.update(check_map(sharding_info, "sharding_info"))
    stages.update(check_map(pipelining_info, "pipelining_info"))

    if isinstance(models, ModelSpec):
        specs = [models]
    elif isinstance(models, (list, tuple)):
        specs = list(models)
    else:
        specs = [ModelSpec(models, dict(input_shapes or {}), precision or "fp32")]  # type: ignore[arg-type]
    opts = CompileOptions(name=name, ipu_version=ipu_version,
                          device_iterations=int(batches_per_step),
                          weights_as_tensor_data=weights_as_tensor_data,
                          save_weights=save_weights, max_tensor_size=int(max_tensor_size),
                          fuse=fuse, num_ipus=int(num_ipus), sharding_info=shard or None,
                          pipelining_info=stages or None,
                          enable_pipelining=bool(enable_pipelining), ipu_memory=int(ipu_memory))
    if (shard or stages or enable_pipelining) and len(specs) == 1:
        opts.fuse = False
    result = compile_onnx(specs, opts)
    return write_outputs(result, output_dir, export_popef=export_popef, popef_name=popef_name,
                         output_model=output_model, compress=compress)


def write_outputs(result: "CompileResult", output_dir: str | os.PathLike[str] | None, *,
                  export_popef: "bool | str | os.PathLike[str]" = True,
                  popef_name: str = POPEF_NAME,
                  output_model: str | os.PathLike[str] | None = None, compress: bool = False,
                  engine_options: dict[str, str] | None = None,
                  opaques: dict[str, bytes] | None = None) -> CompileOutput:
    """Write a compile result: the PopEF file and the transformed ONNX model, where
    ``compile`` says (the ``poprt`` command's outputs)."""
    out_dir = pathlib.Path(output_dir) if output_dir is not None else pathlib.Path.cwd()
    model_path = _anywhere(out_dir, output_model, "output_model") \
        if output_model is not None else None
    if isinstance(export_popef, (str, os.PathLike)):
        popef_path: pathlib.Path | None = _anywhere(out_dir, export_popef, "export_popef")
    else:
        popef_path = _inside(out_dir, popef_name, "popef_name") if export_popef else None
    output = CompileOutput(result)
    if popef_path is not None or output_model is not None:
        _make_dir(out_dir, "output_dir")
    if popef_path is not None:
        _make_dir(popef_path.parent, "the folder of the PopEF file")
    if model_path is not None:
        import onnx

        _make_dir(model_path.parent, "the folder of output_model")
        _write_file(model_path, lambda f: onnx.save(result.output_model, f))
        output.output_model_path = model_path
        _log.info("wrote the transformed ONNX model to %s", model_path)
    if popef_path is not None:
        _write_file(popef_path, lambda f: write_popef(result, f, compress=compress,
                                                      engine_options=engine_options,
                                                      opaques=opaques))
        output.popef_path = popef_path
        _log.info("wrote %s", popef_path)
    return output


def _anywhere(out_dir: pathlib.Path, name: Any, key: str) -> pathlib.Path:
    """``name`` as given if absolute, else ``out_dir / name``: anywhere, as long as it names
    a file (not a folder)."""
    if not isinstance(name, (str, os.PathLike)) or not os.fspath(name):
        raise BadRequestError(f"{key} must be a non-empty file path, got {echo(name)}")
    text = os.fspath(name)
    path = pathlib.Path(name)
    if path.name in ("", ".", "..") or text.endswith(("/", os.sep)):
        raise BadRequestError(f"{key} {echo(text, 120)} must name a file, not a folder")
    path = path if path.is_absolute() else out_dir / path
    if path.is_dir():
        raise BadRequestError(f"{key} {echo(text, 120)} is a folder ({echo(str(path), 120)}); "
                              "expected a file path")
    return path


def _inside(out_dir: pathlib.Path, name: Any, key: str) -> pathlib.Path:
    """``out_dir / name`` (or ``name`` if absolute), refused unless it stays inside
    ``out_dir``.

    Only the folders on the way are resolved: the file itself is replaced by a rename
    (``_write_file``), so a symlink at its name is never followed and need not point
    inside ``out_dir``."""
    if not isinstance(name, (str, os.PathLike)) or not os.fspath(name):
        raise BadRequestError(f"{key} must be a non-empty file name, got {echo(name)}")
    rel = pathlib.Path(name)
    base = out_dir.resolve()
    path = (base / rel.parent).resolve() / rel.name
    if (rel.name in ("", ".", "..") or path == base or not path.is_relative_to(base)):
        raise BadRequestError(f"{key} {echo(os.fspath(name), 120)} must name a file inside the "
                              f"output folder {echo(str(out_dir), 160)}; it resolves to "
                              f"{echo(str(path), 120)}")
    return rel if rel.is_absolute() else out_dir / rel


def _make_dir(path: pathlib.Path, what: str) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise BadRequestError(f"{what} {echo(str(path), 200)} exists and is not a folder") from None
    except OSError as exc:
        raise BadRequestError(f"cannot create {what} {echo(str(path), 200)}: "
                              f"{exc.strerror or exc}") from None


# -- model fusion configuration (seed 004) -----------------------------------------

_GLOBAL_KEYS = {"output_dir", "output_model", "export_popef", "max_tensor_size", "ipu_version",
                "model_fusion", "precision", "input_shape", "batches_per_step",
                "weights_as_tensor_data", "save_weights", "compress", "popef_name", "name",
                "num_ipus", "manual_sharding_config", "sharding_info", "pipelining_info",
                "enable_pipelining"}
_MODEL_KEYS = {"input_model", "input_shape", "precision"}


@dataclass
class FusionConfig:
    """A decoded config YAML: the models to fuse and the keyword arguments of ``compile``."""

    models: list["ModelSpec"]
    output_dir: pathlib.Path
    options: dict[str, Any] = field(default_factory=dict)


def load_config_yaml(path: str | os.PathLike[str],
                     overrides: dict[str, Any] | None = None) -> FusionConfig:
    """Read a model fusion YAML; ``overrides`` (from the command line) win over its globals."""
    p = pathlib.Path(path)
    where = f"config {echo(str(p), 200)}"
    doc = _read_globals(p, where, overrides)
    base = p.resolve().parent
    specs = _model_specs(doc, base, where)
    out_dir = base / doc.get("output_dir", "./")
    # checked now: the config's error, not later
    if doc.get("popef_name") is not None:
        _inside(out_dir, doc["popef_name"], f"{where}: popef_name")
    if doc.get("output_model") is not None:
        _anywhere(out_dir, doc["output_model"], f"{where}: output_model")
    return FusionConfig(specs, out_dir, _fusion_options(doc, base, p))


def _read_globals(p: pathlib.Path, where: str,
                  overrides: dict[str, Any] | None) -> dict[str, Any]:
    """The config file's mapping, its global keys known and typed, ``overrides`` applied."""
    from ipu_emulator.yaml_config import ConfigYamlError, load_yaml_file

    try:
        doc = load_yaml_file(p, "config")
    except ConfigYamlError as exc:
        raise BadRequestError(str(exc)) from None
    if not isinstance(doc, dict):
        raise BadRequestError(f"{where} must be a mapping of keys, got "
                              f"{type(doc).__name__}")
    unknown = sorted(set(doc) - _GLOBAL_KEYS)
    if unknown:
        raise BadRequestError(f"{where}: unknown keys {echo(unknown, 200)}; expected some of "
                              f"{sorted(_GLOBAL_KEYS)}")
    doc.update({k: v for k, v in (overrides or {}).items() if v is not None})
    _check_text(doc, where)
    for key, kind in _TYPES.items():
        if key in doc and (not isinstance(doc[key], kind)
                           or (kind is int and isinstance(doc[key], bool))):
            raise BadRequestError(f"{where}: {key} must be {_TYPE_WORDS[kind]}, "
                                  f"got {echo(doc[key])} ({type(doc[key]).__name__})")
    return doc


def _model_specs(doc: dict[str, Any], base: pathlib.Path, where: str) -> list[ModelSpec]:
    """The ``model_fusion`` entries: each model's path, input shapes and precision (the
    globals' shapes and precision unless the entry gives its own)."""
    from ipu_emulator.compiler import ModelSpec

    entries = doc.get("model_fusion")
    if not isinstance(entries, list) or not entries:
        raise BadRequestError(f"{where}: model_fusion must be a non-empty list of "
                              "models (input_model, input_shape, precision)")
    global_shapes = _shapes(doc.get("input_shape"), where)
    global_precision = doc.get("precision", "fp32")
    specs: list[ModelSpec] = []
    for k, e in enumerate(entries):
        at = f"{where}: model_fusion[{k}]"
        if not isinstance(e, dict):
            raise BadRequestError(f"{at} must be a mapping, got {type(e).__name__}")
        bad = sorted(set(e) - _MODEL_KEYS)
        if bad:
            raise BadRequestError(f"{at}: unknown keys {echo(bad, 200)}; expected some of "
                                  f"{sorted(_MODEL_KEYS)}")
        if not isinstance(e.get("input_model"), str):
            raise BadRequestError(f"{at}: input_model (a path) is required")
        if not isinstance(e.get("precision", ""), str):
            raise BadRequestError(f"{at}: precision must be a str, got "
                                  f"{echo(e['precision'])}")
        shapes = dict(global_shapes)
        shapes.update(_shapes(e.get("input_shape"), at))
        precision = cast(str, e.get("precision", global_precision))   # both checked above
        specs.append(ModelSpec(base / e["input_model"], shapes, precision))
    return specs


def _fusion_options(doc: dict[str, Any], base: pathlib.Path, p: pathlib.Path
                    ) -> dict[str, Any]:
    """The compile options the config's globals give (defaults of seed 004 and PopRT)."""
    options: dict[str, Any] = {
        # As in seed 004: the PopEF file is written only when export_popef is true.
        "export_popef": doc.get("export_popef", False),
        "output_model": doc.get("output_model"),
        "ipu_version": doc.get("ipu_version", "ipu21"),
        "max_tensor_size": doc.get("max_tensor_size", -1),
        "batches_per_step": doc.get("batches_per_step", 1),
        "weights_as_tensor_data": doc.get("weights_as_tensor_data", False),
        "save_weights": doc.get("save_weights", False),
        "compress": doc.get("compress", False),
        "popef_name": doc.get("popef_name", POPEF_NAME),
        "name": doc.get("name", "executable"),
        "fuse": True,
    }
    # manual sharding (PopRT): num_ipus, sharding_info / pipelining_info maps or a
    # manual_sharding_config file, enable_pipelining; applies to a single model
    if "num_ipus" in doc:
        options["num_ipus"] = _int(doc["num_ipus"], "num_ipus", p)
    for key in ("sharding_info", "pipelining_info"):
        if doc.get(key) is not None:
            options[key] = doc[key]
    if doc.get("manual_sharding_config") is not None:
        options["manual_sharding_config"] = base / str(doc["manual_sharding_config"])
    if "enable_pipelining" in doc:
        options["enable_pipelining"] = bool(doc["enable_pipelining"])
    return options

_TYPES: dict[str, type] = {
    "output_dir": str, "output_model": str, "popef_name": str, "name": str,
    "ipu_version": str, "precision": str,
    "export_popef": bool, "weights_as_tensor_data": bool, "save_weights": bool,
    "compress": bool, "max_tensor_size": int, "batches_per_step": int,
    # keys of manual sharding (PopRT), where this version knows them
    "num_ipus": int, "enable_pipelining": bool, "manual_sharding_config": str,
}
"""The type of each global key's value: checked strictly (``'false'`` is not false)."""
_TYPE_WORDS = {str: "a str", bool: "a bool (true or false, unquoted)", int: "an integer"}


def _int(v: Any, key: str, p: pathlib.Path) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise BadRequestError(f"config {echo(str(p), 200)}: {key} must be an integer, got "
                              f"{echo(v)}")
    return v


def _check_text(v: Any, where: str, depth: int = 0) -> None:
    """Every string of the config can be encoded (no lone surrogates from escapes)."""
    if depth > 32:
        raise BadRequestError(f"{where} nests deeper than 32 levels")
    if isinstance(v, str):
        try:
            v.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise BadRequestError(f"{where}: the string {echo(v)} holds a lone surrogate "
                                  f"at character {exc.start}; expected valid Unicode "
                                  "text") from None
    elif isinstance(v, dict):
        for k, x in v.items():
            _check_text(k, where, depth + 1)
            _check_text(x, where, depth + 1)
    elif isinstance(v, list):
        for x in v:
            _check_text(x, where, depth + 1)


# -- PopRT's Python compile API (poprt.compiler) ------------------------------------------
from host_runtime.poprt._compile_api import Compiler, Executable  # noqa: E402
from host_runtime.poprt._errors import NotSupportedError, PoplarRequiredError  # noqa: E402
from host_runtime.poprt._options import CompilerOptions  # noqa: E402

__all__ += ["Compiler", "CompilerOptions", "Executable", "NotSupportedError",
            "PoplarRequiredError"]
