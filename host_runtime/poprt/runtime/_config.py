"""PopRT's runtime configurations, with PopRT's documented defaults.

``RuntimeConfig`` is ``ModelRunnerConfig`` (every option, the same meaning) with the
defaults PopRT documents for its runners (PopRT 1.2.0 and later):

========================  ==========================  ===========================
option                    PopRT runtime               model_runtime (the seeds)
========================  ==========================  ===========================
``thread_safe``           True                        False
``timeout_ns``            10 ms                       5 s
``device_wait_config``    ``DeviceWaitConfig(1, 6)``  NO_WAIT
``runner_type``           ``RunnerType.ModelRunner``  (none)
========================  ==========================  ===========================

``PackRunnerConfig``, ``LightRunnerConfig`` and ``HostConcatRunnerConfig`` extend it
with the options of those runners. ``flush_by_name`` is PopRT's pair of memory views
(inputs, outputs) to flush with: when its inputs are set and no ``flush_callback`` is,
a request that waits ``timeout_ns`` for data is completed with them.
"""

from __future__ import annotations

import enum
from datetime import timedelta
from typing import Any, Optional

from host_runtime.devices import DeviceWaitConfig as _ModelRuntimeWaitConfig
from host_runtime.devices import DeviceWaitStrategy
from host_runtime.errors import BadRequestError
from host_runtime.memory import InputMemoryView, OutputMemoryView
from host_runtime.runner.config import FlushCallback, ModelRunnerConfig

__all__ = ["RunnerType", "DeviceWaitConfig", "RuntimeConfig", "PackAlgorithm",
           "PackRunnerConfig", "LightRunnerConfig", "HostConcatConfig",
           "HostConcatRunnerConfig", "to_model_runner_config"]

UINT32_MAX = 0xFFFFFFFF


class RunnerType(enum.IntEnum):
    """Which runner ``Runner(popef, config)`` makes (``config.runner_type``)."""

    ModelRunner = 0
    PackRunner = 1
    ModelFusionRunner = 2


