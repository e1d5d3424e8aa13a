"""Session on both kinds of IPU (tests/devices/conftest.py), with the seeds' example model.

``tensor_C = tensor_A * weights + tensor_B``; ``weights`` is PopEF tensor data
fed by the Load program; the Save program streams the device's weights back
through ``weights_saved``. One device of each kind serves the whole module.
"""

from __future__ import annotations

import dataclasses
import os
import traceback
import signal

import numpy as np
import pytest

from host_runtime import popef
from host_runtime.devices import Device
from host_runtime.errors import (BadRequestError, DeviceExecutionError, DeviceLostError,
                                 InvalidStateError, PackageHashMismatchError)
from host_runtime.session.predicates import (AnchorCallbackPolicy, AnchorWithPolicy,
                                     PopefDataUsagePolicy, predicate_factory)
from host_runtime.session._session import CallbackInfo, LaunchPolicy, Session, SessionConfig
from ipu_emulator import package_hash
from ipu_emulator.executable import Executable
from ipu_emulator.system import IpuLocks, load_system_config
from shm import naming
from tests._helpers import PATIENT, running
from tools.generate_simple_popef import write_simple_popef
from tools.pytest_plugin.machine import shm_entries

SHAPE = (1, 4)


class Streams:
    """Callbacks over numpy arrays, counting their calls."""

    def __init__(self) -> None:
        self.inputs: dict[str, np.ndarray] = {}
        self.outputs: dict[str, list[np.ndarray]] = {}
        self.calls: dict[str, int] = {}

    def feed(self, name: str, array: np.ndarray):
        self.inputs[name] = np.ascontiguousarray(array, np.float32)

        def cb(view: memoryview) -> None:
            assert not view.readonly and len(view) == self.inputs[name].nbytes
            self.calls[name] = self.calls.get(name, 0) + 1
            np.frombuffer(view, np.uint8)[:] = self.inputs[name].view(np.uint8).ravel()
        return cb

    def sink(self, name: str):
        def cb(view: memoryview) -> None:
            assert view.readonly
            self.calls[name] = self.calls.get(name, 0) + 1
            self.outputs.setdefault(name, []).append(
                np.frombuffer(view, np.float32).reshape(SHAPE).copy())
        return cb

    def bind(self, session: Session, **arrays: np.ndarray) -> None:
        for name, arr in arrays.items():
            session.setCallbackForAnchor(name, self.feed(name, arr))
        for name in ("tensor_C", "weights_saved"):
            session.setCallbackForAnchor(name, self.sink(name))


def rand(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32)


def test_callbacks_compute_a_times_weights_plus_b(model, weights, device):
    with Session(model) as s:
        s.bindToDevice(device)
        assert s.device() is device and device.isActiveSession(s)
        st = Streams()
        st.bind(s, tensor_A=rand(1), tensor_B=rand(2))
        s.runLoadPrograms()
        for i in range(5):
            st.inputs["tensor_A"], st.inputs["tensor_B"] = rand(10 + i), rand(20 + i)
            s.runMainPrograms()
            np.testing.assert_allclose(
                st.outputs["tensor_C"][-1], rand(10 + i) * weights + rand(20 + i), rtol=1e-6)
        assert st.calls == {"tensor_A": 5, "tensor_B": 5, "tensor_C": 5}
        s.runSavePrograms()
        np.testing.assert_array_equal(st.outputs["weights_saved"], [weights])
        assert st.calls == {"tensor_A": 5, "tensor_B": 5, "tensor_C": 5, "weights_saved": 1}


