"""``ModelRunnerConfig`` and ``DataDesc`` (seed 002, section 10.1.3).

Every field of the C++ ``ModelRunnerConfig`` exists with its documented
default. Durations are Python ``int`` nanoseconds or ``datetime.timedelta``
(stored as int nanoseconds); ``NANOSECONDS_MAX`` stands for C++
``std::chrono::nanoseconds::max()`` ("never"). Assigning an unknown attribute
is refused, so a misspelt option cannot be silently ignored. ``validate()``
checks types and ranges and is called by ``ModelRunner``.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, Iterable, Optional

import numpy as np

from host_runtime.devices import Device, DeviceWaitConfig
from host_runtime.errors import BadRequestError, InvalidStateError
from host_runtime.memory import InputMemoryView
from host_runtime.popef.model import DataType
from ipu_emulator.system import MAX_IPUS
from shm.settings import is_digits

__all__ = [
    "ModelRunnerConfig",
    "DataDesc",
    "InputDesc",
    "OutputDesc",
    "NANOSECONDS_MAX",
    "BATCHING_DIM_DISABLED",
    "to_nanoseconds",
    "FlushCallback",
]

NANOSECONDS_MAX = 2**63 - 1
BATCHING_DIM_DISABLED = 0xFFFFFFFF

FlushCallback = Callable[[str, Any, Any], Optional[tuple[Any, Any]]]
"""``flush_callback(tensor_id, inputs, outputs) -> (inputs, outputs) | None`` (seed 001, 3.7).