class DeviceWaitConfig(_ModelRuntimeWaitConfig):
    """PopRT's ``DeviceWaitConfig(timeout_sec=1, sleep_time_sec=6)``: wait up to
    ``timeout_sec`` seconds for a free device, trying again every ``sleep_time_sec``
    seconds (never past the timeout). A model_runtime ``DeviceWaitConfig`` with
    ``WAIT_WITH_TIMEOUT``, so every runner accepts it."""

    __slots__ = ()

    def __init__(self, timeout_sec: int = 1, sleep_time_sec: int = 6) -> None:
        for name, v in (("timeout_sec", timeout_sec), ("sleep_time_sec", sleep_time_sec)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
                raise BadRequestError(
                    f"DeviceWaitConfig.{name}: expected seconds >= 0 (int), got {v!r}")
        super().__init__(DeviceWaitStrategy.WAIT_WITH_TIMEOUT, timedelta(seconds=timeout_sec),
                         timedelta(seconds=sleep_time_sec))

    @property
    def timeout_sec(self) -> int:
        return int(self.timeout.total_seconds())

    @property
    def sleep_time_sec(self) -> int:
        return int(self.sleepTime.total_seconds())

    timeoutSec = timeout_sec
    sleepTimeSec = sleep_time_sec

    def __repr__(self) -> str:
        return f"DeviceWaitConfig(timeout_sec={self.timeout_sec}, " \
               f"sleep_time_sec={self.sleep_time_sec})"


class RuntimeConfig(ModelRunnerConfig):
    """PopRT's runtime options: ``ModelRunnerConfig`` with PopRT's defaults (module doc)."""

    _FIELDS = ModelRunnerConfig._FIELDS + ("runner_type", "flush_by_name")
    _RUNNER = RunnerType.ModelRunner

    runner_type: RunnerType
    flush_by_name: tuple[InputMemoryView, OutputMemoryView]

    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.thread_safe = True
        self.timeout_ns = 10 * 10**6
        self.device_wait_config = DeviceWaitConfig()
        self.runner_type = self._RUNNER
        self.flush_by_name = (InputMemoryView(), OutputMemoryView())
        for key, value in options.items():
            setattr(self, key, value)

    def __setattr__(self, key: str, value: Any) -> None:
        if key == "runner_type":
            value = RunnerType(value)
        elif key == "flush_by_name":
            value = _flush_pair(value)
        super().__setattr__(key, value)

    def __repr__(self) -> str:
        text = super().__repr__()
        return type(self).__name__ + text[text.index("("):]

    __str__ = __repr__


def _flush_pair(value: Any) -> tuple[InputMemoryView, OutputMemoryView]:
    if not (isinstance(value, tuple) and len(value) == 2
            and all(isinstance(v, dict) for v in value)):
        raise BadRequestError(
            "flush_by_name: expected a pair (InputMemoryView, OutputMemoryView) of dicts "
            f"name -> memory, got {value!r}")
    ins, outs = InputMemoryView(), OutputMemoryView()
    ins.update(value[0])
    outs.update(value[1])
    return ins, outs


def _flush_with(pair: tuple[InputMemoryView, OutputMemoryView]) -> FlushCallback:
    ins, outs = pair

    def flush(tensor_id: str, inputs: Any, outputs: Any) -> tuple[Any, Any]:
        return dict(ins), dict(outs)
    return flush


def to_model_runner_config(cfg: ModelRunnerConfig) -> ModelRunnerConfig:
    """The engine's configuration for a PopRT configuration (its own options dropped;
    ``flush_by_name`` becomes a flush callback when none is set)."""
    plain = ModelRunnerConfig()
    for f in ModelRunnerConfig._FIELDS:
        setattr(plain, f, getattr(cfg, f))
    pair = getattr(cfg, "flush_by_name", None)
    if pair is not None and pair[0] and plain.flush_callback is None:
        plain.flush_callback = _flush_with(pair)
    return plain


class PackAlgorithm(enum.IntEnum):
    """How ``PackRunner`` places requests in rows (single-row mode): ``first_fit`` scans
    from the first row for one with room, ``next_fit`` only the current (last) row."""

    first_fit = 0
    next_fit = 1


class PackRunnerConfig(RuntimeConfig):
    """The options of ``PackRunner`` (PopRT's packing of variable-length requests).

    ``timeout_microseconds``: how long requests are gathered before a batch is sent (the
    time from the first request of a batch); ``max_valid_num``: the most requests in one
    batch (0: the model's unpack-info length, else no bound but the rows);
    ``dynamic_input_name``: the input whose length is the request's length (default: the
    first packed input); ``unpack_info_input_name``: the input that receives each
    request's length (default: an input named ``unpack_info`` if the model has one);
    ``mask_name``: the attention mask, written with each request's 1-based number in
    its row (single-row mode) or in the batch (across rows).
    """

    _FIELDS = RuntimeConfig._FIELDS + (
        "timeout_microseconds", "max_valid_num", "dynamic_input_name",
        "unpack_info_input_name", "mask_name", "dynamic_group", "algorithm",
        "disable_data_across_rows", "enable_padding_remove", "delimiter_num",
        "enable_prefetch_datastreams", "compile_batch_size")
    _RUNNER = RunnerType.PackRunner

    timeout_microseconds: int
    max_valid_num: int
    dynamic_input_name: str
    unpack_info_input_name: str
    mask_name: str
    dynamic_group: list[str]
    algorithm: PackAlgorithm
    disable_data_across_rows: bool
    enable_padding_remove: bool
    delimiter_num: int
    enable_prefetch_datastreams: bool
    compile_batch_size: int

    def __init__(self, timeout_microseconds: int = 0, max_valid_num: int = 0,
                 dynamic_input_name: str = "", unpack_info_input_name: str = "",
                 **options: Any) -> None:
        super().__init__()
        self.timeout_microseconds = timeout_microseconds
        self.max_valid_num = max_valid_num
        self.dynamic_input_name = dynamic_input_name
        self.unpack_info_input_name = unpack_info_input_name
        self.mask_name = ""
        self.dynamic_group = []
        self.algorithm = PackAlgorithm.next_fit
        self.disable_data_across_rows = False
        self.enable_padding_remove = False
        self.delimiter_num = 0
        self.enable_prefetch_datastreams = True
        self.compile_batch_size = -1
        for key, value in options.items():
            setattr(self, key, value)

    def __setattr__(self, key: str, value: Any) -> None:
        if key in ("timeout_microseconds", "max_valid_num", "delimiter_num"):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise BadRequestError(f"PackRunnerConfig.{key}: expected an int >= 0, "
                                      f"got {value!r}")
        elif key == "compile_batch_size":
            if isinstance(value, bool) or not isinstance(value, int) or value < -1 or value == 0:
                raise BadRequestError("PackRunnerConfig.compile_batch_size: expected -1 (the "
                                      f"model's batch) or an int >= 1, got {value!r}")
        elif key in ("dynamic_input_name", "unpack_info_input_name", "mask_name"):
            if not isinstance(value, str):
                raise BadRequestError(f"PackRunnerConfig.{key}: expected a str, got {value!r}")
        elif key == "dynamic_group":
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
                raise BadRequestError("PackRunnerConfig.dynamic_group: expected a list of "
                                      f"input names, got {value!r}")
            value = list(value)
        elif key == "algorithm":
            value = PackAlgorithm(value)
        elif key in ("disable_data_across_rows", "enable_padding_remove",
                     "enable_prefetch_datastreams"):
            if not isinstance(value, bool):
                raise BadRequestError(f"PackRunnerConfig.{key}: expected a bool, got {value!r}")
        super().__setattr__(key, value)

    def enable_input_single_row_mode(self, mask_name: str, unpack_info_name: str = "",
                                     delimiter_num: int = 0) -> None:
        """Requests stay inside one row (no request spans two rows); ``mask_name`` gets
        each request's 1-based number in its row; ``delimiter_num`` zeros separate two
        requests of a row; ``unpack_info_name`` gets the requests' lengths."""
        self.mask_name = mask_name
        self.unpack_info_input_name = unpack_info_name
        self.delimiter_num = delimiter_num
        self.disable_data_across_rows = True

    def enable_padding_remove_mode(self, mask_name: str, dynamic_group: list[str]) -> None:
        """Requests come padded to the model's length: each one's length is the count of
        the non-zero values of its ``mask_name``; the inputs of ``dynamic_group`` are cut
        to it before packing."""
        self.mask_name = mask_name
        self.dynamic_group = dynamic_group
        self.enable_padding_remove = True


class LightRunnerConfig(RuntimeConfig):
    """The options of ``LightRunner``: ``replica_to_device`` (replica id -> PopRT
    ``Device``; the runner uses those devices), ``check_package_hash`` and the rest of
    ``RuntimeConfig``."""


class HostConcatConfig:
    """One input the host concatenates (``HostConcatRunner``): ``tensor_name`` is the
    model's merged input, filled with the bytes of ``input_tensor_names`` one after the
    other; ``shape`` and ``data_size_bytes`` describe the merged input."""

    def __init__(self) -> None:
        self.tensor_name = ""
        self.input_tensor_names: list[str] = []
        self.shape: list[int] = []
        self.data_size_bytes = 0

    def __repr__(self) -> str:
        return (f"HostConcatConfig(tensor_name={self.tensor_name!r}, "
                f"input_tensor_names={self.input_tensor_names!r}, shape={self.shape!r}, "
                f"data_size_bytes={self.data_size_bytes})")


class HostConcatRunnerConfig(RuntimeConfig):
    """The options of ``HostConcatRunner``: ``host_concat_config`` (merged input name ->
    ``HostConcatConfig``; empty: read from the PopEF file's opaque blob
    ``HostConcatRunnerConfig``) and the rest of ``RuntimeConfig``."""

    _FIELDS = RuntimeConfig._FIELDS + ("host_concat_config",)

    host_concat_config: dict[str, HostConcatConfig]

    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.host_concat_config = {}
        for key, value in options.items():
            setattr(self, key, value)

    def __setattr__(self, key: str, value: Any) -> None:
        if key == "host_concat_config":
            if not isinstance(value, dict) or not all(
                    isinstance(v, HostConcatConfig) for v in value.values()):
                raise BadRequestError("HostConcatRunnerConfig.host_concat_config: expected a "
                                      f"dict of name -> HostConcatConfig, got {value!r}")
            value = dict(value)
        super().__setattr__(key, value)


def runner_type_of(config: Optional[ModelRunnerConfig]) -> RunnerType:
    return getattr(config, "runner_type", RunnerType.ModelRunner)
