"""Behaviours the seeds specify that the project once deviated from (issue 11, section 3).

Over real IPU processes with the seeds' example model (``tensor_C = tensor_A * weights +
tensor_B``), checked with numpy: ring sizes from ``ring_buffer_size_multiplier``, the
``flush_callback`` contract, ``setUserInputHandler`` over every input, and
``Device.bindToSession`` / ``unbindSession``.
"""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest

import host_runtime as model_runtime
from host_runtime import popef
from host_runtime.session.predicates import AnchorCallbackPolicy, AnchorWithPolicy, predicate_factory
from host_runtime.session._session import Session
from tests._helpers import weights_of, write_example

SHAPE = (4, 3)        # batch of 4 samples of 3 floats
WAIT = 60.0           # generous bound for any single wait

pytestmark = pytest.mark.usefixtures("private_machine")


def rand(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The example model for several shapes: path and weights by shape."""
    found = {}
    for shape in [(1, 4), (4, 3), (2, 3), (1, 1 << 19), (4, 1 << 17)]:
        path = write_example(tmp_path_factory.mktemp("x".join(map(str, shape))), shape)
        found[shape] = (path, weights_of(popef.load_model([path]), shape))
    return found


# ------------------------------------------------------------------ ring sizes
@pytest.mark.parametrize("shape, batching_dim, batch, multiplier, depth", [
    ((1, 4), None, 1, 3, 8),            # batch 1 along dimension 0; small: 8 slots
    ((4, 3), None, 4, 1, 8),            # batch 4 along dimension 0
    ((4, 3), 0, 4, 9, 9),               # dynamic batching on dimension 0; the multiplier's 9
    ((2, 3), 1, 3, 3, 8),               # dynamic batching on dimension 1: batch 3
    ((1, 1 << 19), None, 1, 3, 3),      # 2 MiB slots: the multiplier's alone
    ((4, 1 << 17), 0, 4, 1, 2),         # 2 MiB slots: 2 fit in 4 MiB
])
def test_ring_size_is_multiplier_times_batch_size(models, shape, batching_dim, batch,
                                                  multiplier, depth):
    """Seed 002: ring size = ring_buffer_size_multiplier x batch size, in samples. A slot holds
    one transfer of the model's batch, so a Main ring has at least ``multiplier`` slots, and
    as many as fit in 4 MiB up to 8 (a slot is also the device's memory for a transfer)."""
    path, w = models[shape]
    cfg = model_runtime.ModelRunnerConfig(ring_buffer_size_multiplier=multiplier)
    if batching_dim is not None:
        cfg.batching_dim = batching_dim
        cfg.is_batch_size_timeout_enabled = True
        cfg.batch_size_timeout_ns = timedelta(milliseconds=10)
    with model_runtime.ModelRunner(path, config=cfg) as r:
        rep = r._replicas[0]
        spec = rep.setup.inputs["tensor_A"]
        assert spec.batch == batch
        for name in ("tensor_A", "tensor_B"):
            ring = rep.input_rings()[name]
            assert ring.num_slots == depth
            assert ring.num_slots * spec.batch >= multiplier * batch     # samples it holds
        assert rep.output_rings()["tensor_C"].num_slots == depth
        assert rep.session.direct.input_ring("weights").num_slots == 2        # load program's anchor
        # more requests in flight than slots, several transfers each, all right
        n = 3 * batch
        reqs = [(rand(shape[:1] + (n,) if batching_dim == 1 else (n,) + shape[1:], 2 * k),
                 rand(shape[:1] + (n,) if batching_dim == 1 else (n,) + shape[1:], 2 * k + 1))
                for k in range(depth + 1)]
        futs = [r.executeAsync({"tensor_A": a, "tensor_B": b}) for a, b in reqs]
        tile = (1, 3) if batching_dim == 1 else (3, 1)
        for (a, b), f in zip(reqs, futs):
            assert f.wait(WAIT)
            np.testing.assert_allclose(f["tensor_C"], a * np.tile(w, tile) + b, rtol=1e-6)


def test_ring_of_one_slot_packs_partial_batches(models):
    """One slot (``max_look_ahead`` "0"), dynamic batching without any timer: requests of 1
    and 3 samples share the one slot's transfer, and a 6-sample request spills into the next."""
    path, w = models[(4, 3)]
    cfg = model_runtime.ModelRunnerConfig(ring_buffer_size_multiplier=1, batching_dim=0,
                                          timeout_ns=0, max_look_ahead="0")
    with model_runtime.ModelRunner(path, config=cfg) as r:
        assert r._replicas[0].input_rings()["tensor_A"].num_slots == 1
        sizes = [1, 3, 6, 2, 4]
        reqs = [(rand((n, 3), n), rand((n, 3), n + 10)) for n in sizes]
        futs = [r.executeAsync({"tensor_A": a, "tensor_B": b}) for a, b in reqs]
        row = 0
        for (a, b), f in zip(reqs, futs):
            assert f.wait(WAIT)
            idx = (row + np.arange(len(a))) % 4
            np.testing.assert_allclose(f["tensor_C"], a * w[idx] + b, rtol=1e-6)
            row += len(a)


def test_max_look_ahead_still_caps_the_ring(models):
    path, _ = models[(4, 3)]
    cfg = model_runtime.ModelRunnerConfig(ring_buffer_size_multiplier=5, max_look_ahead="1")
    with model_runtime.ModelRunner(path, config=cfg) as r:
        assert r._replicas[0].input_rings()["tensor_A"].num_slots == 2


# ------------------------------------------------------------------ flush_callback
@pytest.fixture(scope="module")
def reordered(tmp_path_factory, models):
    """The (4, 3) model with its metadata listing tensor_B before tensor_A; its Main program
    still reads tensor_A first (the anchors' order is not the device's)."""
    path, w = models[(4, 3)]
    model = popef.load_model([path])
    anchors = model.metadata.anchors()
    first, second = anchors[0], anchors[1]
    assert (first.name(), second.name()) == ("tensor_A", "tensor_B")
    model.metadata._anchors = (second, first, *anchors[2:])
    out = str(tmp_path_factory.mktemp("reordered") / "reordered.popef")
    popef.save_model(model, out)
    assert [a.name() for a in popef.load_model([out]).metadata.anchors()][:2] == [
        "tensor_B", "tensor_A"]
    return out, w


def dynamic(**options):
    return model_runtime.ModelRunnerConfig(batching_dim=0, timeout_ns=timedelta(milliseconds=30),
                                           flush_on_waiting_outputs=True, **options)


def test_flush_callback_fills_the_views_it_is_given(models):
    """Seed 001, 3.7: the callback gets the tensor waited for and inputs/outputs to fill."""
    path, w = models[(4, 3)]
    extra_a, extra_b = rand((1, 3), 1), rand((1, 3), 2)
    extra_out = np.zeros((1, 3), np.float32)
    calls = []

    def on_flush(tensor_id, inputs, outputs):
        calls.append((tensor_id, type(inputs), type(outputs), dict(inputs), dict(outputs)))
        inputs["tensor_A"] = extra_a
        inputs["tensor_B"] = extra_b
        outputs["tensor_C"] = extra_out

    with model_runtime.ModelRunner(path, config=dynamic(flush_callback=on_flush)) as r:
        a, b = rand((3, 3), 3), rand((3, 3), 4)
        out = r.execute({"tensor_A": a, "tensor_B": b})
        np.testing.assert_allclose(out["tensor_C"], a * w[:3] + b, rtol=1e-6)
        np.testing.assert_allclose(extra_out, extra_a * w[3:] + extra_b, rtol=1e-6)
        assert calls == [("tensor_A", model_runtime.InputMemoryView,
                          model_runtime.OutputMemoryView, {}, {})]


def test_partial_batch_names_the_input_main_reads_first(reordered):
    path, w = reordered
    calls = []
    cfg = dynamic(flush_callback=lambda t, i, o: calls.append(t))
    with model_runtime.ModelRunner(path, config=cfg) as r:
        a, b = rand((2, 3), 5), rand((2, 3), 6)
        out = r.execute({"tensor_A": a, "tensor_B": b})
        np.testing.assert_allclose(out["tensor_C"], a * w[:2] + b, rtol=1e-6)   # zero padded
    assert calls == ["tensor_A"]


def test_partial_batch_never_names_a_frozen_input(models):
    """tensor_A frozen: the device has it; it waits for tensor_B."""
    path, w = models[(4, 3)]
    frozen_a = rand((4, 3), 7)
    calls = []
    cfg = dynamic(flush_callback=lambda t, i, o: calls.append(t),
                  frozen_inputs={"tensor_A": frozen_a})
    with model_runtime.ModelRunner(path, config=cfg) as r:
        assert [d.name for d in r.getExecuteInputs()] == ["tensor_B"]
        b = rand((3, 3), 8)
        out = r.execute({"tensor_B": b})
        np.testing.assert_allclose(out["tensor_C"], frozen_a[:3] * w[:3] + b, rtol=1e-6)
    assert calls == ["tensor_B"]


def test_missing_inputs_name_the_first_read_and_the_callback_supplies_them(reordered):
    """validate_io_params off, a request without inputs: the device would wait for tensor_A
    (Main reads it first); the callback fills both inputs and the request completes."""
    path, w = reordered
    a, b = rand((4, 3), 9), rand((4, 3), 10)
    calls = []

    def on_flush(tensor_id, inputs, outputs):
        calls.append(tensor_id)
        inputs.update({"tensor_A": a, "tensor_B": b})

    cfg = model_runtime.ModelRunnerConfig(validate_io_params=False, flush_callback=on_flush,
                                          timeout_ns=timedelta(milliseconds=30))
    with model_runtime.ModelRunner(path, config=cfg) as r:
        out = r.execute({})
        np.testing.assert_allclose(out["tensor_C"], a * w + b, rtol=1e-6)
    assert calls == ["tensor_A"]


# ------------------------------------------------------------------ Session and Device
def feeder(data):
    def cb(view):
        np.frombuffer(view, np.uint8)[:] = np.ascontiguousarray(data).view(np.uint8).ravel()
    return cb


def sink(into, name):
    def cb(view):
        into.setdefault(name, []).append(np.frombuffer(view, np.float32).reshape(SHAPE).copy())
    return cb


def test_user_input_handler_is_asked_for_every_input_including_popef_data(models, device):
    """Seed 002: the factory is called once per input tensor; the predicate decides."""
    path, w = models[(4, 3)]
    flow = popef.load_model([path]).metadata.programFlow()
    a, b, user_w = rand(SHAPE, 11), rand(SHAPE, 12), np.full(SHAPE, 3.0, np.float32)
    data = {"tensor_A": a, "tensor_B": b, "weights": user_w}
    seen = []

    def factory(info):
        seen.append(info.name())
        return feeder(data[info.name()])

    def run(predicate=None):
        seen.clear()
        outs = {}
        with Session(path) as s:
            s.bindToDevice(device)
            s.setUserInputHandler(factory, predicate)
            s.setUserOutputHandler(lambda info: sink(outs, info.name()))
            s.runMainPrograms()     # the load programs first: weights from the bound callback
        assert sorted(seen) == ["tensor_A", "tensor_B", "weights"]
        return outs["tensor_C"][-1]

    # no predicate: every callback is bound, the user's weights override the PopEF data
    np.testing.assert_allclose(run(), a * 3.0 + b, rtol=1e-6)
    # Main's anchors only; the others skipped: weights keeps its PopEF data
    ac = predicate_factory.anchor_callbacks
    main_only = ac.predProgramFlowMain(flow, reject_policy=AnchorCallbackPolicy.SKIP_CB)
    np.testing.assert_allclose(run(main_only), a * w + b, rtol=1e-6)
    # an empty callback for tensor_B: zeros
    only_a_and_w = ac.predAnchorsPolicies(
        [AnchorWithPolicy("tensor_A", AnchorCallbackPolicy.BIND_USER_CB),
         AnchorWithPolicy("weights", AnchorCallbackPolicy.BIND_USER_CB)])
    np.testing.assert_allclose(run(only_a_and_w), a * 3.0, rtol=1e-6)


def test_device_binds_and_unbinds_sessions(models, device):
    """Seed 002 (protected there): Device.bindToSession / unbindSession / isActiveSession."""
    path, w = models[(4, 3)]
    a1, b1, a2, b2 = (rand(SHAPE, 20 + k) for k in range(4))
    outs1, outs2 = {}, {}
    with Session(path) as s1, Session(path) as s2:
        for s, a, b, outs in ((s1, a1, b1, outs1), (s2, a2, b2, outs2)):
            s.setCallbackForAnchor("tensor_A", feeder(a))
            s.setCallbackForAnchor("tensor_B", feeder(b))
            s.setCallbackForAnchor("tensor_C", sink(outs, "tensor_C"))
            s.setCallbackForAnchor("weights_saved", sink(outs, "weights_saved"))
        device.bindToSession(s1)
        assert s1.device() is device and device.isActiveSession(s1)
        s1.runMainPrograms()
        np.testing.assert_allclose(outs1["tensor_C"][-1], a1 * w + b1, rtol=1e-6)
        device.bindToSession(s2)      # s1 is unbound first: its save programs run
        assert device.isActiveSession(s2) and not device.isActiveSession(s1)
        np.testing.assert_array_equal(outs1["weights_saved"][-1], w)
        s2.runMainPrograms()
        np.testing.assert_allclose(outs2["tensor_C"][-1], a2 * w + b2, rtol=1e-6)
        device.unbindSession()        # s2's save programs run; nobody is active
        assert len(outs2["weights_saved"]) == 1
        assert not device.isActiveSession(s2) and not device.isActiveSession(s1)
        assert s2.device() is device  # still bound: it loads again before it next runs
        device.unbindSession()        # nothing active: nothing to do
        s2.runMainPrograms()
        assert device.isActiveSession(s2)
        np.testing.assert_allclose(outs2["tensor_C"][-1], a2 * w + b2, rtol=1e-6)
        with pytest.raises(model_runtime.BadRequestError,
                           match="bindToSession expects a Session, got 'x'"):
            device.bindToSession("x")


def test_unbind_session_refuses_a_device_running_a_main_loop(models):
    path, w = models[(4, 3)]
    with model_runtime.ModelRunner(path) as r:
        dev = r._replicas[0].session.device()
        with pytest.raises(model_runtime.InvalidStateError,
                           match=r"unbindSession: device \d+ \(ipu \d+\) is running the main "
                                 "loop of its active session"):
            dev.unbindSession()
        a, b = rand(SHAPE, 30), rand(SHAPE, 31)
        np.testing.assert_allclose(r.execute({"tensor_A": a, "tensor_B": b})["tensor_C"],
                                   a * w + b, rtol=1e-6)
