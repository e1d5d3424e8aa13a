"""ModelRunnerConfig defaults (seed 002 10.1.3), conversions and validation."""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest

from host_runtime.runner.config import (BATCHING_DIM_DISABLED, NANOSECONDS_MAX, DataDesc,
                                 ModelRunnerConfig)
from host_runtime.errors import BadRequestError
from host_runtime.popef.model import DataType


def test_defaults_are_the_seeds_defaults():
    c = ModelRunnerConfig()
    assert c.replication_factor == 1
    assert c.run_save_programs is False
    assert c.thread_safe is False
    assert dict(c.frozen_inputs) == {}
    assert c.replica_to_save_programs_outputs == {}
    assert c.replica_to_device == {}
    assert c.check_package_hash is True
    assert c.timeout_ns == 5_000_000_000
    assert c.validate_io_params is True
    assert c.batching_dim == 0xFFFFFFFF == BATCHING_DIM_DISABLED
    assert c.auto_reset is False
    assert c.max_look_ahead == "unlimited"
    assert c.ring_buffer_size_multiplier == 2
    assert c.flush_on_waiting_outputs is False
    assert c.batch_size_timeout_ns == NANOSECONDS_MAX
    assert c.data_parallel_timeout_ns == NANOSECONDS_MAX
    assert c.is_batch_size_timeout_enabled is False
    assert c.request_tracepoints_buffer_size == 1000
    assert c.flush_callback is None
    c.validate()


def test_durations_accept_timedelta_and_int():
    c = ModelRunnerConfig()
    c.timeout_ns = timedelta(milliseconds=250)
    assert c.timeout_ns == 250_000_000
    c.batch_size_timeout_ns = 1234
    assert c.batch_size_timeout_ns == 1234
    with pytest.raises(BadRequestError, match="timeout_ns: expected a duration >= 0 ns, got -1"):
        c.timeout_ns = -1
    with pytest.raises(BadRequestError, match="expected nanoseconds"):
        c.timeout_ns = "5s"


def test_unknown_option_is_refused_with_the_list():
    c = ModelRunnerConfig()
    with pytest.raises(AttributeError, match="no option 'thread_sfae'.*thread_safe"):
        c.thread_sfae = True


def test_keyword_construction_and_max_look_ahead_int():
    c = ModelRunnerConfig(thread_safe=True, max_look_ahead=0)
    assert c.thread_safe is True and c.max_look_ahead == "0" and c.look_ahead == 0
    assert ModelRunnerConfig().look_ahead is None


@pytest.mark.parametrize("field,value,expected", [
    ("replication_factor", 0, "an int in 1..64"),
    ("replication_factor", 2 ** 40, "an int in 1..64 (each replica has IPUs of its own"),
    ("max_look_ahead", "²", "'unlimited' or an unsigned integer"),
    ("thread_safe", 1, "a bool"),
    ("max_look_ahead", "many", "'unlimited' or an unsigned integer"),
    ("ring_buffer_size_multiplier", 0, "an int >= 1"),
    ("request_tracepoints_buffer_size", -5, "an int >= 0"),
    ("flush_callback", 3, "None or a callable"),
])
def test_validate_names_field_expected_and_given(field, value, expected):
    c = ModelRunnerConfig()
    setattr(c, field, value)
    with pytest.raises(BadRequestError) as info:
        c.validate()
    msg = str(info.value)
    assert f"ModelRunnerConfig.{field}" in msg and expected in msg and repr(value) in msg


def test_replica_maps_checked_against_replication_factor():
    c = ModelRunnerConfig(replication_factor=2)
    c.replica_to_device = {2: object()}
    with pytest.raises(BadRequestError, match="replica id 2 out of range; expected 0..1"):
        c.validate()


def test_repr_lists_every_field():
    text = repr(ModelRunnerConfig())
    for f in ModelRunnerConfig._FIELDS:
        assert f + "=" in text


def test_copy_is_independent():
    c = ModelRunnerConfig()
    c.frozen_inputs["x"] = np.zeros(2)
    d = c.copy()
    d.frozen_inputs["y"] = np.zeros(2)
    assert set(c.frozen_inputs) == {"x"} and set(d.frozen_inputs) == {"x", "y"}


def test_data_desc_fields():
    d = DataDesc("tensor_A", 16, [1, 4], DataType.F32)
    assert d.name == "tensor_A" and d.size_in_bytes == 16 and d.shape == [1, 4]
    assert d.data_type == DataType.F32 and d.numpy_data_type() == np.float32
    assert d.popef_contains_tensor_data is False
    assert "tensor_A" in repr(d) and "[1, 4]" in repr(d)


def test_a_nan_duration_is_named_as_nan_and_inf_is_no_deadline():
    c = ModelRunnerConfig()
    with pytest.raises(BadRequestError, match=r"timeout_ns: expected nanoseconds \(int\) or a "
                       r"timedelta, got nan"):
        c.timeout_ns = float("nan")
    c.timeout_ns = float("inf")      # nanoseconds::max(): no deadline, as 0 (seed 002)
    assert c.timeout_ns == 2 ** 63 - 1