def test_session_from_paths_lists_anchors_and_unconnected_ones(model_path, model):
    with Session([model_path]) as s:
        names = lambda anchors: sorted(a.name() for a in anchors)  # noqa: E731
        assert names(s.getInputAnchors()) == ["tensor_A", "tensor_B", "weights"]
        assert names(s.getUserInputAnchors()) == ["tensor_A", "tensor_B"]
        assert names(s.getPopefInputAnchors()) == ["weights"]
        assert names(s.getOutputAnchors()) == ["tensor_C", "weights_saved"]
        assert names(s.getUserOutputAnchors()) == ["tensor_C", "weights_saved"]
        assert s.model().metadata.programFlow().main() == model.metadata.programFlow().main()
        missing = s.anchorsNotConnectedToCallbacks([0, 1, 2])
        assert {p: names(a) for p, a in missing.items()} == {
            1: ["tensor_A", "tensor_B", "tensor_C"], 2: ["weights_saved"]}
        with pytest.raises(InvalidStateError, match="program 1: 'tensor_A', 'tensor_B', "
                                                    "'tensor_C'; program 2: 'weights_saved'"):
            s.errorIfAnchorsAreNotConnectedToCallbacks([0, 1, 2])
        Streams().bind(s, tensor_A=rand(0), tensor_B=rand(0))
        s.errorIfAnchorsAreNotConnectedToCallbacks([0, 1, 2])
        with pytest.raises(BadRequestError, match="unknown anchor 'nope'; expected one of"):
            s.setCallbackForAnchor("nope", lambda v: None)
        assert s.device() is None  # Deferred: nothing attached yet


def test_user_handlers_get_callback_info_and_follow_predicates(model, weights, device):
    ac = predicate_factory.anchor_callbacks
    flow = model.metadata.programFlow()
    with Session(model) as s:
        s.bindToDevice(device)
        st = Streams()
        seen: list[str] = []

        def inputs(info: CallbackInfo):
            seen.append(info.name())
            assert info.isInput() and info.tensorInfo().shape() == list(SHAPE)
            if info.name() == "weights":
                return None           # keep the PopEF data bound to it
            return st.feed(info.name(), rand(5))

        def outputs(info: CallbackInfo):
            seen.append(info.name())
            return st.sink(info.name())

        # tensor_B gets an empty callback (zeros): C = A * weights; weights keeps its data.
        # The factory is called for every tensor (seed), the predicate decides what is bound.
        s.setUserInputHandler(inputs, ac.predAnchorsPolicies(
            [AnchorWithPolicy("tensor_A", AnchorCallbackPolicy.BIND_USER_CB),
             AnchorWithPolicy("weights", AnchorCallbackPolicy.SKIP_CB)]))
        s.setUserOutputHandler(outputs, ac.predProgramFlowMain(flow))
        assert sorted(seen) == ["tensor_A", "tensor_B", "tensor_C", "weights", "weights_saved"]
        s.runMainPrograms()
        np.testing.assert_allclose(st.outputs["tensor_C"][-1], rand(5) * weights, rtol=1e-6)
        s.runSavePrograms()  # weights_saved has the empty callback: dropped
        assert "weights_saved" not in st.calls
        # skip_connected: the factory is not asked again for connected anchors
        seen.clear()
        s.setUserInputHandler(inputs, skip_connected=True)
        assert seen == []
        s.setUserInputHandler(inputs)
        assert sorted(seen) == ["tensor_A", "tensor_B", "weights"]
        s.runMainPrograms()
        np.testing.assert_allclose(st.outputs["tensor_C"][-1], rand(5) * weights + rand(5),
                                   rtol=1e-6)


@pytest.mark.ipu_kinds("process", reason="a Deferred session attaches an IPU of the machine")
def test_frozen_weights_overridden_by_user_data(kind, model):
    user_weights = np.full(SHAPE, 3.0, np.float32)
    cfg = SessionConfig(pred_tensor_data=predicate_factory.popef_data_usage.predAnchorsPolicies(
        [AnchorWithPolicy("weights", PopefDataUsagePolicy.USE_USER_DATA)]), wait_config=PATIENT)
    with Session(model, cfg) as s:
        assert "weights" in [a.name() for a in s.getUserInputAnchors()]
        with pytest.raises(InvalidStateError, match="program 0: 'weights'"):
            s.errorIfAnchorsAreNotConnectedToCallbacks([0])
        st = Streams()
        st.bind(s, tensor_A=rand(1), tensor_B=rand(2), weights=user_weights)
        s.runMainPrograms()   # Deferred: acquires its own device here
        assert s.device() is not None
        np.testing.assert_allclose(st.outputs["tensor_C"][-1], rand(1) * 3.0 + rand(2), rtol=1e-6)
        s.runSavePrograms()
        np.testing.assert_array_equal(st.outputs["weights_saved"][-1], user_weights)
        own = s.device()
    assert not own.isAttached()  # the session released the device it acquired