Called once when the device has waited ``timeout_ns`` (or ``batch_size_timeout_ns``) for
input data: ``tensor_id`` names the input it waits for (the first one the Main programs
read that is missing; in a partial dynamic batch the first non-frozen one). ``inputs``
and ``outputs`` are an empty ``InputMemoryView`` and ``OutputMemoryView``: fill them
with the data to flush with (the C++ callback points its pointers at it), or return
``(inputs, outputs)`` (either may be None). Nothing given: a partial batch is padded with
zeros; a request missing inputs fails with ``DeviceTimeoutError``."""


def to_nanoseconds(value: int | float | timedelta, field: str) -> int:
    """An int number of nanoseconds from an int, a float or a timedelta."""
    if isinstance(value, bool):
        raise BadRequestError(f"{field}: expected nanoseconds (int) or a timedelta, got bool")
    if isinstance(value, timedelta):
        ns = (value.days * 86400 + value.seconds) * 10**9 + value.microseconds * 1000
    elif isinstance(value, (int, np.integer)):
        ns = int(value)
    elif isinstance(value, float) and value == value:
        ns = NANOSECONDS_MAX if value >= NANOSECONDS_MAX else int(value)
    else:
        got = "nan" if isinstance(value, float) else type(value).__name__
        raise BadRequestError(f"{field}: expected nanoseconds (int) or a timedelta, got {got}")
    if ns < 0:
        raise BadRequestError(f"{field}: expected a duration >= 0 ns, got {ns}")
    return min(ns, NANOSECONDS_MAX)


def _default_wait_config() -> DeviceWaitConfig | None:
    """The default ``device_wait_config`` (the test fixtures replace this function)."""
    return DeviceWaitConfig()


_DURATIONS = ("timeout_ns", "batch_size_timeout_ns", "data_parallel_timeout_ns")


class ModelRunnerConfig:
    """ModelRunner configuration options; the defaults are the seeds' defaults.

    ``ring_buffer_size_multiplier``: ring size = multiplier x batch size, in samples. A
    slot of a stream ring holds one transfer (the model's batch), so each Main ring has
    at least ``multiplier`` slots, and up to 8 where they fit in 4 MiB (a slot is also the
    device's memory for a transfer in flight); capped at ``max_look_ahead + 1`` when that
    is a number and at 1024 slots / 64 MiB per ring (docs/design.md section 10).

    ``flush_callback(tensor_id, inputs, outputs)``: see ``FlushCallback``.
    """

    _FIELDS: tuple[str, ...] = (
        "replication_factor", "run_save_programs", "thread_safe", "frozen_inputs",
        "replica_to_save_programs_outputs", "replica_to_device", "device_wait_config",
        "check_package_hash", "timeout_ns", "validate_io_params", "batching_dim",
        "auto_reset", "max_look_ahead", "ring_buffer_size_multiplier",
        "flush_on_waiting_outputs", "batch_size_timeout_ns", "data_parallel_timeout_ns",
        "is_batch_size_timeout_enabled", "request_tracepoints_buffer_size", "flush_callback",
    )

    replication_factor: int
    run_save_programs: bool
    thread_safe: bool
    frozen_inputs: dict[str, Any]
    replica_to_save_programs_outputs: dict[int, dict[str, Any]]
    replica_to_device: dict[int, Device]
    device_wait_config: DeviceWaitConfig | None
    check_package_hash: bool
    timeout_ns: int
    validate_io_params: bool
    batching_dim: int
    auto_reset: bool
    max_look_ahead: str
    ring_buffer_size_multiplier: int
    flush_on_waiting_outputs: bool
    batch_size_timeout_ns: int
    data_parallel_timeout_ns: int
    is_batch_size_timeout_enabled: bool
    request_tracepoints_buffer_size: int
    flush_callback: FlushCallback | None

    def __init__(self, **options: Any) -> None:
        self.replication_factor = 1
        self.run_save_programs = False
        self.thread_safe = False
        self.frozen_inputs = InputMemoryView()
        self.replica_to_save_programs_outputs = {}
        self.replica_to_device = {}
        self.device_wait_config = _default_wait_config()
        self.check_package_hash = True
        self.timeout_ns = 5 * 10**9
        self.validate_io_params = True
        self.batching_dim = BATCHING_DIM_DISABLED
        self.auto_reset = False
        self.max_look_ahead = "unlimited"
        self.ring_buffer_size_multiplier = 2
        self.flush_on_waiting_outputs = False
        self.batch_size_timeout_ns = NANOSECONDS_MAX
        self.data_parallel_timeout_ns = NANOSECONDS_MAX
        self.is_batch_size_timeout_enabled = False
        self.request_tracepoints_buffer_size = 1000
        self.flush_callback = None
        for key, value in options.items():
            setattr(self, key, value)

    def __setattr__(self, key: str, value: Any) -> None:
        if self.__dict__.get("_read_only"):
            raise InvalidStateError(
                f"ModelRunnerConfig.{key}: this is a ModelRunner's configuration (config()), "
                "read-only as the reference's const reference: options act when the runner "
                "is made; set them on a ModelRunnerConfig and create another ModelRunner")
        if key not in self._FIELDS:
            raise AttributeError(
                f"ModelRunnerConfig has no option {key!r}; expected one of "
                + ", ".join(self._FIELDS))
        if key in _DURATIONS:
            value = to_nanoseconds(value, key)
        elif key == "max_look_ahead" and isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        object.__setattr__(self, key, value)

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Raise BadRequestError naming the first option with a wrong type or value."""
        def want(field: str, ok: bool, expected: str) -> None:
            if not ok:
                value = getattr(self, field)
                raise BadRequestError(
                    f"ModelRunnerConfig.{field}: expected {expected}, got {value!r}")

        def is_int(v: Any) -> bool:
            return isinstance(v, (int, np.integer)) and not isinstance(v, bool)

        want("replication_factor", is_int(self.replication_factor)
             and 1 <= self.replication_factor <= MAX_IPUS,
             f"an int in 1..{MAX_IPUS} (each replica has IPUs of its own; a machine has at "
             f"most {MAX_IPUS})")
        for flag in ("run_save_programs", "thread_safe", "check_package_hash",
                     "validate_io_params", "auto_reset", "flush_on_waiting_outputs",
                     "is_batch_size_timeout_enabled"):
            want(flag, isinstance(getattr(self, flag), (bool, np.bool_)), "a bool")
        want("frozen_inputs", isinstance(self.frozen_inputs, dict),
             "an InputMemoryView (dict of name -> memory)")
        want("replica_to_save_programs_outputs",
             isinstance(self.replica_to_save_programs_outputs, dict),
             "a dict of replica id -> OutputMemoryView")
        want("replica_to_device", isinstance(self.replica_to_device, dict),
             "a dict of replica id -> Device")
        want("batching_dim", is_int(self.batching_dim) and self.batching_dim >= 0,
             "a dimension index >= 0 or 0xFFFFFFFF (disabled)")
        want("max_look_ahead", self.max_look_ahead == "unlimited"
             or (isinstance(self.max_look_ahead, str) and is_digits(self.max_look_ahead)),
             "'unlimited' or an unsigned integer")
        want("ring_buffer_size_multiplier", is_int(self.ring_buffer_size_multiplier)
             and self.ring_buffer_size_multiplier >= 1, "an int >= 1")
        want("request_tracepoints_buffer_size", is_int(self.request_tracepoints_buffer_size)
             and self.request_tracepoints_buffer_size >= 0, "an int >= 0 (0 = unbounded)")
        want("flush_callback", self.flush_callback is None or callable(self.flush_callback),
             "None or a callable (tensor_id, inputs, outputs)")
        for rid in self.replica_to_device:
            if not is_int(rid) or not 0 <= rid < self.replication_factor:
                raise BadRequestError(
                    f"ModelRunnerConfig.replica_to_device: replica id {rid!r} out of range; "
                    f"expected 0..{self.replication_factor - 1}")
        for rid in self.replica_to_save_programs_outputs:
            if not is_int(rid) or not 0 <= rid < self.replication_factor:
                raise BadRequestError(
                    "ModelRunnerConfig.replica_to_save_programs_outputs: replica id "
                    f"{rid!r} out of range; expected 0..{self.replication_factor - 1}")

    @property
    def look_ahead(self) -> int | None:
        """``max_look_ahead`` as a number (None = unlimited)."""
        return None if self.max_look_ahead == "unlimited" else int(self.max_look_ahead)

    @property
    def batching_enabled(self) -> bool:
        return self.batching_dim != BATCHING_DIM_DISABLED

    def read_only(self) -> "ModelRunnerConfig":
        """This configuration, frozen in place: setting an option raises InvalidStateError,
        and so does changing ``frozen_inputs`` or ``replica_to_device`` (read-only
        mappings). ``replica_to_save_programs_outputs`` stays the caller's dict, which the
        save programs fill. What ``ModelRunner.config()`` returns."""
        for f in ("frozen_inputs", "replica_to_device"):
            object.__setattr__(self, f, _ReadOnlyMapping(getattr(self, f), f))
        object.__setattr__(self, "_read_only", True)
        return self

    def copy(self) -> "ModelRunnerConfig":
        """A mutable copy (of a runner's read-only configuration too)."""
        new = object.__new__(ModelRunnerConfig)   # every field is set below: no defaults first
        for f in self._FIELDS:
            value = getattr(self, f)
            if isinstance(value, _ReadOnlyMapping):
                value = value.original()
            if isinstance(value, dict):
                value = type(value)(value) if type(value) is dict else _copy_mapping(value)
            object.__setattr__(new, f, value)
        return new

    def __repr__(self) -> str:
        def show(f: str) -> str:
            v = getattr(self, f)
            if f in _DURATIONS:
                return "max" if v == NANOSECONDS_MAX else f"{v}ns"
            if f == "batching_dim" and v == BATCHING_DIM_DISABLED:
                return "disabled"
            if f == "frozen_inputs":
                return "{" + ", ".join(sorted(v)) + "}"
            if f == "flush_callback":
                return "set" if v is not None else "None"
            return repr(v)
        return "ModelRunnerConfig(" + ", ".join(f"{f}={show(f)}" for f in self._FIELDS) + ")"

    __str__ = __repr__


class _ReadOnlyMapping(dict):  # type: ignore[type-arg]
    """A dict whose changes raise InvalidStateError (a runner's configuration)."""

    def __init__(self, m: dict, field: str) -> None:  # type: ignore[type-arg]
        dict.__init__(self, m)
        self._type = type(m)
        self._field = field

    def original(self) -> dict:  # type: ignore[type-arg]
        new = self._type()
        dict.update(new, self)
        return new

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise InvalidStateError(
            f"ModelRunnerConfig.{self._field} of a ModelRunner (config()) is read-only: "
            "options act when the runner is made")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = _refuse
    __ior__ = _refuse


def _copy_mapping(m: dict) -> dict:  # type: ignore[type-arg]
    new = type(m)()
    dict.update(new, m)
    return new


class DataDesc:
    """The description of one input or output tensor of a ModelRunner."""

    __slots__ = ("name", "size_in_bytes", "shape", "data_type", "popef_contains_tensor_data")

    def __init__(self, name: str, size_in_bytes: int, shape: Iterable[int],
                 data_type: DataType, popef_contains_tensor_data: bool = False) -> None:
        self.name = str(name)
        self.size_in_bytes = int(size_in_bytes)
        self.shape = [int(d) for d in shape]
        self.data_type = DataType(data_type)
        self.popef_contains_tensor_data = bool(popef_contains_tensor_data)

    def numpy_data_type(self) -> np.dtype:
        return self.data_type.numpyDType()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DataDesc):
            return NotImplemented
        return all(getattr(self, s) == getattr(other, s) for s in self.__slots__)

    def __repr__(self) -> str:
        extra = ", popef_contains_tensor_data=True" if self.popef_contains_tensor_data else ""
        return (f"DataDesc(name={self.name!r}, shape={self.shape}, "
                f"data_type={self.data_type.value}, size_in_bytes={self.size_in_bytes}{extra})")


InputDesc = DataDesc
OutputDesc = DataDesc
