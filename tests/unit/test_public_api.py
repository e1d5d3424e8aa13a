"""The public surface of ``host_runtime`` is pinned: adding or removing a name is deliberate."""

from __future__ import annotations

import subprocess
import sys

import host_runtime

EXPECTED = [
    "ModelRunner", "ModelRunnerConfig", "DataDesc", "InputDesc", "OutputDesc", "OutputFuture",
    "OutputFutureMemory", "OutputFutureMemoryView", "ReplicaIdToOutputMemoryView",
    "ReplicaIdToDevice",
    "PopefPaths", "InputMemoryView", "OutputMemoryView", "OutputMemory", "TensorMemory",
    "TensorMemoryView", "ConstTensorMemoryView", "empty_shared", "is_shared",
    "DeviceManager", "Device", "DeviceWaitConfig", "DeviceWaitStrategy", "DeviceConstraints",
    "Session", "SessionConfig", "LaunchPolicy", "CallbackInfo", "CallbackHandle",
    "CallbackFactory", "predicate_factory", "PopefDataUsagePolicy", "AnchorCallbackPolicy",
    "AnchorWithPolicy", "ProgramsWithPolicy", "null_anchor_callback_predicate",
    "null_popef_data_usage_predicate", "PopefDataUsagePredicate", "AnchorCallbackPredicate",
    "QueueManager", "InputQueue", "OutputQueue", "IQueue", "InputData", "OutputData",
    "SpscRingBuffer", "InputRingBuffer", "OutputRingBuffer", "IMemoryPool", "RingMemoryPool",
    "allocateQueueStorage", "ring_size_multiplier_factory", "RingSizeMultiplierProdType",
    "ReadStartCallback", "ReadCompleteCallback", "WriteCompleteCallback",
    "ModelRuntimeError", "BadRequestError", "PopefError", "InvalidStateError", "ForkedProcessError",
    "DeviceUnavailableError", "DeviceLostError", "DeviceTimeoutError", "DeviceExecutionError",
    "PackageHashMismatchError", "RemoteTraceback",
    "RecoveryAction", "DeviceRuntimeError", "ApplicationRuntimeError", "RecoverableRuntimeError",
    "UnrecoverableRuntimeError",
]


def test_all_is_pinned():
    assert list(host_runtime.__all__) == EXPECTED


def test_every_public_name_resolves():
    missing = [n for n in EXPECTED if not hasattr(host_runtime, n)]
    assert missing == []


def test_poprt_surface():
    from host_runtime import poprt
    assert sorted(poprt.__all__) == ["Backend", "Converter", "Pass", "PassManager", "Runner",
                                     "RuntimeConfig", "__version__", "compile", "get_pass",
                                     "get_registered_passes"]
    assert callable(poprt.Runner) and callable(poprt.RuntimeConfig)
    assert poprt.__version__ == "1.5.0+emulator"
    for module in ("compiler", "converter", "frontend", "backends", "backend", "quantizer",
                   "passes", "profile", "utils"):
        assert getattr(poprt, module).__name__ == f"host_runtime.poprt.{module}"


def test_import_is_cheap():
    """``import host_runtime`` loads neither numpy nor the device driver."""
    code = ("import sys, host_runtime; "
            "print(','.join(m for m in ('numpy', 'onnxruntime', 'host_runtime.session._session', "
            "'host_runtime.runner._model_runner') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_seed_spelling_via_alias():
    import host_runtime as model_runtime
    cfg = model_runtime.ModelRunnerConfig()
    cfg.thread_safe = True
    view = model_runtime.InputMemoryView()
    assert isinstance(view, dict) and cfg.thread_safe