def test_load_main_and_save_programs_each_observed(model, device):
    user_weights = np.arange(4, dtype=np.float32).reshape(SHAPE)
    cfg = SessionConfig(pred_tensor_data=predicate_factory.popef_data_usage.predProgramFlowLoad(
        model.metadata.programFlow()))
    with Session(model, cfg) as s:
        s.bindToDevice(device)
        st = Streams()
        st.bind(s, tensor_A=np.ones(SHAPE), tensor_B=np.zeros(SHAPE), weights=user_weights)
        s.runLoadPrograms()
        assert st.calls == {"weights": 1}
        s.runMainPrograms()   # load already ran since binding: not again
        assert st.calls == {"weights": 1, "tensor_A": 1, "tensor_B": 1, "tensor_C": 1}
        np.testing.assert_array_equal(st.outputs["tensor_C"][-1], user_weights)
        s.runSavePrograms()
        assert st.calls["weights_saved"] == 1
        np.testing.assert_array_equal(st.outputs["weights_saved"][-1], user_weights)
        st.inputs["weights"] = user_weights * 2
        s.runPrograms([0, 1, 2])
        assert st.calls == {"weights": 2, "tensor_A": 2, "tensor_B": 2, "tensor_C": 2,
                            "weights_saved": 2}
        np.testing.assert_array_equal(st.outputs["weights_saved"][-1], user_weights * 2)
        with pytest.raises(BadRequestError, match=r"program indices \[7\] do not exist; the "
                                                  r"executable has programs 0..2"):
            s.runPrograms([7])
        s.runMainPrograms()  # still usable
        assert st.calls["tensor_C"] == 3


def test_two_sessions_share_one_device(model, device):
    w1, w2 = np.full(SHAPE, 2.0, np.float32), np.full(SHAPE, -1.0, np.float32)
    use_user = SessionConfig(pred_tensor_data=predicate_factory.popef_data_usage.predAnchorsPolicies(
        [AnchorWithPolicy("weights", PopefDataUsagePolicy.USE_USER_DATA)]))
    with Session(model, use_user) as s1, Session(model, use_user) as s2:
        st1, st2 = Streams(), Streams()
        st1.bind(s1, tensor_A=np.ones(SHAPE), tensor_B=np.zeros(SHAPE), weights=w1)
        st2.bind(s2, tensor_A=np.ones(SHAPE), tensor_B=np.zeros(SHAPE), weights=w2)
        s1.bindToDevice(device)
        s1.runMainPrograms()
        np.testing.assert_array_equal(st1.outputs["tensor_C"][-1], w1)
        s2.bindToDevice(device)          # s1's save programs run implicitly
        assert st1.calls.get("weights_saved") == 1
        np.testing.assert_array_equal(st1.outputs["weights_saved"][-1], w1)
        assert device.isActiveSession(s2) and not device.isActiveSession(s1)
        s2.runMainPrograms()              # s2's load programs run first
        np.testing.assert_array_equal(st2.outputs["tensor_C"][-1], w2)
        assert st2.calls["weights"] == 1
        s1.runMainPrograms()              # s2 saved, s1 loaded again, then main
        assert st2.calls.get("weights_saved") == 1
        np.testing.assert_array_equal(st2.outputs["weights_saved"][-1], w2)
        assert st1.calls["weights"] == 2
        np.testing.assert_array_equal(st1.outputs["tensor_C"][-1], w1)
        s1.runMainPrograms()              # no switch: no extra load
        assert st1.calls["weights"] == 2 and st1.calls["tensor_C"] == 3


