"""Names and constructor forms of the seeds' API (issue 11, section 3), without devices."""

from __future__ import annotations

import typing
from datetime import timedelta

import pytest

import host_runtime as model_runtime
from host_runtime.errors import BadRequestError

WAIT = model_runtime.DeviceWaitStrategy


# ------------------------------------------------------------------ names
def test_output_future_memory_names_are_what_execute_async_returns():
    from host_runtime.runner._model_runner import OutputFuture

    assert model_runtime.OutputFutureMemory is OutputFuture
    assert model_runtime.OutputFutureMemoryView is OutputFuture


def test_replica_id_maps_are_dict_types():
    r2o = model_runtime.ReplicaIdToOutputMemoryView
    r2d = model_runtime.ReplicaIdToDevice
    assert typing.get_origin(r2o) is dict and typing.get_args(r2o) == (
        int, model_runtime.OutputMemoryView)
    assert typing.get_origin(r2d) is dict and typing.get_args(r2d) == (int, model_runtime.Device)
    # like the C++ default constructor: an empty map, usable as the config's field
    outs = r2o()
    outs[0] = model_runtime.OutputMemoryView()
    cfg = model_runtime.ModelRunnerConfig(replication_factor=2)
    cfg.replica_to_save_programs_outputs = outs
    cfg.replica_to_device = r2d()
    cfg.validate()


def test_class_level_type_names():
    from host_runtime import popef

    assert model_runtime.Session.ProgIdxType is int
    pam = model_runtime.Session.ProgramsAndAnchorsMap
    assert typing.get_origin(pam) is dict
    assert typing.get_args(pam) == (int, list[popef.Anchor])
    cb = model_runtime.SpscRingBuffer.ReadTimeoutCallback
    assert typing.get_origin(cb) is typing.get_origin(typing.Callable)
    # the ring buffers of the queues inherit it
    assert model_runtime.InputRingBuffer.ReadTimeoutCallback is cb


def test_callback_and_predicate_types_at_the_top_level():
    from host_runtime import popef, queues
    from host_runtime.session import predicates

    assert model_runtime.PopefDataUsagePredicate is predicates.PopefDataUsagePredicate
    assert model_runtime.AnchorCallbackPredicate is predicates.AnchorCallbackPredicate
    assert typing.get_args(model_runtime.PopefDataUsagePredicate) == (
        [popef.Anchor], model_runtime.PopefDataUsagePolicy)
    assert typing.get_args(model_runtime.AnchorCallbackPredicate) == (
        [popef.Anchor], model_runtime.AnchorCallbackPolicy)
    assert model_runtime.RingSizeMultiplierProdType is queues.RingSizeMultiplierProdType
    assert typing.get_args(model_runtime.RingSizeMultiplierProdType) == ([popef.Anchor], int)
    for name in ("ReadStartCallback", "ReadCompleteCallback", "WriteCompleteCallback"):
        assert typing.get_args(getattr(model_runtime, name)) == ([], type(None)), name
    # the factory's functions are of that type: anchor -> multiplier
    f = model_runtime.ring_size_multiplier_factory.ringSizeMultForProgs([1], 4, 1)
    assert callable(f)


def test_new_names_are_importable_with_from():
    from host_runtime import (AnchorCallbackPredicate, OutputFutureMemory,  # noqa: F401
                              OutputFutureMemoryView, PopefDataUsagePredicate,
                              ReadCompleteCallback, ReadStartCallback, ReplicaIdToDevice,
                              ReplicaIdToOutputMemoryView, RingSizeMultiplierProdType,
                              WriteCompleteCallback)


# ------------------------------------------------------------------ DeviceWaitConfig
@pytest.mark.parametrize("make, strategy, timeout, sleep", [
    # the seeds' Python listings (000: 3.2, 3.4, 3.6, 3.8)
    (lambda: model_runtime.DeviceWaitConfig(WAIT.WAIT_WITH_TIMEOUT, timeout=timedelta(seconds=600),
                                            sleepTime=timedelta(seconds=1)),
     WAIT.WAIT_WITH_TIMEOUT, 600, 1),
    # the C++ listings' DeviceWaitConfig{600s, 1s}: positional and keyword forms agree
    (lambda: model_runtime.DeviceWaitConfig(timedelta(seconds=600), timedelta(seconds=1)),
     WAIT.WAIT_WITH_TIMEOUT, 600, 1),
    (lambda: model_runtime.DeviceWaitConfig(timeout=timedelta(seconds=600),
                                            sleepTime=timedelta(seconds=1)),
     WAIT.WAIT_WITH_TIMEOUT, 600, 1),
    (lambda: model_runtime.DeviceWaitConfig(timedelta(seconds=600), sleepTime=timedelta(seconds=1)),
     WAIT.WAIT_WITH_TIMEOUT, 600, 1),
    (lambda: model_runtime.DeviceWaitConfig(timeout=timedelta(seconds=600)),
     WAIT.WAIT_WITH_TIMEOUT, 600, 15),
    (lambda: model_runtime.DeviceWaitConfig(timedelta(seconds=600)), WAIT.WAIT_WITH_TIMEOUT, 600, 15),
    (lambda: model_runtime.DeviceWaitConfig(timeout=30), WAIT.WAIT_WITH_TIMEOUT, 30, 15),
    # strategy given positionally or by keyword
    (lambda: model_runtime.DeviceWaitConfig(WAIT.WAIT_WITH_TIMEOUT, timedelta(seconds=5),
                                            timedelta(seconds=2)),
     WAIT.WAIT_WITH_TIMEOUT, 5, 2),
    (lambda: model_runtime.DeviceWaitConfig(strategy=WAIT.WAIT_FOREVER,
                                            sleepTime=timedelta(seconds=2)),
     WAIT.WAIT_FOREVER, 0, 2),
    (lambda: model_runtime.DeviceWaitConfig(strategy=WAIT.NO_WAIT, timeout=timedelta(seconds=9)),
     WAIT.NO_WAIT, 9, 15),
    (lambda: model_runtime.DeviceWaitConfig(WAIT.NO_WAIT), WAIT.NO_WAIT, 0, 15),
    (lambda: model_runtime.DeviceWaitConfig(), WAIT.NO_WAIT, 0, 15),
])
def test_device_wait_config_forms(make, strategy, timeout, sleep):
    wc = make()
    assert (wc.strategy, wc.timeout, wc.sleepTime) == (
        strategy, timedelta(seconds=timeout), timedelta(seconds=sleep))


@pytest.mark.parametrize("args, kwargs, match", [
    ((), {"sleepTime": timedelta(seconds=1)},
     r"DeviceWaitConfig\(sleepTime=\.\.\.\) without a strategy or a timeout would mean NO_WAIT"),
    ((timedelta(seconds=1),), {"timeout": timedelta(seconds=2)},
     r"DeviceWaitConfig\(timeout, sleepTime\) takes at most those two arguments"),
    ((timedelta(seconds=1),), {"strategy": WAIT.WAIT_FOREVER},
     r"DeviceWaitConfig\(timeout, sleepTime\) takes at most those two arguments"),
    ((WAIT.WAIT_FOREVER,), {"strategy": WAIT.NO_WAIT}, "DeviceWaitConfig got strategy twice"),
    ((WAIT.WAIT_FOREVER, 1, 2, 3), {}, "takes at most three arguments, got 4"),
    ((), {"strategy": "forever"}, "strategy must be a DeviceWaitStrategy, got 'forever'"),
    ((), {"sleep": 1}, r"unexpected keyword\(s\) \['sleep'\]"),
])
def test_device_wait_config_refuses_ambiguous_or_bad_forms(args, kwargs, match):
    with pytest.raises(BadRequestError, match=match):
        model_runtime.DeviceWaitConfig(*args, **kwargs)