def test_stop_and_reload(model, device):
    cfg = SessionConfig(pred_tensor_data=predicate_factory.popef_data_usage.predProgramFlowLoad(
        model.metadata.programFlow()))
    with Session(model, cfg) as s:
        s.bindToDevice(device)
        st = Streams()
        st.bind(s, tensor_A=np.ones(SHAPE), tensor_B=np.ones(SHAPE), weights=np.ones(SHAPE))
        s.runMainPrograms()
        assert not s.isStopped()
        s.stop()
        assert s.isStopped()
        with pytest.raises(InvalidStateError, match=r"stopped; call reload\(\)"):
            s.runMainPrograms()
        s.reload()
        assert not s.isStopped()
        s.runMainPrograms()
        assert st.calls["weights"] == 2  # reload means load programs run again
        np.testing.assert_array_equal(st.outputs["tensor_C"][-1], np.full(SHAPE, 2.0))


def test_callback_exception_fails_the_run_and_the_session_stays_usable(model, weights, device):
    with Session(model) as s:
        s.bindToDevice(device)
        st = Streams()
        st.bind(s, tensor_A=np.ones(SHAPE), tensor_B=np.zeros(SHAPE))

        def bad(view: memoryview) -> None:
            raise KeyError("no data for B")
        s.setCallbackForAnchor("tensor_B", bad)
        with pytest.raises(DeviceExecutionError, match="callback of anchor 'tensor_B' raised "
                                                       "KeyError") as info:
            s.runMainPrograms()
        assert isinstance(info.value.__cause__, KeyError)
        s.setCallbackForAnchor("tensor_B", st.feed("tensor_B", np.zeros(SHAPE)))
        s.runMainPrograms()
        np.testing.assert_allclose(st.outputs["tensor_C"][-1], weights, rtol=1e-6)


def test_a_failed_run_keeps_nothing_alive_with_the_collector_off(model, device):
    """A run's failure is its answer's (a future's) exception; raised through frames that
    hold that future, it made a reference cycle, and every frame of its traceback (the
    caller's too, with what it holds) waited for the collector."""
    def bad(view: memoryview) -> None:
        raise KeyError("no data for B")

    with Session(model) as s:
        s.bindToDevice(device)
        st = Streams()
        st.bind(s, tensor_A=np.ones(SHAPE), tensor_B=np.zeros(SHAPE))
        s.setCallbackForAnchor("tensor_B", bad)

        _raises_and_keeps_nothing(s.runMainPrograms, DeviceExecutionError,
                                  "callback of anchor 'tensor_B' raised")


class _Held:   # a local of the caller's frame, which is in the error's traceback
    pass


def _raises_and_keeps_nothing(call, error: type, text: str = "") -> None:
    """``call()`` raises ``error`` (its message holding ``text``), and with the collector
    off nothing of the frames it went through outlives it."""
    import gc

    def caller() -> None:
        held = _Held()   # noqa: F841 (held by this frame)
        call()

    gc.disable()
    try:
        raised = None
        try:
            caller()
        except error as exc:
            raised = str(exc)
        assert raised is not None and text in raised, raised
        assert not [o for o in gc.get_objects() if isinstance(o, _Held)]
    finally:
        gc.enable()


def test_package_hash_mismatch_is_refused_with_both_hashes(model, weights, device):
    exe = Executable.from_bytes(model.executable.payload())
    exe.package_hash = "0123abcd" * 8
    bad = dataclasses.replace(model, executable=popef.ExecutableBlob(
        model.executable.name(), exe.to_bytes()))
    with Session(bad) as s:
        with pytest.raises(PackageHashMismatchError) as info:
            s.bindToDevice(device)
        assert str(info.value) == (f"package hash {'0123abcd' * 8} differs from runtime hash "
                                   f"{package_hash()}")
    with Session(bad, SessionConfig(check_package_hash=False)) as s:
        s.bindToDevice(device)
        st = Streams()
        st.bind(s, tensor_A=np.ones(SHAPE), tensor_B=np.zeros(SHAPE))
        s.runMainPrograms()
        np.testing.assert_allclose(st.outputs["tensor_C"][-1], weights, rtol=1e-6)


@pytest.mark.ipu_kinds("process", reason="LaunchPolicy.Immediate attaches an IPU of the machine")
def test_immediate_policy_acquires_and_releases_its_own_device(model, weights, device):
    with Session(model, SessionConfig(policy=LaunchPolicy.Immediate, wait_config=PATIENT)) as s:
        own = s.device()
        assert own is not None and own is not device and own.id != device.id
        assert device.isAttached()
        st = Streams()
        st.bind(s, tensor_A=np.ones(SHAPE), tensor_B=np.zeros(SHAPE))
        s.runMainPrograms()
        np.testing.assert_allclose(st.outputs["tensor_C"][-1], weights, rtol=1e-6)
    assert not own.isAttached()
    locks = IpuLocks.try_acquire(load_system_config().lock_dir, tuple(own.ipus()))
    assert isinstance(locks, IpuLocks)  # released for others
    locks.release()


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """The example model of 1024 x 1024 floats: more than a small IPU model holds."""
    path = tmp_path_factory.mktemp("big") / "big.popef"
    write_simple_popef(path, shape=(1024, 1024))
    return popef.load_model([str(path)])


def test_small_ipu_model_runs_small_programs_and_refuses_big_ones(kind, model, weights, big):
    with kind.manager().createSmallIpuModelDevice(model) as small:
        assert small.tilesPerIpu() == 4 and small.isIpuModel() and small.id == -1
        with Session(model) as s:
            s.bindToDevice(small)
            st = Streams()
            st.bind(s, tensor_A=np.ones(SHAPE), tensor_B=np.zeros(SHAPE))
            s.runMainPrograms()
            np.testing.assert_allclose(st.outputs["tensor_C"][-1], weights, rtol=1e-6)
        with Session(model) as s, kind.manager().createSmallIpuModelDevice(1, ipu_version=2) as v2:
            with pytest.raises(BadRequestError, match="compiled for ipu21, but IPU model device "
                                                      r"\(1 x ipu2, 4 tiles\) is ipu2"):
                s.bindToDevice(v2)
        with Session(big) as s:
            with pytest.raises(BadRequestError, match=r"needs \d+ bytes of device memory, but "
                               r"IPU model device .* has 1 IPU\(s\) x 4 tiles x 638976 bytes "
                               r"per tile = 2555904 bytes"):
                s.bindToDevice(small)


def test_feed_data_cycles_through_its_transfers(model, weights, device):
    feeds = np.arange(3 * 4, dtype=np.float32).reshape(3, 1, 4)
    fed = dataclasses.replace(model, feeds=[popef.FeedData("tensor_B", feeds.tobytes(), 3)])
    with Session(fed) as s:
        assert [a.name() for a in s.getPopefInputAnchors()] == ["tensor_B", "weights"]
        s.bindToDevice(device)
        st = Streams()
        s.setCallbackForAnchor("tensor_A", st.feed("tensor_A", np.zeros(SHAPE)))
        s.setCallbackForAnchor("tensor_C", st.sink("tensor_C"))
        for _ in range(4):
            s.runMainPrograms()
        got = np.stack(st.outputs["tensor_C"])
        np.testing.assert_array_equal(got, np.concatenate([feeds, feeds[:1]]))


def test_device_iterations_repeat_the_streams_within_one_main_run(tmp_path, device):
    path = tmp_path / "steps.popef"
    write_simple_popef(path, shape=SHAPE, batches_per_step=3)
    m = popef.load_model([str(path)])
    w = np.frombuffer(m.tensorData("weights").data, np.float32).reshape(SHAPE)
    with Session(m) as s:
        s.bindToDevice(device)
        st = Streams()
        counter = iter(range(100))

        def next_a(view: memoryview) -> None:
            view[:] = np.full(SHAPE, next(counter), np.float32).tobytes()
        s.setCallbackForAnchor("tensor_A", next_a)
        s.setCallbackForAnchor("tensor_B", st.feed("tensor_B", np.ones(SHAPE)))
        s.setCallbackForAnchor("tensor_C", st.sink("tensor_C"))
        s.runMainPrograms()
        assert st.calls == {"tensor_B": 3, "tensor_C": 3}
        np.testing.assert_allclose(np.stack(st.outputs["tensor_C"]),
                                   np.stack([k * w + 1 for k in range(3)]), rtol=1e-6)


def test_an_ipu_model_device_follows_the_models_needs(kind, model):
    mgr = kind.manager()
    with mgr.createIpuModelDevice(model) as dev:
        assert dev.isIpuModel() and dev.numIpus() == 1
        assert dev.ipuVersion() == model.metadata.ipuVersion()
    with pytest.raises(BadRequestError, match="ipu_version must be 2 or 21, got 3"):
        mgr.createIpuModelDevice(1, ipu_version=3)


def test_a_machine_device_is_held_until_released(kind, model, weights):
    mgr = kind.manager()
    with mgr.getDevice(model, wait_config=PATIENT) as dev, Session(model) as s:
        assert isinstance(dev, Device) and not dev.isIpuModel()
        s.bindToDevice(dev)
        st = Streams()
        st.bind(s, tensor_A=rand(3), tensor_B=rand(4))
        s.runMainPrograms()
        np.testing.assert_allclose(st.outputs["tensor_C"][-1], rand(3) * weights + rand(4),
                                   rtol=1e-6)
        # the IPU is held: a second attach of the same device fails
        assert mgr.tryGetSpecificDevice(dev.getId()) is None
    again = mgr.tryGetSpecificDevice(dev.getId())   # released
    assert again is not None
    again.close()


@pytest.mark.parametrize("exit_thread", ["1", "0"])
def test_a_killed_ipu_is_a_lost_device(kind, model, monkeypatch, exit_thread):
    """Whether the event thread is woken by the exit (the exit thread of shm.liveness) or
    looks at the IPU processes every 0.25 s (IPU_EMULATOR_RING_PEER_THREAD=0)."""
    monkeypatch.setenv("IPU_EMULATOR_RING_PEER_THREAD", exit_thread)
    with kind.device(model) as dev, Session(model) as s:
        (pid,) = dev.pids()
        if kind.in_thread:
            assert pid == os.getpid(), "a loopback IPU is a thread of this process"
        else:
            assert pid != os.getpid() and running(pid), "an IPU process of its own"
        s.bindToDevice(dev)
        st = Streams()
        st.bind(s, tensor_A=np.ones(SHAPE), tensor_B=np.zeros(SHAPE))
        s.runMainPrograms()
        ours = shm_entries(naming.current_tag())
        (ipu,) = dev.processes
        assert kind.lose(dev) == pid   # SIGKILL (emulated in a thread): it ends without a BYE
        assert not ipu.alive() and ipu.returncode() == -signal.SIGKILL
        assert "was killed by signal SIGKILL" in ipu.describe_exit()
        # the host is alive: the device side unlinked none of its objects
        assert shm_entries(naming.current_tag()) == ours
        with pytest.raises(DeviceLostError, match=rf"IPU process {pid} was killed by signal "
                                                  "SIGKILL"):
            s.runMainPrograms()
        # every later call raises the device's error; its traceback is that call's only
        # (raised as kept, it grew by each call's frames, and kept their locals)
        depths = []
        for _ in range(3):
            try:
                s.runMainPrograms()
            except DeviceLostError as exc:
                depths.append(len(traceback.extract_tb(exc.__traceback__)))
        assert len(depths) == 3 and depths[0] == depths[1] == depths[2], depths
        # ... and it keeps none of those frames alive (the device, which keeps the error,
        # is among what they hold: a cycle the collector alone would break)
        _raises_and_keeps_nothing(s.runMainPrograms, DeviceLostError)
        assert len(st.outputs["tensor_C"]) == 1
    assert not dev.isAttached()
